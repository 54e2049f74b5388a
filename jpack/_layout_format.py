"""A `Layout` as text, HTML and JSON, and its fingerprint.

Functions over a layout's public attributes; `jpack._layout` delegates its display and
serialization methods here. Decoding returns plain fields (`LayoutFields`), which
`Layout.from_json` turns into `Slot`s and `Bucket`s, so this module never imports
`jpack._layout` at run time.
"""

from __future__ import annotations

import hashlib
import html
import json
from typing import TYPE_CHECKING, Any, Hashable, NamedTuple

import jax
import jax.numpy as jnp

from jpack._internal import dtype_from_name, dtype_name, treedef_text

if TYPE_CHECKING:  # annotations only: jpack._layout imports this module
  from jpack._layout import Layout

FORMAT = "jpack.Layout/1"

_BUCKET_HEADER = ("bucket", "dtype", "leaves", "elements", "bytes", "padding")
_LEAF_HEADER = ("bucket", "offset", "size", "dtype", "shape", "path")
# Leaf rows shown before the HTML table is cut short (a notebook cell stays readable).
_HTML_LEAF_ROWS = 200


class LayoutFields(NamedTuple):
  """A decoded layout, as the arguments of `Layout` (slots and buckets as field tuples).

  Attributes:
    treedef: the tree structure.
    slots: per leaf ``(path, bucket, offset, shape, dtype, size)``, the fields of a `Slot`.
    buckets: per bucket ``(dtype, size, slots, group)``, the fields of a `Bucket`.
    align_bytes: the alignment of every leaf offset.
    num_shards: every bucket length is a multiple of this (times the alignment).
  """

  treedef: Any
  slots: tuple[tuple[Any, ...], ...]
  buckets: tuple[tuple[Any, ...], ...]
  align_bytes: int
  num_shards: int


# -- text and HTML -----------------------------------------------------------------------


def summary_text(layout: Layout, leaves: bool = False) -> str:
  """A readable table of the buckets (and, with ``leaves=True``, of every leaf).

  Args:
    layout: the layout to describe.
    leaves: also list one row per leaf: bucket, offset, size, dtype, shape, path.

  Returns:
    A headline, the bucket table and, with ``leaves=True``, the leaf table.
  """
  out = [_headline(layout), _text_table(_BUCKET_HEADER, _bucket_rows(layout))]
  if leaves:
    out.append(_text_table(_LEAF_HEADER, _leaf_rows(layout)))
  return "\n".join(out)


def summary_html(layout: Layout) -> str:
  """The summary as HTML for notebooks: the bucket table and a collapsed leaf table.

  Args:
    layout: the layout to describe.

  Returns:
    An HTML fragment (a ``div``); the leaf table shows at most 200 rows.
  """
  head = html.escape(_headline(layout))
  table = _html_table(_BUCKET_HEADER, _bucket_rows(layout))
  leaf_rows = _leaf_rows(layout)
  hidden = len(leaf_rows) - _HTML_LEAF_ROWS
  more = f"<p>… {hidden} more leaves</p>" if hidden > 0 else ""
  leaves = (f"<details><summary>{len(leaf_rows)} leaves</summary>"
            f"{_html_table(_LEAF_HEADER, leaf_rows[:_HTML_LEAF_ROWS])}{more}</details>")
  return f"<div class='jpack-layout'><p><b>{head}</b></p>{table}{leaves}</div>"


def _headline(layout: Layout) -> str:
  return (f"Layout {layout.fingerprint}: {layout.num_leaves} leaves in "
          f"{len(layout.buckets)} buckets, {_human(layout.leaf_nbytes)} of leaves in "
          f"{_human(layout.nbytes)} (align {layout.align_bytes} B, "
          f"{layout.num_shards} shard(s))")


def _bucket_rows(layout: Layout) -> list[tuple[str, ...]]:
  rows = []
  for i, b in enumerate(layout.buckets):
    used = sum(layout.slots[j].nbytes for j in b.slots)
    pad = 100.0 * (b.nbytes - used) / b.nbytes if b.nbytes else 0.0
    rows.append((str(i), _group_name(b.group), str(len(b.slots)), f"{b.size:,}",
                 _human(b.nbytes), f"{pad:.1f}%"))
  return rows


def _leaf_rows(layout: Layout) -> list[tuple[str, ...]]:
  rows = []
  for b_index, b in enumerate(layout.buckets):
    for j in b.slots:
      s = layout.slots[j]
      rows.append((str(b_index), str(s.offset), str(s.size), dtype_name(s.dtype),
                   str(s.shape), s.path or "<root>"))
  return rows


