"""Collectives on buckets vs per-leaf jax.lax references, under shard_map and pmap."""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
import jpack._cpu
from jpack._collectives import reduce  # the collective per bucket, chosen by method=
from jpack._reference import count_collectives
from conftest import assert_sliced_at_unfoldable_offsets, bits

N = 8
FLOATS = [np.float32, jnp.bfloat16, np.float16]
INTS = [np.int32, np.int8, np.uint32, np.int16]


def on_path(path):
  """Run on the XLA:CPU path ("cpu", what CPU programs lower) or on the plain path
  ("plain", what GPU and TPU programs lower), both executed here on CPU devices."""
  if path == "cpu":
    return contextlib.nullcontext()
  return mock.patch.object(jpack._cpu, "choose",
                           lambda on_cpu, elsewhere, *args: elsewhere(*args))


@pytest.fixture(params=["cpu", "plain"])
def path(request):
  with on_path(request.param):
    yield request.param


def mesh(n=N):
  return jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n])


def per_device_tree(rng, specs, n=N):
  """Leaves with a leading device axis: device i holds leaf[i]."""
  out = {}
  for i, (shape, dtype) in enumerate(specs):
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
      info = np.iinfo(dtype)
      lo, hi = max(info.min, -50), min(info.max, 50)  # sums stay in range
      x = rng.integers(lo, hi + 1, size=(n,) + shape).astype(dtype)
    else:
      x = rng.normal(size=(n,) + shape).astype(dtype)
    out[f"leaf{i}"] = x
  return out


def run_shard_map(fn, tree, n=N):
  m = mesh(n)
  placed = jax.device_put(tree, NamedSharding(m, P("batch")))
  body = lambda t: fn(jax.tree.map(lambda x: x[0], t))
  return jax.jit(jax.shard_map(body, mesh=m, in_specs=P("batch"), out_specs=P()))(placed)


def run_pmap(fn, tree):
  out = jax.pmap(fn, axis_name="batch")(tree)
  return jax.tree.map(lambda x: x[0], out)


def assert_close(got, want, exact_ints=True):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    if jnp.issubdtype(a.dtype, jnp.integer):
      np.testing.assert_array_equal(a, b)
    else:
      tol = 1e-2 if a.dtype in (jnp.bfloat16, jnp.float16) else 1e-5
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=tol, atol=tol)


specs_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 5), max_size=2).map(tuple),
              st.sampled_from(FLOATS + INTS)), min_size=1, max_size=8)


@settings(max_examples=8, deadline=None)
@given(specs=specs_strategy, seed=st.integers(0, 1000),
       method=st.sampled_from(["auto", "psum", "scatter_gather"]), use_pmap=st.booleans(),
       path=st.sampled_from(["cpu", "plain"]))
def test_psum_equals_per_leaf_psum(specs, seed, method, use_pmap, path):
  tree = per_device_tree(np.random.default_rng(seed), specs)

  def fn(t):
    return (reduce(t, "batch", mean=False, allow_int=True, method=method,
                   layout=jpack.plan(t, num_shards=N, align_bytes=16)),
            jax.tree.map(lambda x: jax.lax.psum(x, "batch"), t))

  with on_path(path):
    got, want = (run_pmap if use_pmap else run_shard_map)(fn, tree)
  assert_close(got, want)


@settings(max_examples=8, deadline=None)
@given(specs=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=2).map(tuple),
                                st.sampled_from(FLOATS)), min_size=1, max_size=8),
       seed=st.integers(0, 1000), use_pmap=st.booleans(), bucket_bytes=st.integers(16, 256),
       path=st.sampled_from(["cpu", "plain"]))
def test_pmean_equals_per_leaf_pmean(specs, seed, use_pmap, bucket_bytes, path):
  tree = per_device_tree(np.random.default_rng(seed), specs)

  def fn(t):
    return (jpack.pmean(t, "batch", layout=jpack.plan(t, num_shards=N,
                                                      bucket_bytes=bucket_bytes)),
            jax.tree.map(lambda x: jax.lax.pmean(x, "batch"), t))

  with on_path(path):
    got, want = (run_pmap if use_pmap else run_shard_map)(fn, tree)
  assert_close(got, want)


def test_packed_input_stays_packed_and_is_reduced_per_bucket():
  tree = per_device_tree(np.random.default_rng(0), [((3, 4), np.float32), ((5,), np.int32)])

  def fn(t):
    packed = jpack.pack(t, jpack.plan(t, num_shards=N))
    out = jpack.psum(packed, "batch")
    assert isinstance(out, jpack.Packed) and out.layout == packed.layout
    return jpack.unpack(out), jax.tree.map(lambda x: jax.lax.psum(x, "batch"), t)

  got, want = run_shard_map(fn, tree)
  assert_close(got, want)


def test_comm_dtype_f32_accumulation_for_bf16_and_bf16_wire_for_f32(path):
  rng = np.random.default_rng(1)
  tree = {"bf": rng.normal(size=(N, 64)).astype(jnp.bfloat16),
          "f": rng.normal(size=(N, 64)).astype(np.float32)}

  def fn(t):
    return (jpack.pmean(t, "batch", comm_dtype=jnp.float32),
            jpack.pmean(t, "batch", comm_dtype=jnp.bfloat16))

  f32_wire, bf16_wire = run_shard_map(fn, tree)
  exact = {k: np.asarray(v, np.float64).mean(0) for k, v in tree.items()}
  assert f32_wire["bf"].dtype == jnp.bfloat16 and bf16_wire["f"].dtype == jnp.float32
  # f32 accumulation: only the final rounding to bf16.
  np.testing.assert_allclose(np.asarray(f32_wire["bf"], np.float64), exact["bf"],
                             atol=np.abs(exact["bf"]).max() * 2**-8 + 1e-6)
  # bf16 wire: the f32 values travel rounded to bf16, error bounded by bf16 precision.
  err = np.abs(np.asarray(bf16_wire["f"], np.float64) - exact["f"]).max()
  assert 0 < err < 0.05
  np.testing.assert_allclose(f32_wire["f"], exact["f"], rtol=1e-5, atol=1e-6)


