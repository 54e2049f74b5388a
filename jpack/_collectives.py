"""Collectives on packed buckets: one collective per bucket instead of one per leaf.

All functions run inside `jax.shard_map` (or `jax.pmap`, or `jax.vmap` with an
``axis_name``) over a named axis. Each
accepts a tree (packed here, unpacked on return) or a `Packed` (used as is, returned
packed), so persistent packed training pays no packing at all.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpack._internal import bits_dtype, dtype_name, is_key_dtype
from jpack._layout import Layout, plan
from jpack import _cpu as cpu
from jpack._pack import Packed, buckets_repr, check_buckets, pack, unpack_shared

AxisName = Any

def _all_gather(x: Any, axis_name: AxisName, **kwargs: Any) -> Any:
  """An all-gather whose result is typed invariant over the axis (every device holds the
  same buffer), so shard_map accepts ``out_specs=P()`` for it; a plain all_gather where
  the value is not varying (``jax.vmap(axis_name=)`` has no varying/invariant types)."""
  if is_varying(x, axis_name):
    return lax.all_gather(x, axis_name, to="invarying", **kwargs)
  return lax.all_gather(x, axis_name, **kwargs)


def is_varying(x: Any, axis_name: AxisName) -> bool:
  """``x`` is typed as varying over every axis in ``axis_name``."""
  return not _not_varying(x, axis_name)


def _not_varying(x: Any, axis_name: AxisName) -> tuple[Any, ...]:
  """The axes of ``axis_name`` that ``x`` is not typed as varying over (jax >= 0.10 keeps
  the varying axes in ``manual_axis_type.varying``, earlier versions in ``vma``)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  varying = mat.varying if mat is not None else getattr(aval, "vma", frozenset())
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  return tuple(name for name in names if name not in varying)


METHODS = ("auto", "psum", "scatter_gather")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Shards:
  """This device's equal slice of every bucket of a `Packed` (ZeRO-style sharding).

  Attributes:
    buckets: tuple of 1-D arrays, bucket ``i`` of length ``layout.buckets[i].size // n``.
    layout: the `Layout` of the full, unsharded buckets.
  """

  buckets: tuple[Any, ...]
  layout: Layout = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    if not isinstance(self.layout, Layout):
      raise TypeError(f"Shards(buckets, layout) needs a jpack.Layout as its second "
                      f"argument, got {type(self.layout).__name__}.")
    object.__setattr__(self, "buckets", tuple(self.buckets))

  def __repr__(self) -> str:
    return buckets_repr(self)


# -- reductions ------------------------------------------------------------------------


def psum(tree: Any, axis_name: AxisName, *, comm_dtype: Any = None,
         layout: Layout | None = None) -> Any:
  """Sum ``tree`` over ``axis_name``, one collective per bucket.

  Equal to ``jax.tree.map(lambda x: jax.lax.psum(x, axis_name), tree)``: exactly for
  integer leaves (summed in their own dtype), to float rounding for floating leaves.

  Args:
    tree: a pytree of arrays, or a `Packed` (then nothing is packed and a `Packed` is
      returned).
    axis_name: the mesh / pmap axis to reduce over.
    comm_dtype: wire dtype of real floating buckets, e.g. ``jnp.float32`` to
      accumulate bf16 gradients in f32, or ``jnp.bfloat16`` to halve the bytes sent for
      f32 gradients. The bucket is cast to the wire dtype, reduced in it, and cast back
      (a mean is divided in the wider of the two). On CPU a reduce-scattered bucket
      whose wire is narrower than it or than 32 bits travels as same-width integers
      through ``all_to_all`` + ``all_gather`` instead, and each device sums in f32:
      XLA:CPU would widen a 16-bit collective to f32 bytes. Results come back in each
      leaf's own dtype. Integer and complex buckets are always sent in their own dtype.
    layout: the `Layout` to pack with (`jpack.plan` with its options); planned from
      ``tree`` with ``num_shards`` set to the axis size if omitted.

  Returns:
    The summed tree (or `Packed`), same structure and dtypes as ``tree``.

  Raises:
    TypeError: a leaf is a bool or a PRNG key (neither can be summed; cast bools to an
      integer dtype first).

  Examples:
    >>> import jax, jax.numpy as jnp, jpack
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> n = jax.device_count()
    >>> mesh = jax.make_mesh((n,), ("batch",))
    >>> tree = {"w": jnp.ones((n, 3)), "count": jnp.ones(n, jnp.int32)}
    >>> tree = jax.device_put(tree, NamedSharding(mesh, P("batch")))  # one row per device
    >>> f = jax.shard_map(lambda t: jpack.psum(t, "batch"), mesh=mesh,
    ...                   in_specs=P("batch"), out_specs=P())
    >>> out = f(tree)    # every device gets the sum of the rows
    >>> int(out["count"][0]) == n, out["w"].shape, out["count"].dtype
    (True, (1, 3), dtype('int32'))
  """
  return reduce(tree, axis_name, mean=False, comm_dtype=comm_dtype, layout=layout,
                allow_int=True)


