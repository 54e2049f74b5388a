"""A griffe extension used only by the docs build (mkdocs.yml loads it by path).

jpack's docstrings are Google style, with two habits griffe's Google parser reads
differently from how they are meant:

* ``Example:`` (singular) is not a section for griffe but an admonition rendered as
  Markdown, so ``>>>`` lines and their outputs become prose (``[('int32', 4)]`` even reads
  as a Markdown link). It is renamed ``Examples:``, which griffe renders as a code block.
* ``Args:`` entries that document several parameters at once
  (``layout, **plan_options: as in `jpack.psum`.``) are split into one entry per
  parameter, so the rendered table lists each with its type and griffe can still warn
  about parameters that really are missing from a signature.

Only the docstring text in memory is changed; jpack's sources are untouched.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$")
_SECTION = re.compile(r"^(\s*)(\w[\w ]*):\s*$")
_GROUPED = re.compile(r"^(\s+)(\**\w+(?:\s*,\s*\**\w+)+):(.*)$")


def rewrite(text: str) -> str:
  """Apply both rewrites to one docstring."""
  out: list[str] = []
  args_indent: int | None = None  # indentation of the "Args:" header we are inside
  item_indent: int | None = None  # indentation of its entries (set by the first one)
  for line in text.splitlines():
    line = _EXAMPLE.sub(r"\1Examples:", line)
    indent = len(line) - len(line.lstrip())
    section = _SECTION.match(line)
    if section and (args_indent is None or indent <= args_indent):
      args_indent = indent if section.group(2) == "Args" else None
      item_indent = None
    elif args_indent is not None and line.strip():
      if indent <= args_indent:
        args_indent = None
      elif item_indent is None:
        item_indent = indent
    grouped = _GROUPED.match(line) if args_indent is not None and indent == item_indent else None
    if grouped:
      prefix, names, rest = grouped.groups()
      out.extend(f"{prefix}{name.strip()}:{rest}" for name in names.split(","))
    else:
      out.append(line)
  return "\n".join(out)


class JpackDocstrings(griffe.Extension):
  """Rewrites docstrings of every loaded object before they are parsed."""

  def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
    del kwargs
    if obj.docstring is not None:
      obj.docstring.value = rewrite(obj.docstring.value)
