"""ZeRO-3 (`mode="fsdp"`, `jpack.fsdp`) against one-device optax and per-device JAX.

References are plain JAX and optax on one device: the loss of the whole batch (or the
mean of each device's loss, for models whose BatchNorm normalises each device's rows).
"""

import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jpack
from benchmarks import models

N = 8


def _mlp():
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(12, 24)).astype(np.float32) / 3,
            "b1": np.zeros(24, np.float32),
            "w2": rng.normal(size=(24, 3)).astype(np.float32) / 5,
            "b2": np.zeros(3, np.float32)}

  def loss(p, batch):
    x, y = batch
    h = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jnp.mean((h - y) ** 2)

  batch = (rng.normal(size=(32, 12)).astype(np.float32) * 4,
           rng.normal(size=(32, 3)).astype(np.float32))
  return params, loss, batch


def _gpt2():
  m = models.gpt2(layers=2, width=32, vocab=64, positions=16, heads=2, seq=8, name="tiny")
  return m.params, m.loss, m.batch(16)


def _decay(p):
  return jax.tree.map(lambda x: np.ndim(x) > 1, p)


# The GPT-2 recipe (global-norm clipping, weight decay on matrices), and SGD with the same
# clipping and mask, whose step is proportional to the gradient (adam's is not: it would
# hide a scaled gradient, and it turns the rounding noise of GPT-2's key biases, whose
# gradient is zero, into steps of the learning rate's size).
OPTIMIZERS = {
    "clip_adamw_mask": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                           optax.adamw(1e-2, weight_decay=0.1, mask=_decay)),
    "clip_sgd_mask": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                         optax.add_decayed_weights(0.1, mask=_decay),
                                         optax.sgd(0.05, momentum=0.9)),
}