def test_comm_dtype_wire_is_visible_in_compiled_program():
  m = mesh()
  x = jax.device_put(np.ones((N, 1024), np.float32), NamedSharding(m, P("batch")))
  fn = lambda wire: jax.jit(jax.shard_map(
      lambda t: reduce({"x": t[0]}, "batch", mean=False, comm_dtype=wire, method="psum"),
      mesh=m, in_specs=P("batch"), out_specs=P())).lower(x).as_text()
  assert "bf16" in fn(jnp.bfloat16) and "bf16" not in fn(None)


def _collective_bytes(hlo_text):
  """Bytes each device puts into its collectives (a reduce-scatter's input is N results)."""
  nbytes = count_collectives(hlo_text).result_bytes
  return (nbytes["all-reduce"] + N * nbytes["reduce-scatter"] + nbytes["all-gather"]
          + nbytes["all-to-all"])


@pytest.mark.parametrize("use_pmap", [False, True])
def test_bf16_wire_halves_compiled_collective_bytes_and_accumulates_wide(use_pmap):
  # XLA:CPU widens bf16 collectives to f32; jpack's narrow wire must survive compilation.
  rng = np.random.default_rng(7)
  tree = {"w": rng.normal(size=(N, 4096)).astype(np.float32),
          "b": rng.normal(size=(N, 100)).astype(np.float32)}

  def fn(wire):
    return lambda t: jpack.pmean(t, "batch", comm_dtype=wire)

  if use_pmap:
    compiled = lambda wire: jax.pmap(fn(wire), axis_name="batch").lower(tree).compile()
  else:
    m = mesh()
    placed = jax.device_put(tree, NamedSharding(m, P("batch")))
    body = lambda wire: lambda t: fn(wire)(jax.tree.map(lambda x: x[0], t))
    compiled = lambda wire: jax.jit(jax.shard_map(
        body(wire), mesh=m, in_specs=P("batch"), out_specs=P())).lower(placed).compile()
  f32_bytes = _collective_bytes(compiled(None).as_text())
  bf16_bytes = _collective_bytes(compiled(jnp.bfloat16).as_text())
  assert f32_bytes > 0 and bf16_bytes * 2 == f32_bytes

  got = (run_pmap if use_pmap else run_shard_map)(fn(jnp.bfloat16), tree)
  for k, x in tree.items():
    # Reference: each device's values rounded to bf16, averaged in float64, rounded once.
    sent = np.asarray(x.astype(jnp.bfloat16), np.float64)
    want = sent.mean(0)
    assert got[k].dtype == np.float32
    np.testing.assert_allclose(np.asarray(got[k], np.float64), want,
                               rtol=2**-8, atol=1e-6)


def test_bf16_buckets_travel_as_16_bits_and_sum_in_f32():
  rng = np.random.default_rng(10)
  x = rng.normal(size=(N, 4096)).astype(np.float32)
  m = mesh()

  def compiled_bytes(dtype):
    placed = jax.device_put({"g": x.astype(dtype)}, NamedSharding(m, P("batch")))
    f = jax.jit(jax.shard_map(lambda t: jpack.pmean({"g": t["g"][0]}, "batch"), mesh=m,
                              in_specs=P("batch"), out_specs=P()))
    return _collective_bytes(f.lower(placed).compile().as_text()), f(placed)

  f32_bytes, _ = compiled_bytes(np.float32)
  bf16_bytes, got = compiled_bytes(jnp.bfloat16)
  assert bf16_bytes * 2 == f32_bytes  # XLA:CPU would widen a bf16 psum_scatter to f32
  sent = np.asarray(x.astype(jnp.bfloat16), np.float64)
  assert got["g"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got["g"], np.float64), sent.mean(0), rtol=2**-8,
                             atol=1e-6)


def test_reduce_scatter_with_bf16_wire_keeps_the_wide_sum():
  rng = np.random.default_rng(8)
  tree = {"w": rng.normal(size=(N, 1024)).astype(np.float32)}
  layout = jpack.plan(jax.tree.map(lambda x: x[0], tree), num_shards=N)

  def fn(t):
    shards = jpack.reduce_scatter(t, "batch", comm_dtype=jnp.bfloat16, layout=layout)
    return jpack.unpack(jpack.all_gather(shards, "batch"))

  got = run_shard_map(fn, tree)
  want = np.asarray(tree["w"].astype(jnp.bfloat16), np.float64).sum(0)
  # The shards are not rounded to the wire again after summing: f32 accuracy.
  np.testing.assert_allclose(np.asarray(got["w"], np.float64), want, rtol=1e-6, atol=1e-5)


def test_complex_leaves_ignore_a_real_wire_dtype():
  rng = np.random.default_rng(9)
  z = (rng.normal(size=(N, 6)) + 1j * rng.normal(size=(N, 6))).astype(np.complex64)
  got = run_shard_map(lambda t: jpack.psum(t, "batch", comm_dtype=jnp.bfloat16), {"z": z})
  np.testing.assert_allclose(got["z"], z.sum(0), rtol=1e-5, atol=1e-5)


