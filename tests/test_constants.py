"""init makes the state that constants decide on the host: the same values, dtypes and
placement as the compiled program, new arrays at every call, and the rest compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import jpack
from jpack import _constants

MESH = jax.make_mesh((2, 4), ("node", "gpu"))


def body(params, scale):
  """Constants of every rule read on the host, by device or not, and input-made values."""
  k = lax.axis_index("gpu")
  counter = jnp.zeros((), jnp.int32)
  grid = jnp.broadcast_to(jnp.asarray([0.0, 1.0, 2.0])[:, None], (3, 2)).astype(jnp.bfloat16)
  joined = jnp.concatenate([jnp.ones((2,)), jnp.full((3,), 2.5)]).reshape(5, 1).squeeze(1)
  by_device = lax.switch(k, [lambda i=i: jnp.full((2,), i, jnp.float32) for i in range(4)])
  both = lax.axis_index(("node", "gpu")).astype(jnp.float32) * jnp.ones(1)  # mul: compiled
  return {"counter": counter, "grid": grid, "joined": joined, "by_device": by_device,
          "both": both, "params": params * scale, "params_by_device": params[:2] + k}


SPECS = {"counter": P(), "grid": P(), "joined": P(), "by_device": P("gpu"),
         "both": P(("node", "gpu")), "params": P(), "params_by_device": P("gpu")}


def test_init_on_the_host_is_the_compiled_program():
  fn = jax.shard_map(body, mesh=MESH, in_specs=P(), out_specs=SPECS, check_vma=False)
  args = (jnp.arange(4.0), jnp.float32(3.0))
  want = jax.jit(fn)(*args)
  run = _constants.on_host_where_constant(fn, MESH)
  got = run(*args)
  for key in want:
    assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
    assert got[key].sharding.is_equivalent_to(want[key].sharding, want[key].ndim), key
    np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)
  again = run(*args)  # new arrays: donating one call's state leaves the next intact
  for key in got:
    got[key].delete()
  np.testing.assert_array_equal(np.asarray(again["by_device"]), np.asarray(want["by_device"]))
  traced = jax.jit(run)(*args)  # under a trace (jit, eval_shape): the program's values
  np.testing.assert_array_equal(np.asarray(traced["grid"]), np.asarray(want["grid"]))
  closed = jax.make_jaxpr(fn)(*args)
  known = _constants._known_outputs(closed, MESH)
  names = sorted(want)  # a dict's leaves are in sorted key order
  assert sorted(names[i] for i in known) == ["by_device", "counter", "grid", "joined"]


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 3)), min_size=1, max_size=4),
       st.sampled_from([jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_]),
       st.floats(-3, 3, width=16))
def test_constants_evaluate_as_jax_does(shapes, dtype, fill):
  def make():
    parts = [jnp.full(s, fill, jnp.float32).astype(dtype).reshape(-1) for s in shapes]
    flat = jnp.concatenate(parts)
    return flat, jnp.broadcast_to(flat[None], (2, flat.size)), jnp.zeros_like(flat)

  closed = jax.make_jaxpr(make)()
  got = _constants.evaluate(closed.jaxpr, closed.consts, [], lambda _: 0)
  for g, w in zip(got, make()):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, np.asarray(w))


@pytest.mark.parametrize("mode", ["packed", "sharded"])
@pytest.mark.parametrize("make", [lambda: optax.adafactor(1e-2), lambda: optax.contrib.muon(1e-2)],
                         ids=["adafactor", "muon"])
def test_a_state_made_on_the_host_trains_as_optax(mode, make):
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(8, 4)).astype(np.float32),
            "b": np.zeros(4, np.float32), "v": rng.normal(size=(4, 2)).astype(np.float32)}
  batch = rng.normal(size=(16, 8)).astype(np.float32)

  def loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]) ** 2)

  dp = jpack.data_parallel(loss, make(), params, mode=mode)
  state = dp.init(params)
  ref, opt = params, make()
  opt_state = opt.init(ref)
  for _ in range(3):
    state, _ = dp.step(state, batch)
    updates, opt_state = opt.update(jax.grad(loss)(ref, batch), opt_state, ref)
    ref = optax.apply_updates(ref, updates)
  for key, want in ref.items():
    np.testing.assert_allclose(np.asarray(dp.unpack(state)[key]), want, rtol=2e-5, atol=2e-6)


def test_large_constants_are_left_to_the_program():
  fn = jax.shard_map(lambda: (jnp.zeros(5 << 20), jnp.ones(3)), mesh=MESH, in_specs=(),
                     out_specs=P(), check_vma=False)
  closed = jax.make_jaxpr(fn)()
  assert sorted(_constants._known_outputs(closed, MESH)) == [1]  # 20 MiB: compiled
  big, small = _constants.on_host_where_constant(fn, MESH)()
  assert big.shape == (5 << 20,) and not np.asarray(big).any()
  np.testing.assert_array_equal(np.asarray(small), np.ones(3, np.float32))
