"""Mixed precision: bf16 params with float32 masters, against plain JAX + optax references."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack

BF16 = jnp.bfloat16


# -- cast_params -----------------------------------------------------------------------

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64, np.int32, np.bool_,
          np.complex64]


@given(st.lists(st.sampled_from(DTYPES), min_size=0, max_size=6),
       st.sampled_from([np.float16, ml_dtypes.bfloat16, np.float32]))
def test_cast_params_casts_floating_leaves_only(dtypes, target):
  tree = {f"x{i}": np.arange(3).astype(d) for i, d in enumerate(dtypes)}
  out = jpack.cast_params(tree, target)
  for k, x in tree.items():
    floating = x.dtype in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16)
    want = x.astype(target) if floating else x
    assert out[k].dtype == want.dtype, k
    np.testing.assert_array_equal(np.asarray(out[k]), want)


def test_cast_params_tree_and_prefix_and_callable():
  params = {"dense": {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}, "norm": {"scale": jnp.ones(2)}}
  by_prefix = jpack.cast_params(params, {"dense": BF16, "norm": None})
  assert by_prefix["dense"]["w"].dtype == BF16 and by_prefix["dense"]["b"].dtype == BF16
  assert by_prefix["norm"]["scale"].dtype == jnp.float32
  by_fn = jpack.cast_params(params, lambda p: {"dense": "bfloat16", "norm": None})
  assert jax.tree.map(lambda x: x.dtype, by_fn) == jax.tree.map(lambda x: x.dtype, by_prefix)
  shapes = jpack.cast_params(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                          params), BF16)
  assert shapes["norm"]["scale"] == jax.ShapeDtypeStruct((2,), BF16)


@pytest.mark.parametrize("bad", [jnp.int32, "bool", np.complex64])
def test_param_dtype_must_be_floating(bad):
  with pytest.raises(ValueError, match=r"param_dtype for the leaf at \['w'\].*floating"):
    jpack.cast_params({"w": jnp.ones(2)}, bad)
  with pytest.raises(ValueError, match="floating"):
    jpack.data_parallel(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), {"w": jnp.ones(8)},
                        precision=jpack.Precision(param_dtype=bad))


def test_param_dtype_tree_must_match():
  with pytest.raises(ValueError, match="structure of the params"):
    jpack.cast_params({"w": jnp.ones(2)}, {"v": BF16})


def test_param_dtype_needs_packed_or_sharded_mode():
  with pytest.raises(ValueError, match=r"Precision\(param_dtype=\.\.\.\) needs "
                     r"mode='packed' or mode='sharded'"):
    jpack.data_parallel(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), {"w": jnp.ones(8)},
                        mode="allreduce", precision=jpack.Precision(param_dtype=BF16))


def test_precision_must_be_a_precision():
  # The dtypes travel together in a jpack.Precision, not as a bare dtype.
  with pytest.raises(TypeError, match=r"precision must be a jpack.Precision\(param_dtype=\.\.\., "
                     r"comm_dtype=\.\.\.\), got tuple"):
    jpack.data_parallel(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), {"w": jnp.ones(8)},
                        precision=(BF16, None))


def test_masters_need_full_precision_tree():
  packed = jpack.pack({"w": jnp.ones(4, BF16)})
  with pytest.raises(TypeError, match="full precision"):
    jpack.optax.flat(optax.adam(0.1), param_dtype=BF16).init(packed)


# -- one device: flat against optax on float32 masters ---------------------------------


def _mlp(key, widths=(12, 16, 8)):
  params = {}
  for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
    key, k = jax.random.split(key)
    params[f"layer{i}"] = {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
  params["scale"] = jnp.ones(widths[-1])
  return params


def _loss(params, batch):
  """Computes in the params' dtype (bf16 for bf16 params); the loss comes out in f32."""
  x, y = batch
  dtype = params["layer0"]["w"].dtype
  h = x.astype(dtype)
  n = len([k for k in params if k.startswith("layer")])
  for i in range(n):
    h = h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"]
    if i < n - 1:
      h = jnp.tanh(h)
  out = h * params["scale"].astype(dtype)
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


POLICY = {"layer0": BF16, "layer1": BF16, "scale": None}  # the scale stays float32


def _batch(key, rows, widths=(12, 16, 8)):
  kx, ky = jax.random.split(key)
  return (jax.random.normal(kx, (rows, widths[0])), jax.random.normal(ky, (rows, widths[-1])))


