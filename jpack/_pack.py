"""pack / unpack: a pytree <-> a few flat buckets, following a `Layout`.

Packing is one ``lax.concatenate`` per bucket and unpacking one ``lax.split`` per bucket.
Both are linear primitives whose transposes are each other, so reverse-mode autodiff of
`unpack` is a single concatenate per bucket (one pack), and of `pack` a single split (one
unpack); forward mode is the same op on tangents. Slicing leaf by leaf instead makes the
backward pass one full-size ``pad`` + ``add`` per leaf, which measured ~100x slower.
(Buckets of many small leaves are filled by a gather instead, which compiles faster; its
custom JVP is the concatenate, so autodiff is unchanged.)
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpack._layout import (Layout, _dtype_name, _is_key_dtype, _storage_dtype, _treedef_text,
                           plan)


class _Buckets:
  """Pytree plumbing shared by `Packed` and `jpack.Shards`: children are the bucket
  arrays, static data is the `Layout`."""

  __slots__ = ("buckets", "layout")

  def __init__(self, buckets: tuple[Any, ...], layout: Layout):
    # The children are not checked: JAX rebuilds pytrees with placeholders.
    if not isinstance(layout, Layout):
      raise TypeError(f"{type(self).__name__}(buckets, layout) needs a jpack.Layout as its "
                      f"second argument, got {type(layout).__name__}.")
    self.buckets = tuple(buckets)
    self.layout = layout

  def tree_flatten(self):
    return self.buckets, self.layout

  @classmethod
  def tree_unflatten(cls, layout, buckets):
    return cls(buckets, layout)

  def __repr__(self) -> str:
    def show(b):
      return f"{getattr(b, 'dtype', '?')}[{','.join(map(str, getattr(b, 'shape', ())))}]"
    return (f"{type(self).__name__}(layout={self.layout.fingerprint}, "
            f"buckets=({', '.join(show(b) for b in self.buckets)}))")


@jax.tree_util.register_pytree_node_class
class Packed(_Buckets):
  """A pytree packed into flat buckets.

  A registered pytree: its children are the 1-D bucket arrays and its static data is the
  `Layout`, so it flows through `jax.jit`, `jax.shard_map`, `jax.pmap`, `jax.grad` and
  optax like any tree of arrays.

  Attributes:
    buckets: tuple of 1-D arrays, one per `layout.buckets` entry.
    layout: the static `Layout`.
  """

  __slots__ = ()


def pack(tree: Any, layout: Layout | None = None, **plan_options: Any) -> Packed:
  """Pack ``tree`` into flat, per-dtype buckets.

  Args:
    tree: a pytree of arrays (jax or numpy) or Python scalars.
    layout: the `Layout` to follow; planned from ``tree`` with ``plan_options`` if
      omitted. Give one when packing many trees of the same structure (gradients every
      step) so planning happens once.
    **plan_options: options for `jpack.plan` (only without ``layout``).

  Returns:
    A `Packed` whose buckets hold every leaf at its slot's offset, zeros in the padding.

  Raises:
    ValueError: the tree's structure, or a leaf's shape, does not match ``layout``.
    TypeError: a leaf is not an array, or its dtype does not match ``layout`` (jpack
      never casts silently).

  Examples:
    >>> import jax.numpy as jnp, jpack
    >>> packed = jpack.pack({"a": jnp.arange(3.0), "b": jnp.ones((2, 2))}, align_bytes=4)
    >>> packed.buckets[0]
    Array([1., 1., 1., 1., 0., 1., 2.], dtype=float32)
  """
  if layout is None:
    layout = plan(tree, **plan_options)
  elif plan_options:
    raise TypeError(f"pack() got a layout and plan options {sorted(plan_options)}; the "
                    "layout already fixes them. Pass one or the other.")
  elif not isinstance(layout, Layout):
    raise TypeError(f"layout must be a jpack.Layout, got {type(layout).__name__}.")
  leaves = _flatten_like(tree, layout)
  if _outside_jit(leaves):
    _check_same_devices(leaves, layout)
    # One compiled program instead of an op per leaf (4000 leaves: first call 4.3 s ->
    # 2.6 s, later calls 100-140 ms -> 30-110 ms).
    return _fill_compiled(tuple(leaves), layout)
  return _fill(leaves, layout)


def _fill(leaves: Any, layout: Layout) -> Packed:
  buckets = []
  for bucket in layout.buckets:
    flat, starts = [], []
    mixed = _mixed_explicit_shardings([leaves[j] for j in bucket.slots])
    for j in bucket.slots:
      slot = layout.slots[j]
      leaf = _unsharded(leaves[j]) if mixed else leaves[j]
      if _is_key_dtype(slot.dtype):
        leaf = jax.random.key_data(leaf)
      flat.append(leaf if np.ndim(leaf) == 1 else lax.reshape(leaf, (np.size(leaf),)))
      starts.append(slot.offset)
    dtype = _storage_dtype(bucket.dtype)
    if len(flat) < GATHER_MIN_LEAVES or _moves_as_bits(dtype):
      place = _place_concat
    else:
      place = _place_gather if jnp.issubdtype(dtype, jnp.inexact) else _place_gather_raw
    buckets.append(place(tuple(flat), tuple(starts), bucket.size, dtype))
  return Packed(tuple(buckets), layout)


_fill_compiled = jax.jit(_fill, static_argnums=1)


# A bucket of this many leaves or more is filled by one gather from the leaves laid end to
# end, instead of a concatenate with a zeros operand per alignment gap: XLA:CPU's compile
# time grows with concatenate operands (4000 leaves: lower + compile 5.3 s -> 3.4 s), and
# the run time stayed the same (interleaved: 19.5 vs 18.2 ms).
# Not for 16/8-bit floats: inside one jitted kernel, LLVM folds bits -> concatenate ->
# gather -> bits back into a select over bf16 values, which the x86 backend computes in
# float32, quieting signalling NaNs and flushing subnormals (measured: 380 of the 65536
# bf16 bit patterns changed). Their concatenate is emitted as plain copies and stays exact.
GATHER_MIN_LEAVES = 128


def _place_concat(flat, starts, size, dtype):
  """The bucket as one concatenate of leaves and zero gaps."""
  zeros: dict[int, Any] = {}  # gaps take few distinct sizes: one zeros array per size

  def gap(n):
    if n not in zeros:
      zeros[n] = jnp.zeros((n,), dtype)
    return zeros[n]

  pieces = []
  end = 0
  for leaf, start in zip(flat, starts):
    if not leaf.shape[0]:
      continue  # XLA:CPU aborts on zero-size concatenate operands followed by a split
    if start > end:
      pieces.append(gap(start - end))
    pieces.append(leaf)
    end = start + leaf.shape[0]
  if size > end:
    pieces.append(gap(size - end))
  if not pieces:
    return jnp.zeros((0,), dtype)
  return pieces[0] if len(pieces) == 1 else _concatenate(tuple(pieces))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _place_gather(flat, starts, size, dtype):
  return _place_gather_raw(flat, starts, size, dtype)


@_place_gather.defjvp
def _place_gather_jvp(starts, size, dtype, primals, tangents):
  # The tangent map is the concatenate form, whose transpose is a split (one unpack).
  (flat,), (dflat,) = primals, tangents
  return _place_gather(flat, starts, size, dtype), _place_concat(dflat, starts, size, dtype)


def _place_gather_raw(flat, starts, size, dtype):
  """The bucket gathered from ``[leaves end to end, 0]``; gaps read the final zero."""
  compact = lax.concatenate([x for x in flat if x.shape[0]] + [jnp.zeros((1,), dtype)], 0)
  index = np.full((size,), compact.shape[0] - 1, np.int32)
  pos = 0
  for leaf, start in zip(flat, starts):
    n = leaf.shape[0]
    index[start:start + n] = np.arange(pos, pos + n, dtype=np.int32)
    pos += n
  return compact.at[index].get(mode="promise_in_bounds")


def unpack(packed: Packed, *, share_kernels: bool = False) -> Any:
  """Rebuild the original tree from a `Packed`: exact inverse of `pack`.

  Args:
    packed: the result of `pack` (or any `Packed` whose buckets match its layout, such
      as the output of a collective or an optimizer update on the buckets).
    share_kernels: inside a jit, slice at offsets XLA cannot constant-fold, so that
      slices of equal size share one compiled XLA:CPU kernel instead of one kernel per
      leaf. Compiles much faster with many leaves (`jax.jit(unpack)` of 4000 leaves:
      8.5-9 s instead of 34-35 s; per-leaf ``x * 2``: 5.5 s), runs a little slower
      inside a step: each leaf becomes a copy of its own that static slices let XLA
      fuse into their consumers (a step whose loss unpacks 1600 leaves of packed
      params: about 9 % slower). Worth it when you recompile often or have thousands
      of leaves; the default keeps the fastest steps. Tuned and measured on XLA:CPU
      only. No effect outside jit.

  Returns:
    The tree, every leaf with its original shape and dtype.

  Called outside `jax.jit` on CPU buckets that every local device holds in full (one
  device, or replicated), the leaves are copied out of the buckets' memory with no
  compilation at all (the 4000-leaf workload: 0.09 s for the first call, where
  `jax.jit(unpack)` compiles for 35 s); other buckets are unpacked by one program
  compiled for the call (on CPU with XLA:CPU's older loop emitters, which compile slices
  2-4x faster). Inside a jit it is traced like any other function, and its static
  slices fuse into their consumers.

  Examples:
    >>> import jax.numpy as jnp, jpack
    >>> tree = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2), jnp.int8)}
    >>> back = jpack.unpack(jpack.pack(tree))
    >>> back["b"].dtype
    dtype('int8')
  """
  if not isinstance(packed, Packed):
    raise TypeError(f"unpack() expects a jpack.Packed, got {type(packed).__name__}; "
                    "use jpack.pack(tree) to make one.")
  _check_buckets(packed.buckets, packed.layout)
  if not _outside_jit(packed.buckets):
    return _unpack_shared(packed) if share_kernels else _unpack(packed)
  if _host_readable(packed.buckets):
    return _unpack_on_host(packed)
  if _on_cpu(packed.buckets):
    return _unpack_compiled_for_cpu(packed)
  return _unpack_compiled(packed)


# Called outside jit, an unpack is compiled for the call and is compile-bound: XLA:CPU
# compiles a kernel per returned slice, and its older loop emitters do that 2-4x faster
# than the default MLIR fusion emitters (4000 leaves: 130 s eager before, see
# docs/performance.md). Inside a user's jit the user's compiler options apply.
_CPU_FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False}


def _targets_cpu() -> bool:
  """Whether a trace will most likely be compiled for CPU: its default backend (a
  tracer does not say which devices its value will live on)."""
  return jax.default_backend() == "cpu"


def _host_readable(arrays: tuple[Any, ...]) -> bool:
  """CPU arrays whose every local device holds the whole value: numpy can view them."""
  return _on_cpu(arrays) and all(
      isinstance(x, jax.Array) and x.is_fully_addressable and x.sharding.is_fully_replicated
      for x in arrays)


def _unpack_on_host(packed: Packed) -> Any:
  """Eager unpack of CPU buckets: a CPU device's memory is host memory, so each leaf is
  a numpy view of its bucket placed back on the bucket's devices (no copy on one
  device; JAX never donates a buffer that a view still references). Compiling the same
  slices costs ~7 ms of XLA:CPU code generation per leaf (28.5 s at 4000 leaves)."""
  layout = packed.layout
  hosts = [np.asarray(b) for b in packed.buckets]
  views = []
  for slot in layout.slots:
    view = hosts[slot.bucket][slot.offset:slot.offset + slot.size]
    key_shape = tuple(slot.dtype._impl.key_shape) if _is_key_dtype(slot.dtype) else ()
    views.append(view.reshape(slot.shape + key_shape))
  # Like a jit's outputs, leaves of uncommitted buckets stay uncommitted.
  committed = [b.committed for b in packed.buckets]
  pinned = [j for j, slot in enumerate(layout.slots) if committed[slot.bucket]]
  free = [j for j, slot in enumerate(layout.slots) if not committed[slot.bucket]]
  leaves: list[Any] = [None] * layout.num_leaves
  shardings = [_whole(b.sharding) for b in packed.buckets]
  placed = jax.device_put([views[j] for j in pinned],
                          [shardings[layout.slots[j].bucket] for j in pinned])
  # jnp.asarray costs half the Python overhead per array of device_put.
  for j, x in zip(pinned + free, placed + [jnp.asarray(views[j]) for j in free]):
    leaves[j] = x
  leaves = [jax.random.wrap_key_data(x, impl=slot.dtype._impl.name)
            if _is_key_dtype(slot.dtype) else x for x, slot in zip(leaves, layout.slots)]
  return jax.tree.unflatten(layout.treedef, leaves)


def _whole(sharding: Any) -> Any:
  """A bucket's sharding for a leaf of any rank: a replicated bucket on a mesh has spec
  ``P(None,)``, which a 0-d leaf cannot take; ``P()`` says the same for every rank."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.P(), memory_kind=sharding.memory_kind)
  return sharding


