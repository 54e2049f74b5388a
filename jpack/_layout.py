"""Layout planning: a pytree of shapes and dtypes -> a static table of buckets and offsets.

Everything here is pure Python on shapes and dtypes (never values), so a `Layout` can be
built from `jax.ShapeDtypeStruct`s, under `jit`, or under `jax.eval_shape`, and used as a
static (hashable) argument without retracing. Its text, HTML and JSON forms live in
`jpack._layout_format`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
from typing import Any, Callable, Hashable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jpack._internal import dtype_name, is_key_dtype, key_words, storage_dtype, where
from jpack._layout_format import (layout_fingerprint, layout_from_json, layout_to_json,
                                  summary_html, summary_text)

# Defaults, chosen from measurements (see docs/concepts.md, "Choosing defaults").
# On CPU several buckets of <= 4 MiB reduced one by one beat one huge collective and
# XLA's merged tuple all-reduce; GPUs prefer bigger ones (DDP 25 MiB, Horovod 128 MB):
# pass `bucket_bytes` there.
DEFAULT_BUCKET_BYTES = 4 * 2**20
# Caps the operand count of one concatenate / split: XLA's compile time grows faster
# than linearly in it (MegEngine caps at 100 leaves; 512 keeps compile fast without
# multiplying the collectives).
DEFAULT_MAX_LEAVES = 512
# CUDA's allocation alignment; keeps every leaf on its own cache-line / vector boundary.
DEFAULT_ALIGN_BYTES = 256
# Leaves of at least 1 MiB get a bucket of their own: packing one is a reshape, not a
# copy, and its collective is already big enough to be efficient (measurements in
# docs/concepts.md).
DEFAULT_SOLO_BYTES: int | None = 2**20

GroupFn = Callable[[str, Any], Hashable]

# What to do with a model object that mixes arrays with functions and settings.
PARTITION_HINT = ("A model that mixes arrays with functions and settings, such as an Equinox "
                  "module, must be split first: params, static = eqx.partition(model, "
                  "eqx.is_inexact_array); pass params, and rebuild the model in loss_fn with "
                  "eqx.combine(params, static).")


class Slot(NamedTuple):
  """Where one leaf lives (a `NamedTuple`: ``plan`` builds thousands of them).

  Attributes:
    path: the leaf's key path, as rendered by `jax.tree_util.keystr`.
    bucket: index into `Layout.buckets`.
    offset: first element of the leaf inside its bucket (aligned).
    shape: the leaf's shape.
    dtype: the leaf's dtype (a numpy dtype, or a JAX PRNG key dtype).
    size: number of bucket elements the leaf occupies (for PRNG keys this counts the
      underlying uint32 words).
  """

  path: str
  bucket: int
  offset: int
  shape: tuple[int, ...]
  dtype: Any
  size: int

  @property
  def nbytes(self) -> int:
    return self.size * storage_dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Bucket:
  """One flat 1-D buffer holding leaves of a single storage dtype.

  Attributes:
    dtype: the storage dtype of the buffer (uint32 for PRNG keys).
    size: length in elements, including alignment and shard padding.
    slots: indices into `Layout.slots` of the leaves it holds, in offset order.
    group: ``(dtype name, label)``: the leaf dtype's name and ``str`` of `group_fn`'s
      label (``None`` without a `group_fn`).
  """

  dtype: np.dtype
  size: int
  slots: tuple[int, ...]
  group: tuple[str, Hashable]

  @property
  def nbytes(self) -> int:
    return self.size * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Layout:
  """A static plan: which bucket and offset each leaf of a pytree occupies.

  Immutable and hashable (a valid static argument under `jax.jit`). Build one with
  `jpack.plan`.

  Attributes:
    treedef: the tree structure the layout was planned for.
    slots: one `Slot` per leaf, in `jax.tree.flatten` order.
    buckets: the `Bucket`s, in the order they are filled (with ``reverse=True`` bucket 0
      holds the *last* leaves: the first gradients ready in a backward pass).
    align_bytes: the alignment of every leaf offset.
    num_shards: every bucket length is a multiple of this (times the alignment).
  """

  treedef: Any
  slots: tuple[Slot, ...]
  buckets: tuple[Bucket, ...]
  align_bytes: int
  num_shards: int

  # -- derived facts -------------------------------------------------------------------

  @property
  def num_leaves(self) -> int:
    return len(self.slots)

  @property
  def nbytes(self) -> int:
    """Total bytes of all buckets, padding included."""
    return sum(b.nbytes for b in self.buckets)

  @property
  def leaf_nbytes(self) -> int:
    """Total bytes of the leaves themselves."""
    return sum(s.nbytes for s in self.slots)

  @property
  def fingerprint(self) -> str:
    """A short hash, equal across processes and runs for the same tree and options."""
    return layout_fingerprint(self)

  def shapes(self) -> Any:
    """The tree of `jax.ShapeDtypeStruct`s this layout packs."""
    return jax.tree.unflatten(
        self.treedef, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in self.slots])

  def bucket_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """One `jax.ShapeDtypeStruct` per bucket."""
    return tuple(jax.ShapeDtypeStruct((b.size,), b.dtype) for b in self.buckets)

  # -- display -------------------------------------------------------------------------

  def summary(self, leaves: bool = False) -> str:
    """A readable table of the buckets (and, with ``leaves=True``, of every leaf).

    Args:
      leaves: also list one row per leaf: bucket, offset, size, dtype, shape, path.

    Returns:
      The table as a string; ``print(layout.summary())``.

    Examples:
      >>> import jax, jpack
      >>> layout = jpack.plan({"w": jax.ShapeDtypeStruct((3, 4), "float32")})
      >>> print(layout.summary(leaves=True))  # doctest: +ELLIPSIS
      Layout ...: 1 leaves in 1 buckets, 48 B of leaves in 256 B (align 256 B, 1 shard(s))
      bucket  dtype    leaves  elements  bytes  padding
      ------  -------  ------  --------  -----  -------
           0  float32       1        64  256 B    81.2%
      bucket  offset  size  dtype    shape   path
      ------  ------  ----  -------  ------  -----
           0       0    12  float32  (3, 4)  ['w']
    """
    return summary_text(self, leaves)

  def __str__(self) -> str:
    return self.summary()

  def __repr__(self) -> str:
    return (f"Layout(fingerprint={self.fingerprint!r}, leaves={self.num_leaves}, "
            f"buckets={len(self.buckets)}, nbytes={self.nbytes})")

  def _repr_html_(self) -> str:
    return summary_html(self)

  # -- serialization -------------------------------------------------------------------

  def to_json(self) -> str:
    """Serialize to a JSON string (canonical: equal layouts give equal strings).

    Returns:
      Compact JSON; `Layout.from_json` reads it back.

    Examples:
      >>> import jax, jpack
      >>> layout = jpack.plan({"w": jax.ShapeDtypeStruct((3, 4), "float32")})
      >>> jpack.Layout.from_json(layout.to_json()) == layout
      True
    """
    return layout_to_json(self)

  @classmethod
  def from_json(cls, text: str, treedef: Any = None) -> "Layout":
    """Rebuild a layout saved with `to_json`.

    Args:
      text: the JSON string.
      treedef: the tree structure. Needed only for trees with node types other than
        dict, list, tuple and None (for example namedtuples or dataclasses), or with dict
        keys other than str, int, float, bool and None (for example tuples), whose
        structure JSON cannot describe; it must match the saved structure.

    Returns:
      A `Layout` equal to the one that was saved.

    Raises:
      ValueError: ``text`` is not a saved layout, or ``treedef`` is missing although
        needed, or does not match the saved structure.
    """
    fields = layout_from_json(text, treedef)
    return cls(fields.treedef, tuple(Slot._make(s) for s in fields.slots),
               tuple(Bucket(*b) for b in fields.buckets), fields.align_bytes,
               fields.num_shards)


def plan(
    tree: Any,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    first_bucket_bytes: int | None = None,
    max_leaves: int | None = DEFAULT_MAX_LEAVES,
    align_bytes: int = DEFAULT_ALIGN_BYTES,
    num_shards: int = 1,
    reverse: bool = True,
    group_fn: GroupFn | None = None,
    solo_bytes: int | None = DEFAULT_SOLO_BYTES,
    solo_ndim: int | None = None,
) -> Layout:
  """Plan how to pack ``tree`` into per-dtype, aligned flat buckets.

  Args:
    tree: a pytree whose leaves are arrays (jax or numpy), Python scalars, or
      `jax.ShapeDtypeStruct`s. Only shapes and dtypes are read.
    bucket_bytes: a bucket closes when adding a leaf would take it past this many bytes.
    first_bucket_bytes: cap of each group's first bucket (default ``bucket_bytes``).
    max_leaves: a bucket closes when it holds this many leaves (``None``: no limit).
    align_bytes: every leaf offset is a multiple of this many bytes (a power of two).
    num_shards: every bucket length is a multiple of ``num_shards`` times the
      alignment, so it can be reduce-scattered into equal, aligned shards.
    reverse: fill buckets from the last leaf backwards, the order in which a backward
      pass produces gradients.
    group_fn: ``group_fn(path, leaf) -> label`` (``path``: the leaf's
      `jax.tree_util.keystr`); leaves whose labels differ as ``str`` never share a bucket.
    solo_bytes: a leaf of at least this many bytes gets a bucket of its own (packing it
      is a reshape, not a copy); ``None`` to pack big leaves with others.
    solo_ndim: a leaf of at least this many dimensions gets a bucket of its own
      (``None``: none; ``jpack.data_parallel`` sets 2 on GPUs, where a matmul would
      copy its weight out of a shared bucket).

  Returns:
    A hashable `Layout`.

  Raises:
    TypeError: a leaf is not an array (or has a dtype jpack cannot pack), ``group_fn``
      is not callable or returns a label holding a memory address, or ``reverse`` is
      not a bool. The message names the leaf's key path.
    ValueError: an option is not a positive int, ``align_bytes`` is not a power of two,
      or a `jax.ShapeDtypeStruct` has a negative or non-integer dimension.

  Examples:
    >>> import jax, jax.numpy as jnp, jpack
    >>> tree = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4), "step": jnp.int32(0)}
    >>> layout = jpack.plan(tree, align_bytes=16)
    >>> [(b.dtype.name, b.size) for b in layout.buckets]
    [('float32', 16), ('int32', 4)]
  """
  options = _check_options(bucket_bytes, first_bucket_bytes, max_leaves, align_bytes,
                           num_shards, solo_bytes, solo_ndim)
  if group_fn is not None and not callable(group_fn):
    raise TypeError(f"group_fn must be a function (path, leaf) -> label, got "
                    f"{type(group_fn).__name__}.")
  if not isinstance(reverse, (bool, np.bool_)):
    raise TypeError(f"reverse must be a bool, got {reverse!r}.")
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  specs = _leaf_specs(path_leaves)
  n = len(specs)
  order = range(n - 1, -1, -1) if reverse else range(n)
  if group_fn is not None:
    specs = _labelled(specs, [leaf for _, leaf in path_leaves], order, group_fn)
  placements, fills = _assign(specs, order, options)
  return _finalize(treedef, specs, placements, fills, options)


def check_plan_options(options: Mapping[str, Any] | None, where: str,
                       **overrides: Any) -> dict[str, Any]:
  """Refuse now the options that `plan` would refuse later, inside a traced step.

  Args:
    options: keyword arguments meant for `plan`, or None for none.
    where: the caller, for the message (e.g. ``"jpack.optax.sharded"``).
    **overrides: options the caller sets itself, checked in their place.

  Returns:
    ``options`` as a dict (without ``overrides``).

  Raises:
    TypeError: an option `plan` does not take, or of the wrong type.
    ValueError: an option value `plan` refuses.
  """
  if options is None:
    return {}
  if not isinstance(options, Mapping):
    raise TypeError(f"{where}: plan_options must be a dict of jpack.plan's keyword "
                    f"arguments, got {type(options).__name__}.")
  known = [p.name for p in inspect.signature(plan).parameters.values()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise TypeError(f"{where}: plan_options has unknown key(s) {unknown}; they go to "
                    f"jpack.plan, which takes {known}.")
  plan((), **{**options, **overrides})
  return dict(options)


# -- plan, step by step: leaf specs -> assignment -> finalize ----------------------------


class _Options(NamedTuple):
  """`plan`'s numeric options, checked and as Python ints (JSON needs them so)."""

  bucket_bytes: int
  first_bucket_bytes: int  # bucket_bytes when not given
  max_leaves: int | None
  align_bytes: int
  num_shards: int
  solo_bytes: int | None
  solo_ndim: int | None


