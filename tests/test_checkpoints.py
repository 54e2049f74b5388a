"""Checkpoints of every mode's training state, independent of the device count.

`jpack.checkpoint.gather_state` / `scatter_state` take any optimizer state (the packed mode's
chain with a `FlatState` too); `jpack.checkpoint.save` / `restore` save a whole
`TrainState` with Orbax and restore it onto 8, 4 or 1 devices and into another mode, and
refuse, naming what differs, a checkpoint of another model or optimizer and a directory
whose only checkpoint was never finished. The 8 CPU devices come from conftest.py.
"""

import doctest
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jpack
from jpack import _checkpoint

MODES = ["packed", "sharded", "allreduce"]
BATCH = 16  # rows: splits over 8, 4 and 1 devices


def params0(width=4):
  rng = np.random.default_rng(0)
  return {"dense": {"w": rng.normal(size=(6, width)).astype(np.float32),
                    "b": np.zeros(width, np.float32)},
          "out": rng.normal(size=(width, 3)).astype(np.float32)}


def loss_fn(params, batch):
  x, y = batch
  h = jnp.tanh(x @ params["dense"]["w"] + params["dense"]["b"])
  return jnp.mean((h @ params["out"] - y) ** 2)


def batch_at(step):
  rng = np.random.default_rng(step)
  return (rng.normal(size=(BATCH, 6)).astype(np.float32),
          rng.normal(size=(BATCH, 3)).astype(np.float32))


def mesh_of(n):
  return jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Explicit,))


def make(mode="packed", n=8, optimizer=None, width=4, **kw):
  return jpack.data_parallel(loss_fn, optimizer or optax.adam(1e-2), params0(width),
                             mesh_of(n), mode=mode, **kw)


def train(dp, state, start, stop):
  for step in range(start, stop):
    state, _ = dp.step(state, batch_at(step))
  return state


def manager_at(path, **options):
  return ocp.CheckpointManager(pathlib.Path(path).absolute(),
                               options=ocp.CheckpointManagerOptions(**options))


def saved_tree(dp, state):
  """What a run carries, device-count independent: params, optimizer state, step."""
  params = dp.unpack(state)  # with a model state: (params, model_state)
  if state.model_state is not None:
    params, _ = params
  return {"params": jax.device_get(params),
          "opt_state": jpack.checkpoint.gather_state(_checkpoint._optimizer_part(state.opt_state)),
          "step": np.asarray(state.step)}


def assert_bits_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


def assert_close(a, b, tol=1e-5):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                               rtol=tol, atol=tol)


def save(path, dp, state, step, key=None, **options):
  with manager_at(path, **options) as manager:
    assert jpack.checkpoint.save(manager, step, state, key=key)


# -- gather_state / scatter_state on any optimizer state ----------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_gather_state_takes_every_modes_state(mode):
  dp = make(mode)
  state = train(dp, dp.init(params0()), 0, 2)
  gathered = jpack.checkpoint.gather_state(state.opt_state)  # raised AttributeError for packed
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(gathered))
  want = optax.adam(1e-2).init(params0())
  inner = gathered if mode == "sharded" else gathered[1]
  assert jax.tree.structure(inner) == jax.tree.structure(want)
  if mode != "sharded":  # the all-reduce's gradient norm is kept where it was
    assert isinstance(gathered[0], jpack.optax.AllReduceState)
  # Every mode holds the same optimizer state on the params tree.
  ref = make("allreduce")
  ref_state = train(ref, ref.init(params0()), 0, 2)
  assert_close(inner, jpack.checkpoint.gather_state(ref_state.opt_state)[1])


def test_gather_state_of_an_abstract_state_is_the_abstract_tree_form():
  dp = make("packed")
  like = jax.eval_shape(dp.init, params0())
  abstract = jpack.checkpoint.gather_state(like.opt_state)
  concrete = jpack.checkpoint.gather_state(dp.init(params0()).opt_state)
  assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
  for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete)):
    assert isinstance(a, jax.ShapeDtypeStruct) and a.sharding is None
    assert (a.shape, a.dtype) == (c.shape, c.dtype)


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_scatter_state_inverts_gather_state_on_another_device_count(mode):
  dp8 = make(mode, 8)
  state = train(dp8, dp8.init(params0()), 0, 3)
  saved = jpack.checkpoint.gather_state(state.opt_state)
  dp4 = make(mode, 4)
  like = jax.eval_shape(dp4.init, params0()).opt_state
  restored = jpack.checkpoint.scatter_state(saved, like)
  assert jax.tree.structure(restored) == jax.tree.structure(like)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like)):
    assert (np.shape(got), np.asarray(got).dtype) == (want.shape, want.dtype)
  assert_bits_equal(jpack.checkpoint.gather_state(restored), saved)