def test_broadcast_is_bit_exact_for_every_dtype_and_root():
  rng = np.random.default_rng(2)
  tree = per_device_tree(rng, [((3,), np.float32), ((2, 2), jnp.bfloat16), ((4,), np.int8),
                               ((2,), np.uint32), ((3,), np.float16)])
  tree["neg_zero"] = np.full((N, 2), -0.0, np.float32)
  tree["nan"] = np.full((N, 1), np.nan, np.float32)
  tree["flags"] = rng.integers(0, 2, size=(N, 5)).astype(bool)
  # complex with -0.0 and NaN-payload parts (a psum of complex values would lose them)
  parts = rng.normal(size=(N, 3, 2)).astype(np.float32)  # (real, imag) pairs
  parts[:, 0, 1] = -0.0
  parts[:, 1, 0] = np.uint32(0x7FC01234).view(np.float32)
  tree["complex"] = parts.view(np.complex64)[..., 0]
  # every bf16 / f16 bit pattern (signalling NaNs, subnormals), different on each device
  patterns = np.arange(2**16, dtype=np.uint16)
  rolled = np.stack([np.roll(patterns, 7 * d) for d in range(N)])
  tree["bf16_all"], tree["f16_all"] = rolled.view(jnp.bfloat16), rolled.view(np.float16)
  for root in (0, 5):
    got = run_shard_map(lambda t: jpack.broadcast(t, "batch", root=root), tree)
    for k in tree:
      assert bits(got[k]) == bits(tree[k][root]), k


def test_broadcast_prng_keys_under_pmap():
  keys = jax.random.split(jax.random.key(0), N)
  got = jax.pmap(lambda k: jpack.broadcast({"k": k}, "batch", root=3), axis_name="batch")(keys)
  np.testing.assert_array_equal(jax.random.key_data(got["k"][6]), jax.random.key_data(keys[3]))


def test_reduce_scatter_then_all_gather_equals_psum(path):
  tree = per_device_tree(np.random.default_rng(3), [((7, 3), np.float32), ((5,), np.int32)])

  def fn(t):
    shards = jpack.reduce_scatter(t, "batch",
                                  layout=jpack.plan(t, num_shards=N, align_bytes=8))
    sizes = [b.size // N for b in shards.layout.buckets]
    assert [s.shape[0] for s in shards.buckets] == sizes
    return (jpack.unpack(jpack.all_gather(shards, "batch")),
            jax.tree.map(lambda x: jax.lax.psum(x, "batch"), t))

  got, want = run_shard_map(fn, tree)
  assert_close(got, want)


@settings(max_examples=8, deadline=None)
@given(specs=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=2).map(tuple),
                                st.sampled_from(FLOATS + INTS + [np.bool_])),
                      min_size=1, max_size=8),
       seed=st.integers(0, 1000), root=st.integers(0, N - 1), use_pmap=st.booleans())
def test_broadcast_equals_the_roots_values_on_random_trees(specs, seed, root, use_pmap):
  tree = per_device_tree(np.random.default_rng(seed), specs)
  tree = {k: (v % 2).astype(bool) if v.dtype == np.bool_ else v for k, v in tree.items()}
  got = (run_pmap if use_pmap else run_shard_map)(
      lambda t: jpack.broadcast(t, "batch", root=root,
                                layout=jpack.plan(t, align_bytes=16)), tree)
  for k in tree:
    assert bits(got[k]) == bits(tree[k][root]), k


@settings(max_examples=8, deadline=None)
@given(specs=specs_strategy, seed=st.integers(0, 1000), use_pmap=st.booleans(),
       mean=st.booleans(), bucket_bytes=st.integers(16, 256))
def test_reduce_scatter_then_all_gather_equals_per_leaf_psum_on_random_trees(
    specs, seed, use_pmap, mean, bucket_bytes):
  tree = per_device_tree(np.random.default_rng(seed), specs)
  if mean:  # a mean of integers is refused (see below): floats only
    tree = {k: v for k, v in tree.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    assume(tree)
  reference = jax.lax.pmean if mean else jax.lax.psum

  def fn(t):
    layout = jpack.plan(t, num_shards=N, bucket_bytes=bucket_bytes, align_bytes=16)
    shards = jpack.reduce_scatter(t, "batch", mean=mean, layout=layout)
    return (jpack.unpack(jpack.all_gather(shards, "batch")),
            jax.tree.map(lambda x: reference(x, "batch"), t))

  got, want = (run_pmap if use_pmap else run_shard_map)(fn, tree)
  assert_close(got, want)


def test_shard_takes_this_devices_slice():
  m = mesh()
  tree = {"x": np.arange(40, dtype=np.float32)}
  layout = jpack.plan(tree, num_shards=N, align_bytes=4)

  def fn(t):
    s = jpack.shard(jpack.pack(t, layout), "batch")
    return s.buckets[0]

  out = jax.jit(jax.shard_map(fn, mesh=m, in_specs=P(), out_specs=P("batch")))(
      jax.device_put(tree, NamedSharding(m, P())))
  np.testing.assert_array_equal(out, np.arange(40, dtype=np.float32))  # the bucket is x
  with pytest.raises(TypeError, match="expects a jpack.Packed, got dict"):
    jax.jit(jax.shard_map(lambda t: jpack.shard(t, "batch"), mesh=m, in_specs=P(),
                          out_specs=P("batch")))(jax.device_put(tree, NamedSharding(m, P())))


# -- refusals --------------------------------------------------------------------------


def _trace(fn, tree):
  return run_shard_map(fn, tree)


def test_mean_of_ints_is_refused_unless_asked():
  tree = {"step": np.full((N, 1), 3, np.int32), "w": np.ones((N, 2), np.float32)}
  with pytest.raises(TypeError, match=r"\['step'\].*allow_int=True"):
    _trace(lambda t: jpack.pmean(t, "batch"), tree)
  got = _trace(lambda t: jpack.pmean(t, "batch", allow_int=True), tree)
  assert got["step"].dtype == jnp.int32 and int(got["step"][0]) == 3


@pytest.mark.parametrize("method", ["psum", "scatter_gather"])
def test_allowed_int_mean_is_the_floor_of_the_exact_mean(method):
  rng = np.random.default_rng(11)
  ints = rng.integers(-50, 50, size=(N, 16)).astype(np.int32)  # differs on every device
  want = np.floor_divide(ints.sum(0), N)
  got = _trace(lambda t: reduce(t, "batch", mean=True, allow_int=True, method=method),
               {"i": ints})
  np.testing.assert_array_equal(got["i"], want)
  layout = jpack.plan({"i": ints[0]}, num_shards=N)
  shards = _trace(lambda t: jpack.all_gather(jpack.reduce_scatter(
      jpack.pack(t, layout), "batch", mean=True, allow_int=True), "batch").buckets[0],
      {"i": ints})
  np.testing.assert_array_equal(shards[:16], want)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.uint32])
