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


# -- a scheduled GPU program: kernels, bytes, copies, overlap ---------------------------

# Ops that launch nothing: views, tuples, parameters, the ends of async pairs, control.
_NOT_KERNELS = frozenset((
    "parameter", "get-tuple-element", "bitcast", "tuple", "constant", "opt-barrier",
    "after-all", "add-dependency", "partition-id", "replica-id", "while", "conditional",
    "call", "all-reduce-done", "all-gather-done", "collective-permute-done", "copy-done",
    "async-done", "async-update", "send-done", "recv-done"))
# What a fusion may hold and still only move bytes (a concatenate, a slice, a pad).
_COPY_OPS = frozenset((
    "parameter", "concatenate", "slice", "bitcast", "reshape", "copy", "tuple",
    "get-tuple-element", "dynamic-slice", "dynamic-update-slice", "pad", "constant",
    "broadcast", "transpose", "bitcast-convert"))
_ELEMENTWISE = frozenset((
    "multiply", "divide", "add", "subtract", "convert", "negate", "bitcast", "copy",
    "compare", "select", "maximum", "minimum", "abs", "bitcast-convert", "sqrt", "rsqrt"))
_COLLECTIVE_BASES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                     "collective-permute")
_INSTR_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\]"
    r"(?:\{[^}]*\})?)\s+(?P<op>[a-z\-]+)\((?P<args>.*)$")
_COMP_RE = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS_RE = re.compile(r"(?:calls|body|to_apply)=%([\w.\-]+)")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _type_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE_RE.findall(text):
    size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += size * _ITEMSIZE.get(dtype, 4)
  return total


def _dtypes(text: str) -> list[str]:
  return [dtype for dtype, _ in _SHAPE_RE.findall(text)]


@dataclasses.dataclass
class _Instr:
  name: str
  op: str
  type: str
  operands: list[str]
  calls: list[str]
  line: str


