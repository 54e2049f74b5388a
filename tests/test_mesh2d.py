"""data_parallel on a two-level mesh, ("node", "gpu") = (2, 4) of the 8 CPU devices.

Every mode trains as one device does with plain optax; the ZeRO modes slice their state
over the inner axis only, and what crosses the outer axis is the 1/4 slices (hybrid
sharding). Two processes on such a mesh: tests/test_checkpoint_multiprocess.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jpack
from jpack._reference import crossing_bytes

NODES, PER_NODE = 2, 4
STEPS = 3


def mesh_2d(shape=(NODES, PER_NODE), names=("node", "gpu")):
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


def init_params():
  rng = np.random.default_rng(0)
  return {"w1": jnp.asarray(rng.normal(size=(6, 32)), jnp.float32), "b1": jnp.zeros(32),
          "w2": jnp.asarray(rng.normal(size=(32, 3)) / 4, jnp.float32), "b2": jnp.zeros(3)}


def loss_fn(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def batches():
  rng = np.random.default_rng(1)
  return [(rng.normal(size=(16, 6)).astype(np.float32),
           rng.normal(size=(16, 3)).astype(np.float32)) for _ in range(STEPS)]


def optimizer():  # GPT-2's recipe: clipped adamw, no decay on vectors
  decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(1e-2, weight_decay=0.1, mask=decay))


def one_device_reference():
  params, tx = init_params(), optimizer()
  state = tx.init(params)
  for batch in batches():
    updates, state = tx.update(jax.grad(loss_fn)(params, batch), state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("mode,accumulate", [
    ("packed", 1), ("allreduce", 2), ("sharded", 1), ("fsdp", 2),
    (jpack.Mode("sharded", shard_accumulator=True), 2),
    (jpack.Mode("fsdp", keep_gathered=True), 1)])
def test_every_mode_on_a_two_level_mesh_equals_one_device_optax(mode, accumulate):
  params = init_params()
  dp = jpack.data_parallel(loss_fn, optimizer(), params, mesh_2d(), mode=mode,
                           accumulate=accumulate)
  state = dp.init(params)
  for batch in batches():
    state, metrics = dp.step(state, batch)
  want = one_device_reference()
  got = dp.unpack(state)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
  name = mode if isinstance(mode, str) else mode.name
  if name in ("sharded", "fsdp"):  # slices over the node's devices, replicated over nodes
    for x in jax.tree.leaves(state.opt_state):
      if x.ndim:
        assert x.sharding.spec == P("gpu")
        assert x.addressable_shards[0].data.shape[0] * PER_NODE == x.shape[0]


@pytest.mark.parametrize("mode", ["packed", "sharded", "fsdp"])
def test_only_slices_cross_nodes_in_the_zero_modes(mode):
  # ZeRO: reduce-scatter within the node, all-reduce of the 1/4 slice across nodes,
  # all-gather within the node. Packed: the whole gradient crosses. (On CPU the slice's
  # all-reduce is itself a reduce-scatter and an all-gather: 1.5 slices of operands.)
  params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
  loss = lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2)
  dp = jpack.data_parallel(loss, optax.adam(1e-3), params, mesh_2d(), mode=mode)
  state = dp.init(params)
  hlo = dp.step.lower(state, np.ones((8, 64), np.float32)).compile().as_text()
  gradient = 4 * sum(b.size for b in dp.layout.buckets)  # bytes, f32
  crossing = crossing_bytes(hlo, PER_NODE)
  scalars = 64
  if mode == "packed":
    assert crossing >= gradient, (crossing, gradient)
  else:
    assert gradient / PER_NODE <= crossing <= 1.5 * gradient / PER_NODE + scalars, (
        crossing, gradient)


def test_a_mesh_of_one_node_is_the_one_level_mesh():
  params = init_params()
  dp = jpack.data_parallel(loss_fn, optimizer(), params, mesh_2d((1, 8)), mode="sharded")
  state = dp.init(params)
  assert {x.sharding.spec for x in jax.tree.leaves(state.opt_state) if x.ndim} == {P("gpu")}


def test_bad_meshes_and_batches_are_refused_with_the_fix():
  params = init_params()
  with pytest.raises(ValueError, match=r"one data-parallel axis, or two \(nodes x devices"):
    jpack.data_parallel(loss_fn, optimizer(), params, mesh_2d((2, 2, 2), ("a", "b", "c")))
  dp = jpack.data_parallel(loss_fn, optimizer(), params, mesh_2d(), mode="sharded")
  state = dp.init(params)
  x, y = batches()[0]
  with pytest.raises(ValueError, match=r"split evenly over this process's 8 devices of "
                                       r"axis \('node', 'gpu'\)"):
    dp.step(state, (x[:12], y[:12]))


def test_hand_written_fsdp_on_two_axes_gives_the_mean_gradient():
  # Several buckets: each gather after the last read of the bucket before it.
  params, mesh = init_params(), mesh_2d()
  layout = jpack.plan(params, num_shards=PER_NODE, bucket_bytes=256, solo_bytes=None)
  assert len(layout.buckets) > 2
  slices = P("gpu")

  def local(buckets, batch):
    shards = jpack.Shards(buckets, layout)
    return jax.grad(jpack.fsdp(loss_fn, ("node", "gpu")))(shards, batch).buckets

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(slices, P(("node", "gpu"))),
                               out_specs=slices))
  batch = batches()[0]
  put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  grads = step(put(jpack.pack(params, layout).buckets, slices), put(batch, P(("node", "gpu"))))
  got = jpack.unpack(jpack.Packed(tuple(np.asarray(g) for g in grads), layout))
  want = jax.grad(loss_fn)(params, batch)  # the full batch: the mean of equal splits
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)


def _collectives(jaxpr):
  """``(primitive, axes)`` of every collective in ``jaxpr``, in program order."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("psum", "psum_invariant", "reduce_scatter"):
      axes = eqn.params.get("axes", eqn.params.get("axis_name"))
      yield eqn.primitive.name, tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
        if inner is not None:
          yield from _collectives(inner if hasattr(inner, "eqns") else inner.jaxpr)


def test_fsdp_averages_across_nodes_once_after_the_backward_pass():
  # Averaged in each bucket's backward rule, the cross-node reductions sat between the
  # reduce-scatters, and XLA:GPU kept more activations alive around them (docs/gpu.md).
  params, mesh = init_params(), mesh_2d()
  layout = jpack.plan(params, num_shards=PER_NODE, bucket_bytes=256, solo_bytes=None)
  sharded = lambda spec: jax.sharding.NamedSharding(mesh, spec)

  def local(buckets, batch):
    return jax.grad(jpack.fsdp(loss_fn, ("node", "gpu")))(jpack.Shards(buckets, layout),
                                                          batch).buckets

  step = jax.shard_map(local, mesh=mesh, in_specs=(P("gpu"), P(("node", "gpu"))),
                       out_specs=P("gpu"))
  buckets = tuple(jax.ShapeDtypeStruct((b.size,), b.dtype, sharding=sharded(P("gpu")))
                  for b in layout.buckets)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharded(P(("node", "gpu")))), batches()[0])
  order = [axes for _, axes in _collectives(jax.make_jaxpr(step)(buckets, batch).jaxpr)]
  within = [i for i, axes in enumerate(order) if axes == ("gpu",)]
  across = [i for i, axes in enumerate(order) if "node" in axes]
  assert len(within) == len(layout.buckets) and across, order
  assert max(within) < min(across), order