# What plan reads from one leaf: (path, shape, dtype, size, label). ``path`` is the
# jax.tree_util.keystr of its key path; ``dtype`` a numpy or PRNG key dtype; ``size`` its
# bucket elements (uint32 words for PRNG keys); ``label`` the str of group_fn's label
# (leaves of one (dtype, label) group share buckets). A plain tuple, unpacked by name
# where used: plan builds thousands, and a NamedTuple would cost a Python call each.
_LeafSpec = tuple[str, tuple[int, ...], Any, int, str | None]


@dataclasses.dataclass(slots=True)
class _Fill:
  """A bucket while `plan` fills it; `_finalize` turns it into a `Bucket`."""

  index: int  # its index in Layout.buckets
  group: tuple[Any, str | None]  # (leaf dtype, label)
  storage: np.dtype
  members: list[int]  # leaf indices in fill order, which is offset order
  end: int = 0  # elements used: the end of the last member


@dataclasses.dataclass(slots=True)
class _GroupState:
  """Where `plan` is filling one (dtype, label) group."""

  storage: np.dtype
  align: int  # the alignment in elements
  open: _Fill | None = None  # takes the group's next leaf if it fits
  first: _Fill | None = None  # its first shared bucket, capped by first_bucket_bytes


def _leaf_specs(path_leaves: Sequence[tuple[Any, Any]]) -> list[_LeafSpec]:
  """One unlabelled leaf spec per leaf, in flatten order; errors name the leaf's path."""
  words: dict[Any, int] = {}  # key_words per dtype: it is slow, and trees repeat dtypes
  specs = []
  for key_path, leaf in path_leaves:
    path = "".join(map(str, key_path))  # jax.tree_util.keystr, without its call overhead
    shape, dtype = _shape_dtype(path, leaf)
    per_element = words.get(dtype)
    if per_element is None:
      per_element = words[dtype] = key_words(dtype)
    specs.append((path, shape, dtype, math.prod(shape) * per_element, None))
  return specs