@pytest.mark.parametrize("method", ["psum", "scatter_gather"])
def test_allowed_int_mean_does_not_overflow_near_the_dtype_limits(dtype, method):
  info = np.iinfo(dtype)
  rng = np.random.default_rng(12)
  ints = rng.integers(info.min, info.max, size=(N, 64), endpoint=True,
                      dtype=np.int64).astype(dtype)
  ints[:, :4] = [info.max, info.min, info.max - 1, 100 % (info.max + 1)]  # equal everywhere
  want = (ints.astype(object).sum(0) // N).astype(dtype)  # exact Python ints
  got = _trace(lambda t: reduce(t, "batch", mean=True, allow_int=True, method=method),
               {"i": ints})["i"]
  assert got.dtype == dtype
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got[:4], ints[0, :4])
  layout = jpack.plan({"i": ints[0]}, num_shards=N)
  shards = _trace(lambda t: jpack.all_gather(jpack.reduce_scatter(
      jpack.pack(t, layout), "batch", mean=True, allow_int=True), "batch").buckets[0],
      {"i": ints})
  np.testing.assert_array_equal(shards[:64], want)


@pytest.mark.parametrize("method", ["psum", "scatter_gather"])
def test_allowed_int_mean_when_the_device_count_does_not_fit_the_dtype(method):
  # 8 does not fit int4 (max 7): the floor split x = 8q + r must not be made in int4.
  rng = np.random.default_rng(13)
  ints = rng.integers(-8, 8, size=(N, 32)).astype(jnp.int4)
  ints[:, 0] = np.arange(N)  # device d holds d: floor mean 3
  want = ints.astype(np.int64).sum(0) // N
  got = _trace(lambda t: reduce(t, "batch", mean=True, allow_int=True, method=method),
               {"i": ints})["i"]
  assert got.dtype == jnp.int4
  np.testing.assert_array_equal(np.asarray(got).astype(np.int64), want)
  layout = jpack.plan({"i": ints[0]}, num_shards=N)
  shards = _trace(lambda t: jpack.all_gather(jpack.reduce_scatter(
      jpack.pack(t, layout), "batch", mean=True, allow_int=True), "batch").buckets[0],
      {"i": ints})
  np.testing.assert_array_equal(np.asarray(shards[:32]).astype(np.int64), want)


@pytest.mark.parametrize("dtype,size", [(np.int8, 200), (np.uint8, 300)])
def test_allowed_int_mean_over_a_wide_vmap_axis(dtype, size):
  info = np.iinfo(dtype)
  rng = np.random.default_rng(14)
  ints = rng.integers(info.min, info.max, size=(size, 5), endpoint=True).astype(dtype)
  want = (ints.astype(object).sum(0) // size).astype(dtype)
  got = jax.vmap(lambda t: jpack.pmean(t, "i", allow_int=True), axis_name="i")({"x": ints})
  np.testing.assert_array_equal(np.asarray(got["x"][0]), want)
  np.testing.assert_array_equal(np.asarray(got["x"]), np.broadcast_to(want, ints.shape))


@pytest.mark.parametrize("dtype,size", [(np.int16, 40000), (np.int32, 46342),
                                        (np.int16, 60000), (np.int32, 65536)])
def test_allowed_int_mean_over_axes_past_the_int32_remainder_sum(dtype, size):
  # Every -1 leaves the remainder size - 1 on every device: size * (size - 1) wrapped
  # int32 from 46342 on (a mean of -1 came out -27145). 40000 does not fit int16.
  # The layout is planned without num_shards: one shard per vmapped device would pad
  # each bucket to size * 64 elements, size times over.
  rng = np.random.default_rng(15)
  ints = np.full((size, 3), -1, dtype)
  ints[:, 1] = rng.integers(-300, 300, size)
  ints[:, 2] = np.iinfo(dtype).min
  want = ints.astype(np.int64).sum(0) // size
  layout = jpack.plan({"x": jax.ShapeDtypeStruct((3,), dtype)})
  got = jax.vmap(lambda t: jpack.pmean(t, "i", allow_int=True, layout=layout),
                 axis_name="i")({"x": ints})["x"]
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got[0]).astype(np.int64), want)