def _reference(loss, params, batch, tx, steps):
  state = tx.init(params)
  for _ in range(steps):
    grads = jax.grad(loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def _close(got, want, rtol=1e-5):
  for path, a in jax.tree_util.tree_leaves_with_path(want):
    b = got
    for k in path:
      b = b[k.key]
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=rtol, atol=rtol * 1e-1,
                               err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("model,opt", [("mlp", "clip_adamw_mask"), ("mlp", "clip_sgd_mask"),
                                       ("gpt2", "clip_sgd_mask")])
def test_fsdp_equals_one_device_optax(model, opt):
  params, loss, batch = {"mlp": _mlp, "gpt2": _gpt2}[model]()
  want = _reference(loss, params, batch, OPTIMIZERS[opt](), 10)
  dp = jpack.data_parallel(loss, OPTIMIZERS[opt](), params, mode="fsdp")
  state = dp.init(params)
  for _ in range(10):
    state, metrics = dp.step(state, batch)
  assert isinstance(state.params, jpack.Shards)
  assert state.params.buckets[0].sharding.spec == P("batch")
  _close(dp.unpack(state), want)


@pytest.mark.parametrize("mode", [
    jpack.Mode("fsdp", keep_gathered=True), "fsdp",
    jpack.Mode("fsdp", remat_policy=jax.checkpoint_policies.everything_saveable),
    jpack.Mode("fsdp", keep_gathered=True,
               remat_policy=jax.checkpoint_policies.nothing_saveable)])
def test_fsdp_accumulates_and_keeps_gathered(mode):
  params, loss, batch = _mlp()
  want = _reference(loss, params, batch, optax.sgd(0.1), 3)
  dp = jpack.data_parallel(loss, optax.sgd(0.1), params, mode=mode, accumulate=2)
  state = dp.init(params)
  for _ in range(3):
    state, metrics = dp.step(state, batch)
  _close(dp.unpack(state), want)
  before = _reference(loss, params, batch, optax.sgd(0.1), 2)  # the last step's params
  np.testing.assert_allclose(float(metrics["grad_norm"]),
                             float(optax.tree.norm(jax.grad(loss)(before, batch))),
                             rtol=1e-5)
  np.testing.assert_allclose(float(metrics["loss"]), float(loss(before, batch)), rtol=1e-5)


def test_fsdp_with_blocks_under_the_models_own_checkpoint():
  """Each block under ``jax.checkpoint`` (as MaxText remats): the block reads its bucket
  whole, and the step still equals one-device optax."""
  m = models.gpt2(layers=2, width=32, vocab=64, positions=16, heads=2, seq=8, name="tiny",
                  remat=True)
  params, batch = m.params, m.batch(16)
  want = _reference(m.loss, params, batch, OPTIMIZERS["clip_sgd_mask"](), 3)
  dp = jpack.data_parallel(m.loss, OPTIMIZERS["clip_sgd_mask"](), params, mode="fsdp")
  state = dp.init(params)
  for _ in range(3):
    state, _ = dp.step(state, batch)
  _close(dp.unpack(state), want)


def test_fsdp_with_batchnorm_state():
  """A ResNet-like model whose BatchNorm normalises each device's rows and keeps running
  statistics: the reference is the mean of each device's loss, and the running
  statistics averaged over the devices, computed one device after the other."""
  m = models.resnet(blocks=(1, 1), width=8, classes=10, image=8, block="basic",
                    bn_state=True, name="tiny_resnet")
  params, running, batch = m.params, m.state, m.batch(16)
  tx = optax.sgd(0.05, momentum=0.9)

  def per_device(p, s, b):
    chunks = jax.tree.map(lambda x: x.reshape((N, -1) + x.shape[1:]), b)
    losses, states = jax.vmap(lambda c: m.loss(p, s, c))(chunks)
    return jnp.mean(losses), jax.tree.map(lambda x: jnp.mean(x, 0), states)

  p, s, opt = params, running, tx.init(params)
  for _ in range(3):
    (_, s), g = jax.value_and_grad(per_device, has_aux=True)(p, s, batch)
    u, opt = tx.update(g, opt, p)
    p = optax.apply_updates(p, u)
  dp = jpack.data_parallel(m.loss, tx, params, mode="fsdp")
  state = dp.init(params, running)
  for _ in range(3):
    state, _ = dp.step(state, batch)
  got_params, got_stats = dp.unpack(state)
  _close(got_params, p, rtol=2e-5)
  _close(got_stats, s, rtol=2e-5)


def test_fsdp_bf16_params_gather_bf16_and_reduce_f32():
  params, loss, batch = _mlp()
  dp = jpack.data_parallel(loss, optax.sgd(0.1), params, mode="fsdp",
                           precision=jpack.Precision(param_dtype=jnp.bfloat16))
  state = dp.init(params)
  # Between steps only the float32 masters (and the optimizer's state) are kept: 12
  # bytes a parameter with adam, none of them a bf16 copy.
  assert state.params is None
  assert all(b.dtype == jnp.float32 for b in state.opt_state.master)
  hlo = dp.step.lower(state, batch).compile().as_text()
  # 16 bits a parameter on the wire (XLA:CPU moves bf16 as its bits, u16).
  gathers = re.findall(r"= (\w+)\[\d+\]\S* all-gather(?:-start)?\(", hlo)
  assert gathers and set(gathers) <= {"bf16", "u16"}, gathers
  scatters = re.findall(r"= (\w+)\[\d+\]\S* reduce-scatter(?:-start)?\(", hlo)
  assert scatters and set(scatters) == {"f32"}, scatters
  # The masters are f32: one SGD step from them, against numpy in f32.
  state, _ = dp.step(state, batch)
  grads = jax.grad(loss)(jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
                                      params), batch)
  got = dp.unpack(state)
  for k in params:
    want = (params[k] - 0.1 * np.asarray(grads[k])).astype(jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(got[k], np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-3, err_msg=k)


def test_backward_gathers_again_unless_kept():
  """Without keep_gathered, the backward pass gathers each bucket again (the gathered
  buckets are not saved for it); with it, one gather per bucket. Read in the program
  jpack hands XLA: XLA:CPU merges the two gathers of a bucket again, XLA:GPU keeps them
  (docs/gpu.md)."""
  params, loss, batch = _gpt2()
  counts = {}
  for keep in (False, True):
    dp = jpack.data_parallel(loss, optax.sgd(0.1), params,
                             mode=jpack.Mode("fsdp", keep_gathered=keep))
    state = dp.init(params)
    counts[keep] = dp.step.lower(state, batch).as_text().count("stablehlo.all_gather")
  buckets = len(dp.layout.buckets)
  assert counts[True] == buckets
  assert counts[False] == 2 * buckets


def test_hand_written_fsdp_step():
  """The how-to's step: jpack.fsdp's gradient with respect to the slices is the mean
  gradient's slice; jpack.optax.sharded updates the slices."""
  params, loss, batch = _mlp()
  want = _reference(loss, params, batch, optax.sgd(0.1), 3)
  mesh = jax.make_mesh((N,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
  layout = jpack.plan(params, num_shards=N)
  tx = jpack.optax.sharded(optax.sgd(0.1), "batch")

  def train(params, batch):
    shards = jpack.shard(jpack.pack(params, layout), "batch")
    opt_state = tx.init(shards)
    for _ in range(3):
      grads = jax.grad(jpack.fsdp(loss, "batch"))(shards, batch)
      updates, opt_state = tx.update(grads, opt_state, shards)
      shards = optax.apply_updates(shards, updates)
    return jpack.unpack(jpack.all_gather(shards, "batch"))

  step = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P()))
  batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("batch")))
  got = step(jax.device_put(params, jax.sharding.NamedSharding(mesh, P())), batch)
  _close(jax.device_get(got), want)