def _computations(hlo_text: str) -> tuple[dict[str, list[_Instr]], str]:
  comps: dict[str, list[_Instr]] = {}
  entry, current = "", None
  for line in hlo_text.splitlines():
    line = _INDEX_COMMENT_RE.sub("", line)
    if current is None:
      m = _COMP_RE.match(line)
      if m and "=" not in line.split("{")[0].split("(")[0]:
        current = m.group("name")
        comps[current] = []
        if m.group("entry"):
          entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTR_RE.match(line)
    if m:
      args = m.group("args")
      head = args[:args.find(")")] if ")" in args else args
      comps[current].append(_Instr(m.group("name"), m.group("op"), m.group("type"),
                                   re.findall(r"%([\w.\-]+)", head),
                                   _CALLS_RE.findall(args), line))
  return comps, entry


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective in a scheduled program."""
  op: str          # "all-reduce", "reduce-scatter", ...
  dtype: str       # its operands' element type, e.g. "f32"
  bytes: int       # bytes of its result
  overlapped: bool  # a compute kernel is scheduled between its start and its done


@dataclasses.dataclass(frozen=True)
class Program:
  """What a compiled (scheduled) GPU program does per device, read from its text.

  Attributes:
    kernels: launches: fusions, custom calls, copies and collectives, in the entry
      computation and in loop bodies (counted once per trip).
    hbm_bytes: an estimate of memory traffic: every kernel reads its operands and
      writes its result once (a fused slice reads only the slice).
    copy_kernels: kernels that only move bytes (a fusion of concatenates, slices, pads
      and the like, or a copy).
    copy_bytes: bytes those kernels write.
    collectives: every collective, in schedule order.
  """
  kernels: int
  hbm_bytes: int
  copy_kernels: int
  copy_bytes: int
  collectives: tuple[CollectiveOp, ...]
  kernel_bytes: tuple[tuple[str, str, int], ...] = ()  # (name, op_name, HBM bytes)

  @property
  def overlapped(self) -> int:
    return sum(c.overlapped for c in self.collectives)

  def collective_summary(self) -> str:
    """E.g. ``"13 all-reduce f32 (349 MiB)"``; ``"none"`` when there are none."""
    groups: dict[tuple[str, str], list[int]] = {}
    for c in self.collectives:
      groups.setdefault((c.op, c.dtype), []).append(c.bytes)
    parts = [f"{len(v)} {op} {dtype} ({sum(v) / 2**20:,.0f} MiB)"
             for (op, dtype), v in groups.items()]
    return ", ".join(parts) or "none"


def analyze_program(hlo_text: str) -> Program:
  """Read a `Program` off ``compiled.as_text()`` (a scheduled XLA:GPU module)."""
  comps, entry = _computations(hlo_text)

  def copy_only(comp: str, seen: frozenset = frozenset()) -> bool:
    if comp in seen or comp not in comps:
      return False
    return all(i.op in _COPY_OPS or (i.op == "fusion" and all(
        copy_only(c, seen | {comp}) for c in i.calls)) for i in comps[comp])

  def collective_of(instr: _Instr) -> str | None:
    base = instr.op.removesuffix("-start")
    if base in _COLLECTIVE_BASES:
      return base
    if instr.op == "async-start":
      for c in instr.calls:
        for inner in comps.get(c, []):
          if inner.op in _COLLECTIVE_BASES:
            return inner.op
    return None

  read_cache: dict[str, list[int | None]] = {}

  def reads(comp: str) -> list[int | None]:
    """Per parameter of fused computation ``comp``: the bytes it reads when it only
    slices that parameter (a kernel reading one element of a bucket reads one
    element), else None (the whole operand)."""
    if comp not in read_cache:
      instrs = comps.get(comp, [])
      params = {i.name: int(re.search(r"parameter\((\d+)\)", i.line).group(1))
                for i in instrs if i.op == "parameter"}
      out: list[int | None] = [None] * len(params)
      by_name = {i.name: i for i in instrs}

      def sliced(name: str, depth: int = 0) -> int | None:
        # Bytes read of ``name`` when every use of it, through elementwise ops of its
        # shape, ends in a slice; else None.
        users = [i for i in instrs if name in i.operands]
        if not users or depth > 8:
          return None
        total = 0
        for u in users:
          if u.op in ("slice", "dynamic-slice"):
            total += _type_bytes(u.type)
          elif u.op in _ELEMENTWISE and _SHAPE_RE.findall(u.type)[1:] == [] and \
              _SHAPE_RE.findall(u.type)[0][1] == _SHAPE_RE.findall(by_name[name].type)[0][1]:
            part = sliced(u.name, depth + 1)
            if part is None:
              return None
            total += part
          else:
            return None
        return total

      for name, index in params.items():
        out[index] = sliced(name)
      read_cache[comp] = out
    return read_cache[comp]

  def operand_bytes(i: _Instr, types: dict[str, str]) -> int:
    sliced = reads(i.calls[0]) if i.op == "fusion" and i.calls else []
    total = 0
    for k, o in enumerate(i.operands):
      full = _type_bytes(types.get(o, ""))
      part = sliced[k] if k < len(sliced) else None
      total += full if part is None else min(part, full)
    return total

  kernels = hbm = copies = copy_bytes = 0
  collectives: list[CollectiveOp] = []
  per_kernel: list[tuple[str, str, int]] = []

  def is_kernel(i: _Instr) -> bool:
    return i.op not in _NOT_KERNELS and not i.op.endswith("-done")

  def walk(comp: str, trips: int) -> None:
    nonlocal kernels, hbm, copies, copy_bytes
    instrs = comps.get(comp, [])
    types = {i.name: i.type for i in instrs}
    for pos, i in enumerate(instrs):
      if i.op == "while":
        m = _TRIP_RE.search(i.line)
        for body in i.calls:
          walk(body, trips * (int(m.group(1)) if m else 1))
        continue
      if not is_kernel(i):
        continue
      kernels += trips
      out = _type_bytes(i.type)
      between: list[_Instr] = []  # what is scheduled between an async start and its done
      if i.op.endswith("-start") or i.op == "async-start":
        # An async start's type holds its operands and results: its done has the results.
        end = next((k for k in range(pos + 1, len(instrs)) if i.name in instrs[k].operands
                    and instrs[k].op.endswith("-done")), None)
        out = _type_bytes(instrs[end].type if end is not None else i.type)
        between = instrs[pos + 1:end]
      moved = trips * (out + operand_bytes(i, types))
      hbm += moved
      m = re.search(r'op_name="([^"]*)"', i.line)
      per_kernel.append((i.name, m.group(1) if m else "", moved))
      if i.op == "copy" or i.op == "copy-start" or (
          i.op == "fusion" and all(copy_only(c) for c in i.calls)):
        copies += trips
        copy_bytes += trips * out
      base = collective_of(i)
      if base is None:
        continue
      dtype = next(iter(_dtypes(types.get(i.operands[0], "") if i.operands else i.type)),
                   "?")
      overlapped = any(is_kernel(k) and collective_of(k) is None for k in between)
      collectives.append(CollectiveOp(base, dtype, out * trips, overlapped))

  walk(entry, 1)
  return Program(kernels, hbm, copies, copy_bytes, tuple(collectives), tuple(per_kernel))
