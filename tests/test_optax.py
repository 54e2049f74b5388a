"""jpack.optax.allreduce and flat: compose in chains, match the unpacked optimizer."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack

N = 8


def params0():
  rng = np.random.default_rng(0)
  return {"dense": {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
                    "b": jnp.zeros(4, jnp.float32)},
          "norm": {"scale": jnp.ones(4, jnp.float32)},
          "emb": jnp.asarray(rng.normal(size=(5, 6)), jnp.bfloat16)}


def loss(p, x):
  h = jnp.tanh(x @ p["emb"].astype(jnp.float32)) @ p["dense"]["w"] + p["dense"]["b"]
  return jnp.mean((h * p["norm"]["scale"]) ** 2)


def run(tx, steps, reduce=None, n=N):
  """`steps` optimizer steps inside shard_map; `reduce` averages grads before `tx`."""
  mesh = jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n])
  data = np.random.default_rng(1).normal(size=(n, steps, 3, 5)).astype(np.float32)
  data = jax.device_put(data, NamedSharding(mesh, P("batch")))

  def body(params, data):
    state = tx.init(params)

    def one(carry, x):
      params, state = carry
      g = jax.grad(loss)(jpack.vary(params, "batch"), x)  # this device's own gradient
      if reduce is not None:
        g = reduce(g)
      u, state = tx.update(g, state, params)
      return (optax.apply_updates(params, u), state), None

    (params, _), _ = jax.lax.scan(one, (params, state), data[0])
    return params

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P()))
  return f(jax.device_put(params0(), NamedSharding(mesh, P())), data)


def per_leaf_pmean(g):
  return jax.tree.map(lambda x: jax.lax.pmean(x, "batch"), g)


def assert_trees_close(a, b, tol=2e-5):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    t = 2e-2 if x.dtype == jnp.bfloat16 else tol
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               rtol=t, atol=t)


@pytest.mark.parametrize("opt", [optax.sgd(0.1, momentum=0.9), optax.adam(1e-2),
                                 optax.adamw(1e-2, weight_decay=0.1)])
def test_allreduce_in_chain_matches_per_leaf_pmean(opt):
  got = run(optax.chain(jpack.optax.allreduce("batch"), opt), 30)
  want = run(opt, 30, reduce=per_leaf_pmean)
  assert_trees_close(got, want)


def test_allreduce_sum_and_bf16_wire():
  got = run(optax.chain(jpack.optax.allreduce("batch", mean=False), optax.sgd(0.01)), 5)
  want = run(optax.sgd(0.01), 5, reduce=lambda g: jax.tree.map(lambda x: jax.lax.psum(x, "batch"), g))
  assert_trees_close(got, want)
  wire = run(optax.chain(jpack.optax.allreduce("batch", comm_dtype=jnp.bfloat16),
                         optax.sgd(0.01)), 5)
  assert_trees_close(wire, run(optax.sgd(0.01), 5, reduce=per_leaf_pmean), tol=1e-2)


@pytest.mark.parametrize("opt", [optax.adam(1e-2), optax.lion(1e-3),
                                 optax.chain(optax.scale_by_adam(),
                                             optax.scale_by_schedule(optax.cosine_decay_schedule(1e-2, 50)),
                                             optax.scale(-1.0))])
def test_flat_matches_the_unpacked_optimizer_over_many_steps(opt):
  got = run(optax.chain(jpack.optax.allreduce("batch"), jpack.optax.flat(opt)), 60)
  want = run(opt, 60, reduce=per_leaf_pmean)
  assert_trees_close(got, want)


def test_flat_keeps_dtypes_and_packs_the_state():
  params = params0()
  tx = jpack.optax.flat(optax.adam(1e-3))
  state = tx.init(params)
  mu = state.inner_state[0].mu
  assert isinstance(mu, tuple) and {x.dtype for x in mu} == {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}
  updates, _ = tx.update(params, state, params)
  assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(lambda x: x.dtype, params)


def test_flat_with_labels_masks_weight_decay_and_freezes():
  labels = lambda p: {"dense": {"w": "decay", "b": "no_decay"}, "norm": {"scale": "frozen"},
                      "emb": "decay"}
  transforms = {"decay": optax.adamw(1e-2, weight_decay=0.5), "no_decay": optax.adam(1e-2),
                "frozen": optax.set_to_zero()}
  got = run(optax.chain(jpack.optax.allreduce("batch"),
                        jpack.optax.flat(jpack.optax.partition(transforms, labels))), 20)
  want = run(optax.multi_transform(transforms, labels), 20, reduce=per_leaf_pmean)
  assert_trees_close(got, want)
  np.testing.assert_array_equal(got["norm"]["scale"], params0()["norm"]["scale"])


def test_persistent_packed_params_with_plain_optax():
  """Params live packed: the loss unpacks, grads arrive packed, optax updates buckets."""
  packed = jpack.pack(params0())
  tx = optax.adam(1e-2)
  state = tx.init(packed)
  x = jnp.ones((3, 5))
  g = jax.grad(lambda p: loss(jpack.unpack(p), x))(packed)
  assert isinstance(g, jpack.Packed)
  u, state = tx.update(g, state, packed)
  new = jpack.unpack(optax.apply_updates(packed, u))
  ref_tx = optax.adam(1e-2)
  ref_u, _ = ref_tx.update(jax.grad(loss)(params0(), x), ref_tx.init(params0()), params0())
  assert_trees_close(new, optax.apply_updates(params0(), ref_u))


def test_flat_errors():
  # A dict of transformations takes its labels from jpack.optax.partition.
  with pytest.raises(TypeError, match=r"needs the labels.*jpack.optax.partition"):
    jpack.optax.flat({"a": optax.adam(1e-3)})
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    jpack.optax.flat("adam")
  tx = jpack.optax.flat(jpack.optax.partition({"a": optax.adam(1e-3)},
                                              lambda p: jax.tree.map(lambda _: "b", p)))
  with pytest.raises(ValueError, match=r"labels \['b'\] have no transformation"):
    tx.init(params0())
  tx = jpack.optax.flat(jpack.optax.partition({"a": optax.adam(1e-3)}, {"x": "a"}))
  with pytest.raises(ValueError, match="tree structure of the params .* or a prefix"):
    tx.init(params0())


def init_sharded(tx, params=None, n=N):
  """``tx.init`` traced inside shard_map over "batch", where `sharded` probes its inner."""
  mesh = jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n])
  f = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
  return jax.eval_shape(f, params0() if params is None else params)


def on_leaves(caplog, make, labels=None):
  """``jpack.optax.flat(make())`` initialised: what its log line says runs on the leaves."""
  caplog.clear()
  with caplog.at_level(logging.INFO, logger="jpack"):
    jpack.optax.flat(with_labels(make(), labels)).init(params0())
  lines = [r.getMessage() for r in caplog.records if r.name == "jpack"]
  assert len(lines) <= 1, lines  # said once
  return lines[0] if lines else None


ONE = lambda p: jax.tree.map(lambda _: "a", p)  # noqa: E731 - one label for every leaf


def with_labels(inner, labels):
  """``inner``, or with ``labels`` the `jpack.optax.partition` of its dict."""
  return inner if labels is None else jpack.optax.partition(inner, labels)


# Compared with one-device optax in tests/test_per_leaf.py: here only what the log says.
SAID_ONLY = "said only"


@pytest.mark.parametrize("inner,culprit,labels", [
    (lambda: optax.lamb(1e-3), "scale_by_trust_ratio on the buckets, leaf by leaf",
     SAID_ONLY),
    (lambda: optax.adafactor(1e-3), "scale_by_factored_rms", SAID_ONLY),
    (lambda: optax.novograd(1e-3), "scale_by_novograd", None),
    (lambda: optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
     "optax.masked on the buckets, leaf by leaf", SAID_ONLY),
    (lambda: {"a": optax.chain(optax.clip_by_block_rms(1.0), optax.sgd(0.1))},
     "The optimizer runs on the leaves (optax.clip_by_block_rms", ONE),
    # MultiSteps hands out bound methods of an object that holds the optimizer, and
    # runs it inside a lax.cond.
    (lambda: optax.MultiSteps(optax.lamb(1e-3), 2).gradient_transformation(),
     "runs on the leaves (optax.scale_by_trust_ratio", None),
    (lambda: optax.contrib.galore(1e-3, rank=2, update_proj_gap=1), "galore", None),
    (lambda: optax.noisy_sgd(0.1, key=0), "add_noise", None),  # the same noise as optax
    (lambda: optax.contrib.muon(1e-3), "runs on the leaves", SAID_ONLY),
    (lambda: optax.flatten(optax.adam(1e-3)), "flatten", None),
    # A mask built at update time (inject_hyperparams calls adamw at every update).
    (lambda: optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=1e-2, weight_decay=1e-4,
        mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)), "masked", "once"),
    # A mask given as a tree of the params: static flags, computed on the buckets.
    (lambda: optax.masked(optax.adam(1e-3), {"dense": {"w": True, "b": False},
                                             "norm": {"scale": False}, "emb": True}),
     "optax.masked on the buckets, leaf by leaf", None),
])
def test_flat_runs_what_needs_whole_leaves_per_leaf_like_optax(caplog, inner, culprit,
                                                                    labels):
  # On 1-D buckets an ndim-based mask would see no matrix at all (no weight decay, no
  # error), and per-leaf norms would be per-bucket norms: these run on the leaves, or
  # leaf by leaf on the buckets (a trust ratio, a static mask).
  scans = labels != "once"  # its bf16 moments turn float32 (optax's own behaviour)
  compare = labels != SAID_ONLY
  labels = labels if scans and compare else None
  said = on_leaves(caplog, inner, labels)
  assert said is not None and culprit in said, said
  if not compare:
    return
  if not scans:
    params, tx, ref = params0(), jpack.optax.flat(inner()), inner()
    got, _ = tx.update(params, tx.init(params), params)
    assert_trees_close(got, ref.update(params, ref.init(params), params)[0])
    return
  want = inner()
  if isinstance(want, dict):
    want = optax.multi_transform(want, ONE)
  got = run(optax.chain(jpack.optax.allreduce("batch"),
                        jpack.optax.flat(with_labels(inner(), labels))), 6)
  assert_trees_close(got, run(want, 6, reduce=per_leaf_pmean))
  jpack.data_parallel(loss, with_labels(inner(), labels), params0(), mode="packed")


def test_flat_refuses_what_raises_on_the_params_with_the_error():
  # Its line search calls the loss function, which only the user can give.
  with pytest.raises(TypeError, match=r"optax.chain cannot run inside jpack.optax.flat: its "
                                      r"update .*raised.*value_fn"):
    jpack.optax.flat(optax.lbfgs()).init(params0())


def test_flat_refuses_a_collective_inside_and_says_where_to_reduce():
  tx = jpack.optax.flat(optax.chain(jpack.optax.allreduce("batch"), optax.adam(1e-3)))
  with pytest.raises(TypeError, match=r"jpack.optax.allreduce cannot run inside "
                                      r"jpack.optax.flat: it runs a collective.*optax.chain\("
                                      r"jpack.optax.allreduce\(axis_name\), jpack.optax.flat"):
    tx.init(params0())


@pytest.mark.parametrize("make", [
    # Refused by name before; a mask or labels that select every leaf change nothing.
    lambda: optax.multi_transform({"a": optax.adam(1e-2)},
                                  lambda p: jax.tree.map(lambda _: "a", p)),
    lambda: optax.masked(optax.adamw(1e-2), lambda p: jax.tree.map(lambda _: True, p)),
    lambda: optax.chain(optax.normalize_by_update_norm(), optax.sgd(1e-2)),  # whole norm
])
def test_flat_accepts_what_buckets_do_not_change_and_matches_optax(make):
  got = run(optax.chain(jpack.optax.allreduce("batch"), jpack.optax.flat(make())), 10)
  assert_trees_close(got, run(make(), 10, reduce=per_leaf_pmean), tol=1e-4)


def test_known_transformations_are_not_probed_and_others_once_even_under_jit(monkeypatch):
  # init is traced (jit, eval_shape, shard_map): the probe makes values of its own.
  from jpack import _probe
  calls = []
  probe = _probe._probe
  _probe._verdict.cache_clear()
  monkeypatch.setattr(_probe, "_probe", lambda *a: calls.append(a[2]) or probe(*a))
  tx = jpack.optax.flat(optax.lamb(1e-3))
  for init in (jax.jit(tx.init), lambda p: jax.eval_shape(tx.init, p), tx.init):
    init(params0())
  assert calls == []  # every part of lamb is in the table
  halve = optax.GradientTransformation(  # the user's own: probed
      lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(lambda g: g / 2, u), s))
  tx = jpack.optax.flat(optax.chain(halve, optax.adam(1e-3)))
  for init in (jax.jit(tx.init), tx.init):
    init(params0())
  assert calls == ["buckets"]
  tx = jpack.optax.flat(optax.chain(jpack.optax.allreduce("batch"), optax.adam(1e-3)))
  for init in (jax.jit(tx.init), tx.init):
    with pytest.raises(TypeError, match="allreduce cannot run"):
      init(params0())
  assert calls == ["buckets"]


def test_flat_global_norm_clipping_sees_the_whole_gradient():
  # Buckets hold every leaf (and zero padding): their global norm is the tree's.
  opt = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))
  got = run(optax.chain(jpack.optax.allreduce("batch"), jpack.optax.flat(opt)), 20)
  assert_trees_close(got, run(opt, 20, reduce=per_leaf_pmean))


def test_flat_refuses_packed_updates_of_another_layout_and_takes_trees():
  params = {"a": jnp.ones(64), "b": jnp.ones(64)}
  grads = {"a": jnp.full(64, 1.0), "b": jnp.full(64, -100.0)}
  tx = jpack.optax.flat(optax.adam(0.1))
  state = tx.init(params)
  other = jpack.plan(grads, reverse=False)  # same bucket sizes, other leaf order
  assert other != state.layout
  with pytest.raises(ValueError, match="layout"):
    tx.update(jpack.pack(grads, other), state, params)
  with pytest.raises(ValueError, match="params"):
    tx.update(grads, state, jpack.pack(params, other))
  want, _ = optax.adam(0.1).update(grads, optax.adam(0.1).init(params), params)
  got, _ = tx.update(jpack.pack(grads, state.layout), state, params)  # the state's layout
  assert_trees_close(jpack.unpack(got), want)


WIDER_UPDATES = [(lambda: optax.adam(1e-2, mu_dtype=jnp.float32), True),
                 (lambda: optax.sgd(jnp.float32(0.05)), True),
                 # Its bf16 moments turn float32 after one update (optax's own behaviour),
                 # so neither it nor plain optax can run in the scan of `run`.
                 (lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2), False)]


@pytest.mark.parametrize("make,scans", WIDER_UPDATES)
def test_updates_wider_than_bf16_params_come_back_like_optax(make, scans):
  # These return float32 updates for bf16 leaves (optax.apply_updates casts them back);
  # the float32 bucket used to be refused when unpacked into the bf16 layout.
  params = params0()
  want, _ = make().update(params, make().init(params), params)
  tx = jpack.optax.flat(make())
  got, _ = tx.update(params, tx.init(params), params)
  assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, want)
  assert_trees_close(got, want)
  if not scans:
    return
  assert_trees_close(run(optax.chain(jpack.optax.allreduce("batch"), jpack.optax.flat(make())),
                         20),
                     run(make(), 20, reduce=per_leaf_pmean))
  assert_trees_close(run(jpack.optax.sharded(make(), "batch"), 20),
                     run(make(), 20, reduce=per_leaf_pmean))


def test_allreduce_allow_int_on_trees_and_packed():
  # allow_int used to reach only the tree path (through **plan_options): a Packed was
  # refused, and mean=False passed it on to plan(), which has no such option.
  mesh = jax.make_mesh((N,), ("batch",))
  counts = np.arange(N * 3, dtype=np.int32).reshape(N, 3) * 7
  w = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
  tree = jax.device_put({"c": counts, "w": w}, NamedSharding(mesh, P("batch")))
  layout = jpack.plan({"c": counts[0], "w": w[0]}, num_shards=N)

  def body(t, packed, mean):
    t = jax.tree.map(lambda x: x[0], t)
    tx = jpack.optax.allreduce("batch", mean=mean, allow_int=True)
    u_tree, _ = tx.update(t, tx.init(None))
    u_packed, _ = tx.update(jpack.pack(t, layout) if packed else t, tx.init(None))
    return u_tree, (jpack.unpack(u_packed) if packed else u_packed)

  for mean in (True, False):
    want_c = counts.sum(0) // N if mean else counts.sum(0)
    want_w = w.mean(0) if mean else w.sum(0)
    got = jax.jit(jax.shard_map(lambda t: body(t, True, mean), mesh=mesh,
                                in_specs=P("batch"), out_specs=P()))(tree)
    for u in got:
      np.testing.assert_array_equal(np.asarray(u["c"]), want_c)
      np.testing.assert_allclose(np.asarray(u["w"]), want_w, rtol=1e-6)


MODULE_CLIP = optax.clip_by_global_norm(1.0)
MODULE_TRUST = optax.scale_by_trust_ratio()


def test_transforms_built_by_a_factory_are_read_through(caplog):
  # inject_hyperparams calls the factory at every update: its first build is read, and
  # on ZeRO-1 the clip it builds is computed on the slices (tests/test_sharded.py).
  clip_chain = lambda lr: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(lr))
  init_sharded(jpack.optax.sharded(optax.inject_hyperparams(clip_chain)(lr=0.1), "batch"))
  block_rms = lambda lr: optax.chain(optax.clip_by_block_rms(1.0), optax.sgd(lr))
  assert "clip_by_block_rms" in on_leaves(
      caplog, lambda: optax.inject_hyperparams(block_rms)(lr=0.1))
  assert on_leaves(caplog, lambda: optax.inject_hyperparams(clip_chain)(lr=0.1)) is None
  # A transformation built once at module level and used inside the factory.
  init_sharded(jpack.optax.sharded(optax.inject_hyperparams(
      lambda lr: optax.chain(MODULE_CLIP, optax.sgd(lr)))(lr=0.1), "batch"))
  assert "scale_by_trust_ratio" in on_leaves(caplog, lambda: optax.inject_hyperparams(
      lambda lr: optax.chain(MODULE_TRUST, optax.sgd(lr)))(lr=0.1))
  init_sharded(jpack.optax.sharded(optax.inject_hyperparams(
      lambda lr: optax.chain(optax.scale_by_adam(), optax.scale(-lr)))(lr=0.1), "batch"))
  # What ZeRO-1 can run neither on slices nor on owned leaves is still refused.
  with pytest.raises(TypeError, match="clip_by_global_norm cannot run inside "
                                      "jpack.optax.sharded: on each device's"):
    init_sharded(jpack.optax.sharded(optax.inject_hyperparams(lambda lr: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adafactor(lr)))(lr=0.1), "batch"))


def test_extra_update_arguments_reach_the_inner_optimizer():
  params = params0()
  grads = jax.tree.map(lambda x: (x * 0.5 + 0.25).astype(x.dtype), params)
  opt = optax.polyak_sgd(max_learning_rate=1.0, f_min=0.0)
  want, _ = opt.update(grads, opt.init(params), params, value=jnp.float32(3.0))
  for tx in (jpack.optax.flat(opt), optax.chain(jpack.optax.flat(opt))):
    got, _ = tx.update(grads, tx.init(params), params, value=jnp.float32(3.0))
    assert_trees_close(got, want)


def test_sharded_passes_extra_arguments_and_takes_shards_in_init():
  opt = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
  tx = jpack.optax.sharded(opt, "batch", plan_options=dict(align_bytes=16))
  mesh = jax.make_mesh((N,), ("batch",))
  params = jax.tree.map(lambda x: x.astype(jnp.float32), params0())
  grads = jax.tree.map(lambda x: x + 1.0, params)

  def body(params, grads):
    state = tx.init(params)
    same = tx.init(jpack.shard(jpack.pack(params, state.layout), "batch"))
    assert jax.tree.structure(same) == jax.tree.structure(state)
    for value in (1.0, 2.0):  # a worse loss: the plateau halves the scale
      updates, state = tx.update(grads, state, params, value=jnp.float32(value))
    return updates

  got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P()))(
      params, grads)
  state = opt.init(params)
  for value in (1.0, 2.0):
    want, state = opt.update(grads, state, params, value=jnp.float32(value))
  assert_trees_close(got, want)


def test_flat_refuses_float_updates_for_integer_leaves_with_their_paths():
  params = {"w": jnp.ones((3, 3)), "n": jnp.arange(4, dtype=jnp.int32)}
  grads = {"w": jnp.full((3, 3), 0.5), "n": jnp.zeros(4, jnp.int32)}
  tx = jpack.optax.flat(optax.sgd(0.1))  # optax gives float32 updates for the int leaf
  with pytest.raises(TypeError, match=r"float32 updates for bucket 1, which holds int32 "
                                      r"leaves \(\['n'\]\).*optax.set_to_zero"):
    tx.update(grads, tx.init(params), params)
  # The way out the message names: the int leaf frozen by a label keeps its dtype.
  tx = jpack.optax.flat(jpack.optax.partition({"t": optax.sgd(0.1), "f": optax.set_to_zero()},
                                              {"w": "t", "n": "f"}))
  got, _ = tx.update(grads, tx.init(params), params)
  assert got["n"].dtype == jnp.int32 and not np.asarray(got["n"]).any()
  np.testing.assert_allclose(got["w"], np.full((3, 3), -0.05, np.float32))