def test_allowed_int_mean_past_65536_devices_needs_64_bit_sums():
  size = 65537
  ints = np.full((size, 2), -1, np.int32)
  layout = jpack.plan({"x": jax.ShapeDtypeStruct((2,), np.int32)})
  mean = lambda t: jpack.pmean(t, "i", allow_int=True, layout=layout)
  if not jax.config.jax_enable_x64:
    with pytest.raises(ValueError, match="axis of 65537 devices.*jax_enable_x64"):
      jax.vmap(mean, axis_name="i")({"x": ints})
  with jax.enable_x64(True):
    got = jax.vmap(mean, axis_name="i")({"x": ints})["x"]
  np.testing.assert_array_equal(np.asarray(got[0]), [-1, -1])


@pytest.mark.parametrize("op", ["pmean", "psum", "broadcast"])
def test_a_packed_whose_buckets_do_not_match_its_layout_is_refused(op):
  # A stacked Packed split with P("batch") keeps a per-device axis of 1 in shard_map.
  m = mesh()
  layout = jpack.plan({"a": jnp.ones(3)}, num_shards=N)
  stacked = jax.vmap(lambda v: jpack.pack({"a": v}, layout))(jnp.ones((N, 3)))
  stacked = jax.device_put(stacked, NamedSharding(m, P("batch")))
  f = jax.jit(jax.shard_map(lambda p: getattr(jpack, op)(p, "batch"), mesh=m,
                            in_specs=P("batch"), out_specs=P("batch")))
  with pytest.raises(ValueError, match=r"Bucket 0 has shape \(1, 512\), but the layout "
                                       r"expects \(512,\)"):
    f(stacked)


def test_scatter_gather_refuses_a_bucket_that_does_not_split_evenly():
  tree = {"w": np.ones((N, 3), np.float32)}
  layout = jpack.plan({"w": np.ones(3, np.float32)}, align_bytes=4)  # 3 elements, 1 shard
  with pytest.raises(ValueError, match=r"Bucket 0 \(float32\) has 3 elements.*num_shards=8"):
    _trace(lambda t: reduce(t, "batch", mean=False, layout=layout,
                            method="scatter_gather"), tree)
  got = _trace(lambda t: jpack.psum(t, "batch", layout=layout), tree)  # auto: a psum
  np.testing.assert_array_equal(got["w"], np.full(3, N, np.float32))


def test_bools_and_keys_are_refused_by_reductions():
  with pytest.raises(TypeError, match=r"\['flag'\] is bool"):
    _trace(lambda t: jpack.psum(t, "batch"), {"flag": np.ones((N, 2), bool)})
  keys = jax.random.split(jax.random.key(0), N)
  with pytest.raises(TypeError, match=r"\['k'\] is a PRNG key"):
    jax.pmap(lambda k: jpack.psum({"k": k}, "batch"), axis_name="batch")(keys)


def test_bad_arguments():
  tree = {"w": np.ones((N, 3), np.float32)}
  with pytest.raises(ValueError, match="comm_dtype must be a floating"):
    _trace(lambda t: jpack.psum(t, "batch", comm_dtype=jnp.int32), tree)
  if not jax.config.jax_enable_x64:  # JAX would narrow it to float32 with a warning
    with pytest.raises(ValueError, match="comm_dtype=float64 needs 64-bit types"):
      _trace(lambda t: jpack.psum(t, "batch", comm_dtype=jnp.float64), tree)
  with pytest.raises(ValueError, match="method must be one of"):
    _trace(lambda t: reduce(t, "batch", mean=False, method="ring"), tree)
  with pytest.raises(ValueError, match=r"root must be an int in \[0, 8\)"):
    _trace(lambda t: jpack.broadcast(t, "batch", root=8), tree)
  with pytest.raises(ValueError, match="num_shards=8"):
    _trace(lambda t: jpack.reduce_scatter(
        t, "batch", layout=jpack.plan(t, num_shards=3, align_bytes=4)), tree)
  with pytest.raises(NameError, match="not bound"):
    jpack.psum({"w": jnp.ones(2)}, "batch")


@pytest.mark.parametrize("method", ["auto", "psum", "scatter_gather"])
def test_collectives_under_vmap_with_an_axis_name_equal_numpy(method, path):
  # vmap(axis_name=) has no varying/invariant types: the gathers fall back to all_gather.
  rng = np.random.default_rng(3)
  tree = per_device_tree(rng, [((3, 5), np.float32), ((7,), jnp.bfloat16), ((2,), np.int32)])
  tree["scalar"] = rng.normal(size=(N,)).astype(np.float32)
  floats = {k: v for k, v in tree.items() if k != "leaf2"}

  def run(fn, t):
    out = jax.jit(jax.vmap(fn, axis_name="batch"))(t)
    return jax.tree.map(lambda x: x[0], out)

  summed = run(lambda t: reduce(t, "batch", mean=False, allow_int=True, method=method), tree)
  for k, v in tree.items():
    exact = np.asarray(v, np.float64).sum(0)
    assert summed[k].dtype == v.dtype and summed[k].shape == exact.shape
    # method="psum" sums a bf16 bucket in bf16: up to N roundings of the partial sums.
    eps = 2**-8 if v.dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(summed[k], np.float64), exact, rtol=0,
                               atol=N * eps * np.abs(np.asarray(v, np.float64)).sum(0).max())
  mean = run(lambda t: reduce(t, "batch", mean=True, method=method), floats)
  assert_close(mean, {k: np.asarray(v, np.float64).mean(0).astype(v.dtype)
                      for k, v in floats.items()})
  wire = run(lambda t: reduce(t, "batch", mean=True, comm_dtype=jnp.bfloat16,
                              method=method), floats)
  for k, v in floats.items():
    # bf16 rounding of the inputs, and (method="psum": summed on a bf16 wire) of the
    # partial sums: within a bf16 ulp of the sum of magnitudes per rounding.
    x = np.asarray(v, np.float64)
    assert wire[k].dtype == v.dtype
    np.testing.assert_allclose(np.asarray(wire[k], np.float64), x.mean(0), rtol=0,
                               atol=2**-8 * np.abs(x).sum(0).max())
  gathered = run(lambda t: jpack.unpack(jpack.all_gather(jpack.reduce_scatter(
      t, "batch", mean=True), "batch")), floats)
  assert_close(gathered, mean)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("method", ["auto", "psum", "scatter_gather"])