def test_scatter_state_names_the_path_in_a_whole_state():
  dp = make("packed")
  state = dp.init(params0())
  saved = jpack.checkpoint.gather_state(state.opt_state)
  bad = (saved[0], (saved[1][0]._replace(mu={**saved[1][0].mu,
                                             "out": np.zeros((5, 3), np.float32)}),
                    saved[1][1]))
  with pytest.raises(ValueError, match=r"\[1\]\[0\]\.mu\['out'\].*\(5, 3\)"):
    jpack.checkpoint.scatter_state(bad, state.opt_state)
  with pytest.raises(ValueError, match=r"first difference: saved .*expected \[0\]\.grad_norm"):
    jpack.checkpoint.scatter_state(saved[1], state.opt_state)  # the chain's first part missing


# -- save and restore with Orbax ----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_restored_state_continues_bit_identically(mode, tmp_path):
  dp = make(mode)
  state = train(dp, dp.init(params0()), 0, 3)
  key = jax.random.key(42)
  save(tmp_path, dp, state, 3, key=key)
  restored, restored_key = jpack.checkpoint.restore(
      tmp_path, jax.eval_shape(dp.init, params0()))
  assert int(restored.step) == 3
  assert_bits_equal(saved_tree(dp, restored), saved_tree(dp, state))
  assert bool(restored_key == key) and restored_key.dtype == key.dtype
  # The next steps from the restored state are the original run's, bit for bit.
  assert_bits_equal(saved_tree(dp, train(dp, restored, 3, 5)),
                    saved_tree(dp, train(dp, state, 3, 5)))


@pytest.mark.parametrize("n", [4, 1])
def test_a_sharded_run_on_8_restores_onto_4_and_1(n, tmp_path):
  dp8 = make("sharded", 8)
  state = train(dp8, dp8.init(params0()), 0, 3)
  save(tmp_path, dp8, state, 3)
  dpn = make("sharded", n)
  restored, key = jpack.checkpoint.restore(tmp_path, jax.eval_shape(dpn.init, params0()))
  assert key is None
  assert restored.opt_state.layout == dpn.layout  # buckets padded for n devices
  assert_bits_equal(saved_tree(dpn, restored), saved_tree(dp8, state))
  # Training goes on where the 8-device run does (up to the order of float sums).
  assert_close(dpn.unpack(train(dpn, restored, 3, 5)), dp8.unpack(train(dp8, state, 3, 5)))


@pytest.mark.parametrize("make_optimizer", [lambda: optax.contrib.muon(1e-2),
                                            lambda: optax.adafactor(1e-2),
                                            lambda: optax.sm3(0.1)],
                         ids=["muon", "adafactor", "sm3"])
def test_an_owned_state_saves_as_optax_state_and_restores_in_any_mode_and_count(
    make_optimizer, tmp_path):
  # ZeRO-1 runs these on each device's own whole leaves: the saved state is optax's on
  # the params tree, as one device trains it.
  dp8 = make("sharded", 8, optimizer=make_optimizer())
  state = train(dp8, dp8.init(params0()), 0, 3)
  tx, params = make_optimizer(), params0()
  opt_state = tx.init(params)
  for step in range(3):
    updates, opt_state = tx.update(jax.grad(loss_fn)(params, batch_at(step)), opt_state, params)
    params = optax.apply_updates(params, updates)
  assert_close(saved_tree(dp8, state)["opt_state"], opt_state)
  save(tmp_path, dp8, state, 3)
  want = dp8.unpack(train(dp8, state, 3, 5))
  for mode, n in [("sharded", 4), ("packed", 8), ("fsdp", 4)]:
    other = make(mode, n, optimizer=make_optimizer())
    restored, _ = jpack.checkpoint.restore(tmp_path, jax.eval_shape(other.init, params0()))
    assert_close(other.unpack(train(other, restored, 3, 5)), want)
  back = tmp_path / "from_packed"  # and the reverse: from mode="packed" onto ZeRO-1
  packed = make("packed", 8, optimizer=make_optimizer())
  save(back, packed, train(packed, packed.init(params0()), 0, 3), 3)
  restored, _ = jpack.checkpoint.restore(back, jax.eval_shape(dp8.init, params0()))
  assert_close(dp8.unpack(train(dp8, restored, 3, 5)), want)