def pmean(tree: Any, axis_name: AxisName, *, comm_dtype: Any = None,
          layout: Layout | None = None, allow_int: bool = False) -> Any:
  """Average ``tree`` over ``axis_name``, one collective per bucket.

  Equal to per-leaf ``jax.lax.pmean`` for floating leaves, to float rounding. The sum
  is divided in the dtype it was accumulated in (see ``comm_dtype`` in `jpack.psum`:
  the wider of the leaf dtype and ``comm_dtype``, at least f32 on CPU's integer-bits
  path), then cast back to the leaf dtype.

  Args:
    tree: as in `jpack.psum`.
    axis_name: as in `jpack.psum`.
    comm_dtype: as in `jpack.psum`.
    layout: as in `jpack.psum`.
    allow_int: integer leaves have no exact mean in their own dtype, so they are refused
      unless this is True; then each leaf gets the floor of the exact mean, in its own
      dtype, with no overflow over the whole dtype range (values equal on every device,
      like step counters, come back unchanged; it costs a second, uint32 collective per
      integer bucket). Exact over axes of up to 65536 devices, or any size with
      ``jax_enable_x64`` on (the second collective is then int64 beyond 65536).
      ``jax.lax.pmean`` would instead return float32.

  Returns:
    The averaged tree (or `Packed`), same structure and dtypes as ``tree``.

  Raises:
    TypeError: an integer leaf without ``allow_int=True``, a bool leaf, or a PRNG key.
    ValueError: ``allow_int=True`` with integer leaves over an axis of more than 65536
      devices while 64-bit types are off.
  """
  return reduce(tree, axis_name, mean=True, comm_dtype=comm_dtype, layout=layout,
                allow_int=allow_int)