def test_fp8_buckets_reduce_exactly_like_numpy(dtype, method, path):
  # JAX refuses to promote fp8 implicitly; the accumulator is the wider float.
  # Values in {0, 1}: every sum and mean over 8 devices is exact in these formats.
  rng = np.random.default_rng(11)
  tree = {"a": rng.integers(0, 2, size=(N, 24)).astype(dtype),
          "b": rng.integers(0, 2, size=(N, 3, 5)).astype(dtype)}
  for mean, ref in ((False, lambda v: v.sum(0)), (True, lambda v: v.mean(0))):
    got = run_shard_map(lambda t: reduce(t, "batch", mean=mean, method=method), tree)
    for k, v in tree.items():
      assert got[k].dtype == dtype
      np.testing.assert_array_equal(np.asarray(got[k], np.float64),
                                    ref(np.asarray(v, np.float64)))
  wire = run_shard_map(lambda t: reduce({"f": t["f"]}, "batch", mean=True,
                                        comm_dtype=dtype, method=method),
                       {"f": tree["a"].astype(np.float32)})
  np.testing.assert_array_equal(np.asarray(wire["f"], np.float64),
                                np.asarray(tree["a"], np.float64).mean(0))


@pytest.mark.parametrize("dtype,wire", [(np.float32, None), (np.float32, jnp.bfloat16),
                                        (jnp.bfloat16, None), (jnp.float16, None)])
def test_derivatives_through_collectives_equal_lax(dtype, wire, path):
  # 16-bit payloads travel as integer bits, through which no derivative flows: the
  # gradients came out zero. The tangent now takes the same reduction in floats.
  m = mesh()
  x = jax.device_put(np.random.default_rng(5).normal(size=(N, 16)).astype(dtype),
                     NamedSharding(m, P("batch")))
  mine = {
      "pmean": lambda v: jpack.pmean({"v": v}, "batch", comm_dtype=wire)["v"],
      "psum": lambda v: jpack.psum({"v": v}, "batch", comm_dtype=wire)["v"],
      "rs+ag": lambda v: jpack.unpack(jpack.all_gather(jpack.reduce_scatter(
          {"v": v}, "batch", mean=True, comm_dtype=wire), "batch"))["v"],
      "broadcast": lambda v: jpack.broadcast({"v": v}, "batch", root=3)["v"],
  }
  idx = lambda: jax.lax.axis_index("batch")
  ref = {"pmean": lambda v: jax.lax.pmean(v, "batch"),
         "psum": lambda v: jax.lax.psum(v, "batch"),
         "rs+ag": lambda v: jax.lax.pmean(v, "batch"),
         "broadcast": lambda v: jax.lax.psum(jnp.where(idx() == 3, v, 0), "batch")}
  for name in mine:
    def grads(f):
      def body(v):
        v = v[0]
        loss = lambda v: jnp.sum(jnp.sin(f(v).astype(jnp.float32)) * jnp.arange(16.0))
        g = jax.grad(loss)(v)
        _, t = jax.jvp(f, (v,), (jnp.ones_like(v),))
        return g[None], t[None]
      return jax.jit(jax.shard_map(body, mesh=m, in_specs=P("batch"),
                                   out_specs=P("batch")))(x)
    (g, t), (g_ref, t_ref) = grads(mine[name]), grads(ref[name])
    tol = 1e-6 if dtype == np.float32 and wire is None else 2e-2
    assert g.dtype == g_ref.dtype and np.abs(np.asarray(g_ref, np.float32)).max() > 0
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32),
                               rtol=tol, atol=tol, err_msg=name)
    np.testing.assert_allclose(np.asarray(t, np.float32), np.asarray(t_ref, np.float32),
                               rtol=tol, atol=tol, err_msg=name)


def test_vary_adds_only_missing_axes_and_is_a_no_op_under_vmap():
  m = jax.make_mesh((2, 4), ("x", "y"))
  a = np.arange(8.0, dtype=np.float32)

  def f(a):  # a varies over "x" already
    v = jpack.vary({"a": a}, ("x", "y"))
    return jpack.pmean(v, ("x", "y"))["a"]

  got = jax.jit(jax.shard_map(f, mesh=m, in_specs=P("x"), out_specs=P()))(
      jax.device_put(a, NamedSharding(m, P("x"))))
  np.testing.assert_allclose(got, a.reshape(2, 4).mean(0))
  x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
  got = jax.vmap(lambda t: jpack.pmean(jpack.vary(t, "b"), "b"), axis_name="b")({"a": x})
  np.testing.assert_allclose(got["a"], np.broadcast_to(x.mean(0), (2, 3)))
  with pytest.raises(NameError):
    jpack.vary({"a": jnp.ones(2)}, "nope")