def test_a_per_device_owned_state_restores_on_the_same_device_count_and_no_other(tmp_path):
  # noisy_sgd's state holds a PRNG key: optax makes it for the whole tree, so each
  # device keeps its own, flattened by the device count and layout.
  optimizer = lambda: optax.noisy_sgd(1e-2, key=0)  # noqa: E731
  dp8 = make("sharded", 8, optimizer=optimizer())
  state = train(dp8, dp8.init(params0()), 0, 3)
  save(tmp_path, dp8, state, 3)
  restored, _ = jpack.checkpoint.restore(tmp_path, jax.eval_shape(dp8.init, params0()))
  assert_bits_equal(dp8.unpack(train(dp8, restored, 3, 5)), dp8.unpack(train(dp8, state, 3, 5)))
  dp4 = make("sharded", 4, optimizer=optimizer())
  with pytest.raises(ValueError, match="owned by 8 devices.*not in the new run"):
    jpack.checkpoint.restore(tmp_path, jax.eval_shape(dp4.init, params0()))


@pytest.mark.parametrize("saved_mode,new_mode", [("packed", "sharded"), ("sharded", "packed"),
                                                 ("allreduce", "sharded")])
def test_a_checkpoint_restores_in_another_mode(saved_mode, new_mode, tmp_path):
  dp = make(saved_mode, 8)
  state = train(dp, dp.init(params0()), 0, 3)
  save(tmp_path, dp, state, 3)
  other = make(new_mode, 4)
  restored, _ = jpack.checkpoint.restore(tmp_path,
                                               jax.eval_shape(other.init, params0()))
  assert_bits_equal(saved_tree(other, restored), saved_tree(dp, state))
  assert_close(other.unpack(train(other, restored, 3, 5)), dp.unpack(train(dp, state, 3, 5)))


def test_masters_and_labels_survive_a_change_of_mode_and_device_count(tmp_path):
  optimizer = {"decay": optax.adamw(1e-2, weight_decay=0.1), "plain": optax.adam(1e-2)}
  labels = {"dense": {"w": "decay", "b": "plain"}, "out": "decay"}
  kw = dict(optimizer=jpack.optax.partition(optimizer, labels),
            precision=jpack.Precision(param_dtype=jnp.bfloat16))
  dp = make("packed", 8, **kw)
  state = train(dp, dp.init(params0()), 0, 2)
  save(tmp_path, dp, state, 2)
  other = make("sharded", 4, **kw)
  restored, _ = jpack.checkpoint.restore(tmp_path,
                                               jax.eval_shape(other.init, params0()))
  saved = saved_tree(other, restored)
  assert saved["params"]["out"].dtype == jnp.bfloat16
  assert saved["opt_state"]["master"]["out"].dtype == np.float32
  assert_bits_equal(saved, saved_tree(dp, state))
  train(other, restored, 2, 3)


def decay_matrices(params):
  return jax.tree.map(lambda x: x.ndim > 1, params)


@pytest.mark.parametrize("name", ["muon", "adamw_mask"])
def test_a_state_kept_on_the_leaves_restores_onto_8_and_4(name, tmp_path):
  # flat runs what buckets would change on the params tree: all of muon (its state is
  # then params-shaped, already the tree form; gather_state took it for a jax.pmap
  # state), and adamw's masked weight decay (adam's moments stay on buckets).
  optimizer = (optax.contrib.muon(1e-2) if name == "muon" else
               optax.adamw(1e-2, weight_decay=0.1, mask=decay_matrices))
  dp = make("packed", 8, optimizer)
  state = train(dp, dp.init(params0()), 0, 3)
  saved = saved_tree(dp, state)
  assert jax.tree.structure(saved["opt_state"]) == jax.tree.structure(
      optimizer.init(params0()))
  save(tmp_path, dp, state, 3)
  runs = []
  for n in (8, 4):
    other = make("packed", n, optimizer)
    restored, _ = jpack.checkpoint.restore(tmp_path,
                                                 jax.eval_shape(other.init, params0()))
    assert_bits_equal(saved_tree(other, restored), saved)
    runs.append(saved_tree(other, train(other, restored, 3, 5)))
  want = saved_tree(dp, train(dp, state, 3, 5))  # the uninterrupted run
  assert_bits_equal(runs[0], want)
  assert_close(runs[1]["params"], want["params"])  # up to the order of float sums


