"""Collective ops in compiled HLO text: what the benchmarks report.

Counting ops in ``compiled.as_text()`` is how we show that a step really sends a few
bucket collectives instead of one per leaf (and how many bytes they return).
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVE_OPS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")
_ABBREV = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A"}

_OP_RE = re.compile(
    r"=\s*(?P<type>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|reduce-scatter|all-gather|all-to-all)(?P<start>-start)?\(")
_INDEX_COMMENT_RE = re.compile(r"/\*index=\d+\*/")  # long tuples carry /*index=N*/ markers
_SHAPE_RE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class Collectives:
  """Collective ops in a compiled HLO module.

  Attributes:
    count: ops of each kind (``-start`` forms of async ops included). XLA merges
      several collectives into one op on a tuple of arrays; such an op counts once.
    result_bytes: bytes of each kind's results (async ``-start`` ops not counted).
    arrays: arrays all the ops move (their operands): a merged tuple all-reduce of
      160 leaves counts 160 here and 1 in ``count``.
  """

  count: dict[str, int]
  result_bytes: dict[str, int]
  arrays: int

  def short(self) -> str:
    """E.g. ``"AR1 RS3 AG3"``; ``"-"`` when there are none."""
    parts = [f"{_ABBREV[k]}{self.count[k]}" for k in COLLECTIVE_OPS if self.count[k]]
    return " ".join(parts) or "-"


def count_collectives(hlo_text: str) -> Collectives:
  """Count the collective ops in ``hlo_text`` (``compiled.as_text()``)."""
  count = dict.fromkeys(COLLECTIVE_OPS, 0)
  nbytes = dict.fromkeys(COLLECTIVE_OPS, 0)
  arrays = 0
  for line in hlo_text.splitlines():
    line = _INDEX_COMMENT_RE.sub("", line)
    m = _OP_RE.search(line)
    if not m:
      # A form the regex does not parse still counts.
      for k in COLLECTIVE_OPS:
        if f" {k}(" in line or f" {k}-start(" in line:
          count[k] += 1
      continue
    op = m.group("op")
    count[op] += 1
    arrays += _operands(line[m.end():])
    if m.group("start"):
      continue
    for dtype, dims in _SHAPE_RE.findall(m.group("type")):
      size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
      nbytes[op] += size * _ITEMSIZE.get(dtype, 4)
  return Collectives(count, nbytes, arrays)


def _operands(args: str) -> int:
  """Top-level comma-separated operands in ``args``, the text just past an op's ``(``."""
  depth, commas, seen = 0, 0, False
  for ch in args:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      if depth == 0:
        break
      depth -= 1
    elif ch == "," and depth == 0:
      commas += 1
    elif not ch.isspace():
      seen = True
  return commas + 1 if seen else 0