def reduce(tree: Any, axis_name: AxisName, *, mean: bool, comm_dtype: Any = None,
           layout: Layout | None = None, allow_int: bool = False,
           method: str = "auto") -> Any:
  """`psum` or `pmean`, with the collective per bucket chosen by ``method``:
  ``"psum"`` (one ``lax.psum``), ``"scatter_gather"`` (``psum_scatter`` + ``all_gather``),
  or ``"auto"``, the platform's choice: on CPU scatter_gather where a bucket splits
  evenly over the axis (XLA:CPU merges plain all-reduces into one slow tuple
  all-reduce), psum elsewhere and on other backends."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
  comm_dtype = _check_comm_dtype(comm_dtype)
  n = axis_size(axis_name)
  op = "pmean" if mean else "psum"
  packed, was_packed = _to_packed(tree, layout, num_shards=n)
  _check_reducible(packed.layout, mean=mean, allow_int=allow_int, op=op)
  for i, bucket in enumerate(packed.layout.buckets):
    if method == "scatter_gather" and bucket.size % n:
      raise ValueError(f"Bucket {i} ({bucket.dtype}) has {bucket.size} elements, which do "
                       f"not split evenly over {n} devices (method='scatter_gather'); plan "
                       f"with num_shards={n} or use method='psum'.")
  scatter = [method == "scatter_gather" or (method == "auto" and b.size % n == 0)
             for b in packed.layout.buckets]
  plain = [method == "scatter_gather"] * len(scatter)
  out = _reduce_buckets(packed.buckets, axis_name, n, scatter_on_cpu=scatter,
                        scatter_elsewhere=plain, mean=mean, comm_dtype=comm_dtype,
                        gather=True)
  result = Packed(out, packed.layout)
  return result if was_packed else _unpacked(result)


def _reduce_buckets(buckets, axis_name, n, *, scatter_on_cpu, scatter_elsewhere, mean,
                    comm_dtype, gather):
  """Each bucket reduced (psum, or psum_scatter + all_gather where ``scatter_*``), the
  XLA:CPU way in programs lowered for CPU (see `cpu.reduce_narrow` and `reduce`)."""
  def plain(buckets):
    return tuple(_reduce_bucket(x, axis_name, n, mean=mean, comm_dtype=comm_dtype,
                                scatter=s, gather=gather)
                 for x, s in zip(buckets, scatter_elsewhere))

  def on_cpu(buckets):
    return tuple(_reduce_bucket(x, axis_name, n, mean=mean, comm_dtype=comm_dtype,
                                scatter=s, gather=gather, narrow=_narrow(x, comm_dtype, s))
                 for x, s in zip(buckets, scatter_on_cpu))

  differs = scatter_on_cpu != scatter_elsewhere or any(
      _narrow(x, comm_dtype, s) for x, s in zip(buckets, scatter_on_cpu))
  return cpu.choose(on_cpu, plain, tuple(buckets)) if differs else plain(buckets)


def _narrow(x, comm_dtype, scatter):
  """A scattered floating bucket whose wire is narrower than it or than 32 bits."""
  if not (scatter and x.size and jnp.issubdtype(x.dtype, jnp.floating)):
    return False
  wire = np.dtype(comm_dtype if comm_dtype is not None else x.dtype)
  return wire.itemsize < max(np.dtype(x.dtype).itemsize, 4)


def _reduce_bucket(x, axis_name, n, *, mean, comm_dtype, scatter, gather, narrow=False):
  """Reduce one bucket: psum, or psum_scatter (+ all_gather unless ``gather=False``)."""
  dtype = x.dtype
  if x.size == 0:  # only zero-size leaves: XLA refuses to scatter an empty array
    return lax.psum(x, axis_name) if gather else jnp.zeros((0,), dtype)
  # Complex buckets keep their dtype: a real wire dtype would drop the imaginary part.
  floating = jnp.issubdtype(dtype, jnp.floating)
  wire = comm_dtype if (floating and comm_dtype is not None) else dtype
  if narrow:
    return cpu.reduce_narrow(x, axis_name, n, mean=mean, wire=np.dtype(wire),
                             accumulate=_wider(dtype, jnp.float32), gather=gather,
                             all_gather=_all_gather)

  def reduce(v):
    if scatter:
      return lax.psum_scatter(v, axis_name, scatter_dimension=0, tiled=True)
    return lax.psum(v, axis_name)

  if mean and not jnp.issubdtype(dtype, jnp.inexact):
    y = _floor_mean(x, n, reduce)
  else:
    y = reduce(x.astype(wire))
    if mean:
      wide = _wider(dtype, wire)
      y = (y.astype(wide) / n).astype(dtype)
  y = y.astype(dtype)
  if scatter and gather:
    y = _all_gather(y, axis_name, axis=0, tiled=True)
  return y


def _wider(a: Any, b: Any) -> np.dtype:
  """The dtype to accumulate two floating dtypes in: their promotion, or, for fp8 types
  (which JAX refuses to promote implicitly), the wider of the two."""
  try:
    return np.dtype(jnp.promote_types(a, b))
  except jax.dtypes.TypePromotionError:
    return np.dtype(a) if np.dtype(a).itemsize >= np.dtype(b).itemsize else np.dtype(b)


def _floor_mean(x, n, reduce):
  """floor(sum / n) of integers, exact over the whole dtype range.

  Summing first overflows (eight int8 100s sum to 800); with x = n*q + r, 0 <= r < n,
  the mean is sum(q) + floor(sum(r) / n): sum(q) is within a rounding of the result
  (and modular arithmetic undoes any wrap), and sum(r) <= n*(n-1) is summed in uint32
  (exact up to 65536 devices; int32 wrapped from 46342 on), or in int64 when 64-bit
  types are on. When n itself does not fit in x's dtype (8 devices and int4, 200 and
  int8), the split is made in int32, and the mean, which fits x's dtype, is cast back.
  """
  if n > jnp.iinfo(x.dtype).max:
    return _floor_mean(x.astype(jnp.int32), n, reduce).astype(x.dtype)
  if n <= 2**16:
    remainders = jnp.uint32
  elif jax.config.jax_enable_x64:
    remainders = jnp.int64
  else:
    raise ValueError(f"An integer mean over an axis of {n} devices sums remainders up to "
                     f"{n}*{n - 1}, past 32 bits (exact up to 65536 devices). Enable 64-bit "
                     "types (jax.config.update('jax_enable_x64', True)), or psum the "
                     "integers and divide them yourself.")
  q = x // n
  r = (x - q * n).astype(remainders)
  return reduce(q) + (reduce(r) // n).astype(x.dtype)


# -- broadcast -------------------------------------------------------------------------


def broadcast(tree: Any, axis_name: AxisName, *, root: int = 0,
              layout: Layout | None = None) -> Any:
  """Give every device ``root``'s values of ``tree`` (e.g. the initial parameters).

  Bit-exact for every dtype (floats, and the real and imaginary parts of complex
  numbers, travel as same-width unsigned integers, so ``-0.0`` and NaN payloads
  survive), including bools and PRNG keys.

  Args:
    tree: a pytree of arrays, or a `Packed`.
    axis_name: the mesh / pmap axis.
    root: index along ``axis_name`` of the device whose values win.
    layout: as in `jpack.psum`, but planned from ``tree`` with ``num_shards=1`` if omitted.

  Returns:
    ``tree`` as it is on ``root``, on every device.
  """
  n = axis_size(axis_name)
  if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < n:
    raise ValueError(f"root must be an int in [0, {n}) for axis {axis_name!r}, got {root!r}.")
  packed, was_packed = _to_packed(tree, layout, num_shards=1)
  send = lambda bits: _root_only_sum(bits, axis_name, root)
  send_float = lambda x: _send_bits(x, axis_name, root)
  out = []
  for x in packed.buckets:
    if x.dtype == jnp.bool_:
      out.append(send(x.astype(jnp.uint8)).astype(jnp.bool_))
    elif jnp.issubdtype(x.dtype, jnp.complexfloating):
      out.append(lax.complex(send_float(jnp.real(x)), send_float(jnp.imag(x))))
    elif jnp.issubdtype(x.dtype, jnp.floating):
      out.append(send_float(x))
    else:
      out.append(send(x))
  result = Packed(tuple(out), packed.layout)
  return result if was_packed else _unpacked(result)


def _root_only_sum(x, axis_name, root):
  """A sum in which only ``root`` contributes: root's values on every device."""
  is_root = lax.axis_index(axis_name) == root
  return lax.psum(jnp.where(is_root, x, jnp.zeros_like(x)), axis_name)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _send_bits(x, axis_name, root):
  """root's floats on every device, bit-exact (as integers, so -0.0 and NaN payloads
  survive); differentiable like the float sum it stands for."""
  bits = lax.bitcast_convert_type(x, bits_dtype(x.dtype))
  return lax.bitcast_convert_type(_root_only_sum(bits, axis_name, root), x.dtype)


