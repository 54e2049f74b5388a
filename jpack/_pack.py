"""pack / unpack: a pytree <-> a few flat buckets, following a `Layout`.

Packing is one ``lax.concatenate`` per bucket and unpacking one ``lax.split`` per bucket.
Both are linear primitives whose transposes are each other, so reverse-mode autodiff of
`unpack` is a single concatenate per bucket (one pack), and of `pack` a single split (one
unpack); forward mode is the same op on tangents. Slicing leaf by leaf instead would make
the backward pass one full-size ``pad`` + ``add`` per leaf. On CPU a few of these ops
take another form (see jpack/_cpu.py); their derivatives are still the plain ones.
`to_tree` and `to_buckets` carry an optimizer's updates between the two forms.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpack import _cpu as cpu
from jpack._internal import (dtype_name, is_key_dtype, leaf_from_flat, outside_jit,
                             replicated, storage_dtype, treedef_text)
from jpack._layout import Layout, plan, retyped


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Packed:
  """A pytree packed into flat buckets.

  A registered pytree: its children are the 1-D bucket arrays and its static data is the
  `Layout`, so it flows through `jax.jit`, `jax.shard_map`, `jax.pmap`, `jax.grad` and
  optax like any tree of arrays.

  Attributes:
    buckets: tuple of 1-D arrays, one per `layout.buckets` entry.
    layout: the static `Layout`.
  """

  buckets: tuple[Any, ...]
  layout: Layout = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    # The buckets are not checked: JAX rebuilds pytrees with placeholders.
    if not isinstance(self.layout, Layout):
      raise TypeError(f"{type(self).__name__}(buckets, layout) needs a jpack.Layout as its "
                      f"second argument, got {type(self.layout).__name__}.")
    object.__setattr__(self, "buckets", tuple(self.buckets))

  def __repr__(self) -> str:
    return buckets_repr(self)


def buckets_repr(x: Any) -> str:
  """``Name(layout=<fingerprint>, buckets=(float32[1024], ...))``."""
  def show(b):
    return f"{getattr(b, 'dtype', '?')}[{','.join(map(str, getattr(b, 'shape', ())))}]"
  return (f"{type(x).__name__}(layout={x.layout.fingerprint}, "
          f"buckets=({', '.join(show(b) for b in x.buckets)}))")


def pack(tree: Any, layout: Layout | None = None) -> Packed:
  """Pack ``tree`` into flat, per-dtype buckets.

  Args:
    tree: a pytree of arrays (jax or numpy) or Python scalars.
    layout: the `Layout` to follow (`jpack.plan` with its options); planned from
      ``tree`` with `jpack.plan`'s defaults if omitted. Give one when packing many trees
      of the same structure (gradients every step) so planning happens once.

  Returns:
    A `Packed` whose buckets hold every leaf at its slot's offset, zeros in the padding.

  Raises:
    ValueError: the tree's structure, or a leaf's shape, does not match ``layout``.
    TypeError: a leaf is not an array, or its dtype does not match ``layout`` (jpack
      never casts silently).

  Examples:
    >>> import jax.numpy as jnp, jpack
    >>> tree = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2))}
    >>> packed = jpack.pack(tree, jpack.plan(tree, align_bytes=4))
    >>> packed.buckets[0]
    Array([1., 1., 1., 1., 0., 1., 2.], dtype=float32)
  """
  if layout is None:
    layout = plan(tree)
  elif not isinstance(layout, Layout):
    raise TypeError(f"layout must be a jpack.Layout, got {type(layout).__name__}.")
  leaves = flatten_like(tree, layout)
  if outside_jit(leaves):
    _check_same_devices(leaves, layout)
    return _fill_compiled(tuple(leaves), layout)  # one program, not an op per leaf
  return _fill(leaves, layout)


def _fill(leaves: Any, layout: Layout) -> Packed:
  flats = []
  for bucket in layout.buckets:
    mixed = _mixed_explicit_shardings([leaves[j] for j in bucket.slots])
    flat = []
    for j in bucket.slots:
      leaf = replicated(leaves[j]) if mixed else leaves[j]
      if is_key_dtype(layout.slots[j].dtype):
        leaf = jax.random.key_data(leaf)
      flat.append(leaf if np.ndim(leaf) == 1 else lax.reshape(leaf, (np.size(leaf),)))
    flats.append(tuple(flat))
  concats = [functools.partial(concat_with_gaps, starts=_starts(layout, b), size=b.size,
                               dtype=storage_dtype(b.dtype)) for b in layout.buckets]

  def plain(flats):
    return tuple(concat(flat) for concat, flat in zip(concats, flats))

  def on_cpu(flats):
    return tuple(cpu.fill(flat, _starts(layout, b), b.size, storage_dtype(b.dtype), concat)
                 for flat, b, concat in zip(flats, layout.buckets, concats))

  if any(cpu.fills_differently(len(b.slots), storage_dtype(b.dtype)) for b in layout.buckets):
    return Packed(cpu.choose(on_cpu, plain, tuple(flats)), layout)
  return Packed(plain(tuple(flats)), layout)


_fill_compiled = jax.jit(_fill, static_argnums=1)


def _starts(layout: Layout, bucket: Any) -> tuple[int, ...]:
  return tuple(layout.slots[j].offset for j in bucket.slots)


def concat_with_gaps(flat: tuple[Any, ...], starts: tuple[int, ...], size: int, dtype: Any,
                     concatenate: Callable[..., Any] = lambda xs: lax.concatenate(xs, 0)) -> Any:
  """The bucket as one concatenate of the 1-D leaves and zero gaps."""
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
  return pieces[0] if len(pieces) == 1 else concatenate(tuple(pieces))


def unpack(packed: Packed) -> Any:
  """Rebuild the original tree from a `Packed`: exact inverse of `pack`.

  Args:
    packed: the result of `pack` (or any `Packed` whose buckets match its layout, such
      as the output of a collective or an optimizer update on the buckets).

  Returns:
    The tree, every leaf with its original shape and dtype.

  Called outside `jax.jit` on CPU buckets that every local device holds in full (one
  device, or replicated), the leaves are numpy views of the buckets placed back on their
  devices, and nothing is compiled; other buckets are unpacked by one program compiled
  for the call. Inside a jit it is traced like any other function, and its static
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
  check_buckets(packed.buckets, packed.layout)
  if not outside_jit(packed.buckets):
    return _unpack_traced(packed, share_kernels=False)
  if cpu.readable_on_host(packed.buckets):
    return cpu.unpack_on_host(packed.layout, packed.buckets)
  if cpu.on_cpu(packed.buckets):
    return _unpack_compiled_for_cpu(packed)
  return _unpack_compiled(packed)