def test_flat_updates_float32_masters_like_optax():
  masters = _mlp(jax.random.key(0))
  tx = jpack.optax.flat(optax.adamw(3e-2, weight_decay=0.1), param_dtype=POLICY)
  state = tx.init(masters)
  params = jpack.cast_params(masters, POLICY)
  ref_tx = optax.adamw(3e-2, weight_decay=0.1)
  ref_state, ref_masters = ref_tx.init(masters), masters
  for i in range(20):
    batch = _batch(jax.random.key(i), 16)
    grads = jax.grad(_loss)(params, batch)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    # Reference: the loss on the rounded masters, the float32 gradient on the masters.
    ref_grads = jax.grad(_loss)(jpack.cast_params(ref_masters, POLICY), batch)
    ref_grads = jax.tree.map(lambda g: g.astype(jnp.float32), ref_grads)
    ref_updates, ref_state = ref_tx.update(ref_grads, ref_state, ref_masters)
    ref_masters = optax.apply_updates(ref_masters, ref_updates)
  want = jpack.cast_params(ref_masters, POLICY)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                          np.asarray(b, np.float32)),
               params, want)
  assert jax.tree.map(lambda x: x.dtype, params) == jax.tree.map(lambda x: x.dtype, want)
  # The masters, read from their buckets at the layout's offsets: float32, like optax's.
  for slot, want in zip(state.layout.slots, jax.tree.leaves(ref_masters)):
    bucket = state.master[slot.bucket]
    assert bucket.dtype == jnp.float32
    got = bucket[slot.offset:slot.offset + slot.size].reshape(slot.shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=slot.path)


# -- several devices: data_parallel against a one-device reference of the same policy ---


def _reference(masters, batches, n, steps, lr=1e-2, accumulate=1):
  """One device: f32 masters, bf16 params for the loss; each of the n devices' (and k
  micro-batches') gradients in bf16, cast to f32 and averaged; adam on the masters."""
  tx = optax.adam(lr)
  state = tx.init(masters)

  @jax.jit
  def step(masters, state, batch):
    params = jpack.cast_params(masters, POLICY)
    rows = jax.tree.map(lambda x: x.reshape((n * accumulate, -1) + x.shape[1:]), batch)
    grads = jax.vmap(jax.grad(_loss), in_axes=(None, 0))(params, rows)
    grads = jax.tree.map(lambda g: jnp.mean(g.astype(jnp.float32), axis=0), grads)
    updates, state = tx.update(grads, state, masters)
    return optax.apply_updates(masters, updates), state

  for i in range(steps):
    masters, state = step(masters, state, batches[i])
  return masters


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_bf16_params_match_reference(mode, n):
  steps = 50
  masters = _mlp(jax.random.key(1))
  batches = [_batch(jax.random.key(100 + i), 8 * n) for i in range(steps)]
  mesh = jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  dp = jpack.data_parallel(_loss, optax.adam(1e-2), masters, mesh, mode=mode,
                           precision=jpack.Precision(param_dtype=POLICY))
  state = dp.init(masters)
  for batch in batches:
    state, _ = dp.step(state, batch)
  got = dp.unpack(state)
  want_masters = _reference(masters, batches, n, steps)
  want = jpack.cast_params(want_masters, POLICY)
  assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, want)
  # Within bf16 rounding of the cast params: the reference sums the devices' gradients
  # in another order, which may move a master across a rounding boundary.
  for path, a, b in zip(*_paths(got), jax.tree.leaves(want)):
    if a.dtype == jnp.float32:  # kept in float32 (the scale): float32 rounding only
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6,
                                 err_msg=path)
      continue
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    ulp = np.abs(b) * 2.0 ** -7 + 1e-30
    assert np.all(np.abs(a - b) <= ulp + 1e-6), path
    assert np.mean(a == b) > 0.95, path


def _paths(tree):
  pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [jax.tree_util.keystr(p) for p, _ in pairs], [x for _, x in pairs]


# -- memory: ZeRO-1 with bf16 params is 2Ψ + 12Ψ/N bytes per device ----------------------