def _outside_jit(values: Any) -> bool:
  """No value is being traced: the call runs eagerly and may compile its own program."""
  return not any(isinstance(x, jax.core.Tracer) for x in values)


def _check_same_devices(leaves: list[Any], layout: Layout) -> None:
  """Leaves committed to different devices cannot be packed by one program: name two
  of them (JAX's own error names only argument positions)."""
  first = None
  for slot, leaf in zip(layout.slots, leaves):
    if isinstance(leaf, jax.Array) and leaf.committed:
      devices = leaf.sharding.device_set
      if first is None:
        first = (slot.path, devices)
      elif devices != first[1]:
        show = lambda ds: sorted(d.id for d in ds)
        raise ValueError(
            f"pack: leaves are committed to different devices: {first[0]} is on devices "
            f"{show(first[1])} and {slot.path} on {show(devices)}. Put them on the same "
            "devices first (jax.device_put(tree, device_or_sharding)).")


def _on_cpu(arrays: tuple[Any, ...]) -> bool:
  for x in arrays:
    if isinstance(x, jax.Array):
      if any(d.platform != "cpu" for d in x.sharding.device_set):
        return False
    elif jax.default_backend() != "cpu":
      return False
  return True


def _unpack(packed: Packed, split: Callable[..., list[Any]] | None = None) -> Any:
  """Static slices (``split`` defaults to the bit-exact `_split`)."""
  layout = packed.layout
  split = split or _split
  leaves: list[Any] = [None] * layout.num_leaves
  for bucket, array in zip(layout.buckets, packed.buckets):
    sizes, owners, empty = [], [], []
    end = 0
    for j in bucket.slots:
      slot = layout.slots[j]
      if not slot.size:  # kept out of the split: see _place_concat
        empty.append(j)
        continue
      if slot.offset > end:
        sizes.append(slot.offset - end)
        owners.append(None)
      sizes.append(slot.size)
      owners.append(j)
      end = slot.offset + slot.size
    if bucket.size > end:
      sizes.append(bucket.size - end)
      owners.append(None)
    # Even a leaf that fills its bucket: JAX refuses to reshape across an Explicit axis.
    whole = _unsharded(array)
    parts = split(whole, tuple(sizes)) if len(sizes) > 1 else [whole]
    for j, part in zip(owners, parts):
      if j is not None:
        leaves[j] = _leaf(part, layout.slots[j])
    for j in empty:
      leaves[j] = _leaf(lax.slice_in_dim(whole, 0, 0), layout.slots[j])
  return jax.tree.unflatten(layout.treedef, leaves)