def _unpack_traced(packed: Packed, share_kernels: bool) -> Any:
  layout = packed.layout
  plain = functools.partial(_slices, layout, split=lax.split)
  exact = functools.partial(_slices, layout, split=cpu.split)
  if share_kernels:
    on_cpu = functools.partial(cpu.shared_slices, layout, exact=exact, linear=plain)
  elif any(cpu.moves_as_bits(b.dtype) for b in layout.buckets):
    on_cpu = exact
  else:
    return plain(packed.buckets)
  return cpu.choose(on_cpu, plain, packed.buckets)


def _slices(layout: Layout, buckets: tuple[Any, ...], split: Callable[..., list[Any]]) -> Any:
  """The tree, one ``split`` per bucket at the layout's (static) offsets."""
  leaves: list[Any] = [None] * layout.num_leaves
  for bucket, array in zip(layout.buckets, buckets):
    sizes, owners, empty = [], [], []
    end = 0
    for j in bucket.slots:
      slot = layout.slots[j]
      if not slot.size:  # kept out of the split: see concat_with_gaps
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
    whole = replicated(array)
    parts = split(whole, tuple(sizes)) if len(sizes) > 1 else [whole]
    for j, part in zip(owners, parts):
      if j is not None:
        leaves[j] = leaf_from_flat(part, layout.slots[j])
    for j in empty:
      leaves[j] = leaf_from_flat(lax.slice_in_dim(whole, 0, 0), layout.slots[j])
  return jax.tree.unflatten(layout.treedef, leaves)


def unpack_shared(packed: Packed) -> Any:
  """`unpack` inside a trace, with slices of equal size sharing one kernel on CPU
  whatever the number of leaves: for trees whose leaves are copied out anyway."""
  return _unpack_traced(packed, share_kernels=True)


_unpack_compiled = jax.jit(functools.partial(_unpack_traced, share_kernels=False))


# Compiler options this jaxlib refused ("No such compile option"): not tried again.
_UNKNOWN_OPTIONS: set[tuple[tuple[str, Any], ...]] = set()


@functools.cache
def _unpack_compiled_with(options: tuple[tuple[str, Any], ...]) -> Any:
  return jax.jit(functools.partial(_unpack_traced, share_kernels=False),
                 compiler_options=dict(options))