def _hand_written_grads(loss, params, batch):
  """jax.grad of ``jpack.fsdp(loss)`` on 8 devices, a bucket per leaf, gathered whole."""
  mesh = jax.make_mesh((N,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
  layout = jpack.plan(params, num_shards=N, bucket_bytes=1, align_bytes=4)
  assert len(layout.buckets) == len(jax.tree.leaves(params))

  def grads(params, batch):
    shards = jpack.shard(jpack.pack(params, layout), "batch")
    g = jax.grad(jpack.fsdp(loss, "batch"))(shards, batch)
    return jpack.unpack(jpack.all_gather(g, "batch"))

  step = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P()))
  return jax.device_get(step(jax.device_put(params, jax.sharding.NamedSharding(mesh, P())),
                             jax.device_put(batch, jax.sharding.NamedSharding(mesh, P("batch")))))


def test_fsdp_with_tied_embeddings_and_a_position_table():
  """The position table's rows, which only the operations before the first matmul read,
  are saved for the backward pass (the program's gathers: tests/test_gpu_compile.py);
  the gradient is jax.grad's of the whole batch on one device."""
  rng = np.random.default_rng(2)
  params = {"wte": rng.normal(size=(11, 16)).astype(np.float32),
            "wpe": rng.normal(size=(6, 16)).astype(np.float32) / 2,
            "w": rng.normal(size=(16, 16)).astype(np.float32) / 4}

  def loss(p, ids):
    h = p["wte"][ids] + p["wpe"][: ids.shape[1]]
    h = h + jnp.tanh(h @ p["w"])
    return -jnp.mean(jax.nn.log_softmax(h @ p["wte"].T)[..., 0])

  ids = rng.integers(0, 11, size=(16, 5)).astype(np.int32)
  _close(_hand_written_grads(loss, params, ids), jax.grad(loss)(params, ids))


def test_hand_written_fsdp_with_a_bucket_per_matrix():
  """A bucket per matrix and vector; the last three matrices read the same input, so
  their gathers wait for the same earlier reader, not for each other, and, more of them
  than collectives in flight, are gathered in one all-gather (docs/gpu.md). The
  gradient is still the mean gradient's slice: jax.grad of the whole batch's loss on
  one device."""
  rng = np.random.default_rng(1)
  params = {"w0": rng.normal(size=(12, 16)).astype(np.float32) / 3,
            "w1": rng.normal(size=(16, 16)).astype(np.float32) / 4,
            "b1": rng.normal(size=16).astype(np.float32),
            "w2": rng.normal(size=(16, 16)).astype(np.float32) / 4,
            "w3": rng.normal(size=(16, 3)).astype(np.float32) / 4,
            "w4": rng.normal(size=(16, 5)).astype(np.float32) / 4}

  def loss(p, x):
    h = jnp.sum(x @ p["w0"], axis=-1, keepdims=True) * x @ p["w0"]
    g = jax.nn.gelu(h @ p["w1"] + p["b1"])
    return jnp.mean((g @ p["w2"] + jnp.tanh(g @ p["w3"]).sum(-1, keepdims=True)
                     - jnp.sin(g @ p["w4"]).sum(-1, keepdims=True)) ** 2)

  x = rng.normal(size=(32, 12)).astype(np.float32)
  _close(_hand_written_grads(loss, params, x), jax.grad(loss)(params, x))
  mesh = jax.make_mesh((N,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))
  layout = jpack.plan(params, num_shards=N, bucket_bytes=1, align_bytes=4)
  replicated = jax.device_put(params, jax.sharding.NamedSharding(mesh, P()))
  split = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("batch")))

  def forward(params, x):
    shards = jpack.shard(jpack.pack(params, layout), "batch")
    return jax.lax.pmean(jpack.fsdp(loss, "batch")(shards, x), "batch")

  text = jax.jit(jax.shard_map(forward, mesh=mesh, in_specs=(P(), P("batch")),
                               out_specs=P())).lower(replicated, split).as_text()
  # w0, w1 and b1 one at a time, w2, w3 and w4 together.
  assert text.count("stablehlo.all_gather") == 4


