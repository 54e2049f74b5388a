"""Layout planning: a pytree of shapes and dtypes -> a static table of buckets and offsets.

Everything here is pure Python on shapes and dtypes (never values), so a `Layout` can be
built from `jax.ShapeDtypeStruct`s, under `jit`, or under `jax.eval_shape`, and used as a
static (hashable) argument without retracing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import html
import inspect
import json
import math
import operator
import re
from typing import Any, Callable, Hashable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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
# copy, and its collective is already big enough to be efficient. Measured on CPU
# (docs/concepts.md): a standalone pmean of ResNet-50's tree 1.20x -> 0.71x of per-leaf,
# MLP 24x1024 ZeRO-1 step 1.94x -> 2.39x, other steps unchanged within noise.
DEFAULT_SOLO_BYTES: int | None = 2**20

GroupFn = Callable[[str, Any], Hashable]


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
    return self.size * _storage_dtype(self.dtype).itemsize


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
    digest = hashlib.sha256(self.to_json().encode()).hexdigest()
    return digest[:16]

  def shapes(self) -> Any:
    """The tree of `jax.ShapeDtypeStruct`s this layout packs."""
    return jax.tree.unflatten(
        self.treedef, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in self.slots])

  def bucket_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """One `jax.ShapeDtypeStruct` per bucket."""
    return tuple(jax.ShapeDtypeStruct((b.size,), b.dtype) for b in self.buckets)

  # -- display -------------------------------------------------------------------------

  def _bucket_rows(self) -> list[tuple[str, ...]]:
    rows = []
    for i, b in enumerate(self.buckets):
      used = sum(self.slots[j].nbytes for j in b.slots)
      pad = 100.0 * (b.nbytes - used) / b.nbytes if b.nbytes else 0.0
      rows.append((str(i), _group_name(b.group), str(len(b.slots)), f"{b.size:,}",
                   _human(b.nbytes), f"{pad:.1f}%"))
    return rows

  def _leaf_rows(self) -> list[tuple[str, ...]]:
    rows = []
    for b_index, b in enumerate(self.buckets):
      for j in b.slots:
        s = self.slots[j]
        rows.append((str(b_index), str(s.offset), str(s.size), _dtype_name(s.dtype),
                     str(s.shape), s.path or "<root>"))
    return rows

  _BUCKET_HEADER = ("bucket", "dtype", "leaves", "elements", "bytes", "padding")
  _LEAF_HEADER = ("bucket", "offset", "size", "dtype", "shape", "path")

  def summary(self, leaves: bool = False) -> str:
    """A readable table of the buckets (and, with ``leaves=True``, of every leaf).

    Args:
      leaves: also list one row per leaf: bucket, offset, size, dtype, shape, path.

    Returns:
      The table as a string; ``print(layout.summary())``.
    """
    out = [f"Layout {self.fingerprint}: {self.num_leaves} leaves in {len(self.buckets)} "
           f"buckets, {_human(self.leaf_nbytes)} of leaves in {_human(self.nbytes)} "
           f"(align {self.align_bytes} B, {self.num_shards} shard(s))"]
    out.append(_text_table(self._BUCKET_HEADER, self._bucket_rows()))
    if leaves:
      out.append(_text_table(self._LEAF_HEADER, self._leaf_rows()))
    return "\n".join(out)

  def __str__(self) -> str:
    return self.summary()

  def __repr__(self) -> str:
    return (f"Layout(fingerprint={self.fingerprint!r}, leaves={self.num_leaves}, "
            f"buckets={len(self.buckets)}, nbytes={self.nbytes})")

  def _repr_html_(self) -> str:
    head = html.escape(self.summary().splitlines()[0])
    table = _html_table(self._BUCKET_HEADER, self._bucket_rows())
    leaf_rows = self._leaf_rows()
    shown = leaf_rows[:200]
    more = f"<p>… {len(leaf_rows) - 200} more leaves</p>" if len(leaf_rows) > 200 else ""
    leaves = (f"<details><summary>{len(leaf_rows)} leaves</summary>"
              f"{_html_table(self._LEAF_HEADER, shown)}{more}</details>")
    return f"<div class='jpack-layout'><p><b>{head}</b></p>{table}{leaves}</div>"

  # -- serialization -------------------------------------------------------------------

  def to_json(self) -> str:
    """Serialize to a JSON string (canonical: equal layouts give equal strings)."""
    doc = {
        "format": "jpack.Layout/1",
        "treedef": _treedef_text(self.treedef),
        "structure": _structure_to_json(self.treedef),
        "align_bytes": self.align_bytes,
        "num_shards": self.num_shards,
        "slots": [[s.path, s.bucket, s.offset, list(s.shape), _dtype_name(s.dtype), s.size]
                  for s in self.slots],
        "buckets": [[b.dtype.name, b.size, list(b.slots), list(b.group)]
                    for b in self.buckets],
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)

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
    """
    doc = json.loads(text)
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if fmt != "jpack.Layout/1":
      raise ValueError(f"Not a jpack layout (format={fmt!r}); expected "
                       "text produced by Layout.to_json().")
    if treedef is None:
      if doc["structure"] is None:
        raise ValueError(
            f"The saved tree structure {doc['treedef']} uses node types JSON cannot "
            "describe; pass treedef=jax.tree.structure(your_tree) to Layout.from_json.")
      treedef = jax.tree.structure(_structure_from_json(doc["structure"]),
                                   is_leaf=lambda x: x is _LEAF)
    if _treedef_text(treedef) != doc["treedef"]:
      raise ValueError(f"treedef {treedef} does not match the saved one {doc['treedef']}.")
    slots = tuple(Slot(p, b, o, tuple(sh), _dtype_from_name(d), n)
                  for p, b, o, sh, d, n in doc["slots"])
    buckets = []
    for name, size, members, group in doc["buckets"]:
      buckets.append(Bucket(jnp.dtype(name), size, tuple(members), tuple(group)))
    return cls(treedef, slots, tuple(buckets), doc["align_bytes"], doc["num_shards"])


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
) -> Layout:
  """Plan how to pack ``tree`` into per-dtype, aligned flat buckets.

  Args:
    tree: a pytree whose leaves are arrays (jax or numpy), Python scalars, or
      `jax.ShapeDtypeStruct`s. Only shapes and dtypes are read.
    bucket_bytes: a bucket closes when adding a leaf would take it past this many
      bytes. A leaf bigger than the cap gets a bucket of its own; a zero-size leaf
      never closes one.
    first_bucket_bytes: cap of the first bucket of each group (DDP uses 1 MiB so the
      first collective starts early). Defaults to ``bucket_bytes``.
    max_leaves: a bucket closes when it holds this many leaves (bounds compile time).
      ``None`` for no limit.
    align_bytes: every leaf offset is a multiple of this many bytes (a power of two).
    num_shards: every bucket length is a multiple of ``num_shards`` times the
      alignment, so it can be reduce-scattered into equal, aligned shards.
    reverse: fill buckets from the last leaf backwards, the order in which a backward
      pass produces gradients.
    group_fn: ``group_fn(path, leaf) -> label``; leaves with different labels never
      share a bucket (e.g. to give weight-decayed and non-decayed parameters separate
      buckets). ``path`` is the `jax.tree_util.keystr` of the leaf. Labels are compared
      and stored as ``str(label)`` (``None`` stays ``None``).
    solo_bytes: a leaf of at least this many bytes gets a bucket of its own (packing it
      is then a reshape, not a copy); the open bucket of its group stays open for the
      next leaves. Default 1 MiB; ``None`` to pack big leaves with others like any leaf.

  Returns:
    A hashable `Layout`.

  Examples:
    >>> import jax, jax.numpy as jnp, jpack
    >>> tree = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4), "step": jnp.int32(0)}
    >>> layout = jpack.plan(tree, align_bytes=16)
    >>> [(b.dtype.name, b.size) for b in layout.buckets]
    [('float32', 16), ('int32', 4)]
  """
  (bucket_bytes, first_bucket_bytes, max_leaves, align_bytes, num_shards,
   solo_bytes) = _check_options(bucket_bytes, first_bucket_bytes, max_leaves, align_bytes,
                                num_shards, solo_bytes)
  if group_fn is not None and not callable(group_fn):
    raise TypeError(f"group_fn must be a function (path, leaf) -> label, got "
                    f"{type(group_fn).__name__}.")
  if not isinstance(reverse, (bool, np.bool_)):
    raise TypeError(f"reverse must be a bool, got {reverse!r}.")
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  n = len(path_leaves)
  paths: list[str] = [""] * n
  shapes: list[tuple[int, ...]] = [()] * n
  dtypes: list[Any] = [None] * n
  sizes: list[int] = [0] * n
  for i, (key_path, leaf) in enumerate(path_leaves):
    path = "".join(map(str, key_path))  # jax.tree_util.keystr, without its call overhead
    shape, dtype = _shape_dtype(path, leaf)
    paths[i], shapes[i], dtypes[i] = path, shape, dtype
    sizes[i] = math.prod(shape) * _key_words(dtype)

  first_cap = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
  # group -> [bucket index, fill in elements, leaf count] of the open bucket.
  open_buckets: dict[Any, list[int]] = {}
  first_bucket: dict[Any, int] = {}
  group_storage: dict[Any, tuple[np.dtype, int]] = {}
  members: list[list[int]] = []
  fills: list[int] = []
  groups: list[tuple[str, Hashable]] = []
  storage: list[np.dtype] = []
  offsets = [0] * n
  bucket_of = [0] * n
  order = range(n - 1, -1, -1) if reverse else range(n)
  for i in order:
    dtype = dtypes[i]
    label = None
    if group_fn is not None:
      # Labels are kept as strings so layouts serialize exactly and hash the same in
      # every process.
      try:
        raw = group_fn(paths[i], path_leaves[i][1])
      except Exception as e:
        if hasattr(e, "add_note"):  # Python >= 3.11
          e.add_note(f"(raised by group_fn for the leaf at {paths[i] or '<root>'})")
        raise
      label = None if raw is None else str(raw)
      if label is not None and " at 0x" in label:
        raise TypeError(
            f"group_fn returned {label} for the leaf at {paths[i] or '<root>'}: a label "
            "is kept as its str(), and this one holds a memory address, which differs "
            "between processes and runs. Return a string, number or enum instead.")
    group = (dtype, label)
    facts = group_storage.get(group)
    if facts is None:
      sdtype = _storage_dtype(dtype)
      facts = group_storage[group] = (sdtype, _align_elements(align_bytes, sdtype.itemsize))
    sdtype, align = facts
    solo = solo_bytes is not None and sizes[i] * sdtype.itemsize >= solo_bytes
    state = None if solo else open_buckets.get(group)
    if state is not None:
      b, fill, count = state
      start = -(-fill // align) * align
      cap = first_cap if b == first_bucket[group] else bucket_bytes
      # An empty leaf takes no bytes: it never opens a bucket of its own.
      too_big = sizes[i] and (start + sizes[i]) * sdtype.itemsize > cap
      too_many = max_leaves is not None and count >= max_leaves
      if too_big or too_many:
        state = None
    if state is None:
      b = len(members)
      members.append([])
      fills.append(0)
      groups.append(group)
      storage.append(sdtype)
      state = [b, 0, 0]
      if not solo:
        open_buckets[group] = state
        first_bucket.setdefault(group, b)
      start = 0
    b = state[0]
    offsets[i], bucket_of[i] = start, b
    members[b].append(i)
    state[1] = fills[b] = start + sizes[i]
    state[2] += 1

  slots = tuple(map(Slot, paths, bucket_of, offsets, shapes, dtypes, sizes))
  buckets = []
  for b, idx in enumerate(members):
    quantum = _align_elements(align_bytes, storage[b].itemsize) * num_shards
    size = -(-fills[b] // quantum) * quantum
    idx.sort(key=offsets.__getitem__)
    group = (_dtype_name(groups[b][0]), groups[b][1])
    buckets.append(Bucket(storage[b], size, tuple(idx), group))
  return Layout(treedef, slots, tuple(buckets), align_bytes, num_shards)


def _check_plan_options(options: Mapping[str, Any], where: str) -> None:
  """TypeError / ValueError now, naming ``where``, for options that `plan` would refuse
  later (inside a traced step, where the error is harder to place)."""
  known = [p.name for p in inspect.signature(plan).parameters.values()
           if p.kind is inspect.Parameter.KEYWORD_ONLY]
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise TypeError(f"{where} got unexpected keyword argument(s) {unknown}; its extra "
                    f"keyword arguments go to jpack.plan, which takes {known}.")
  plan((), **options)


# -- helpers ---------------------------------------------------------------------------


def _check_options(bucket_bytes, first_bucket_bytes, max_leaves, align_bytes, num_shards,
                   solo_bytes=None):
  """The options as Python ints (numpy ints would not serialise to JSON), or ValueError."""
  def positive_int(name, value, allow_none=False):
    if value is None and allow_none:
      return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return int(value)

  options = (positive_int("bucket_bytes", bucket_bytes),
             positive_int("first_bucket_bytes", first_bucket_bytes, allow_none=True),
             positive_int("max_leaves", max_leaves, allow_none=True),
             positive_int("align_bytes", align_bytes),
             positive_int("num_shards", num_shards),
             positive_int("solo_bytes", solo_bytes, allow_none=True))
  align_bytes = options[3]
  if align_bytes & (align_bytes - 1):
    raise ValueError(f"align_bytes must be a power of two, got {align_bytes}; "
                     "try 256 (CUDA's allocation alignment) or 64 (a cache line).")
  return options


def _is_key_dtype(dtype: Any) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _storage_dtype(dtype: Any) -> np.dtype:
  """The dtype of the bucket that stores leaves of ``dtype``."""
  if _is_key_dtype(dtype):
    return np.dtype(np.uint32)
  return np.dtype(dtype)


@functools.lru_cache(maxsize=None)  # plan calls it once per leaf
def _key_words(dtype: Any) -> int:
  """uint32 words per element: a PRNG key holds several, an ordinary dtype one."""
  if _is_key_dtype(dtype):
    return math.prod(dtype._impl.key_shape)
  return 1


def _key_impl_name(dtype: Any) -> str:
  return dtype._impl.name


def _align_elements(align_bytes: int, itemsize: int) -> int:
  return max(1, align_bytes // itemsize)


_SCALAR_TYPES = (bool, int, float, complex)


# Leaf types known to be arrays: checking type() membership first keeps `plan` at a few
# microseconds per leaf (isinstance against the jax.Array ABC is slow).
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
        valid = min(shape, default=0) >= 0
      except TypeError:
        valid = False
      if not valid:
        raise ValueError(f"Leaf at {path or '<root>'} is a jax.ShapeDtypeStruct of shape "
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
          f"Leaf at {path or '<root>'} is the Python int {leaf}, outside the range of "
          f"{jnp.asarray(0).dtype} (64-bit types are disabled). Pass an array of an "
          "explicit dtype, or enable jax_enable_x64.") from None
  else:
    raise TypeError(
        f"Leaf at {path or '<root>'} is a {type(leaf).__name__}, not an array: jpack packs "
        "jax/numpy arrays, Python scalars and jax.ShapeDtypeStruct. Convert it, or mark "
        "it static (e.g. keep it out of the tree or use None).")
  dtype = _checked_dtype(leaf.dtype, path)
  if isinstance(leaf, (np.ndarray, np.generic)):  # np.memmap too: any subclass
    if isinstance(leaf, np.ma.MaskedArray):
      raise TypeError(f"Leaf at {path or '<root>'} is a numpy masked array: JAX would drop "
                      "its mask. Pass leaf.filled(value) or leaf.data.")
    _check_canonical(dtype, path, "numpy scalar of dtype" if isinstance(leaf, np.generic)
                     else "numpy array of dtype")
  return tuple(map(int, leaf.shape)), dtype


def _check_canonical(dtype: Any, path: str, what: str) -> None:
  """TypeError if JAX would silently narrow ``dtype`` (64-bit types with x64 off)."""
  canonical = dtype if _is_key_dtype(dtype) else jax.dtypes.canonicalize_dtype(dtype)
  if dtype != canonical:
    raise TypeError(
        f"Leaf at {path or '<root>'} is a {what} {dtype}, which JAX would silently turn "
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
  if not _is_key_dtype(dtype):
    checked = np.dtype(dtype)
    # ml_dtypes' bfloat16, float8_*, int4... have kind "V" but are numbers; float0 and
    # structured or raw-bytes dtypes are "V" too and are not.
    if not (checked.kind in "biufc" or jnp.issubdtype(checked, jnp.number)):
      hint = (" (the gradient of an integer or bool leaf under allow_int=True: drop those "
              "leaves, or differentiate only the float ones)"
              if checked == jax.dtypes.float0 else "")
      raise TypeError(f"Leaf at {path or '<root>'} has dtype {checked}{hint}, which jpack "
                      "cannot pack; expected a bool, integer, float or complex dtype.")
    problem = _unsupported(checked)
    if problem:
      shown = checked.name if checked.isnative else checked.str
      raise TypeError(f"Leaf at {path or '<root>'} has dtype {shown}: {problem}")
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


def _dtype_name(dtype: Any) -> str:
  if _is_key_dtype(dtype):
    return f"key<{_key_impl_name(dtype)}>"
  return np.dtype(dtype).name


def _dtype_from_name(name: str) -> Any:
  if name.startswith("key<"):
    return jax.random.key(0, impl=name[4:-1]).dtype
  return jnp.dtype(name)


def _group_name(group: tuple[str, Hashable]) -> str:
  name, label = group
  return name if label is None else f"{name} [{label}]"


_LEAF = object()


def _treedef_text(treedef: Any) -> str:
  """``str(treedef)`` without memory addresses, which differ between processes: static
  fields of custom nodes (an equinox module's activation function, say) print as
  ``<function relu at 0x7f...>``."""
  text = re.sub(r" at 0x[0-9a-fA-F]+", "", str(treedef))
  # Sets print in hash order, which for strings changes with PYTHONHASHSEED: sort the
  # elements of flat set reprs (no nested braces or dict colons).
  return re.sub(r"(frozenset\(|(?<=[\s(\[,=]))\{([^{}:]*)\}",
                lambda m: m.group(1) + "{" + ", ".join(sorted(m.group(2).split(", "))) + "}",
                text)


def _structure_to_json(treedef: Any) -> Any:
  """The tree structure as nested JSON, or None if it holds other node types."""
  try:
    skeleton = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
  except Exception:  # pragma: no cover - unflatten of exotic nodes
    return None

  def encode(node):
    if node is None:
      return {"none": None}
    if type(node) is dict:
      # Only keys JSON gives back unchanged; a tuple key would come back a list.
      if not all(k is None or type(k) in (str, int, float, bool) for k in node):
        raise _Unencodable
      return {"dict": [[k, encode(v)] for k, v in node.items()]}
    if type(node) is list:
      return {"list": [encode(v) for v in node]}
    if type(node) is tuple:
      return {"tuple": [encode(v) for v in node]}
    if type(node) is int and node == 0:
      return "*"
    raise _Unencodable

  try:
    return encode(skeleton)
  except _Unencodable:
    return None


class _Unencodable(Exception):
  pass


def _structure_from_json(doc: Any) -> Any:
  if doc == "*":
    return _LEAF
  (kind, value), = doc.items()
  if kind == "none":
    return None
  if kind == "dict":
    return {k: _structure_from_json(v) for k, v in value}
  if kind == "list":
    return [_structure_from_json(v) for v in value]
  return tuple(_structure_from_json(v) for v in value)


def _human(nbytes: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if nbytes < 1024 or unit == "GiB":
      return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1024
  return str(nbytes)  # unreachable


def _text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
  widths = [max(len(h), *(len(r[c]) for r in rows)) if rows else len(h)
            for c, h in enumerate(header)]
  line = lambda cells: "  ".join(c.rjust(w) if c[:1].isdigit() else c.ljust(w)
                                 for c, w in zip(cells, widths)).rstrip()
  return "\n".join([line(header), line(tuple("-" * w for w in widths))] +
                   [line(r) for r in rows])


def _html_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
  th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
  body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                 for r in rows)
  return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"