def _bytes_per_device(tree):
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_sharded_bf16_memory_is_zero1_formula():
  widths = (512, 1024, 512, 256)
  masters = _mlp(jax.random.key(2), widths)
  del masters["scale"]
  psi = sum(x.size for x in jax.tree.leaves(masters))
  n = jax.device_count()

  def loss(params, batch):
    h = batch.astype(BF16)
    for i in range(3):
      h = jnp.tanh(h @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"])
    return jnp.mean(h.astype(jnp.float32) ** 2)

  dp = jpack.data_parallel(loss, optax.adam(1e-3), masters, mode="sharded",
                           precision=jpack.Precision(param_dtype=BF16))
  state = dp.init(masters)
  state, _ = dp.step(state, jnp.ones((2 * n, widths[0])))
  assert all(b.dtype == BF16 for b in state.params.buckets)
  assert all(m.dtype == jnp.float32 for m in state.opt_state.master)
  used = _bytes_per_device((state.params, state.opt_state))
  assert used <= (2 * psi + 12 * psi / n) * 1.01, (used, psi)
  # The float32 replicated run, for scale: 4Ψ of params and 8Ψ of adam moments.
  f32 = jpack.data_parallel(loss, optax.adam(1e-3), masters, mode="packed")
  f32_state = f32.init(masters)
  assert _bytes_per_device((f32_state.params, f32_state.opt_state)) >= 12 * psi


def test_sharded_bf16_gathers_params_in_bf16():
  widths = (64, 512, 256)  # big enough that padding to 8 aligned shards is below 1 %
  masters = _mlp(jax.random.key(3), widths)
  n = jax.device_count()
  batch = _batch(jax.random.key(4), 2 * n, widths)
  gathered = {}
  for dtype in (None, BF16):
    dp = jpack.data_parallel(_loss, optax.adam(1e-3), masters, mode="sharded",
                             precision=jpack.Precision(param_dtype=dtype))
    hlo = jax.jit(dp.step, donate_argnums=0).lower(dp.init(masters), batch).compile().as_text()
    gathered[dtype] = [line for line in hlo.splitlines() if " all-gather(" in line]
  def elements(lines, types):
    found = [re.search(r"= (\w+)\[(\d+)\]", line).groups() for line in lines]
    assert found and all(t in types for t, _ in found), found
    return sum(int(k) for _, k in found)

  # Half the bytes: bf16 on the wire (XLA:CPU gets its integer bits, which it would
  # otherwise widen to f32), for about as many elements.
  bf16_bytes = 2 * elements(gathered[BF16], ("bf16", "u16"))
  f32_bytes = 4 * elements(gathered[None], ("f32",))
  assert bf16_bytes <= 0.51 * f32_bytes, (bf16_bytes, f32_bytes)


# -- checkpoints of the masters ----------------------------------------------------------


def test_gather_and_scatter_state_keep_masters():
  masters = _mlp(jax.random.key(5))
  n = jax.device_count()
  dp = jpack.data_parallel(_loss, optax.adam(1e-2), masters, mode="sharded",
                           precision=jpack.Precision(param_dtype=POLICY))
  state = dp.init(masters)
  for i in range(3):
    state, _ = dp.step(state, _batch(jax.random.key(i), 2 * n))
  saved = jpack.checkpoint.gather_state(state.opt_state)
  # The saved masters are the full-precision params tree.
  assert jax.tree.structure(saved["master"]) == jax.tree.structure(masters)
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(saved["master"]))
  np.testing.assert_array_equal(
      np.asarray(jpack.cast_params(saved["master"], POLICY)["layer0"]["w"], np.float32),
      np.asarray(dp.unpack(state)["layer0"]["w"], np.float32))
  # Restored onto 4 devices, training goes on from the same masters.
  mesh4 = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4],
                        axis_types=(jax.sharding.AxisType.Explicit,))
  dp4 = jpack.data_parallel(_loss, optax.adam(1e-2), masters, mesh4, mode="sharded",
                            precision=jpack.Precision(param_dtype=POLICY))
  like = jax.eval_shape(dp4.init, masters)
  restored = jpack.checkpoint.scatter_state(saved, like.opt_state)
  fresh = dp4.init(masters)
  state4 = fresh._replace(params=jpack.pack(jpack.cast_params(saved["master"], POLICY),
                                            dp4.layout),
                          opt_state=restored)
  state4, metrics = dp4.step(state4, _batch(jax.random.key(9), 8))
  assert np.isfinite(float(metrics["loss"]))
  again = jpack.checkpoint.gather_state(state4.opt_state)
  assert jax.tree.structure(again) == jax.tree.structure(saved)