def test_model_state_is_carried(tmp_path):
  dp = make("sharded")
  state = dp.init(params0())
  stats = {"mean": np.arange(4, dtype=np.float32), "count": np.int32(7)}
  save(tmp_path, dp, state._replace(model_state=stats), 0)
  like = jax.eval_shape(dp.init, params0())._replace(model_state=jax.eval_shape(lambda: stats))
  restored, _ = jpack.checkpoint.restore(tmp_path, like)
  assert_bits_equal(restored.model_state, stats)
  with pytest.raises(ValueError, match="carries model_state.*carries no model_state"):
    jpack.checkpoint.restore(tmp_path, jax.eval_shape(dp.init, params0()))



class BatchNormNet(nn.Module):
  """Synchronised BatchNorm (over ``axis_name``): its batch_stats are those of the whole
  batch, whatever the device count, so a run can move to another one."""
  axis_name: str | None = "batch"

  @nn.compact
  def __call__(self, x):
    x = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name, momentum=0.9)(
        nn.Dense(8, use_bias=False)(x))
    return nn.Dense(3)(nn.relu(x))


def batch_norm_loss(model):
  def loss(params, batch_stats, batch):
    x, y = batch
    out, new = model.apply({"params": params, "batch_stats": batch_stats}, x,
                           mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2), new["batch_stats"]
  return loss


def test_a_batch_norm_state_moves_from_sharded_on_8_to_packed_on_4(tmp_path):
  variables = BatchNormNet().init(jax.random.key(0), jnp.zeros((2, 6)))
  params, stats = variables["params"], variables["batch_stats"]

  def make_bn(mode, n):
    return jpack.data_parallel(batch_norm_loss(BatchNormNet()), optax.adam(1e-2), params,
                               mesh_of(n), mode=mode)

  dp8, dp4 = make_bn("sharded", 8), make_bn("packed", 4)
  state = train(dp8, dp8.init(params, stats), 0, 3)
  # Host copies taken before any further step donates the buffers.
  saved_stats = jax.tree.map(np.array, state.model_state)
  saved = saved_tree(dp8, state)
  save(tmp_path, dp8, state, 3)
  restored, _ = jpack.checkpoint.restore(
      tmp_path, jax.eval_shape(dp4.init, params, stats))
  assert restored.opt_state[1].inner_state[0].mu[0].shape == (dp4.layout.buckets[0].size,)
  assert_bits_equal(restored.model_state, saved_stats)
  assert_bits_equal(saved_tree(dp4, restored), saved)
  # Restored onto the run that saved it, it goes on bit for bit as if never stopped.
  again, _ = jpack.checkpoint.restore(tmp_path, jax.eval_shape(dp8.init, params, stats))
  again = train(dp8, again, 3, 5)
  resumed, uninterrupted = train(dp4, restored, 3, 5), train(dp8, state, 3, 5)
  assert_bits_equal(saved_tree(dp8, again), saved_tree(dp8, uninterrupted))
  assert_bits_equal(again.model_state, uninterrupted.model_state)
  # On 4 devices, packed, it goes on where the sharded run on 8 does (up to float sums).
  assert_close(saved_tree(dp4, resumed), saved_tree(dp8, uninterrupted))
  assert_close(resumed.model_state, uninterrupted.model_state)
  # And where plain Flax + optax does on one device (BatchNorm over the whole batch).
  loss, tx = batch_norm_loss(BatchNormNet(None)), optax.adam(1e-2)

  @jax.jit  # one compile instead of hundreds of eager ops
  def ref_step(ref, batch):
    ref_params, ref_stats, ref_opt = ref
    grads, ref_stats = jax.grad(loss, has_aux=True)(ref_params, ref_stats, batch)
    updates, ref_opt = tx.update(grads, ref_opt, ref_params)
    return optax.apply_updates(ref_params, updates), ref_stats, ref_opt

  ref = (params, stats, tx.init(params))
  for step in range(5):
    ref = ref_step(ref, batch_at(step))
  ref_params, ref_stats, ref_opt = ref
  resumed_params, resumed_stats = dp4.unpack(resumed)  # what init took: both
  assert_close(resumed_params, ref_params, tol=1e-4)
  assert_close(resumed_stats, ref_stats, tol=1e-4)
  assert_close(resumed.model_state, ref_stats, tol=1e-4)
  assert_close(saved_tree(dp4, resumed)["opt_state"], ref_opt, tol=1e-4)


