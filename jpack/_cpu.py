"""What jpack does differently on XLA:CPU, in one place.

jpack's plain path (one concatenate / split per bucket; ``psum``, ``psum_scatter`` and
``all_gather`` in the bucket's own dtype) is right on every backend, and it is what GPUs
and TPUs run. XLA:CPU is slow or inexact on a few of its steps, and this module holds
what jpack does there instead:

- 16- and 8-bit floats move as same-width unsigned integers through concatenate, split
  and narrow-wire reductions: XLA:CPU computes them in float32, which quiets NaN
  payloads in copies and sends f32 bytes in collectives.
- A bucket of many leaves is filled by one gather, which compiles faster than a
  concatenate of hundreds of operands.
- Trees returned by collectives are sliced at
  offsets XLA cannot fold, so slices of equal size share one compiled kernel instead of
  one kernel per leaf.
- Collectives reduce a bucket with ``psum_scatter`` + ``all_gather``: XLA:CPU
  merges plain all-reduces into one slow tuple all-reduce.
- Outside ``jit``, CPU buckets are unpacked as numpy views (nothing is compiled).
- ``jpack.data_parallel`` bounds the steps in flight on CPU devices: XLA:CPU's
  in-process collectives deadlock when too many executions are queued.

Inside a trace the choice is `jax.lax.platform_dependent` (`choose`): it is made when
the program is lowered, so a program exported for another platform
(``jax.export(..., platforms=("cuda",))``) holds only the plain path. Outside a trace it
is made from the platform of the arrays' devices, or of the mesh.
"""

from __future__ import annotations

import collections
import functools
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpack._internal import bits_dtype, is_key_dtype, leaf_from_flat, replicated

# -- choosing --------------------------------------------------------------------------


def choose(on_cpu: Callable[..., Any], elsewhere: Callable[..., Any], *args: Any) -> Any:
  """``on_cpu(*args)`` in a program lowered for CPU, ``elsewhere(*args)`` otherwise.

  Both are traced (their outputs must have equal types); only the chosen one is lowered.
  """
  return lax.platform_dependent(*args, cpu=on_cpu, default=elsewhere)


def on_cpu(arrays: tuple[Any, ...]) -> bool:
  """Every array lives on CPU devices (non-arrays count as the default backend's)."""
  for x in arrays:
    if isinstance(x, jax.Array):
      if any(d.platform != "cpu" for d in x.sharding.device_set):
        return False
    elif jax.default_backend() != "cpu":
      return False
  return True


# -- 16/8-bit floats as integer bits ---------------------------------------------------
#
# The custom JVPs keep both ops linear (their tangents are the plain ops, whose
# transposes are each other), so autodiff costs one pack / unpack as for other dtypes.


def moves_as_bits(dtype: Any) -> bool:
  """A float narrower than 32 bits, which XLA:CPU would compute in float32."""
  return jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4


@jax.custom_jvp
def concatenate_bits(pieces: tuple[Any, ...]) -> Any:
  """``lax.concatenate(pieces, 0)``, bit-exact for 16/8-bit floats."""
  dtype = pieces[0].dtype
  bits = lax.concatenate([lax.bitcast_convert_type(p, bits_dtype(dtype)) for p in pieces], 0)
  return lax.bitcast_convert_type(bits, dtype)