def _saved_and_restored(saved_in, restored_in, mesh=None, precision=None):
  """The params after 3 steps in ``saved_in``, and after 2 steps there, a checkpoint, a
  restore into ``restored_in`` on ``mesh`` and one step there."""
  ocp = pytest.importorskip("orbax.checkpoint")
  params, loss, batch = _mlp()
  tx = optax.adam(1e-2)
  dp = jpack.data_parallel(loss, tx, params, mode=saved_in, precision=precision)
  state = dp.init(params)
  for _ in range(2):
    state, _ = dp.step(state, batch)
  directory = tempfile.mkdtemp()
  with ocp.CheckpointManager(directory) as manager:
    jpack.checkpoint.save(manager, 2, state)
  state, _ = dp.step(state, batch)

  other = jpack.data_parallel(loss, tx, params, mesh, mode=restored_in, precision=precision)
  restored, _ = jpack.checkpoint.restore(directory, jax.eval_shape(other.init, params))
  restored, _ = other.step(restored, batch)
  return dp.unpack(state), other.unpack(restored)


@pytest.mark.parametrize("saved_in,restored_in,devices", [
    ("fsdp", "sharded", 4), ("fsdp", "packed", 1), ("packed", "fsdp", 4), ("fsdp", "fsdp", 2)])
def test_checkpoint_across_modes_and_device_counts(saved_in, restored_in, devices):
  mesh = jax.make_mesh((devices,), ("batch",), devices=jax.devices()[:devices])
  want, got = _saved_and_restored(saved_in, restored_in, mesh)
  _close(got, want, rtol=1e-6)


@pytest.mark.parametrize("saved_in,restored_in", [
    ("fsdp", "packed"), ("sharded", "fsdp"), ("fsdp", "fsdp")])
def test_bf16_checkpoint_across_modes(saved_in, restored_in):
  """ZeRO-3 with bf16 params keeps only the masters; its checkpoint holds the bf16 params
  and the masters as every other mode's does, and restores in them, and the reverse."""
  want, got = _saved_and_restored(saved_in, restored_in,
                                  precision=jpack.Precision(param_dtype=jnp.bfloat16))
  for k in want:  # bf16 params from the same masters: within one bf16 rounding
    np.testing.assert_allclose(np.asarray(got[k], np.float32),
                               np.asarray(want[k], np.float32), rtol=8e-3, atol=1e-6,
                               err_msg=k)


def test_bad_input():
  params, loss, batch = _mlp()
  with pytest.raises(ValueError, match="keep_gathered"):
    jpack.data_parallel(loss, optax.sgd(0.1), params, mode=jpack.Mode("packed",
                                                                       keep_gathered=True))
  with pytest.raises(ValueError, match="shard_accumulator"):
    jpack.data_parallel(loss, optax.sgd(0.1), params,
                        mode=jpack.Mode("fsdp", shard_accumulator=True))
  with pytest.raises(ValueError, match="remat_policy"):
    jpack.data_parallel(loss, optax.sgd(0.1), params, mode=jpack.Mode(
        "sharded", remat_policy=jax.checkpoint_policies.dots_saveable))
  with pytest.raises(TypeError, match="jax.checkpoint policy"):
    jpack.data_parallel(loss, optax.sgd(0.1), params,
                        mode=jpack.Mode("fsdp", remat_policy="dots"))
  dp = jpack.data_parallel(loss, optax.sgd(0.1), params, mode="fsdp")
  state = dp.init(params)
  packed = state._replace(params=jpack.pack(params, dp.layout))
  with pytest.raises(TypeError, match="jpack.Shards"):
    dp.step(packed, batch)
  with pytest.raises(ValueError, match=r"missing .*'w2'"):
    dp.init({"w1": params["w1"], "b1": params["b1"]})
  # Nothing was half-updated: the state still steps.
  state, _ = dp.step(state, batch)
  with pytest.raises(TypeError, match="apply_if_finite"):
    jpack.data_parallel(loss, optax.apply_if_finite(optax.sgd(0.1), 3), params,
                        mode="fsdp")
