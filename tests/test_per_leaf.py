"""Optimizers that need whole leaves, in every mode.

`jpack.optax.flat` (and so ``data_parallel(mode="packed")``) runs a transformation that
buckets would change on the params tree instead, and only that part of an `optax.chain`;
a trust ratio or a static mask is computed leaf by leaf on the buckets. Each target here
must match plain optax on one device, on the same tree, over several steps. ZeRO-1
(``mode="sharded"``) runs them leaf by leaf on its slices or on each device's own whole
leaves, and must match too.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import jpack

N = 8
STEPS = 4
TOL = 1e-5


def params0():
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.float32)
  return {"embed": normal(12, 16),
          "block": {"w": normal(16, 16), "b": jnp.full(16, 0.1, jnp.float32),
                    "norm": {"scale": jnp.ones(16, jnp.float32)}},
          "head": {"w": normal(16, 4), "b": jnp.full(4, 0.1, jnp.float32)}}


def loss_fn(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["embed"])
  h = jnp.tanh(h @ p["block"]["w"] + p["block"]["b"]) * p["block"]["norm"]["scale"]
  return jnp.mean((h @ p["head"]["w"] + p["head"]["b"] - y) ** 2)


def batches():
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(N * 4, 12)).astype(np.float32),
           rng.normal(size=(N * 4, 4)).astype(np.float32)) for _ in range(STEPS)]


def decay_mask(p):
  """GPT-2's recipe: weight decay on matrices, not on biases and norms."""
  return jax.tree.map(lambda x: x.ndim > 1, p)


TARGETS = {
    "adamw(mask=fn)": lambda: optax.adamw(1e-3, weight_decay=0.1, mask=decay_mask),
    "adamw(mask=tree)": lambda: optax.adamw(1e-3, weight_decay=0.1,
                                            mask=decay_mask(params0())),
    "lamb": lambda: optax.lamb(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "muon": lambda: optax.contrib.muon(1e-3),
    "sm3": lambda: optax.sm3(1e-3),
}


def optax_on_one_device(tx):
  """The reference: plain optax on the whole batch, on the tree."""
  params, state = params0(), tx.init(params0())
  for batch in batches():
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def assert_close(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_flat_matches_optax(name):
  make = TARGETS[name]
  tx, params = jax.jit(jpack.optax.flat(make()).update), params0()
  state = jpack.optax.flat(make()).init(params)
  for batch in batches():
    updates, state = tx(jax.grad(loss_fn)(params, batch), state, params)
    params = optax.apply_updates(params, updates)
  assert_close(params, optax_on_one_device(make()))


# data_parallel's packed mode runs jpack.optax.flat, which test_flat_matches_optax checks
# on every target: here the step around it, with a mask (a function, a tree) and with
# muon. ZeRO-1 runs what slices would change leaf by leaf on the slices (the masks,
# lamb's trust ratio) or on each device's own whole leaves: every target.
@pytest.mark.parametrize("mode,name", [
    *(("packed", n) for n in ["adamw(mask=fn)", "adamw(mask=tree)", "muon"]),
    *(("sharded", n) for n in sorted(TARGETS))])
def test_data_parallel_matches_optax(mode, name):
  make = TARGETS[name]
  dp = jpack.data_parallel(loss_fn, make(), params0(), mode=mode)
  state = dp.init(params0())
  for batch in batches():
    state, _ = dp.step(state, batch)
  assert_close(dp.unpack(state), optax_on_one_device(make()))


def test_adamw_mask_keeps_adam_and_the_mask_on_buckets_and_says_so(caplog):
  tx = jpack.optax.flat(TARGETS["adamw(mask=fn)"]())
  with caplog.at_level(logging.INFO, logger="jpack"):
    state = tx.init(params0())
    jax.jit(tx.init)(params0())  # traced again: said once
  said = [r.getMessage() for r in caplog.records if r.name == "jpack"]
  assert len(said) == 1 and "optax.masked on the buckets, leaf by leaf" in said[0], said
  adam, decay, lr = state.inner_state
  assert isinstance(adam.mu, tuple) and len(adam.mu) == len(state.layout.buckets)
  assert type(decay).__name__ == "MaskedState"  # optax.masked's state, over the buckets
  assert lr == optax.EmptyState()


def test_a_whole_optimizer_on_the_leaves_keeps_optax_state():
  tx = jpack.optax.flat(optax.lamb(1e-3))
  state = tx.init(params0())
  want = optax.lamb(1e-3).init(params0())
  # adam's moments on buckets, the trust ratio's (empty) state as optax keeps it.
  assert len(state.inner_state) == len(want)
  muon = jpack.optax.flat(optax.contrib.muon(1e-3)).init(params0())
  assert (jax.tree.structure(muon.inner_state)
          == jax.tree.structure(optax.contrib.muon(1e-3).init(params0())))


def test_what_the_inner_optimizer_raises_is_named():
  def broken_update(updates, state, params=None):
    raise IndexError("list index out of range")
  broken = optax.GradientTransformation(lambda p: optax.EmptyState(), broken_update)
  for tx in (jpack.optax.flat(broken), jpack.optax.flat(optax.chain(optax.adam(1e-3),
                                                                    broken))):
    with pytest.raises(TypeError, match=r"cannot run inside jpack.optax.flat: .*IndexError: "
                                        r"list index out of range"):
      state = tx.init(params0())
      tx.update(params0(), state, params0())