def test_a_raw_key_and_the_latest_of_several_steps(tmp_path):
  dp = make("packed")
  state = dp.init(params0())
  raw = jax.random.PRNGKey(3)
  with manager_at(tmp_path, save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(2),
                  preservation_policy=ocp.checkpoint_managers.LatestN(2)) as manager:
    for step in range(6):
      state = train(dp, state, step, step + 1)
      saved = jpack.checkpoint.save(manager, step + 1, state, key=raw)
      assert saved == ((step + 1) % 2 == 0)  # the manager's policy decides
    manager.wait_until_finished()
    assert manager.all_steps() == [4, 6]
    restored, key = jpack.checkpoint.restore(manager, jax.eval_shape(dp.init, params0()))
    assert int(restored.step) == 6 and key.dtype == np.uint32
    np.testing.assert_array_equal(key, raw)
    # A real state works as `like` too (its values are not used).
    older, _ = jpack.checkpoint.restore(manager, dp.init(params0()), step=4)
    assert int(older.step) == 4



@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_a_donated_state_works_as_like(mode, tmp_path):
  # Its values are never read: a state whose buffers a step has donated gives the
  # structure, shapes and dtypes only (on several processes `like` is a real state).
  dp = make(mode)
  state = train(dp, dp.init(params0()), 0, 2)
  save(tmp_path, dp, state, 2)
  like = dp.init(params0())
  dp.step(like, batch_at(0))
  assert all(x.is_deleted() for x in like.params.buckets)
  restored, _ = jpack.checkpoint.restore(tmp_path, like)
  assert_bits_equal(saved_tree(dp, restored), saved_tree(dp, state))


def test_save_refuses_a_step_that_is_not_the_states(tmp_path):
  dp = make("packed")
  with manager_at(tmp_path) as manager:
    with pytest.raises(ValueError, match="asked to save step 5, but the state has taken 0"):
      jpack.checkpoint.save(manager, 5, dp.init(params0()))


def test_checkpoint_metadata_does_not_depend_on_the_device_count(tmp_path):
  metas = []
  for n in (8, 2):
    dp = make("sharded", n)
    save(tmp_path / str(n), dp, dp.init(params0()), 0)
    with manager_at(tmp_path / str(n)) as manager:
      metas.append(_checkpoint._read_meta(manager, 0, "here"))
  assert metas[0] == metas[1]
  assert metas[0]["params"][0] == ["['dense']['b']", [4], "float32"]
  assert metas[0]["fingerprint"] != make("sharded", 8).layout.fingerprint


def read_raw_state(path, step):
  """The "state" item as Orbax holds it, read without a target."""
  with manager_at(path) as manager:
    return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state


def test_the_saved_state_is_one_flat_array_per_dtype_whatever_the_mode_and_devices(tmp_path):
  size = sum(np.size(x) for x in jax.tree.leaves(params0()))
  forms = []
  for mode, n in [("packed", 8), ("sharded", 2), ("allreduce", 4)]:
    dp = make(mode, n)
    save(tmp_path / mode, dp, dp.init(params0()), 0)
    forms.append(read_raw_state(tmp_path / mode, 0))
  raw = forms[0]
  assert jax.tree.map(np.shape, raw) == {
      "params": {"float32": (size,)},
      "opt_state": {"float32": (2 * size,), "scalars": [()]},  # adam's mu and nu; count
      "step": ()}
  for other in forms[1:]:
    assert_bits_equal(other, raw)


def leaves_by_meta(flat, signature):
  """Each leaf of a saved part, sliced from its flat arrays as the meta describes them."""
  offsets, out, scalars = {}, {}, iter(flat.get("scalars", []))
  for path, shape, dtype in signature:
    if not shape:
      out[path] = next(scalars)
      continue
    start, size = offsets.get(dtype, 0), int(np.prod(shape))
    out[path] = flat[dtype][start:start + size].reshape(shape)
    offsets[dtype] = start + size
  assert offsets == {k: v.size for k, v in flat.items() if k != "scalars"}  # nothing else
  return out


def test_the_meta_says_where_each_leaf_is_in_the_flat_arrays(tmp_path):
  # bfloat16 params, float32 masters
  dp = make("sharded", 8, precision=jpack.Precision(param_dtype=jnp.bfloat16))
  state = train(dp, dp.init(params0()), 0, 3)
  save(tmp_path, dp, state, 3)
  raw = read_raw_state(tmp_path, 3)
  assert set(raw["params"]) == {"bfloat16"} and set(raw["opt_state"]) == {"float32", "scalars"}
  with manager_at(tmp_path) as manager:
    meta = _checkpoint._read_meta(manager, 3, "here")
  tree = saved_tree(dp, state)
  for part in ("params", "opt_state"):
    want = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree[part])}
    got = leaves_by_meta(raw[part], meta[part])
    assert list(got) == list(want)
    assert_bits_equal(got, want)