def test_all_gather_checks_the_axis_and_options_name_the_function():
  m = jax.make_mesh((2, 4), ("x", "y"))
  tree = jax.device_put({"w": np.ones((8, 16), np.float32)}, NamedSharding(m, P(("x", "y"))))

  def gather_over_x_only(t):
    layout = jpack.plan(t, num_shards=8, align_bytes=4)
    return jpack.all_gather(jpack.reduce_scatter(t, ("x", "y"), layout=layout), "x")

  with pytest.raises(ValueError, match=r"all_gather over 'x' \(2 devices\): bucket 0"):
    jax.jit(jax.shard_map(gather_over_x_only, mesh=m, in_specs=P(("x", "y")),
                          out_specs=P())).trace(tree)
  with pytest.raises(TypeError, match=r"jpack.optax.allreduce: plan_options has unknown "
                                      r"key\(s\) \['bucket_size'\]"):
    jpack.optax.allreduce("batch", plan_options=dict(bucket_size=3))
  with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
    jpack.optax.flat(optax.sgd(0.1), plan_options=dict(bucket_bytes=0))


@pytest.mark.parametrize("dtype,wire", [(jnp.bfloat16, None), (np.float32, jnp.bfloat16)])
def test_narrow_wire_over_an_axis_wider_than_16_equals_numpy(dtype, wire):
  # Past 16 devices the narrow-wire reduce sums its chunks with one reduction, not
  # unrolled adds: a vmap axis of 32 reaches that branch on any machine.
  n = 32
  rng = np.random.default_rng(21)
  x = rng.normal(size=(n, 40)).astype(dtype)
  got = jax.jit(jax.vmap(lambda t: jpack.pmean(t, "i", comm_dtype=wire,
                                               layout=jpack.plan(t, num_shards=n)),
                         axis_name="i"))({"x": x})["x"]
  assert got.dtype == x.dtype
  wide = np.asarray(x, np.float64)
  want = wide.mean(0)
  # Values (and the f32 leaf's wire) rounded to bf16 once each way; the sum is in f32.
  tol = 2 * 2**-8 * np.abs(wide).max()
  for row in np.asarray(got, np.float64):
    np.testing.assert_allclose(row, want, rtol=0, atol=tol)