def _labelled(specs: list[_LeafSpec], leaves: list[Any], order: range,
              group_fn: GroupFn) -> list[_LeafSpec]:
  """``specs`` with group_fn's labels; it is called in ``order``, the fill order, so an
  error names the first leaf assignment would have reached."""
  labelled = list(specs)
  for i in order:
    path, shape, dtype, size, _ = specs[i]
    try:
      raw = group_fn(path, leaves[i])
    except Exception as e:
      if hasattr(e, "add_note"):  # Python >= 3.11
        e.add_note(f"(raised by group_fn for the leaf at {where(path)})")
      raise
    # Labels are kept as strings so layouts serialize exactly and hash the same in
    # every process.
    label = None if raw is None else str(raw)
    if label is not None and " at 0x" in label:
      raise TypeError(
          f"group_fn returned {label} for the leaf at {where(path)}: a label is kept as "
          "its str(), and this one holds a memory address, which differs between "
          "processes and runs. Return a string, number or enum instead.")
    labelled[i] = (path, shape, dtype, size, label)
  return labelled


def _assign(specs: list[_LeafSpec], order: range,
            options: _Options) -> tuple[list[tuple[int, int]], list[_Fill]]:
  """Greedy fill: each leaf, in ``order``, joins its group's open bucket if it fits
  there, else opens a new one; a solo leaf gets a bucket no later leaf joins.

  Returns:
    ``(bucket, offset)`` per leaf, and the buckets in the order they were opened.
  """
  bucket_bytes, first_cap, max_leaves, align_bytes, _, solo_bytes, solo_ndim = options
  placements = [(0, 0)] * len(specs)
  fills: list[_Fill] = []
  groups: dict[tuple[Any, str | None], _GroupState] = {}
  for i in order:
    _, shape, dtype, size, label = specs[i]
    group = (dtype, label)
    state = groups.get(group)
    if state is None:
      storage = storage_dtype(dtype)
      state = groups[group] = _GroupState(storage,
                                          _align_elements(align_bytes, storage.itemsize))
    itemsize = state.storage.itemsize
    solo = ((solo_bytes is not None and size * itemsize >= solo_bytes) or
            (solo_ndim is not None and len(shape) >= solo_ndim and size > 0))
    fill = None if solo else state.open
    start = 0
    if fill is not None:
      start = -(-fill.end // state.align) * state.align
      cap = first_cap if fill is state.first else bucket_bytes
      # An empty leaf takes no bytes: it never opens a bucket of its own.
      too_big = size and (start + size) * itemsize > cap
      too_many = max_leaves is not None and len(fill.members) >= max_leaves
      if too_big or too_many:
        fill, start = None, 0
    if fill is None:
      fill = _Fill(len(fills), group, state.storage, [])
      fills.append(fill)
      if not solo:
        state.open = fill
        if state.first is None:
          state.first = fill
    placements[i] = (fill.index, start)
    fill.members.append(i)
    fill.end = start + size
  return placements, fills


def _finalize(treedef: Any, specs: list[_LeafSpec], placements: list[tuple[int, int]],
              fills: list[_Fill], options: _Options) -> Layout:
  """The `Layout`: bucket lengths padded to a multiple of the alignment times num_shards."""
  slots = ()
  if specs:  # columns, then one C-level map: thousands of leaves
    paths, shapes, dtypes, sizes, _ = zip(*specs)
    bucket_of, offsets = zip(*placements)
    # tuple.__new__ builds each Slot without the Python-level NamedTuple.__new__ call.
    slots = tuple(map(functools.partial(tuple.__new__, Slot),
                      zip(paths, bucket_of, offsets, shapes, dtypes, sizes)))
  buckets = []
  for fill in fills:
    align = _align_elements(options.align_bytes, fill.storage.itemsize)
    quantum = align * options.num_shards
    size = -(-fill.end // quantum) * quantum
    group = (dtype_name(fill.group[0]), fill.group[1])
    buckets.append(Bucket(fill.storage, size, tuple(fill.members), group))
  return Layout(treedef, slots, tuple(buckets), options.align_bytes, options.num_shards)


# -- helpers ---------------------------------------------------------------------------


def _check_options(bucket_bytes, first_bucket_bytes, max_leaves, align_bytes, num_shards,
                   solo_bytes, solo_ndim=None) -> _Options:
  """The options as Python ints (numpy ints would not serialise to JSON), or ValueError."""
  def positive_int(name, value, allow_none=False):
    if value is None and allow_none:
      return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)

  bucket_bytes = positive_int("bucket_bytes", bucket_bytes)
  first_bucket_bytes = positive_int("first_bucket_bytes", first_bucket_bytes,
                                    allow_none=True)
  options = _Options(
      bucket_bytes, bucket_bytes if first_bucket_bytes is None else first_bucket_bytes,
      positive_int("max_leaves", max_leaves, allow_none=True),
      positive_int("align_bytes", align_bytes),
      positive_int("num_shards", num_shards),
      positive_int("solo_bytes", solo_bytes, allow_none=True),
      positive_int("solo_ndim", solo_ndim, allow_none=True))
  if options.align_bytes & (options.align_bytes - 1):
    raise ValueError(f"align_bytes must be a power of two, got {options.align_bytes}; "
                     "try 256 (CUDA's allocation alignment) or 64 (a cache line).")
  return options


def _align_elements(align_bytes: int, itemsize: int) -> int:
  return max(1, align_bytes // itemsize)


_SCALAR_TYPES = (bool, int, float, complex)


# Leaf types known to be arrays: checking type() membership first keeps `plan` fast per
# leaf (isinstance against the jax.Array ABC is slow).
_ARRAY_TYPES: set[type] = {np.ndarray, jax.ShapeDtypeStruct}


def _shape_dtype(path: str, leaf: Any) -> tuple[tuple[int, ...], Any]:
  """Shape and dtype of a leaf, or a TypeError naming its path."""
  kind = type(leaf)
  if kind in _ARRAY_TYPES:
    if kind is jax.ShapeDtypeStruct:
      dtype = _checked_dtype(leaf.dtype, path)
      if getattr(dtype, "itemsize", 0) >= 8:  # only 64-bit types can be narrowed
        _check_canonical(dtype, path, "jax.ShapeDtypeStruct of dtype")
      try:  # numpy-integer dims would break JSON; 2.5 or -1 are not dims
        shape = tuple(map(operator.index, leaf.shape))
        valid = not shape or min(shape) >= 0  # min(..., default=0) costs a keyword call
      except TypeError:
        valid = False
      if not valid:
        raise ValueError(f"Leaf at {where(path)} is a jax.ShapeDtypeStruct of shape "
                         f"{leaf.shape}: dimensions must be non-negative integers.")
      return shape, dtype
    if kind is not np.ndarray:  # jax arrays: int shapes, canonical dtypes
      return leaf.shape, _checked_dtype(leaf.dtype, path)
  elif isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    if isinstance(leaf, jax.Array):
      _ARRAY_TYPES.add(kind)
  elif isinstance(leaf, _SCALAR_TYPES):
    try:
      return (), jnp.asarray(leaf).dtype
    except OverflowError:
      raise ValueError(
          f"Leaf at {where(path)} is the Python int {leaf}, outside the range of "
          f"{jnp.asarray(0).dtype} (64-bit types are disabled). Pass an array of an "
          "explicit dtype, or enable jax_enable_x64.") from None
  else:
    raise TypeError(
        f"Leaf at {where(path)} is a {type(leaf).__name__}, not an array: jpack packs "
        "jax/numpy arrays, Python scalars and jax.ShapeDtypeStruct. Convert it, or mark "
        "it static (e.g. keep it out of the tree or use None). " + PARTITION_HINT)
  dtype = _checked_dtype(leaf.dtype, path)
  if isinstance(leaf, (np.ndarray, np.generic)):  # np.memmap too: any subclass
    if isinstance(leaf, np.ma.MaskedArray):
      raise TypeError(f"Leaf at {where(path)} is a numpy masked array: JAX would drop "
                      "its mask. Pass leaf.filled(value) or leaf.data.")
    _check_canonical(dtype, path, "numpy scalar of dtype" if isinstance(leaf, np.generic)
                     else "numpy array of dtype")
  return tuple(map(int, leaf.shape)), dtype


def _check_canonical(dtype: Any, path: str, what: str) -> None:
  """TypeError if JAX would silently narrow ``dtype`` (64-bit types with x64 off)."""
  canonical = dtype if is_key_dtype(dtype) else jax.dtypes.canonicalize_dtype(dtype)
  if dtype != canonical:
    raise TypeError(
        f"Leaf at {where(path)} is a {what} {dtype}, which JAX would silently turn "
        f"into {canonical} (64-bit types are disabled). Cast it explicitly, or enable "
        "jax_enable_x64.")


_CHECKED_DTYPES: dict[Any, Any] = {}


def _checked_dtype(dtype: Any, path: str) -> Any:
  """``dtype`` as a numpy dtype (PRNG key dtypes unchanged), or a TypeError naming the path."""
  try:
    return _CHECKED_DTYPES[dtype]
  except (KeyError, TypeError):
    pass
  checked = dtype
  if not is_key_dtype(dtype):
    checked = np.dtype(dtype)
    # ml_dtypes' bfloat16, float8_*, int4... have kind "V" but are numbers; float0 and
    # structured or raw-bytes dtypes are "V" too and are not.
    if not (checked.kind in "biufc" or jnp.issubdtype(checked, jnp.number)):
      hint = (" (the gradient of an integer or bool leaf under allow_int=True: drop those "
              "leaves, or differentiate only the float ones)"
              if checked == jax.dtypes.float0 else "")
      raise TypeError(f"Leaf at {where(path)} has dtype {checked}{hint}, which jpack "
                      "cannot pack; expected a bool, integer, float or complex dtype.")
    problem = _unsupported(checked)
    if problem:
      shown = checked.name if checked.isnative else checked.str
      raise TypeError(f"Leaf at {where(path)} has dtype {shown}: {problem}")
  try:
    _CHECKED_DTYPES[dtype] = checked
  except TypeError:  # pragma: no cover - an unhashable dtype-like
    pass
  return checked


def _unsupported(dtype: np.dtype) -> str:
  """Why JAX cannot hold ``dtype`` faithfully, or ''."""
  if not dtype.isnative:
    return ("not in this machine's byte order, which JAX arrays do not keep (to_json "
            "would also lose it). Convert it first: leaf.astype(leaf.dtype.newbyteorder('='))")
  if dtype.kind in "fc" and dtype.itemsize > (16 if dtype.kind == "c" else 8):
    return "extended precision, which JAX does not support. Cast it to float64 or float32."
  if dtype.name in ("int2", "uint2"):
    return ("2-bit integers abort XLA:CPU when concatenated (a bucket is a concatenate). "
            "Store them as int8 / uint8 (or int4 / uint4) instead.")
  return ""


def retyped(layout: Layout, dtypes: list[np.dtype]) -> Layout:
  """``layout`` with bucket i (and its leaves) of ``dtypes[i]``: same element offsets."""
  slots = tuple(slot._replace(dtype=dtypes[slot.bucket]) for slot in layout.slots)
  buckets = tuple(dataclasses.replace(b, dtype=d) for b, d in zip(layout.buckets, dtypes))
  return dataclasses.replace(layout, slots=slots, buckets=buckets)


def whole_leaf_shards(layout: Layout, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      max_leaves: int | None = DEFAULT_MAX_LEAVES) -> Layout:
  """``layout`` re-planned so that each of its ``num_shards`` shards holds whole leaves.

  ZeRO-1 gives device k shard k of every bucket; an optimizer that needs whole leaves
  (lamb, adafactor, muon) then owns the leaves in its shard. Per group, in ``layout``'s
  bucket order (backward-ready), leaves join a bucket until it would hold more than
  ``num_shards`` times the per-device size: ``bucket_bytes``, or the largest leaf in it
  (a big embedding takes a shard of its own, and the other shards of its bucket fill with
  other leaves rather than padding). Within a bucket the leaves go, largest first, to the
  shard holding the fewest elements; every shard is padded to the fullest one. The
  padding is what a bucket reduce-scatters and all-gathers beyond its leaves.

  Returns:
    A `Layout` with the same leaves, groups and ``num_shards``, where no leaf crosses a
    shard boundary (`shard_of` gives each leaf's owner).
  """
  n = layout.num_shards
  groups: dict[Any, list[int]] = {}
  for bucket in layout.buckets:
    groups.setdefault(bucket.group, []).extend(bucket.slots)
  storage = {b.group: b.dtype for b in layout.buckets}
  slots = list(layout.slots)
  buckets: list[Bucket] = []
  for group, members in groups.items():
    dtype = storage[group]
    align = _align_elements(layout.align_bytes, dtype.itemsize)
    per_device = max(1, bucket_bytes // dtype.itemsize)
    aligned = {j: -(-layout.slots[j].size // align) * align for j in members}
    chunks: list[list[int]] = [[]]
    total = biggest = 0
    for j in members:
      size = aligned[j]
      full = max(per_device, biggest, size) * n
      if chunks[-1] and ((size and total + size > full) or (
          max_leaves is not None and len(chunks[-1]) >= max_leaves * n)):
        chunks.append([])
        total = biggest = 0
      chunks[-1].append(j)
      total, biggest = total + size, max(biggest, size)
    for chunk in chunks:
      loads, owned = [0] * n, [[] for _ in range(n)]
      for j in sorted(chunk, key=lambda j: -aligned[j]):  # stable: ties keep their order
        k = loads.index(min(loads))
        owned[k].append(j)
        loads[k] += aligned[j]
      width = max(max(loads), align)
      index = len(buckets)
      order = []
      for k in range(n):
        offset = k * width
        for j in owned[k]:
          slots[j] = slots[j]._replace(bucket=index, offset=offset)
          offset += aligned[j]
          order.append(j)
      buckets.append(Bucket(dtype, width * n, tuple(order), group))
  return dataclasses.replace(layout, slots=tuple(slots), buckets=tuple(buckets))


def shard_of(layout: Layout, slot: Slot) -> int | None:
  """The shard that holds all of ``slot``'s leaf, or None if it crosses a boundary (a
  zero-size leaf: the shard its offset falls in)."""
  width = layout.buckets[slot.bucket].size // layout.num_shards
  first = slot.offset // width
  return first if slot.size == 0 or (slot.offset + slot.size - 1) // width == first else None