@_send_bits.defjvp
def _send_bits_jvp(axis_name, root, primals, tangents):
  (x,), (t,) = primals, tangents
  return _send_bits(x, axis_name, root), _root_only_sum(t, axis_name, root)


# -- reduce-scatter / all-gather -------------------------------------------------------


def shard(packed: Packed, axis_name: AxisName) -> Shards:
  """This device's slice of each bucket, without communication.

  Args:
    packed: a `Packed` whose layout was planned with ``num_shards`` a multiple of the
      axis size.
    axis_name: the mesh / pmap axis the buckets are split over.

  Returns:
    `Shards`: bucket ``i`` sliced to ``[k * size / n, (k + 1) * size / n)`` on device k.

  Raises:
    TypeError: ``packed`` is not a `Packed` (pack the tree first, with ``num_shards``).
  """
  if not isinstance(packed, Packed):
    raise TypeError(f"shard() expects a jpack.Packed, got {type(packed).__name__}; pack "
                    "the tree first: jpack.pack(tree, jpack.plan(tree, num_shards=<axis size>)).")
  n = axis_size(axis_name)
  check_shardable(packed.layout, n)
  k = lax.axis_index(axis_name)
  return Shards(tuple(lax.dynamic_slice_in_dim(x, k * (x.shape[0] // n), x.shape[0] // n)
                      for x in packed.buckets), packed.layout)


def reduce_scatter(tree: Any, axis_name: AxisName, *, mean: bool = False,
                   comm_dtype: Any = None, layout: Layout | None = None,
                   allow_int: bool = False) -> Shards:
  """Sum (or average) over ``axis_name`` and keep only this device's slice of each bucket.

  Args:
    tree: a pytree of arrays, or a `Packed` planned with ``num_shards`` a multiple of
      the axis size.
    axis_name: the mesh / pmap axis.
    mean: average instead of sum.
    comm_dtype: as in `jpack.pmean`.
    layout: as in `jpack.pmean`.
    allow_int: as in `jpack.pmean`.

  Returns:
    `Shards` holding the reduced slices; `jpack.all_gather` reassembles them.
  """
  comm_dtype = _check_comm_dtype(comm_dtype)
  n = axis_size(axis_name)
  packed, _ = _to_packed(tree, layout, num_shards=n)
  check_shardable(packed.layout, n)
  _check_reducible(packed.layout, mean=mean, allow_int=allow_int or not mean,
                   op="reduce_scatter")
  scatter = [True] * len(packed.buckets)
  return Shards(_reduce_buckets(packed.buckets, axis_name, n, scatter_on_cpu=scatter,
                                scatter_elsewhere=scatter, mean=mean, comm_dtype=comm_dtype,
                                gather=False), packed.layout)


def slice_axes(axis_name: AxisName) -> tuple[tuple[Any, ...], Any]:
  """``(replica_axes, slice_axis)``: how ZeRO (`jpack.optax.sharded`, `jpack.fsdp`) uses a
  data-parallel axis name. A tuple ``(outer, ..., inner)`` slices over its last axis and
  replicates over the others (hybrid sharding: reduce-scatter within a node, all-reduce
  of the slice across nodes); a single name slices over it."""
  if isinstance(axis_name, tuple):
    if not axis_name:
      raise ValueError("axis_name is an empty tuple; name the data-parallel mesh axes.")
    return tuple(axis_name[:-1]), axis_name[-1]
  return (), axis_name


def mean_to_slices(packed: Packed, axis_name: AxisName, *, comm_dtype: Any = None) -> Shards:
  """The mean of ``packed`` over every axis of ``axis_name``, as this device's slices
  over its `slice_axes` axis: a reduce-scatter over that axis, then an all-reduce of the
  slices over the replica axes (1/n of the bytes cross them)."""
  replicas, axis = slice_axes(axis_name)
  shards = reduce_scatter(packed, axis, mean=True, comm_dtype=comm_dtype)
  return Shards(mean_over(shards.buckets, replicas, comm_dtype), shards.layout)


def mean_over(buckets: tuple[Any, ...], axes: tuple[Any, ...], comm_dtype: Any = None
              ) -> tuple[Any, ...]:
  """Each 1-D array averaged over ``axes`` (none: unchanged), as `pmean` reduces a bucket."""
  if not axes:
    return tuple(buckets)
  n = axis_size(axes)
  comm_dtype = _check_comm_dtype(comm_dtype)
  scatter = [b.size % n == 0 for b in buckets]
  return _reduce_buckets(tuple(buckets), axes, n, scatter_on_cpu=scatter,
                         scatter_elsewhere=[False] * len(buckets), mean=True,
                         comm_dtype=comm_dtype, gather=True)


def all_gather(shards: Shards, axis_name: AxisName) -> Packed:
  """Reassemble full buckets from every device's `Shards`.

  Args:
    shards: this device's `Shards` (from `jpack.reduce_scatter` or `jpack.shard`).
    axis_name: the mesh / pmap axis.

  Returns:
    The `Packed` with full buckets, identical on every device.
  """
  if not isinstance(shards, Shards):
    raise TypeError(f"all_gather() expects jpack.Shards, got {type(shards).__name__}.")
  n = axis_size(axis_name)
  for i, (x, bucket) in enumerate(zip(shards.buckets, shards.layout.buckets)):
    if x.shape[0] * n != bucket.size:
      raise ValueError(
          f"all_gather over {axis_name!r} ({n} devices): bucket {i} has a slice of "
          f"{x.shape[0]} elements, and {n} of them do not make its {bucket.size}. Gather "
          "over the axes the Shards were made over (jpack.shard / reduce_scatter).")
  return Packed(tuple(gather_bucket(x, axis_name) for x in shards.buckets), shards.layout)


def gather_bucket(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """One bucket's slices from every device, concatenated (`all_gather`'s per bucket)."""
  def plain(x):
    return _all_gather(x, axis_name, axis=0, tiled=True)

  if not x.size:
    return jnp.zeros((0,), x.dtype)
  if not cpu.moves_as_bits(x.dtype):
    return plain(x)
  return cpu.choose(functools.partial(cpu.moved_as_bits, plain), plain, x)


def vary(tree: Any, axis_name: AxisName) -> Any:
  """Mark replicated values as per-device ("varying") over ``axis_name``, for autodiff.

  Inside `jax.shard_map`, the gradient with respect to a replicated (``P()``) input is
  already summed over the axis: JAX inserts one ``psum`` per leaf in the backward pass.
  That is the unpacked all-reduce jpack replaces, and a sum where a mean was meant.
  Differentiate with respect to ``vary(params, axis)`` instead to get this device's own
  gradient, then reduce it with `jpack.pmean` (or `jpack.optax.allreduce` / `sharded`).
  A no-op for values already varying (e.g. under `jax.pmap`) and under
  ``jax.vmap(axis_name=...)``, which has no replicated values; with a tuple of axes, only
  the axes a value does not yet vary over are added.

  Args:
    tree: a pytree of arrays (or a `Packed`).
    axis_name: the mesh axis, or a tuple of axes.

  Returns:
    ``tree`` with every leaf varying over ``axis_name``.
  """
  manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  manual = set(names if manual is None else manual)  # older jax: cast as before

  def one(x):
    missing = _not_varying(x, axis_name)
    for name in missing:
      if name not in manual:
        lax.axis_size(name)  # a vmap axis passes; an unbound name raises JAX's NameError
    missing = tuple(name for name in missing if name in manual)
    if not missing:
      return x
    return lax.pcast(x, missing, to="varying")

  return jax.tree.map(one, tree)


# -- helpers ---------------------------------------------------------------------------


def assert_same_layout(layout: Layout) -> None:
  """Raise unless every process planned the same layout (multi-process runs).

  Collectives combine buffers by bucket index: processes that planned different layouts
  (another model config, other plan options or library version) would silently mix
  unrelated parameters. Call it once, outside ``jit``, before the first collective of
  a step you build yourself; `jpack.data_parallel` calls it in ``init``. Every process
  must call it (it exchanges the layouts' fingerprints). With one process it returns at
  once.

  Args:
    layout: this process's `Layout`.

  Raises:
    ValueError: the processes' layout fingerprints differ; the message lists them.

  Examples:
    >>> import jax.numpy as jnp, jpack
    >>> jpack.assert_same_layout(jpack.plan({"w": jnp.ones(3)}))
  """
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  mine = np.frombuffer(layout.fingerprint.encode(), np.uint8)
  everyone = np.asarray(multihost_utils.process_allgather(mine))
  prints = {bytes(row.astype(np.uint8)).decode() for row in everyone.reshape(-1, mine.size)}
  if len(prints) > 1:
    raise ValueError(
        f"Processes planned different jpack layouts (fingerprints {sorted(prints)}); this "
        f"process has {layout.fingerprint}. Every process must build the step from the same "
        "param shapes, dtypes and plan options, or collectives would mix unrelated buffers.")


def axis_size(axis_name: AxisName) -> int:
  try:
    return int(lax.axis_size(axis_name))
  except NameError as e:
    raise NameError(f"Axis {axis_name!r} is not bound: jpack collectives run inside "
                    "jax.shard_map(..., mesh=...), jax.pmap(..., axis_name=...) or "
                    "jax.vmap(..., axis_name=...) over that axis.") from e


def _to_packed(tree, layout, *, num_shards):
  if isinstance(tree, Packed):
    if layout is not None:
      raise TypeError("Got a Packed and a layout; a Packed carries its own layout. Pass "
                      "one or the other.")
    check_buckets(tree.buckets, tree.layout)  # e.g. a per-device axis left on by shard_map
    return tree, True
  if layout is None:
    layout = plan(tree, num_shards=num_shards)
  return pack(tree, layout), False


def _unpacked(result: Packed) -> Any:
  """The tree out of a collective's buckets. Its leaves are copied out of the buckets
  anyway, so slicing with shared kernels (on CPU) changes only the compile time."""
  return unpack_shared(result)


def _check_comm_dtype(comm_dtype):
  if comm_dtype is None:
    return None
  dtype = jnp.dtype(comm_dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"comm_dtype must be a floating dtype (e.g. jnp.bfloat16 or "
                     f"jnp.float32), got {dtype}.")
  if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
    # JAX would make it float32 with only a warning: a wire narrower than asked.
    raise ValueError(f"comm_dtype={dtype} needs 64-bit types: set "
                     "jax.config.update('jax_enable_x64', True), or use jnp.float32.")
  return dtype


def _check_reducible(layout: Layout, *, mean: bool, allow_int: bool, op: str) -> None:
  for slot in layout.slots:
    where = slot.path or "<root>"
    if is_key_dtype(slot.dtype):
      raise TypeError(f"Leaf at {where} is a PRNG key ({dtype_name(slot.dtype)}); keys "
                      f"cannot be summed or averaged. Keep keys out of the tree given to "
                      f"{op}, or use jpack.broadcast to share them.")
    if slot.dtype == jnp.bool_:
      raise TypeError(f"Leaf at {where} is bool; {op} of bools is ambiguous (count? any? "
                      "all?). Cast it, e.g. x.astype(jnp.int32) for a count.")
    if mean and not allow_int and jnp.issubdtype(slot.dtype, jnp.integer):
      raise TypeError(f"Leaf at {where} has integer dtype {slot.dtype}, which has no exact "
                      f"mean. Pass allow_int=True to floor-divide the sum (keeps the dtype),"
                      f" cast it to a float, or keep it out of the tree.")


def check_shardable(layout: Layout, n: int) -> None:
  for i, bucket in enumerate(layout.buckets):
    if bucket.size % n:
      raise ValueError(f"Bucket {i} has {bucket.size} elements, which do not split evenly "
                       f"over {n} devices. Plan the layout with num_shards={n} (or a "
                       "multiple).")