def _many_leaves(rng, n_small=300):
  """Many small leaves of repeated sizes in several buckets per dtype, zero-size leaves
  and two larger ones."""
  sizes = [(3,), (5, 2), (7,), (1,), (0,), (4, 4), ()]
  dtypes = [np.float32, jnp.bfloat16, np.int32, np.float16]
  specs = [(sizes[i % len(sizes)], dtypes[(i // 3) % len(dtypes)]) for i in range(n_small)]
  specs += [((64, 80), np.float32), ((40, 70), np.float32)]
  return per_device_tree(rng, specs)


@pytest.mark.parametrize("use_pmap,join", [(False, True), (True, True), (False, False)])
def test_trees_of_many_leaves_in_several_buckets_equal_per_leaf_references(
    use_pmap, join, monkeypatch, path):
  # A tree returned by a collective is sliced at offsets XLA cannot fold (one kernel per
  # leaf size): values must not depend on it. Small buckets: several per dtype, read
  # from one joined array per dtype (the default for small leaves) or one by one.
  if not join:
    monkeypatch.setattr(jpack._cpu, "JOIN_MAX_BYTES_PER_LEAF", 0)
  tree = _many_leaves(np.random.default_rng(21), n_small=64)
  floats = {k: v for k, v in tree.items() if not jnp.issubdtype(v.dtype, jnp.integer)}
  idx = lambda: jax.lax.axis_index("batch")
  opts = dict(bucket_bytes=256, align_bytes=16)

  def fn(t, f):
    lt, lf = jpack.plan(t, num_shards=N, **opts), jpack.plan(f, num_shards=N, **opts)
    mine = (jpack.psum(t, "batch", layout=lt), jpack.pmean(f, "batch", layout=lf),
            jpack.broadcast(t, "batch", root=5, layout=lt),
            reduce(f, "batch", mean=True, layout=lf, method="psum"))
    ref = (jax.tree.map(lambda x: jax.lax.psum(x, "batch"), t),
           jax.tree.map(lambda x: jax.lax.pmean(x, "batch"), f),
           jax.tree.map(lambda x: jax.lax.psum(jnp.where(idx() == 5, x, 0), "batch"), t),
           jax.tree.map(lambda x: jax.lax.pmean(x, "batch"), f))
    return mine, ref

  layout = jpack.plan(jax.tree.map(lambda x: x[0], tree), num_shards=N, **opts)
  assert len([b for b in layout.buckets if b.dtype == np.float32]) > 3
  both = (tree, floats)
  if use_pmap:
    got, want = run_pmap(lambda tf: fn(*tf), both)
  else:
    got, want = run_shard_map(lambda tf: fn(*tf), both)
  for g, w in zip(got, want):
    assert_close(g, w)
  for k in tree:  # broadcast is bit-exact
    assert bits(got[2][k]) == bits(tree[k][5]), k


@pytest.mark.parametrize("dtypes", [[np.float32], [np.int32, np.float32], [jnp.bfloat16]])
def test_trees_out_of_collectives_are_sliced_at_offsets_xla_cannot_fold(dtypes):
  # The mechanism behind the compile time (docs/performance.md): a folded offset would
  # show as a static slice, one kernel per leaf. The conds' predicate comes from the
  # first bucket (int32 here in one case: XLA folds x == x for integers).
  specs = [((6,), dtypes[i * len(dtypes) // 200]) for i in range(200)]
  tree = per_device_tree(np.random.default_rng(4), specs)
  m = mesh()
  body = lambda t: jpack.psum(jax.tree.map(lambda x: x[0], t), "batch")
  text = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("batch"), out_specs=P())).lower(
      jax.device_put(tree, NamedSharding(m, P("batch")))).compile().as_text()
  assert_sliced_at_unfoldable_offsets(text, 200, 6)


def test_trees_out_of_collectives_on_the_plain_path_are_sliced_statically():
  # The shared kernels hinge on lax.cond, whose predicate XLA:GPU reads back to the host
  # (outside command buffers): off CPU a collective's tree comes out of static slices.
  specs = [((6,), np.float32)] * 100 + [((3,), np.int32)] * 100
  tree = per_device_tree(np.random.default_rng(5), specs)
  m = mesh()
  body = lambda t: jpack.psum(jax.tree.map(lambda x: x[0], t), "batch")
  with on_path("plain"):
    compiled = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("batch"),
                                     out_specs=P())).lower(
        jax.device_put(tree, NamedSharding(m, P("batch")))).compile()
  assert "conditional(" not in compiled.as_text()
  got = compiled(jax.device_put(tree, NamedSharding(m, P("batch"))))
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
    assert g.dtype == x.dtype
    np.testing.assert_allclose(g, x.sum(0, dtype=x.dtype), rtol=1e-5, atol=1e-5)


def test_grad_through_a_collective_of_bf16_leaves_equals_lax(path):
  # Regression: the shared-kernel unpack took its tangents from the bit-exact split,
  # whose bitcasts JAX cannot transpose (KeyError: bitcast_convert_type under jax.grad).
  m = mesh()
  x = jax.device_put(np.random.default_rng(7).normal(size=(N, 12)).astype(np.float32),
                     NamedSharding(m, P("batch")))

  def grads(reduce):
    def body(v):
      tree = {"h": v[0, :6].astype(jnp.bfloat16), "k": (v[0, 6:] * 2).astype(jnp.bfloat16),
              "f": v[0, 3:9]}
      loss = lambda t: sum(jnp.sum(jnp.sin(y.astype(jnp.float32)) * (i + 1))
                           for i, y in enumerate(jax.tree.leaves(reduce(t))))
      return jax.tree.map(lambda g: g[None].astype(jnp.float32), jax.grad(loss)(tree))
    return jax.jit(jax.shard_map(body, mesh=m, in_specs=P("batch"), out_specs=P("batch")))(x)

  got = grads(lambda t: jpack.psum(t, "batch"))
  want = grads(lambda t: jax.tree.map(lambda y: jax.lax.psum(y, "batch"), t))
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-2, atol=2e-2, err_msg=k)


@pytest.mark.parametrize("op", ["pmean", "psum", "broadcast"])
def test_derivatives_through_a_many_leaf_tree_equal_lax(op, path):
  # Forward and reverse mode through the shared-kernel unpack (several leaves, an int
  # leaf with a float0 tangent), against the same per-leaf lax program.
  m = mesh()
  x = jax.device_put(np.random.default_rng(6).normal(size=(N, 12)).astype(np.float32),
                     NamedSharding(m, P("batch")))
  idx = lambda: jax.lax.axis_index("batch")
  floor_mean = lambda v: (jax.lax.pmean(v, "batch") if v.dtype == jnp.float32
                          else jax.lax.psum(v, "batch") // N)  # allow_int: the floor
  lax_op = {"pmean": floor_mean, "psum": lambda v: jax.lax.psum(v, "batch"),
            "broadcast": lambda v: jax.lax.psum(jnp.where(idx() == 3, v, 0), "batch")}[op]
  mine = {"pmean": lambda t: jpack.pmean(t, "batch", allow_int=True),
          "psum": lambda t: jpack.psum(t, "batch"),
          "broadcast": lambda t: jpack.broadcast(t, "batch", root=3)}[op]

  def tree_of(v):
    return {"a": v, "b": v[:5] * 3.0, "c": jnp.sin(v[2:9]).reshape(7, 1),
            "n": jnp.arange(4, dtype=jnp.int32) + idx()}

  def grads(f):
    def body(v):
      v = v[0]
      loss = lambda v: sum(jnp.sum(jnp.cos(y) * (i + 1)) for i, y in
                           enumerate(jax.tree.leaves(f(tree_of(v)))) if y.dtype != jnp.int32)
      g = jax.grad(loss)(v)
      out, t = jax.jvp(lambda v: f(tree_of(v)), (v,), (jnp.ones_like(v),))
      return g[None], jax.tree.map(lambda y: y[None], (out, t))
    return jax.jit(jax.shard_map(body, mesh=m, in_specs=P("batch"), out_specs=P("batch")))(x)

  (g, (out, t)), (g_ref, (out_ref, t_ref)) = grads(mine), grads(lambda t: jax.tree.map(lax_op, t))
  assert np.abs(np.asarray(g_ref)).max() > 0
  np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)
  for k in out_ref:
    assert t[k].dtype == t_ref[k].dtype, k
    np.testing.assert_allclose(np.asarray(out[k]), np.asarray(out_ref[k]), rtol=1e-5, atol=1e-6)
    if t_ref[k].dtype != jax.dtypes.float0:
      np.testing.assert_allclose(t[k], t_ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