def _group_name(group: tuple[str, Hashable]) -> str:
  name, label = group
  return name if label is None else f"{name} [{label}]"


def _human(nbytes: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if nbytes < 1024 or unit == "GiB":
      return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
    nbytes /= 1024
  return str(nbytes)  # unreachable


def _text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
  widths = [max(len(h), *(len(r[c]) for r in rows)) if rows else len(h)
            for c, h in enumerate(header)]

  def line(cells):  # numbers right-aligned, text left-aligned
    return "  ".join(c.rjust(w) if c[:1].isdigit() else c.ljust(w)
                     for c, w in zip(cells, widths)).rstrip()

  return "\n".join([line(header), line(tuple("-" * w for w in widths))] +
                   [line(r) for r in rows])


def _html_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
  th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
  body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                 for r in rows)
  return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


# -- JSON and fingerprint ----------------------------------------------------------------


def layout_fingerprint(layout: Layout) -> str:
  """16 hex digits of the SHA-256 of `layout_to_json`: equal across processes and runs.

  Args:
    layout: the layout to hash.

  Returns:
    The fingerprint.
  """
  return hashlib.sha256(layout_to_json(layout).encode()).hexdigest()[:16]


def layout_to_json(layout: Layout) -> str:
  """The layout as canonical JSON: equal layouts give equal strings.

  The fingerprint hashes this string, so its format must only change together with
  `FORMAT`.

  Args:
    layout: the layout to encode.

  Returns:
    Compact JSON with sorted keys.
  """
  doc = {
      "format": FORMAT,
      "treedef": treedef_text(layout.treedef),
      "structure": _structure_to_json(layout.treedef),
      "align_bytes": layout.align_bytes,
      "num_shards": layout.num_shards,
      "slots": [[s.path, s.bucket, s.offset, list(s.shape), dtype_name(s.dtype), s.size]
                for s in layout.slots],
      "buckets": [[b.dtype.name, b.size, list(b.slots), list(b.group)]
                  for b in layout.buckets],
  }
  return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def layout_from_json(text: str, treedef: Any = None) -> LayoutFields:
  """Decode `layout_to_json`'s output.

  Args:
    text: the JSON string.
    treedef: the tree structure, or ``None`` to rebuild it from the saved structure.

  Returns:
    The layout's fields.

  Raises:
    ValueError: ``text`` is not a saved layout; ``treedef`` is needed (the structure
      holds node types or dict keys JSON cannot describe) or does not match the saved one.
  """
  doc = json.loads(text)
  fmt = doc.get("format") if isinstance(doc, dict) else None
  if fmt != FORMAT:
    raise ValueError(f"Not a jpack layout (format={fmt!r}); expected "
                     "text produced by Layout.to_json().")
  if treedef is None:
    if doc["structure"] is None:
      raise ValueError(
          f"The saved tree structure {doc['treedef']} uses node types JSON cannot "
          "describe; pass treedef=jax.tree.structure(your_tree) to Layout.from_json.")
    treedef = jax.tree.structure(_structure_from_json(doc["structure"]),
                                 is_leaf=lambda x: x is _LEAF)
  if treedef_text(treedef) != doc["treedef"]:
    raise ValueError(f"treedef {treedef} does not match the saved one {doc['treedef']}.")
  slots = tuple((p, b, o, tuple(sh), dtype_from_name(d), n)
                for p, b, o, sh, d, n in doc["slots"])
  buckets = tuple((jnp.dtype(name), size, tuple(members), tuple(group))
                  for name, size, members, group in doc["buckets"])
  return LayoutFields(treedef, slots, buckets, doc["align_bytes"], doc["num_shards"])


# Stands for a leaf in a decoded structure (a leaf of the skeleton is the int 0).
_LEAF = object()


class _Unencodable(Exception):
  pass


def _structure_to_json(treedef: Any) -> Any:
  """The tree structure as nested JSON, or None if it holds other node types."""
  try:
    skeleton = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
  except Exception:  # pragma: no cover - unflatten of exotic nodes
    return None
  try:
    return _encode_node(skeleton)
  except _Unencodable:
    return None


def _encode_node(node: Any) -> Any:
  if node is None:
    return {"none": None}
  if type(node) is dict:
    # Only keys JSON gives back unchanged; a tuple key would come back a list.
    if not all(k is None or type(k) in (str, int, float, bool) for k in node):
      raise _Unencodable
    return {"dict": [[k, _encode_node(v)] for k, v in node.items()]}
  if type(node) is list:
    return {"list": [_encode_node(v) for v in node]}
  if type(node) is tuple:
    return {"tuple": [_encode_node(v) for v in node]}
  if type(node) is int and node == 0:
    return "*"
  raise _Unencodable


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
