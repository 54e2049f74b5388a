"""ZeRO-1 (jpack.optax.sharded) vs the replicated optimizer after per-leaf pmean."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from jpack import _constants
from test_optax import (assert_trees_close, init_sharded, loss, params0, per_leaf_pmean,
                         run)

OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "chain_schedule": lambda: optax.chain(
        optax.scale_by_adam(),
        optax.scale_by_schedule(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 100)),
        optax.scale(-1.0)),
}


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_equals_replicated_over_100_steps(name, n):
  got = run(jpack.optax.sharded(OPTIMIZERS[name](), "batch"), 100, n=n)
  want = run(OPTIMIZERS[name](), 100, reduce=per_leaf_pmean, n=n)
  assert_trees_close(got, want, tol=5e-5)


def test_shards_in_shards_out_then_gather_params_equals_replicated():
  """update(Shards, state, Shards) skips the all-gather; gathering new params matches."""
  n = 4
  mesh = jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n])
  data = np.random.default_rng(1).normal(size=(n, 30, 3, 5)).astype(np.float32)
  data = jax.device_put(data, NamedSharding(mesh, P("batch")))
  tx = jpack.optax.sharded(optax.adamw(1e-2, weight_decay=0.1), "batch")

  def body(params, data):
    packed = jpack.pack(params, jpack.plan(params, num_shards=n))
    state = tx.init(packed)

    def one(carry, x):
      packed, state = carry
      g = jax.grad(lambda p: loss(jpack.unpack(p), x))(jpack.vary(packed, "batch"))
      local = jpack.shard(packed, "batch")
      u, state = tx.update(jpack.reduce_scatter(g, "batch", mean=True), state, local)
      assert isinstance(u, jpack.Shards)
      return (jpack.all_gather(optax.apply_updates(local, u), "batch"), state), None

    (packed, _), _ = jax.lax.scan(one, (packed, state), data[0])
    return jpack.unpack(packed)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P()))
  got = f(jax.device_put(params0(), NamedSharding(mesh, P())), data)
  want = run(optax.adamw(1e-2, weight_decay=0.1), 30, reduce=per_leaf_pmean, n=n)
  assert_trees_close(got, want, tol=5e-5)


@pytest.mark.parametrize("n", [2, 8])
def test_global_norm_clipping_uses_the_whole_gradient(n):
  # optax's own clip_by_global_norm on ZeRO-1 slices: each device holds 1/n of the
  # gradient, and the norm it clips by is the whole gradient's (a slice's norm would
  # clip less), as plain optax clips after a per-leaf pmean.
  clip = 0.05  # small: clipping is active on every step
  got = run(jpack.optax.sharded(optax.chain(optax.clip_by_global_norm(clip),
                                            optax.sgd(0.1)), "batch"), 20, n=n)
  want = run(optax.chain(optax.clip_by_global_norm(clip), optax.sgd(0.1)), 20,
             reduce=per_leaf_pmean, n=n)
  assert_trees_close(got, want)
  # The clip alone, and first in a chain with adam, at another threshold.
  for make in (lambda: optax.clip_by_global_norm(0.5),
               lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))):
    got = run(jpack.optax.sharded(make(), "batch"), 10, n=n)
    assert_trees_close(got, run(make(), 10, reduce=per_leaf_pmean, n=n), tol=5e-5)


def test_masks_and_frozen_leaves_through_labels():
  labels = lambda p: {"dense": {"w": "decay", "b": "no_decay"}, "norm": {"scale": "frozen"},
                      "emb": "decay"}
  transforms = lambda: {"decay": optax.adamw(1e-2, weight_decay=0.5),
                        "no_decay": optax.adamw(1e-2, weight_decay=0.0),
                        "frozen": optax.set_to_zero()}
  got = run(jpack.optax.sharded(jpack.optax.partition(transforms(), labels), "batch"), 30)
  want = run(optax.multi_transform(transforms(), labels), 30, reduce=per_leaf_pmean)
  assert_trees_close(got, want)
  np.testing.assert_array_equal(got["norm"]["scale"], params0()["norm"]["scale"])


# Each device owns whole leaves for what needs them (lamb's trust ratio, adafactor's
# factored moments, a weight-decay mask, muon): optax's result.
OWNED = {
    "lamb": lambda: optax.lamb(1e-2, weight_decay=0.1),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "adamw(mask)": lambda: optax.adamw(1e-2, weight_decay=0.1,
                                       mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    "MultiSteps(lamb)": lambda: optax.MultiSteps(optax.lamb(1e-2), 2).gradient_transformation(),
    "muon": lambda: optax.contrib.muon(1e-2),
    "sm3": lambda: optax.sm3(0.1),
    "clip, lamb": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.lamb(1e-2)),
    # Noise drawn per leaf from a key split over the whole tree: a device's own leaves
    # get the numbers the tree's do. A NaN flag per leaf.
    "noisy_sgd": lambda: optax.noisy_sgd(0.1, key=0),
    "zero_nans": lambda: optax.chain(optax.zero_nans(), optax.sgd(0.1)),
}


@pytest.mark.parametrize("name", sorted(OWNED))
def test_transforms_that_need_whole_leaves_run_on_owned_leaves_like_optax(name):
  got = run(jpack.optax.sharded(OWNED[name](), "batch"), 10)
  make, tol = OWNED[name], 1e-5
  if "lamb" in name:
    # A norm (the clip's, the trust ratio's) is summed in another order, and adam
    # amplifies that last bit on small gradients over the ten steps: chain(clip, adam),
    # all on slices, differs from optax by as much. One step agrees within 1e-6
    # (tests/test_leafwise.py).
    tol = 2e-4
  assert_trees_close(got, run(make(), 10, reduce=per_leaf_pmean), tol=tol)


@given(st.recursive(st.just(0), lambda kids: st.lists(kids, min_size=1, max_size=3) | (
    st.dictionaries(st.sampled_from("abc"), kids, min_size=1, max_size=3)), max_leaves=8),
       st.data())
def test_owned_state_leaves_are_matched_to_their_param_leaves(params, data):
  # init's state on every device is made from two traces (whole leaves, stand-ins): each
  # state leaf in a tree of the params' structure is its param's (or in a list there);
  # a chain's tuple of states is not one.
  treedef = jax.tree.structure(params)
  n = treedef.num_leaves
  masked = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
  mu = treedef.unflatten(range(n))
  nu = treedef.unflatten([optax.MaskedNode() if m else j for j, m in enumerate(masked)])
  per_dim = treedef.unflatten([[j, j] for j in range(n)])  # sm3: a list per leaf
  state = ((-1, mu), (-1, nu, (-1, -1)), per_dim)  # -1: not a param's
  want = jax.tree.leaves(state)
  found = _constants.by_param(jax.tree.unflatten(jax.tree.structure(state),
                                              range(len(want))), treedef)
  if treedef == jax.tree.structure(0):  # one array: every state leaf is its
    want = [0] * len(want)
  assert {i: j for j, i in found} == {i: j for i, j in enumerate(want) if j >= 0}


def test_owned_leaves_keep_about_one_nth_of_the_state():
  n = 8
  rng = np.random.default_rng(0)
  params = {f"w{i:02d}": jnp.asarray(rng.normal(size=(32, 32)), jnp.float32) for i in range(16)}
  params["b"] = jnp.zeros(32, jnp.float32)
  mesh = jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n])
  tx = jpack.optax.sharded(optax.contrib.muon(1e-3), "batch", plan_options=dict(align_bytes=16))
  state = init_sharded(tx, params, n)  # one device's state
  full = sum(x.size * x.dtype.itemsize
             for x in jax.tree.leaves(optax.contrib.muon(1e-3).init(params)))
  per_device = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert per_device <= 1.1 * full / n, (per_device, full)
  # The reduce-scatter hands each device whole leaves: no leaf crosses a shard.
  layout = state.layout
  for slot in layout.slots:
    width = layout.buckets[slot.bucket].size // n
    assert slot.offset // width == (slot.offset + slot.size - 1) // width, slot.path


@pytest.mark.parametrize("inner,culprit", [
    (lambda: optax.chain(optax.contrib.normalize(), optax.sgd(0.1)), "normalize"),  # a slice's
    (lambda: optax.contrib.dog(), "scale_by_dog"),  # a distance over the whole parameters
    (lambda: optax.apply_if_finite(optax.adam(1e-3), 2), "apply_if_finite"),  # a slice's NaN
    # a measurement of the updates kept in the state: each device's slice's norm
    (lambda: optax.chain(optax.transforms.snapshot("norm", optax.tree.norm), optax.sgd(0.1)),
     "snapshot"),
    (lambda: optax.transforms.monitor({"norm": optax.tree.norm}), "monitor"),  # measures
    (lambda: optax.polyak_sgd(max_learning_rate=0.5), "scale_by_polyak"),  # whole-gradient norm
])
def test_unshardable_inner_transforms_are_refused(inner, culprit):
  # Neither slices nor a device's own leaves have what they need.
  with pytest.raises(TypeError, match=f"{culprit}.* cannot run inside jpack.optax.sharded: "
                                      "on each device's"):
    init_sharded(jpack.optax.sharded(inner(), "batch"))


@pytest.mark.parametrize("make", [
    # Per-coordinate, refused by name before.
    lambda: optax.contrib.cocob(),
    lambda: optax.contrib.sam(optax.sgd(0.05), optax.sgd(0.05)),
])
def test_per_coordinate_transforms_run_on_slices_like_optax(make):
  got = run(jpack.optax.sharded(make(), "batch"), 20)
  assert_trees_close(got, run(make(), 20, reduce=per_leaf_pmean), tol=5e-5)


@pytest.mark.parametrize("make", [
    lambda: optax.inject_hyperparams(lambda learning_rate: optax.chain(
        optax.clip_by_global_norm(0.05), optax.adamw(learning_rate)))(learning_rate=1e-2),
    lambda: optax.chain(optax.clip_by_global_norm(0.05),  # bf16 moments would turn float32
                        optax.inject_hyperparams(optax.sgd)(learning_rate=1e-2)),
])
def test_a_clip_with_inject_hyperparams_runs_on_slices_like_optax(make):
  # The clip inject_hyperparams builds at every update is computed on the slices too.
  got = run(jpack.optax.sharded(make(), "batch"), 10)
  assert_trees_close(got, run(make(), 10, reduce=per_leaf_pmean), tol=2e-4)


def _train(mesh, params, opt_state=None, steps=10, start=0, mode="sharded", optimizer=None,
           labels=None):
  optimizer = optimizer or optax.adam(1e-2)
  if labels is not None:
    optimizer = jpack.optax.partition(optimizer, labels)
  dp = jpack.data_parallel(loss_fn, optimizer, params, mesh, mode=mode)
  state = dp.init(params)
  if opt_state is not None:
    placed = jax.device_put(opt_state, jax.tree.map(lambda x: x.sharding, state.opt_state))
    state = state._replace(opt_state=placed)
  rng = np.random.default_rng(start)
  for _ in range(steps):
    batch = rng.normal(size=(8, 3, 5)).astype(np.float32)
    batch = jax.device_put(batch, NamedSharding(mesh, P("batch")))
    state, _ = dp.step(state, batch)
  return dp, state


def loss_fn(p, batch):
  return jnp.mean(jax.vmap(lambda x: loss(p, x))(batch))


def _train_per_leaf(mesh, params, opt_state=None, steps=10, start=0, optimizer=None,
                    labels=None):
  """The reference: plain optax in a shard_map step, one lax.pmean per gradient leaf, on
  the same batches as `_train`. Returns (params, opt_state)."""
  tx = optimizer or optax.adam(1e-2)
  if labels is not None:
    tx = optax.multi_transform(tx, labels)
  opt_state = tx.init(params) if opt_state is None else opt_state
  params, opt_state = jax.device_put((params, opt_state), NamedSharding(mesh, P()))

  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(jax.lax.pcast(params, "batch", to="varying"), batch)
    grads = jax.tree.map(lambda g: jax.lax.pmean(g, "batch"), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("batch")),
                               out_specs=(P(), P())))
  rng = np.random.default_rng(start)
  for _ in range(steps):
    batch = rng.normal(size=(8, 3, 5)).astype(np.float32)
    params, opt_state = step(params, opt_state,
                             jax.device_put(batch, NamedSharding(mesh, P("batch"))))
  return params, opt_state


def f32_params():
  # All f32: a bf16 leaf would make 4- and 8-device means round differently.
  return jax.tree.map(lambda x: x.astype(jnp.float32), params0())


def test_optimizer_memory_is_one_over_n():
  # Params large enough that the buckets' alignment padding (256 bytes a leaf on CPU)
  # is small next to them.
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(512, 128)), jnp.float32),
            "b": jnp.zeros(128, jnp.float32),
            "emb": jnp.asarray(rng.normal(size=(256, 128)), jnp.bfloat16)}
  mesh8 = jax.make_mesh((8,), ("batch",))
  dp = jpack.data_parallel(lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2),
                           optax.adam(1e-2), params, mesh8, mode="sharded")
  state = dp.init(params)
  per_device = jpack.optax.state_bytes_per_device(state.opt_state, 8)
  assert per_device == sum(x.addressable_shards[0].data.nbytes
                           for x in jax.tree.leaves(state.opt_state))
  replicated = sum(x.nbytes for x in jax.tree.leaves(optax.adam(1e-2).init(params)))
  assert per_device >= replicated / 8
  # 1/N of the state plus a little alignment padding and the step count.
  assert per_device <= 1.02 * replicated / 8 + 8, (per_device, replicated)
  for x in jax.tree.leaves(state.opt_state):
    if x.ndim:
      assert x.addressable_shards[0].data.shape[0] == x.shape[0] // 8


LABELS = lambda p: {"dense": {"w": "decay", "b": "no_decay"}, "norm": {"scale": "frozen"},
                    "emb": "decay"}


def labelled_optimizer():
  return {"decay": optax.adamw(1e-2, weight_decay=0.5), "no_decay": optax.adam(1e-2),
          "frozen": optax.set_to_zero()}


@pytest.mark.parametrize("mode", ["packed", "allreduce", "sharded"])
def test_data_parallel_with_labels_equals_optax_multi_transform(mode):
  mesh = jax.make_mesh((8,), ("batch",))
  dp, state = _train(mesh, f32_params(), mode=mode, optimizer=labelled_optimizer(),
                     labels=LABELS)
  ref, _ = _train_per_leaf(mesh, f32_params(), optimizer=labelled_optimizer(), labels=LABELS)
  assert_trees_close(dp.unpack(state), ref, tol=1e-4)
  np.testing.assert_array_equal(dp.unpack(state)["norm"]["scale"], params0()["norm"]["scale"])
  # Each label has buckets of its own.
  assert {b.group[1] for b in dp.layout.buckets} == {"decay", "no_decay", "frozen"}


@pytest.mark.parametrize("labelled,mu_dtype", [(False, None), (True, None),
                                               (False, jnp.bfloat16)])
def test_checkpoint_is_plain_optax_state_and_resumes_on_4(labelled, mu_dtype):
  """gather_state is the state plain optax has after the same steps (with labels:
  optax.multi_transform's full-tree state; with mu_dtype: bf16 moments of f32 params),
  as host arrays; save on 8 devices, resume on 4."""
  mesh8 = jax.make_mesh((8,), ("batch",))
  mesh4 = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  kw = dict(optimizer=labelled_optimizer(), labels=LABELS) if labelled else {}
  if mu_dtype is not None:
    kw = dict(optimizer=optax.adam(1e-2, mu_dtype=mu_dtype))
  dp8, s8 = _train(mesh8, f32_params(), **kw)
  _, ref_state = _train_per_leaf(mesh8, f32_params(), **kw)
  tree_state = jpack.checkpoint.gather_state(s8.opt_state)
  assert jax.tree.structure(tree_state) == jax.tree.structure(ref_state)
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(tree_state))
  assert (jax.tree.map(lambda x: x.dtype, tree_state)
          == jax.tree.map(lambda x: x.dtype, ref_state))
  assert_trees_close(tree_state, ref_state, tol=1e-4)
  saved = jax.tree.map(np.asarray, tree_state)  # what a checkpointer would write
  params = dp8.unpack(s8)
  # Resume ZeRO-1 on 4 devices, and plain optax (per-leaf) on 4 devices, from the save.
  dp4, fresh4 = _train(mesh4, params, steps=0, **kw)
  restored = jpack.checkpoint.scatter_state(saved, like=fresh4.opt_state)
  _, s4 = _train(mesh4, params, opt_state=restored, steps=5, start=1, **kw)
  r4, _ = _train_per_leaf(mesh4, params, opt_state=saved, steps=5, start=1, **kw)
  assert_trees_close(dp4.unpack(s4), r4, tol=1e-4)
  # And the restored state itself round-trips exactly.
  again = jpack.checkpoint.gather_state(restored)
  assert jax.tree.structure(again) == jax.tree.structure(saved)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(np.asarray(a), b)


def test_scatter_state_refuses_a_state_of_other_shapes():
  mesh = jax.make_mesh((8,), ("batch",))
  _, state = _train(mesh, f32_params(), steps=0)
  saved = jax.tree.map(np.asarray, jpack.checkpoint.gather_state(state.opt_state))
  saved[0].mu["dense"]["w"] = np.zeros((7, 4), np.float32)  # not the (6, 4) of the params
  with pytest.raises(ValueError, match=r"mu\['dense'\]\['w'\]"):
    jpack.checkpoint.scatter_state(saved, like=state.opt_state)
  saved[0].mu["dense"]["w"] = np.zeros((6, 4), np.float16)  # right shape, wrong dtype
  with pytest.raises(ValueError, match=r"mu\['dense'\]\['w'\].*float16"):
    jpack.checkpoint.scatter_state(saved, like=state.opt_state)


def test_scatter_state_refuses_another_optimizer_or_other_labels():
  mesh = jax.make_mesh((8,), ("batch",))
  _, state = _train(mesh, f32_params(), steps=0)
  _, sgd = _train(mesh, f32_params(), steps=0, optimizer=optax.sgd(0.1, momentum=0.9))
  saved = jpack.checkpoint.gather_state(sgd.opt_state)
  with pytest.raises(ValueError, match="same inner transformation"):
    jpack.checkpoint.scatter_state(saved, like=state.opt_state)
  # A save of a partition restored onto a run without one.
  _, labelled = _train(mesh, f32_params(), steps=0, optimizer=labelled_optimizer(),
                       labels=LABELS)
  saved = jpack.checkpoint.gather_state(labelled.opt_state)
  with pytest.raises(ValueError, match=r"saved \.inner_states\['decay'\]"):
    jpack.checkpoint.scatter_state(saved, like=state.opt_state)


def test_flat_clip_by_global_norm_counts_both_parts_of_complex_leaves():
  tree = {"z": jnp.array([3j, 4j], jnp.complex64), "x": jnp.array([1.0, -2.0])}
  tx = jpack.optax.flat(optax.clip_by_global_norm(1.0))
  got, _ = tx.update(tree, tx.init(tree), tree)
  want, _ = optax.clip_by_global_norm(1.0).update(tree, optax.EmptyState())
  for k in tree:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-6)


def test_sharded_refuses_packed_updates_of_another_layout():
  params = {"a": jnp.ones(64), "b": jnp.ones(64)}
  grads = {"a": jnp.full(64, 1.0), "b": jnp.full(64, -100.0)}
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])

  def body(p, layout_kwargs):
    tx = jpack.optax.sharded(optax.sgd(1.0), "x")
    layout = jpack.plan(grads, num_shards=4, **layout_kwargs)
    u, _ = tx.update(jpack.pack(grads, layout), tx.init(p), p)
    return jpack.unpack(u)

  def run_body(**layout_kwargs):
    return jax.jit(jax.shard_map(lambda p: body(p, layout_kwargs), mesh=mesh, in_specs=P(),
                                 out_specs=P(), check_vma=False))(params)

  with pytest.raises(ValueError, match="layout"):
    run_body(reverse=False)  # same bucket sizes, leaves in the other order
  got = run_body()  # the layout sharded() plans itself: accepted
  np.testing.assert_allclose(got["a"], -1.0)
  np.testing.assert_allclose(got["b"], 100.0)


def test_an_allreduce_inside_sharded_is_refused():
  # On ZeRO-1 slices it would add up different devices' slices.
  for inner in (optax.chain(jpack.optax.allreduce("batch"), optax.adam(1e-3)),
                jpack.optax.sharded(optax.sgd(0.1), "batch")):
    with pytest.raises(TypeError, match=r"jpack.optax.(allreduce|sharded) cannot run inside "
                                        r"jpack.optax.sharded: .*runs a collective over "
                                        r"(a mesh axis|'batch').*Reduce nothing inside"):
      init_sharded(jpack.optax.sharded(inner, "batch"))


@pytest.mark.parametrize("params", [jnp.arange(40.0), [jnp.arange(40.0)],
                                    {"a": jnp.ones(3), "b": jnp.arange(5.0)},
                                    jnp.float32(0.5), {"scale": jnp.float32(2.0)}])
def test_checkpoint_round_trip_when_params_are_one_array(params):
  # With a single array as params, every array leaf of the state looked like a params
  # tree (or none did): restoring the gathered state failed on structure. A scalar
  # param's moments look like the step count: they are found by their position.
  tx = jpack.optax.sharded(optax.adam(1e-3), "batch")

  def init_on(n):
    mesh = jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n])
    shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(),
                                          check_vma=False), params)
    specs = jax.tree.map(lambda x: P("batch") if x.ndim else P(), shapes)
    return jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  saved = jpack.checkpoint.gather_state(init_on(8))
  want = optax.adam(1e-3).init(params)
  assert jax.tree.structure(saved) == jax.tree.structure(want)
  saved = jax.tree.map(lambda x: x + 1, saved)  # distinct values to follow
  restored = jpack.checkpoint.scatter_state(saved, like=init_on(4))
  again = jpack.checkpoint.gather_state(restored)
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(a, b)


def test_checkpoint_errors_name_where_the_states_differ():
  mesh = jax.make_mesh((8,), ("batch",))
  _, state = _train(mesh, f32_params(), steps=0)
  saved = jpack.checkpoint.gather_state(state.opt_state)
  _, other = _train(mesh, f32_params(), steps=0, optimizer=optax.sgd(0.1, momentum=0.9))
  with pytest.raises(ValueError, match=r"first difference: saved \[0\]\.count, expected "
                                       r"\[0\]\.trace"):
    jpack.checkpoint.scatter_state(saved, like=other.opt_state)
  # Moments of other params, where the new run keeps a tree like its params.
  bad = (saved[0]._replace(mu={"other": np.zeros(3, np.float32)}),) + tuple(saved[1:])
  with pytest.raises(ValueError, match=r"at \[0\]\.mu is PyTreeDef\(\{'other'.*same params"):
    jpack.checkpoint.scatter_state(bad, like=state.opt_state)
  # A hand-written pmap step's state has a row per device: refused, not passed through
  # unchanged.
  tx = jpack.optax.sharded(optax.adam(1e-2), "batch")
  rows = jax.tree.map(lambda x: jnp.stack([x] * 8), f32_params())
  pmapped = jax.pmap(tx.init, axis_name="batch")(rows)
  with pytest.raises(ValueError, match="jax.pmap state"):
    jpack.checkpoint.gather_state(jax.device_get(pmapped))


@pytest.mark.parametrize("keys", [(True, False), (1, 0)])
def test_labels_that_are_not_strings_keep_their_keys_in_the_state(keys):
  """gather_state is keyed like optax.multi_transform(inner, labels).init(params), so a
  plain optax run resumes from it (the layout keeps labels as str; the state must not)."""
  decay, plain = keys
  labels = lambda p: {"dense": {"w": decay, "b": plain}, "norm": {"scale": plain},
                      "emb": decay}
  optimizer = {decay: optax.adamw(1e-2, weight_decay=0.5), plain: optax.adam(1e-2)}
  mesh = jax.make_mesh((8,), ("batch",))
  _, state = _train(mesh, f32_params(), steps=3, optimizer=optimizer, labels=labels)
  _, ref_state = _train_per_leaf(mesh, f32_params(), steps=3, optimizer=optimizer,
                                 labels=labels)
  saved = jpack.checkpoint.gather_state(state.opt_state)
  assert set(saved.inner_states) == {decay, plain}
  assert jax.tree.structure(saved) == jax.tree.structure(ref_state)
  assert_trees_close(saved, ref_state, tol=1e-4)
  # A plain optax step from the saved state (it raised KeyError: True before).
  tx = optax.multi_transform(optimizer, labels)
  params = f32_params()
  tx.update(jax.tree.map(jnp.ones_like, params), saved, params)
  jpack.checkpoint.scatter_state(saved, like=state.opt_state)


def test_labels_equal_as_strings_are_refused():
  with pytest.raises(ValueError, match="labels 1 and '1' are the same label"):
    jpack.optax.flat(jpack.optax.partition(
        {1: optax.sgd(0.1), "1": optax.adam(0.1)},
        lambda p: jax.tree.map(lambda _: 1, p))).init(f32_params())


@pytest.mark.parametrize("mode", ["packed", "allreduce", "sharded"])
def test_a_prefix_label_tree_labels_whole_subtrees_as_in_optax(mode):
  prefix = {"dense": "decay", "norm": "frozen", "emb": "no_decay"}  # a prefix of params
  mesh = jax.make_mesh((8,), ("batch",))
  dp, state = _train(mesh, f32_params(), mode=mode, optimizer=labelled_optimizer(),
                     labels=prefix, steps=5)
  ref, _ = _train_per_leaf(mesh, f32_params(), optimizer=labelled_optimizer(),
                           labels=prefix, steps=5)
  assert_trees_close(dp.unpack(state), ref, tol=1e-4)
  np.testing.assert_array_equal(dp.unpack(state)["norm"]["scale"], params0()["norm"]["scale"])
  with pytest.raises(ValueError, match="or a prefix of it"):
    _train(mesh, f32_params(), mode=mode, optimizer=labelled_optimizer(),
           labels={"dense": "decay"}, steps=0)


@pytest.mark.parametrize("dominant", [True, False])
def test_init_warns_when_owned_leaves_pad_the_buckets_beyond_twice_the_leaves(
    caplog, dominant):
  """One leaf far larger than the rest pads every device's shard to it: init says so at
  WARNING with what to use instead; leaves of similar size are said at INFO."""
  sizes = [4096] + [64] * 7 if dominant else [512] * 8
  params = {f"w{i}": jnp.ones((n, 4), jnp.float32) for i, n in enumerate(sizes)}
  with caplog.at_level(logging.INFO, logger="jpack"):
    init_sharded(jpack.optax.sharded(optax.contrib.muon(1e-2), "batch"), params, n=8)
  records = [r for r in caplog.records if r.name == "jpack" and "own whole leaves" in
             r.getMessage()]
  assert len(records) == 1, [r.getMessage() for r in records]
  (record,) = records
  assert record.levelno == (logging.WARNING if dominant else logging.INFO)
  assert ("mode='packed'" in record.getMessage()) == dominant


# -- optax.clip_by_global_norm and jpack.optax.partition in every data_parallel mode -------

MLP_IN, MLP_HIDDEN, MLP_OUT, MLP_ROWS = 5, 16, 3, 32  # 4 rows a device on 8 devices


def mlp_params():
  rng = np.random.default_rng(3)
  return {"hidden": {"w": rng.normal(size=(MLP_IN, MLP_HIDDEN)).astype(np.float32),
                     "b": rng.normal(size=MLP_HIDDEN).astype(np.float32)},
          "out": {"w": rng.normal(size=(MLP_HIDDEN, MLP_OUT)).astype(np.float32),
                  "b": rng.normal(size=MLP_OUT).astype(np.float32)}}


def mlp_loss(p, batch):
  x, y = batch
  h = jnp.tanh(x @ p["hidden"]["w"] + p["hidden"]["b"])
  # Targets far from the outputs: the gradient's global norm is well above 1.
  return jnp.mean((h @ p["out"]["w"] + p["out"]["b"] - y) ** 2)


def mlp_batch(step):
  rng = np.random.default_rng(100 + step)
  return (rng.normal(size=(MLP_ROWS, MLP_IN)).astype(np.float32),
          10.0 * rng.normal(size=(MLP_ROWS, MLP_OUT)).astype(np.float32))


def one_device_optax(tx, params, steps):
  """The reference: plain optax on one device, the gradient of the whole batch's mean
  loss. Returns (params, the gradient's global norm at each step)."""
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  state = tx.init(params)

  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(mlp_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, optax.tree.norm(grads)

  norms = []
  for i in range(steps):
    params, state, norm = step(params, state, jax.device_put(mlp_batch(i), device))
    norms.append(float(norm))
  return params, norms


def assert_relative(got, want, rtol):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=0,
                               err_msg=jax.tree_util.keystr(path))


def clipped_masked_adamw():
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(1e-3, weight_decay=0.1,
                                 mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))


@pytest.mark.parametrize("mode", ["packed", "allreduce", "sharded"])
def test_clip_then_masked_adamw_equals_one_device_optax_in_every_mode(mode):
  steps = 3
  mesh = jax.make_mesh((8,), ("batch",))
  dp = jpack.data_parallel(mlp_loss, clipped_masked_adamw(), mlp_params(), mesh, mode=mode)
  state = dp.init(mlp_params())
  grad_norms = []
  for i in range(steps):
    state, metrics = dp.step(state, mlp_batch(i))
    grad_norms.append(float(metrics["grad_norm"]))
  want, want_norms = one_device_optax(clipped_masked_adamw(), mlp_params(), steps)
  assert min(want_norms) > 5.0, want_norms  # the clip scales every step's gradient
  np.testing.assert_allclose(grad_norms, want_norms, rtol=1e-5)
  assert_relative(dp.unpack(state), want, rtol=1e-5)
  # The mask: the biases (not decayed) are where clip + plain adam takes them, the
  # matrices (decayed) are not.
  plain, _ = one_device_optax(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
                              mlp_params(), steps)
  for layer in ("hidden", "out"):
    np.testing.assert_allclose(np.asarray(dp.unpack(state)[layer]["b"]),
                               np.asarray(plain[layer]["b"]), rtol=1e-5)
    assert not np.allclose(np.asarray(dp.unpack(state)[layer]["w"]),
                           np.asarray(plain[layer]["w"]), rtol=1e-6, atol=0)


MLP_LABELS = {"hidden": {"w": "decay", "b": "plain"}, "out": {"w": "decay", "b": "frozen"}}


def mlp_transforms():
  return {"decay": optax.adamw(1e-2, weight_decay=0.5), "plain": optax.sgd(0.1, momentum=0.9),
          "frozen": optax.set_to_zero()}


@pytest.mark.parametrize("labels", [MLP_LABELS, lambda p: MLP_LABELS])
def test_partition_is_optax_partition_as_a_plain_transformation(labels):
  params = jax.tree.map(jnp.asarray, mlp_params())
  got_tx = jpack.optax.partition(mlp_transforms(), labels)
  want_tx = optax.partition(mlp_transforms(), labels)
  got_state, want_state = got_tx.init(params), want_tx.init(params)
  assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
  got_params = want_params = params
  for i in range(3):
    got_u, got_state = got_tx.update(jax.grad(mlp_loss)(got_params, mlp_batch(i)), got_state,
                                     got_params)
    want_u, want_state = want_tx.update(jax.grad(mlp_loss)(want_params, mlp_batch(i)),
                                        want_state, want_params)
    assert_relative(got_u, want_u, rtol=1e-6)
    got_params = optax.apply_updates(got_params, got_u)
    want_params = optax.apply_updates(want_params, want_u)
  assert_relative(got_state, want_state, rtol=1e-6)
  assert_relative(got_params, want_params, rtol=1e-6)
  np.testing.assert_array_equal(got_params["out"]["b"], params["out"]["b"])


def test_partition_in_sharded_mode_equals_optax_and_keeps_frozen_leaves():
  steps = 3
  mesh = jax.make_mesh((8,), ("batch",))
  tx = jpack.optax.partition(mlp_transforms(), MLP_LABELS)
  dp = jpack.data_parallel(mlp_loss, tx, mlp_params(), mesh, mode="sharded")
  state = dp.init(mlp_params())
  for i in range(steps):
    state, _ = dp.step(state, mlp_batch(i))
  got = dp.unpack(state)
  np.testing.assert_array_equal(got["out"]["b"], mlp_params()["out"]["b"])  # frozen
  want, _ = one_device_optax(optax.partition(mlp_transforms(), MLP_LABELS), mlp_params(), steps)
  assert_relative(got, want, rtol=1e-5)
  assert not np.allclose(got["hidden"]["b"], mlp_params()["hidden"]["b"])  # trained
  # Each label has buckets of its own.
  assert {b.group[1] for b in dp.layout.buckets} == {"decay", "plain", "frozen"}


def test_clip_by_global_norm_on_slices_counts_both_parts_of_complex_leaves():
  """optax.clip_by_global_norm inside sharded: a complex leaf's norm is |z|, both parts."""
  t = {"z": jnp.array([3j, 4j], jnp.complex64), "x": jnp.array([1.0, -2.0])}
  mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  tx = jpack.optax.sharded(optax.clip_by_global_norm(1.0), "batch")
  f = jax.jit(jax.shard_map(lambda t: tx.update(t, tx.init(t), t)[0], mesh=mesh,
                            in_specs=P(), out_specs=P(), check_vma=False))
  got = f(t)
  want = optax.clip_by_global_norm(1.0).update(t, None)[0]
  for k in t:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6)