def _unpack_compiled_for_cpu(packed: Packed) -> Any:
  """`_unpack_compiled` with `cpu.COMPILER_OPTIONS`, where this jaxlib knows them (jaxlib
  0.11 dropped XLA:CPU's older emitters and their option): faster to compile, same result."""
  options = tuple(sorted(cpu.COMPILER_OPTIONS.items()))
  if options not in _UNKNOWN_OPTIONS:
    try:
      return _unpack_compiled_with(options)(packed)
    except jax.errors.JaxRuntimeError as e:
      if "No such compile option" not in str(e):
        raise
      _UNKNOWN_OPTIONS.add(options)
  return _unpack_compiled(packed)


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


def _mixed_explicit_shardings(leaves: list[Any]) -> bool:
  """Leaves of one bucket typed with different shardings over Explicit mesh axes: JAX
  refuses to concatenate them, so they are first made replicated."""
  shardings = {getattr(jax.typeof(x), "sharding", None) for x in leaves}
  return len(shardings) > 1 and any(s is not None and any(s.spec) for s in shardings)


# -- validation ------------------------------------------------------------------------


def flatten_like(tree: Any, layout: Layout) -> list[Any]:
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
      raise TypeError(f"Leaf at {slot.path or '<root>'} has dtype {dtype_name(leaf.dtype)},"
                      f" but the layout expects {dtype_name(slot.dtype)}; jpack never "
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
                f"{treedef_text(got_node)}, expected {treedef_text(want_node)}")
      return f"at {where}: got {kind(got)}, expected {kind(want)}"
    if jax.tree_util.treedef_is_leaf(got_node):
      return ""
    for (key, g), (_, w) in zip(got_children, want_children):
      found = walk(g, w, path + key)
      if found:
        return found
    return ""

  return walk(tree, expected, ()) or f"got {jax.tree.structure(tree)}, expected {treedef}"


def check_buckets(buckets: tuple[Any, ...], layout: Layout) -> None:
  if len(buckets) != len(layout.buckets):
    raise ValueError(f"Packed holds {len(buckets)} buckets but its layout has "
                     f"{len(layout.buckets)}.")
  for i, (array, bucket) in enumerate(zip(buckets, layout.buckets)):
    shape = tuple(getattr(array, "shape", ()))
    if shape != (bucket.size,):
      raise ValueError(f"Bucket {i} has shape {shape}, but the layout expects "
                       f"({bucket.size},).")
    if is_key_dtype(array.dtype) or np.dtype(array.dtype) != storage_dtype(bucket.dtype):
      raise TypeError(f"Bucket {i} has dtype {array.dtype}, but the layout expects "
                      f"{bucket.dtype}.")


def updates_dtype(given: Any, returned: Mapping[int, Any], layout: Layout) -> np.dtype:
  """A bucket's dtype for updates ``returned`` (slot index -> update): ``given``, or their
  widest float (as `optax.apply_updates` adds them); any other change is refused."""
  given = np.dtype(given)
  got = {j: np.dtype(jnp.result_type(x)) for j, x in returned.items()}
  if set(got.values()) <= {given}:
    return given
  if not all(jnp.issubdtype(d, jnp.floating) for d in set(got.values()) | {given}):
    paths = [layout.slots[j].path for j, d in got.items() if d != given]
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    raise TypeError(
        f"The optimizer returned {sorted(map(str, set(got.values())))} updates for {given} "
        f"leaves ({shown}); jpack never casts silently. Keep such leaves out of the "
        "optimizer: jpack.optax.partition with optax.set_to_zero() for them, or out of the params.")
  return np.dtype(jnp.result_type(*got.values(), given))


def to_tree(buckets: Sequence[Any], layout: Layout) -> Any:
  """The params tree of ``buckets`` of ``layout``, each leaf in its bucket's dtype."""
  dtypes = [np.dtype(b.dtype) for b in buckets]
  if dtypes != [b.dtype for b in layout.buckets]:
    layout = retyped(layout, dtypes)
  return unpack(Packed(tuple(buckets), layout))


def to_buckets(tree: Any, layout: Layout) -> tuple[Any, ...]:
  """``tree`` (updates returned on the leaves) packed into buckets of `updates_dtype`."""
  leaves = layout.treedef.flatten_up_to(tree)
  dtypes = [updates_dtype(bucket.dtype, {j: leaves[j] for j in bucket.slots}, layout)
            for bucket in layout.buckets]
  wide = retyped(layout, dtypes)
  leaves = [x if np.dtype(jnp.result_type(x)) == wide.slots[j].dtype
            else jnp.asarray(x).astype(wide.slots[j].dtype) for j, x in enumerate(leaves)]
  return pack(layout.treedef.unflatten(leaves), wide).buckets