# -- refused ------------------------------------------------------------------------------


def test_a_checkpoint_of_another_model_is_refused_naming_the_leaf(tmp_path):
  dp = make("sharded")
  save(tmp_path, dp, dp.init(params0()), 0)
  wider = make("sharded", width=8)
  with pytest.raises(ValueError, match=r"in the params, \['dense'\]\['b'\] is \(4,\) "
                                       r"float32 in the checkpoint, \(8,\) float32 in the "
                                       r"new run \(params fingerprint \w+ saved, \w+ now\)"
                                       r"; it is of another model\."):
    jpack.checkpoint.restore(tmp_path, jax.eval_shape(wider.init, params0(8)))
  renamed = jpack.data_parallel(lambda p, b: loss_fn({**p, "out": p["head"]}, b),
                                optax.adam(1e-2),
                                {"dense": params0()["dense"], "head": params0()["out"]},
                                mesh_of(8), mode="sharded")
  like = jax.eval_shape(renamed.init, {"dense": params0()["dense"], "head": params0()["out"]})
  with pytest.raises(ValueError, match=r"in the params, \['out'\] is in the checkpoint, "
                                       r"not in the new run"):
    jpack.checkpoint.restore(tmp_path, like)


def test_a_checkpoint_of_another_optimizer_is_refused_naming_the_path(tmp_path):
  dp = make("packed")
  save(tmp_path, dp, dp.init(params0()), 0)
  sgd = make("packed", optimizer=optax.sgd(0.1, momentum=0.9))
  with pytest.raises(ValueError, match=r"in the optimizer state, \[0\]\.count is in the "
                                       r"checkpoint.*same optimizer"):
    jpack.checkpoint.restore(tmp_path, jax.eval_shape(sgd.init, params0()))
  masters = make("packed", precision=jpack.Precision(param_dtype=jnp.bfloat16))
  with pytest.raises(ValueError, match="does not fit the new run"):
    jpack.checkpoint.restore(tmp_path, jax.eval_shape(masters.init, params0()))


def test_a_directory_whose_only_checkpoint_is_unfinished_is_refused(tmp_path):
  dp = make("packed")
  like = jax.eval_shape(dp.init, params0())
  # What a save killed before Orbax finalized it leaves: the step's temporary directory.
  save(tmp_path / "done", dp, dp.init(params0()), 0)
  (tmp_path / "done" / "0").rename(tmp_path / "0.orbax-checkpoint-tmp")
  with pytest.raises(FileNotFoundError, match=r"no finished checkpoint in .*; unfinished "
                                              r"\(a save was interrupted\): "
                                              r"0\.orbax-checkpoint-tmp\."):
    jpack.checkpoint.restore(tmp_path, like)
  with manager_at(tmp_path) as manager:  # a manager sees no step there either
    assert manager.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no finished checkpoint in"):
      jpack.checkpoint.restore(manager, like)
  with pytest.raises(FileNotFoundError, match="no finished checkpoint in .*no such directory"):
    jpack.checkpoint.restore(tmp_path / "missing", like)
  save(tmp_path / "other", dp, dp.init(params0()), 0)
  with pytest.raises(FileNotFoundError, match=r"no finished checkpoint of step 3 in .*"
                                              r"finished steps: \[0\]"):
    jpack.checkpoint.restore(tmp_path / "other", like, step=3)


def test_a_checkpoint_not_written_by_jpack_checkpoint_save_is_refused(tmp_path):
  dp = make("packed")
  with manager_at(tmp_path) as manager:
    manager.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(
        {"params": params0()})))
  with pytest.raises(ValueError, match="not written by jpack"):
    jpack.checkpoint.restore(tmp_path, jax.eval_shape(dp.init, params0()))


def test_a_checkpoint_of_another_format_is_refused(tmp_path):
  dp = make("packed")
  with manager_at(tmp_path) as manager:
    manager.save(0, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params0()}),
        meta=ocp.args.JsonSave({"jpack_checkpoint": 1, "step": 0})))
  with pytest.raises(ValueError, match=r"is in jpack's checkpoint format 1; this jpack "
                                       r"reads format 2 only"):
    jpack.checkpoint.restore(tmp_path, jax.eval_shape(dp.init, params0()))


def test_docstring_examples():
  result = doctest.testmod(_checkpoint, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