_unpack_compiled = jax.jit(_unpack)
_unpack_compiled_for_cpu = jax.jit(_unpack, compiler_options=_CPU_FAST_COMPILE)


def _unpack_at(packed: Packed, starts: tuple[Any, ...]) -> Any:
  """`unpack` whose slice offsets are runtime values: ``starts[j]`` is slot j's offset.

  XLA:CPU compiles every static slice into a kernel of its own (its offset is a
  constant in the code), so 40 identical layers cost 40 kernels. With the offsets
  passed in as executable arguments (int32 scalars), slices of equal shape from equal
  buckets share one kernel: a jit-compiled step that unpacks its reduced gradients for a
  per-leaf optimizer compiled 2x faster (MLP 40x256). Reverse-mode autodiff costs one
  pack, as for `unpack` (a dynamic slice would transpose to a full-size update per leaf).
  """
  _check_buckets(packed.buckets, packed.layout)
  return _unpack_at_vjp(packed.layout, packed.buckets, tuple(starts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unpack_at_vjp(layout, buckets, starts):
  return _slice_at(layout, buckets, starts)


def _unpack_at_fwd(layout, buckets, starts):
  return _slice_at(layout, buckets, starts), None


def _unpack_at_bwd(layout, _, cotangents):
  return pack(cotangents, layout).buckets, None  # offsets are integers: no cotangent


_unpack_at_vjp.defvjp(_unpack_at_fwd, _unpack_at_bwd)


def _unpack_shared(packed: Packed) -> Any:
  """`unpack` inside a trace whose slices of equal size share one XLA:CPU kernel.

  For the trees a collective returns on CPU, and ``unpack(share_kernels=True)``.
  XLA:CPU compiles a kernel per slice with its offset built in and reuses a kernel only
  for identical fusions, so a static unpack of
  1000 leaves costs 1000 kernels (the same leaves' per-leaf ``x * 0.125`` cost one per
  distinct shape). Here each offset comes out of a `lax.cond` whose two branches return
  the same constants (correct whatever the predicate; XLA cannot fold it; one cond per
  chunk of leaves, chained, see `_slice_shared`), and a dtype's
  buckets of small leaves are first joined into one array (one copy; see
  _JOIN_MAX_BYTES_PER_LEAF), so a kernel serves every leaf of its size. Tree-in/tree-out `pmean`, lower + compile on 8
  CPU devices: 1000 small leaves 8.2 -> 4.4-5.8 s (per-leaf `pmean` 4.8-5.4 s), 4000
  leaves 49 -> 27-32 s (per-leaf 26-28 s). Derivatives take the static `unpack` (custom
  JVP), whose transpose is one pack.
  """
  layout = packed.layout
  if (sum(1 for s in layout.slots if s.size) < 2
      or max(b.size for b in layout.buckets) * len(layout.buckets) >= 2**31):
    return _unpack(packed)  # nothing to share; or offsets past int32
  return _unpack_shared_jvp(layout, tuple(packed.buckets))


# A dtype's buckets are read from one joined array, so that a slice kernel serves equal
# sizes in every bucket, when its leaves average at most this many bytes: the join is one
# more copy of the bytes per call, which only pays off in compile time for many small
# leaves (a 10 MB MLP of 80 leaves: 63 ms per step with the join, 49.5 ms without, in
# two runs of the step benchmark).
_JOIN_MAX_BYTES_PER_LEAF = 16 << 10
# Outputs per `lax.cond`: the SPMD partitioner's time grew with the square of one cond's
# outputs (4000 leaves: +5.8 s with one cond; none with chunks of 64).
_COND_OUTPUTS = 64


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _unpack_shared_jvp(layout, buckets):
  return _slice_shared(layout, buckets)


@_unpack_shared_jvp.defjvp
def _unpack_shared_jvp_rule(layout, primals, tangents):
  (buckets,), (dbuckets,) = primals, tangents
  # Tangents of integer buckets are float0: unpack zeros in their place, then give
  # non-float leaves float0 tangents again.
  dbuckets = tuple(d if jnp.issubdtype(b.dtype, jnp.inexact) else jnp.zeros_like(b)
                   for b, d in zip(buckets, dbuckets))
  # Tangents must be linear in dbuckets: plain splits (the bit-exact one bitcasts, which
  # JAX cannot transpose; only its custom JVP is linear).
  dleaves = jax.tree.leaves(_unpack(Packed(dbuckets, layout), split=lax.split))
  dleaves = [d if not _is_key_dtype(s.dtype) and jnp.issubdtype(s.dtype, jnp.inexact)
             else np.zeros(s.shape, jax.dtypes.float0) for d, s in zip(dleaves, layout.slots)]
  return _slice_shared(layout, buckets), jax.tree.unflatten(layout.treedef, dleaves)


def _slice_shared(layout: Layout, buckets: tuple[Any, ...]) -> Any:
  arrays = []
  for x in buckets:
    x = _unsharded(x)
    arrays.append(lax.bitcast_convert_type(x, _bits_dtype(x.dtype))
                  if _moves_as_bits(x.dtype) else x)
  groups: dict[Any, list[int]] = {}
  for i, (bucket, x) in enumerate(zip(layout.buckets, arrays)):
    if bucket.size:
      groups.setdefault(x.dtype, []).append(i)
  pred = _unevaluable(arrays[next(iter(groups.values()))[0]][:1])
  sources, where = [], {}  # bucket -> (source, offset of the bucket in it)
  for dtype, members in groups.items():
    total = sum(layout.buckets[i].size for i in members) * np.dtype(dtype).itemsize
    count = sum(len(layout.buckets[i].slots) for i in members)
    join = total <= _JOIN_MAX_BYTES_PER_LEAF * count
    for part in [members] if join else [[i] for i in members]:
      start = 0
      for i in part:
        where[i] = (len(sources), start)
        start += layout.buckets[i].size
      sources.append(arrays[part[0]] if len(part) == 1 else
                     _joined(tuple(arrays[i] for i in part), pred))
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
    # live only while its slices run: XLA's buffer assignment tries every scalar that is
    # live across the whole program against every output buffer (4000 leaves: 2.2 s,
    # 1.25 s chained; per-leaf pmean 0.7 s). The link is a leaf of the commonest size, read
    # at an unfoldable 0, so one kernel serves every link.
    link = max(chunk, key=lambda j: (how_many[layout.slots[j].size], j))
    pred = _unevaluable(lax.dynamic_slice_in_dim(leaves[link], zero, 1,
                                                 allow_negative_indices=False))
  for j, (slot, part) in enumerate(zip(layout.slots, leaves)):
    if part is None:
      part = lax.slice_in_dim(arrays[slot.bucket], 0, 0)
    if part.dtype != buckets[slot.bucket].dtype:
      part = lax.bitcast_convert_type(part, buckets[slot.bucket].dtype)
    leaves[j] = _leaf(part, slot)
  return jax.tree.unflatten(layout.treedef, leaves)


def _unevaluable(x: Any) -> Any:
  """A bool scalar XLA cannot evaluate at compile time, from a one-element array. Its
  value never matters (both branches of every cond it drives agree); ``x == x`` would do
  for floats, but XLA folds it to true for integers."""
  return lax.reshape(lax.ne(x, lax.full_like(x, 0)), ())


def _joined(arrays: tuple[Any, ...], pred: Any) -> Any:
  """One concatenate, computed inside a `lax.cond` on ``pred`` (a value XLA cannot
  evaluate) so that XLA cannot fuse it into every slice kernel (which then reads all the
  buckets: 2x the compile time per kernel at 4000 leaves). An optimization barrier does
  not stop it: XLA:CPU removes them first."""
  cat = lambda xs: lax.concatenate(xs, 0)
  return lax.cond(pred, cat, cat, arrays)


def _unfoldable(values: list[int], pred: Any) -> list[Any]:
  """int32 scalars equal to ``values`` that XLA cannot constant-fold: outputs of one
  `lax.cond` on ``pred`` (a value XLA cannot evaluate), both of whose branches return
  the same values. (`lax.optimization_barrier` is folded through.)"""
  values = tuple(np.int32(v) for v in values)
  return list(lax.cond(pred, lambda: values, lambda: values))


def _slice_at(layout: Layout, buckets: tuple[Any, ...], starts: tuple[Any, ...]) -> Any:
  leaves: list[Any] = [None] * layout.num_leaves
  for bucket, array in zip(layout.buckets, buckets):
    bits = _moves_as_bits(array.dtype)  # keep 16/8-bit float payloads exact
    array = _unsharded(array)
    source = lax.bitcast_convert_type(array, _bits_dtype(array.dtype)) if bits else array
    for j in bucket.slots:
      slot = layout.slots[j]
      if len(bucket.slots) == 1 and slot.size == bucket.size:
        part = array
      else:
        part = lax.dynamic_slice_in_dim(source, starts[j], slot.size)
        part = lax.bitcast_convert_type(part, array.dtype) if bits else part
      leaves[j] = _leaf(part, slot)
  return jax.tree.unflatten(layout.treedef, leaves)


def _unsharded(array: Any) -> Any:
  """A bucket sharded over an Explicit mesh axis, replicated: leaves do not start at
  shard boundaries, and JAX refuses to slice across them (an Auto mesh lets XLA insert
  the same all-gather)."""
  sharding = getattr(jax.typeof(array), "sharding", None)
  if sharding is None or not any(sharding.spec):
    return array
  return jax.sharding.reshard(array, jax.sharding.NamedSharding(sharding.mesh,
                                                                jax.P()))


def _mixed_explicit_shardings(leaves: list[Any]) -> bool:
  """Leaves of one bucket typed with different shardings over Explicit mesh axes: JAX
  refuses to concatenate them, so they are first made replicated."""
  shardings = {getattr(jax.typeof(x), "sharding", None) for x in leaves}
  return len(shardings) > 1 and any(s is not None and any(s.spec) for s in shardings)


def _leaf(part: Any, slot: Any) -> Any:
  """A slot's leaf from its 1-D slice of a bucket."""
  if _is_key_dtype(slot.dtype):
    words = slot.dtype._impl.key_shape
    return jax.random.wrap_key_data(part.reshape(slot.shape + tuple(words)),
                                    impl=slot.dtype._impl.name)
  return part.reshape(slot.shape)


# -- bit-exact concatenate / split ------------------------------------------------------
#
# XLA's CPU backend computes 16-bit floats in float32 and rounds back, which turns every
# NaN payload into the canonical NaN. Moving bf16/f16/fp8 bits as unsigned integers keeps
# them exact; the custom JVP keeps both ops linear (their tangents are the plain ops, whose
# transposes are each other), so autodiff costs one pack / unpack as for other dtypes.


def _moves_as_bits(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4


def _bits_dtype(dtype: Any) -> np.dtype:
  """The unsigned integer of the same bit width (uint4 for float4, which is 1 byte wide
  in numpy's itemsize)."""
  bits = (jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating)
          else 8 * np.dtype(dtype).itemsize)
  return np.dtype(jnp.uint4) if bits == 4 else np.dtype(f"uint{bits}")


def _concatenate(pieces: tuple[Any, ...]) -> Any:
  if _moves_as_bits(pieces[0].dtype):
    return _concatenate_bits(pieces)
  return lax.concatenate(pieces, 0)


def _split(array: Any, sizes: tuple[int, ...]) -> list[Any]:
  if _moves_as_bits(array.dtype):
    return _split_bits(array, sizes)
  return lax.split(array, sizes)


@jax.custom_jvp
def _concatenate_bits(pieces):
  dtype = pieces[0].dtype
  bits = lax.concatenate([lax.bitcast_convert_type(p, _bits_dtype(dtype)) for p in pieces], 0)
  return lax.bitcast_convert_type(bits, dtype)


@_concatenate_bits.defjvp
def _concatenate_bits_jvp(primals, tangents):
  (pieces,), (dpieces,) = primals, tangents
  return _concatenate_bits(pieces), lax.concatenate(dpieces, 0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _split_bits(array, sizes):
  bits = lax.split(lax.bitcast_convert_type(array, _bits_dtype(array.dtype)), sizes)
  return [lax.bitcast_convert_type(b, array.dtype) for b in bits]


@_split_bits.defjvp
def _split_bits_jvp(sizes, primals, tangents):
  (array,), (darray,) = primals, tangents
  return _split_bits(array, sizes), lax.split(darray, sizes)


# -- validation ------------------------------------------------------------------------


def _flatten_like(tree: Any, layout: Layout) -> list[Any]:
  """Leaves of ``tree`` checked against ``layout``: structure, shapes and dtypes."""
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  if treedef != layout.treedef:
    got = {jax.tree_util.keystr(p) for p, _ in path_leaves}
    want = {s.path for s in layout.slots}
    detail = []
    if want - got:
      detail.append(f"missing {sorted(want - got)[:5]}")
    if got - want:
      detail.append(f"unexpected {sorted(got - want)[:5]}")
    if not detail:  # same key paths, different node types (a list for a tuple, ...)
      detail.append(_first_node_difference(tree, layout.treedef))
    raise ValueError(
        "Tree structure does not match the layout"
        + (f" ({'; '.join(detail)})" if detail else f": got {treedef}, expected "
           f"{layout.treedef}") + ". Plan a new layout for this tree with jpack.plan().")
  leaves = []
  for (_, leaf), slot in zip(path_leaves, layout.slots):
    # np.float64 is a float and np.complex128 a complex: numpy scalars keep their dtype
    # (jnp.asarray would narrow them with x64 off, past the dtype check below).
    if isinstance(leaf, (bool, int, float, complex)) and not isinstance(leaf, np.generic):
      try:
        leaf = jnp.asarray(leaf)
      except OverflowError:
        raise ValueError(f"Leaf at {slot.path or '<root>'} is the Python int {leaf}, "
                         f"outside the range of the layout's {slot.dtype}.") from None
    elif not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(f"Leaf at {slot.path or '<root>'} is a {type(leaf).__name__}, not "
                      "an array; pack() needs values (plan() alone accepts "
                      "jax.ShapeDtypeStruct).")
    if tuple(leaf.shape) != slot.shape:
      raise ValueError(f"Leaf at {slot.path or '<root>'} has shape {tuple(leaf.shape)}, "
                       f"but the layout expects {slot.shape}.")
    if leaf.dtype != slot.dtype:
      raise TypeError(f"Leaf at {slot.path or '<root>'} has dtype {_dtype_name(leaf.dtype)},"
                      f" but the layout expects {_dtype_name(slot.dtype)}; jpack never "
                      "casts silently. Cast the leaf or plan a new layout.")
    leaves.append(leaf)
  return leaves


def _first_node_difference(tree: Any, treedef: Any) -> str:
  """Where ``tree`` first differs from ``treedef``, walking both one level at a time."""
  expected = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)

  def one_level(x):
    return jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)

  def kind(x):
    if x is None:
      return "None"
    node = jax.tree.structure(x)
    return "a leaf" if node.num_nodes == 1 and node.num_leaves == 1 else f"a {type(x).__name__}"

  def walk(got, want, path):
    (got_children, got_node), (want_children, want_node) = one_level(got), one_level(want)
    if got_node != want_node:
      where = jax.tree_util.keystr(path) or "<root>"
      if kind(got) == kind(want):  # same node type, other static (aux) data
        return (f"at {where}: {kind(got)} with other static data: got "
                f"{_treedef_text(got_node)}, expected {_treedef_text(want_node)}")
      return f"at {where}: got {kind(got)}, expected {kind(want)}"
    if jax.tree_util.treedef_is_leaf(got_node):
      return ""
    for (key, g), (_, w) in zip(got_children, want_children):
      found = walk(g, w, path + key)
      if found:
        return found
    return ""

  return walk(tree, expected, ()) or f"got {jax.tree.structure(tree)}, expected {treedef}"


def _check_buckets(buckets: tuple[Any, ...], layout: Layout) -> None:
  if len(buckets) != len(layout.buckets):
    raise ValueError(f"Packed holds {len(buckets)} buckets but its layout has "
                     f"{len(layout.buckets)}.")
  for i, (array, bucket) in enumerate(zip(buckets, layout.buckets)):
    shape = tuple(getattr(array, "shape", ()))
    if shape != (bucket.size,):
      raise ValueError(f"Bucket {i} has shape {shape}, but the layout expects "
                       f"({bucket.size},).")
    if _is_key_dtype(array.dtype) or np.dtype(array.dtype) != _storage_dtype(bucket.dtype):
      raise TypeError(f"Bucket {i} has dtype {array.dtype}, but the layout expects "
                      f"{bucket.dtype}.")