@concatenate_bits.defjvp
def _concatenate_bits_jvp(primals, tangents):
  (pieces,), (dpieces,) = primals, tangents
  return concatenate_bits(pieces), lax.concatenate(dpieces, 0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def split_bits(array: Any, sizes: tuple[int, ...]) -> list[Any]:
  """``lax.split(array, sizes)``, bit-exact for 16/8-bit floats."""
  bits = lax.split(lax.bitcast_convert_type(array, bits_dtype(array.dtype)), sizes)
  return [lax.bitcast_convert_type(b, array.dtype) for b in bits]


@split_bits.defjvp
def _split_bits_jvp(sizes, primals, tangents):
  (array,), (darray,) = primals, tangents
  return split_bits(array, sizes), lax.split(darray, sizes)


def moved_as_bits(move: Callable[[Any], Any], x: Any) -> Any:
  """``move(x)`` for a collective that only moves values (all-gather), sent as integer
  bits: XLA:CPU widens a 16-bit float collective to float32, twice the bytes."""

  @jax.custom_jvp
  def moved(x):
    return lax.bitcast_convert_type(move(lax.bitcast_convert_type(x, bits_dtype(x.dtype))),
                                    x.dtype)

  @moved.defjvp
  def _(primals, tangents):
    return moved(*primals), move(*tangents)

  return moved(x)


def split(array: Any, sizes: tuple[int, ...]) -> list[Any]:
  """``lax.split``, through integer bits where XLA:CPU would not be exact."""
  return split_bits(array, sizes) if moves_as_bits(array.dtype) else lax.split(array, sizes)


# -- filling a bucket ------------------------------------------------------------------

# A bucket of this many leaves or more is filled by one gather from the leaves laid end
# to end: XLA:CPU's compile time grows with the operands of a concatenate, while the run
# time stays the same. Not for 16/8-bit floats: inside one kernel LLVM folds bits ->
# concatenate -> gather -> bits back into a select computed in float32, which would
# change signalling NaNs and subnormals.
GATHER_MIN_LEAVES = 128


def fills_differently(num_leaves: int, dtype: Any) -> bool:
  """Whether `fill` differs from the plain concatenate for such a bucket."""
  return moves_as_bits(dtype) or num_leaves >= GATHER_MIN_LEAVES


def fill(flat: tuple[Any, ...], starts: tuple[int, ...], size: int, dtype: Any,
         concat: Callable[..., Any]) -> Any:
  """A bucket of ``size`` elements holding 1-D ``flat[i]`` at ``starts[i]``.

  ``concat(flat, concatenate=...)`` is the plain concatenate-with-gaps form; it is the
  tangent map of the gather, so reverse mode still costs one split.
  """
  if moves_as_bits(dtype):
    return concat(flat, concatenate=concatenate_bits)
  if len(flat) < GATHER_MIN_LEAVES:
    return concat(flat)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return _gather(flat, starts, size, dtype)

  @jax.custom_jvp
  def gather(flat):
    return _gather(flat, starts, size, dtype)

  @gather.defjvp
  def gather_jvp(primals, tangents):
    (flat,), (dflat,) = primals, tangents
    return gather(flat), concat(dflat)

  return gather(flat)


def _gather(flat, starts, size, dtype):
  """The bucket gathered from ``[leaves end to end, 0]``; gaps read the final zero."""
  compact = lax.concatenate([x for x in flat if x.shape[0]] + [jnp.zeros((1,), dtype)], 0)
  index = np.full((size,), compact.shape[0] - 1, np.int32)
  pos = 0
  for leaf, start in zip(flat, starts):
    n = leaf.shape[0]
    index[start:start + n] = np.arange(pos, pos + n, dtype=np.int32)
    pos += n
  return compact.at[index].get(mode="promise_in_bounds")


# -- slicing with shared kernels -------------------------------------------------------

# A dtype's buckets are read from one joined array, so that a slice kernel serves equal
# sizes in every bucket, when its leaves average at most this many bytes: the join is one
# more copy of the bytes per call, which pays off in compile time only for small leaves.
JOIN_MAX_BYTES_PER_LEAF = 16 << 10
# Outputs per `lax.cond`: the SPMD partitioner's time grows with the square of one
# cond's outputs.
_COND_OUTPUTS = 64


def shared_slices(layout: Any, buckets: tuple[Any, ...], exact: Callable[..., Any],
                  linear: Callable[..., Any]) -> Any:
  """The tree of ``layout``'s leaves, sliced so that equal sizes share one kernel.

  XLA:CPU compiles a kernel per slice with its offset built in, and reuses a kernel only
  for identical fusions: a static unpack of 1000 leaves costs 1000 kernels. Here each
  offset comes out of a `lax.cond` whose two branches return the same constants (right
  whatever the predicate, and XLA cannot fold it), and a dtype's buckets of small leaves
  are first joined into one array, so one kernel serves every leaf of its size.
  ``exact(buckets)`` is the static, bit-exact unpack, for trees with nothing to share;
  ``linear(buckets)`` the static unpack in linear primitives, which derivatives take
  (its transpose is one pack).
  """
  if (sum(1 for s in layout.slots if s.size) < 2
      or max(b.size for b in layout.buckets) * len(layout.buckets) >= 2**31):
    return exact(buckets)  # nothing to share; or offsets past int32

  @jax.custom_jvp
  def sliced(buckets):
    return _slice_shared(layout, buckets)

  @sliced.defjvp
  def sliced_jvp(primals, tangents):
    (buckets,), (dbuckets,) = primals, tangents
    # Tangents of integer buckets are float0: slice zeros in their place, then give
    # non-float leaves float0 tangents again.
    dbuckets = tuple(d if jnp.issubdtype(b.dtype, jnp.inexact) else jnp.zeros_like(b)
                     for b, d in zip(buckets, dbuckets))
    dleaves = jax.tree.leaves(linear(dbuckets))
    dleaves = [d if not is_key_dtype(s.dtype) and jnp.issubdtype(s.dtype, jnp.inexact)
               else np.zeros(s.shape, jax.dtypes.float0)
               for d, s in zip(dleaves, layout.slots)]
    return sliced(buckets), jax.tree.unflatten(layout.treedef, dleaves)

  return sliced(tuple(buckets))


def _slice_shared(layout: Any, buckets: tuple[Any, ...]) -> Any:
  arrays = []
  for x in buckets:
    x = replicated(x)
    arrays.append(lax.bitcast_convert_type(x, bits_dtype(x.dtype))
                  if moves_as_bits(x.dtype) else x)
  pred, sources, where = _sources(layout, arrays)
  leaves: list[Any] = [None] * layout.num_leaves
  sized = [j for j, s in enumerate(layout.slots) if s.size]
  how_many = collections.Counter(layout.slots[j].size for j in sized)
  for c in range(0, len(sized), _COND_OUTPUTS):
    chunk = sized[c:c + _COND_OUTPUTS]
    *starts, zero = _unfoldable(
        [where[layout.slots[j].bucket][1] + layout.slots[j].offset for j in chunk] + [0], pred)
    for j, start in zip(chunk, starts):
      leaves[j] = lax.dynamic_slice_in_dim(sources[where[layout.slots[j].bucket][0]], start,
                                           layout.slots[j].size, allow_negative_indices=False)
    # The next chunk's offsets wait for one of these slices, so that each chunk's offsets
    # live only while its slices run: XLA's buffer assignment tries every scalar live
    # across the whole program against every output buffer. The link is a leaf of the
    # commonest size, read at an unfoldable 0, so one kernel serves every link.
    link = max(chunk, key=lambda j: (how_many[layout.slots[j].size], j))
    pred = _unevaluable(lax.dynamic_slice_in_dim(leaves[link], zero, 1,
                                                 allow_negative_indices=False))
  for j, (slot, part) in enumerate(zip(layout.slots, leaves)):
    if part is None:
      part = lax.slice_in_dim(arrays[slot.bucket], 0, 0)
    if part.dtype != buckets[slot.bucket].dtype:
      part = lax.bitcast_convert_type(part, buckets[slot.bucket].dtype)
    leaves[j] = leaf_from_flat(part, slot)
  return jax.tree.unflatten(layout.treedef, leaves)


def _sources(layout, arrays):
  """The arrays slices are read from: each dtype's small-leaf buckets joined into one.

  Returns an unevaluable predicate, the sources, and for each bucket the index of its
  source and its offset there.
  """
  groups: dict[Any, list[int]] = {}
  for i, (bucket, x) in enumerate(zip(layout.buckets, arrays)):
    if bucket.size:
      groups.setdefault(x.dtype, []).append(i)
  pred = _unevaluable(arrays[next(iter(groups.values()))[0]][:1])
  sources, where = [], {}
  for dtype, members in groups.items():
    total = sum(layout.buckets[i].size for i in members) * np.dtype(dtype).itemsize
    count = sum(len(layout.buckets[i].slots) for i in members)
    join = total <= JOIN_MAX_BYTES_PER_LEAF * count
    for part in [members] if join else [[i] for i in members]:
      start = 0
      for i in part:
        where[i] = (len(sources), start)
        start += layout.buckets[i].size
      sources.append(arrays[part[0]] if len(part) == 1 else
                     _joined(tuple(arrays[i] for i in part), pred))
  return pred, sources, where


def _unevaluable(x: Any) -> Any:
  """A bool scalar XLA cannot evaluate at compile time, from a one-element array. Its
  value never matters (both branches of every cond it drives agree); ``x == x`` would do
  for floats, but XLA folds it to true for integers."""
  return lax.reshape(lax.ne(x, lax.full_like(x, 0)), ())


def _joined(arrays: tuple[Any, ...], pred: Any) -> Any:
  """One concatenate inside a `lax.cond` on ``pred``, so that XLA cannot fuse it into
  every slice kernel (an optimization barrier does not stop that on XLA:CPU)."""
  cat = lambda xs: lax.concatenate(xs, 0)
  return lax.cond(pred, cat, cat, arrays)


def _unfoldable(values: list[int], pred: Any) -> list[Any]:
  """int32 scalars equal to ``values`` that XLA cannot constant-fold: outputs of one
  `lax.cond` on ``pred`` whose two branches return the same values."""
  values = tuple(np.int32(v) for v in values)
  return list(lax.cond(pred, lambda: values, lambda: values))


# -- unpacking outside jit -------------------------------------------------------------

# An unpack compiled for one eager call is compile-bound: XLA:CPU compiles a kernel per
# returned slice, and its older loop emitters do that several times faster than the
# default fusion emitters. Inside a user's jit the user's compiler options apply.
COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


def readable_on_host(arrays: tuple[Any, ...]) -> bool:
  """CPU arrays whose every local device holds the whole value: numpy can view them."""
  return on_cpu(arrays) and all(
      isinstance(x, jax.Array) and x.is_fully_addressable and x.sharding.is_fully_replicated
      for x in arrays)


def unpack_on_host(layout: Any, buckets: tuple[jax.Array, ...]) -> Any:
  """The tree, as numpy views of CPU buckets placed back on the buckets' devices.

  A CPU device's memory is host memory: no copy on one device, and nothing to compile
  (compiling the same slices costs XLA:CPU a kernel per leaf). JAX never donates a
  buffer that a view still references.
  """
  hosts = [np.asarray(b) for b in buckets]
  views = []
  for slot in layout.slots:
    view = hosts[slot.bucket][slot.offset:slot.offset + slot.size]
    key_shape = tuple(slot.dtype._impl.key_shape) if is_key_dtype(slot.dtype) else ()
    views.append(view.reshape(slot.shape + key_shape))
  # Like a jit's outputs, leaves of uncommitted buckets stay uncommitted.
  committed = [b.committed for b in buckets]
  pinned = [j for j, slot in enumerate(layout.slots) if committed[slot.bucket]]
  free = [j for j, slot in enumerate(layout.slots) if not committed[slot.bucket]]
  shardings = [_whole(b.sharding) for b in buckets]
  placed = jax.device_put([views[j] for j in pinned],
                          [shardings[layout.slots[j].bucket] for j in pinned])
  leaves: list[Any] = [None] * layout.num_leaves
  # jnp.asarray costs half the Python overhead per array of device_put.
  for j, x in zip(pinned + free, placed + [jnp.asarray(views[j]) for j in free]):
    slot = layout.slots[j]
    leaves[j] = (jax.random.wrap_key_data(x, impl=slot.dtype._impl.name)
                 if is_key_dtype(slot.dtype) else x)
  return jax.tree.unflatten(layout.treedef, leaves)


def _whole(sharding: Any) -> Any:
  """A bucket's sharding for a leaf of any rank: a replicated bucket on a mesh has spec
  ``P(None,)``, which a 0-d leaf cannot take; ``P()`` says the same for every rank."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.P(), memory_kind=sharding.memory_kind)
  return sharding


# -- collectives -----------------------------------------------------------------------


def reduce_narrow(x: Any, axis_name: Any, n: int, *, mean: bool, wire: np.dtype,
                  accumulate: np.dtype, gather: bool,
                  all_gather: Callable[..., Any]) -> Any:
  """Reduce-scatter (+ all-gather) of a floating bucket over a wire narrower than 32 bits.

  XLA:CPU widens 16-bit float collectives to f32, so a bf16 ``psum_scatter`` sends as
  many bytes as an f32 one. Here the wire values travel as same-width unsigned integers:
  an ``all_to_all`` hands each device the n copies of its chunk, the device sums them in
  ``accumulate``, and, if gathering, the result travels back rounded once to the wire
  dtype (``all_gather(x, axis_name, axis=0, tiled=True)``). Same bytes as a ring
  reduce-scatter. Differentiable: the tangent takes the same reduction in linear
  primitives.
  """

  @jax.custom_jvp
  def reduce(x):
    return _reduce_narrow(x, axis_name, n, mean, wire, accumulate, gather, all_gather)

  @reduce.defjvp
  def reduce_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    dy = lax.psum_scatter(t.astype(wire).astype(accumulate), axis_name, scatter_dimension=0,
                          tiled=True)
    dy = (dy / n if mean else dy).astype(x.dtype)
    return reduce(x), (all_gather(dy, axis_name, axis=0, tiled=True) if gather else dy)

  return reduce(x)


def _reduce_narrow(x, axis_name, n, mean, wire, accumulate, gather, all_gather):
  dtype = x.dtype
  bits = bits_dtype(wire)
  chunks = lax.bitcast_convert_type(x.astype(wire), bits).reshape(n, -1)
  chunks = lax.all_to_all(chunks, axis_name, 0, 0, tiled=False)
  chunks = lax.bitcast_convert_type(chunks, wire).astype(accumulate)
  if n <= 16:  # unrolled adds fuse into one loop; XLA:CPU's reduce over axis 0 is slower
    y = chunks[0]
    for j in range(1, n):
      y = y + chunks[j]
  else:
    y = jnp.sum(chunks, axis=0)
  if mean:
    y = y / n
  if not gather:
    return y.astype(dtype)
  y = all_gather(lax.bitcast_convert_type(y.astype(wire), bits), axis_name, axis=0,
                 tiled=True)
  return lax.bitcast_convert_type(y, wire).astype(dtype)


# -- training loop ---------------------------------------------------------------------

# XLA:CPU's in-process collectives deadlock when too many executions are queued (a loop
# of ~40 un-synchronised steps with a psum aborted, "Expected 8 threads to join the
# rendezvous"). `bound_in_flight` waits for the step this many back; with several steps
# still queued, the devices never idle for it.
MAX_IN_FLIGHT = 4


def bound_in_flight(devices: list[Any]) -> Callable[[Any], Any]:
  """``bounded(loss)``: on several CPU devices, waits for the loss of the step
  `MAX_IN_FLIGHT` calls back; elsewhere does nothing."""
  if len(devices) < 2 or any(d.platform != "cpu" for d in devices):
    return lambda loss: None
  queued: collections.deque = collections.deque()

  def bounded(loss):
    if isinstance(loss, jax.core.Tracer):  # step traced by an outer jit: nothing runs yet
      return
    queued.append(loss)
    if len(queued) > MAX_IN_FLIGHT:
      queued.popleft().block_until_ready()

  return bounded


# -- the data-parallel step's defaults on GPUs -------------------------------------------

# XLA:GPU's all-reduce combiner merges jpack's all-reduces into one grouped NCCL call on
# a tuple of buckets; its all-reduce-contiguous pass would concatenate that tuple into
# one buffer and slice it back (two copies of the gradient), so that pass is off. Groups
# of 8 MiB keep only a few buckets alive at once. The reduce-scatter combiner stays off:
# merged reduce-scatters wait for most of the backward pass, with nothing to overlap
# them (docs/gpu.md).
GPU_STEP_COMPILER_OPTIONS = {"xla_gpu_all_reduce_combine_threshold_bytes": 8 << 20,
                             "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
                             "xla_disable_hlo_passes": "all-reduce-contiguous"}
# On GPUs a bucket only needs vector-load alignment; 256 bytes would pad a big leaf's own
# bucket past the leaf (GPT-2's 50257 x 768 embedding) and turn reading it back, a
# bitcast, into a copy.
GPU_ALIGN_BYTES = 16
# XLA:GPU's matmul and convolution kernels do not read an operand out of a bigger buffer:
# a weight sliced from a shared bucket is copied for the forward pass every step. In a
# bucket of its own, reading it back is a bitcast. (Vectors, read by elementwise
# kernels, share buckets: their slices fuse into the kernels that read them.)
GPU_SOLO_NDIM = 2


# ZeRO-3 gathers each bucket where the loss reads it; merged, the gathers would bring in
# many buckets at once, ahead of their layers. With one collective in flight at a time
# (XLA's default), the backward pass's gathers take its compute; two in flight let a
# gather and a reduce-scatter overlap it together. On two mesh axes the slices are
# all-reduced across nodes at the end of the backward pass, in groups large enough that
# their buffers fit into one node's temp (docs/gpu.md).
FSDP_IN_FLIGHT = 2
GPU_FSDP_COMPILER_OPTIONS = {"xla_gpu_all_gather_combine_threshold_bytes": 0,
                             "xla_gpu_experimental_parallel_collective_overlap_limit":
                                 FSDP_IN_FLIGHT,
                             "xla_gpu_all_reduce_combine_threshold_bytes": 64 << 20}


def step_defaults(devices: Any, n: int, slices: int, fsdp: bool = False
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
  """``(plan options, compiler options)`` of `jpack.data_parallel`'s step on ``devices``
  (``n`` of them on the data axes, ZeRO state cut in ``slices``; 1 without ZeRO).

  On CPU devices (and TPUs): buckets padded to a multiple of ``n`` (CPU reduces them by
  reduce-scatter + all-gather), XLA's own compiler options. On GPUs: buckets padded for
  ZeRO's equal slices only, offsets aligned to `GPU_ALIGN_BYTES`, every matrix (and
  higher-rank leaf) in a bucket of its own (`GPU_SOLO_NDIM`), and XLA's
  all-reduce combiner at 8 MiB without its concatenation, and the reduce-scatter
  combiner off (`GPU_STEP_COMPILER_OPTIONS`). A user's plan options win.
  """
  if any(d.platform != "gpu" for d in devices):
    return {"num_shards": n}, {}
  options = {**GPU_STEP_COMPILER_OPTIONS, **(GPU_FSDP_COMPILER_OPTIONS if fsdp else {})}
  # The step's option replaces XLA_FLAGS' list of disabled passes: keep the user's.
  user = re.findall(r"--xla_disable_hlo_passes=(\S+)", os.environ.get("XLA_FLAGS", ""))
  if user:
    options["xla_disable_hlo_passes"] = ",".join([*user, options["xla_disable_hlo_passes"]])
  return ({"num_shards": slices, "align_bytes": GPU_ALIGN_BYTES,
           "solo_ndim": GPU_SOLO_NDIM}, options)
