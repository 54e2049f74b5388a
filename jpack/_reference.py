"""The steps jpack is measured against, and what compiled programs are read for.

Used by `python -m jpack demo` and by the benchmarks (``benchmarks/``, which import it;
nothing in jpack imports them). The steps are the usual data-parallel steps written
without jpack: a shard_map step with a ``lax.pmean`` per gradient leaf
(`per_leaf_step`) and plain ``jax.jit`` on sharded arrays (`jit_step`). The HLO readers
count the collectives in ``compiled.as_text()`` and read a scheduled GPU program's
kernels, bytes and overlap (`analyze_program`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

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


_GROUPS_RE = re.compile(r"replica_groups=(\{(?:\{[\d,]*\},?)*\}|\[\d+,\d+\]<=\[[\d,]+\]"
                        r"(?:T\([\d,]+\))?|mesh\[[^\]]*\](?:, device_ids=\(\[[\d,]+\](?:T\([\d,]+\))?\))?"
                        r" \{[^}]*\})")


def replica_groups(text: str) -> list[list[int]] | None:
  """The device groups of the first ``replica_groups=`` in ``text``: the explicit form
  ``{{0,1},{2,3}}`` or the iota form ``[2,2]<=[2,2]T(1,0)`` (an arange of the dims,
  transposed, cut into the groups); None without one."""
  m = _GROUPS_RE.search(text)
  if not m:
    return None
  spec = m.group(1)
  if spec.startswith("{"):
    return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", spec)]
  if spec.startswith("mesh"):  # mesh['a'=8,'b'=8], device_ids=(...) {'b'}: along 'b'
    sizes = [(name, int(n)) for name, n in re.findall(r"'(\w+)'=(\d+)", spec)]
    along = re.findall(r"'(\w+)'", spec[spec.index("{"):])
    ids = re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", spec)
    # The devices at the mesh's positions: an iota, or the one device_ids gives.
    devices = _iota(*ids.groups()) if ids else _iota(",".join(str(n) for _, n in sizes))
    order = ([i for i, (name, _) in enumerate(sizes) if name not in along]
             + [i for i, (name, _) in enumerate(sizes) if name in along])
    size = math.prod(n for name, n in sizes if name in along)
    grid = devices.reshape([n for _, n in sizes]).transpose(order)
    return grid.reshape(-1, size).tolist()
  groups, dims, perm = re.fullmatch(r"\[(\d+,\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                                    spec).groups()
  return _iota(dims, perm).reshape([int(d) for d in groups.split(",")]).tolist()


def _iota(dims: str, perm: str | None = None) -> Any:
  """XLA's iota tile assignment ``[dims]T(perm)``: an arange of ``dims``, transposed,
  flattened."""
  import numpy as np

  shape = [int(d) for d in dims.split(",")]
  order = [int(d) for d in perm.split(",")] if perm else list(range(len(shape)))
  return np.arange(math.prod(shape)).reshape(shape).transpose(order).ravel()


def crossing_bytes(hlo_text: str, per_node: int) -> int:
  """Operand bytes per device of the collectives whose replica groups hold devices of
  more than one node (devices ``k * per_node ...`` to ``(k + 1) * per_node - 1`` make
  node k): what a step puts on the network between nodes. Ops inside loops count once."""
  total = 0
  for line in hlo_text.splitlines():
    line = _INDEX_COMMENT_RE.sub("", line)
    m = _OP_RE.search(line)
    groups = replica_groups(line) if m else None
    if groups is None or (groups and all(len({d // per_node for d in g}) == 1
                                         for g in groups)):
      continue  # no collective, or every group within a node ({}: all devices)
    op, size, kind = m.group("op"), len(groups[0]) if groups else 0, m.group("type")
    if m.group("start") and op != "all-reduce":  # (operands, results): the first
      total += _type_bytes(_first_element(kind))
    elif op == "all-gather":
      total += _type_bytes(kind) // max(size, 1)
    elif op == "reduce-scatter":
      total += _type_bytes(kind) * size
    else:  # all-reduce (its start's type: the results), all-to-all
      total += _type_bytes(kind)
  return total


def _first_element(tuple_type: str) -> str:
  """``(A, B)`` -> ``A``, where A may itself be a tuple."""
  depth = 0
  for i, ch in enumerate(tuple_type):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 1:
      return tuple_type[1:i]
  return tuple_type


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
# A matmul or convolution kernel: a cuBLAS/cuDNN call or a Triton gemm fusion.
_MATMUL_RE = re.compile(r'__cublas|__cudnn\$conv|"kind":"__triton[a-z_]*gemm')


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
  leading: bool = False  # done before the program's first matmul or convolution


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
  matmul_seen = False  # a matmul or convolution kernel scheduled so far
  collectives: list[CollectiveOp] = []
  per_kernel: list[tuple[str, str, int]] = []

  def is_kernel(i: _Instr) -> bool:
    return i.op not in _NOT_KERNELS and not i.op.endswith("-done")

  def walk(comp: str, trips: int) -> None:
    nonlocal kernels, hbm, copies, copy_bytes, matmul_seen
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
      matmul_seen = matmul_seen or bool(_MATMUL_RE.search(i.line))
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
      leading = not matmul_seen and not any(_MATMUL_RE.search(k.line) for k in between)
      collectives.append(CollectiveOp(base, dtype, out * trips, overlapped, leading))

  walk(entry, 1)
  return Program(kernels, hbm, copies, copy_bytes, tuple(collectives), tuple(per_kernel))


def loop_collectives(hlo_text: str) -> Collectives:
  """The collectives in while-loop bodies (and what they call): the count of the whole
  program has them once, yet they run once per iteration (lax.scan's micro-steps)."""
  comps, _ = _computations(hlo_text)
  todo = [c for instrs in comps.values() for i in instrs if i.op == "while" for c in i.calls]
  inside: set[str] = set()
  while todo:
    name = todo.pop()
    if name not in inside and name in comps:
      inside.add(name)
      todo += [c for i in comps[name] for c in i.calls]
  return count_collectives("\n".join(i.line for name in inside for i in comps[name]))


def compiled_hlo(dp: Any, state: Any, batch: Any) -> str:
  """The optimized HLO of the program ``dp.step`` runs.

  ``dp.step`` is a jitted function (the plain steps) or a thin Python wrapper around one
  (``jpack.data_parallel``); lowering that jitted function again for the same arguments
  hits JAX's compilation cache (no second compile). If the wrapper ever stops exposing
  it, compile ``jax.jit(dp.step)`` instead: the same program, at the cost of one more
  compile.
  """
  import jax

  if callable(getattr(dp.step, "lower", None)):
    return dp.step.lower(state, batch).compile().as_text()
  for cell in getattr(dp.step, "__closure__", None) or ():
    try:
      inner = cell.cell_contents
    except ValueError:  # empty cell
      continue
    if callable(getattr(inner, "lower", None)):
      try:
        return inner.lower(state, batch).compile().as_text()
      except Exception:  # noqa: BLE001 - not the step function after all: fall back
        break
  return jax.jit(dp.step).lower(state, batch).compile().as_text()


def human_bytes(n: float, digits: int = 1) -> str:
  """``n`` bytes in B, KiB, MiB or GiB, with ``digits`` decimals above bytes."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
    n /= 1024
  raise AssertionError  # unreachable


# -- the steps without jpack -----------------------------------------------------------


def loss_in(loss_fn: Callable, param_dtype: Any = None) -> Callable:
  """``loss_fn`` on the params cast to ``param_dtype`` (float32 params stay the masters:
  their gradients come back float32 through the cast)."""
  if param_dtype is None:
    return loss_fn
  import jpack

  return lambda params, *rest: loss_fn(jpack.cast_params(params, param_dtype), *rest)


def _multi_steps(optimizer: Any, accumulate: int) -> Any:
  """``optimizer`` applied every ``accumulate`` calls to the mean of their gradients
  (``optax.MultiSteps``), or ``optimizer`` itself."""
  import optax

  if accumulate == 1:
    return optimizer
  return optax.MultiSteps(optimizer, every_k_schedule=accumulate).gradient_transformation()


def _scan_micro_batches(update: Callable, carry: Any, batch: Any, accumulate: int,
                        split: Callable) -> tuple[Any, tuple[Any, Any]]:
  """``update`` once on ``batch``, or over its ``accumulate`` micro-batches under
  `jax.lax.scan` (MultiSteps applies the optimizer on the last one): the new carry, the
  mean loss and the last gradient norm."""
  import jax

  if accumulate == 1:
    return update(carry, batch)
  carry, (losses, norms) = jax.lax.scan(update, carry, jax.tree.map(split, batch))
  return carry, (losses.mean(), norms[-1])


def per_leaf_step(loss_fn: Callable, optimizer: Any, params: Any, mesh: Any, *,
                  reduce: Callable[[Any], Any] | None = None,
                  norm: Callable[[Any], Any] | None = None, param_dtype: Any = None,
                  accumulate: int = 1) -> Any:
  """The usual data-parallel step without jpack: a shard_map step with a ``lax.pmean``
  per gradient leaf.

  Args:
    loss_fn: ``loss_fn(params, batch)``, or with a model state given to ``init``
      (``init(params, model_state)``), ``loss_fn(params, model_state, batch) -> (loss,
      new_model_state)``, the new state averaged leaf by leaf as `jpack.data_parallel`
      averages it.
    reduce: gradients -> their mean over the axis (default: a ``lax.pmean`` per leaf);
      ``lambda g: g`` where ``optimizer`` reduces them itself.
    norm: the optimizer state -> the reported gradient norm, where ``reduce`` leaves
      the gradients unreduced (default: the norm of the reduced gradients).
    param_dtype: the loss sees the params cast to it.
    accumulate: micro-batches of each device's rows per step, under ``jax.lax.scan``,
      with ``optax.MultiSteps``: every micro-batch's gradients are reduced.

  Returns a `jpack.DataParallel` over the mesh's first axis. Its ``layout``, planned as
  data_parallel plans it (`jpack.step_options`), is only reported: the step never packs.
  """
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jpack

  axis = mesh.axis_names[0]
  reduce = reduce or (lambda grads: jax.tree.map(lambda g: jax.lax.pmean(g, axis), grads))
  loss_fn = loss_in(loss_fn, param_dtype)
  optimizer = _multi_steps(optimizer, accumulate)

  def update(carry, batch):
    params, opt_state, model_state = carry
    # Differentiate w.r.t. this device's copy of the params: shard_map's autodiff would
    # otherwise all-reduce each gradient leaf by itself, before the reduction below.
    mine = jax.tree.map(lambda x: jax.lax.pcast(x, axis, to="varying"), params)
    if model_state is None:
      loss, grads = jax.value_and_grad(loss_fn)(mine, batch)
    else:
      (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          mine, model_state, batch)
      model_state = jax.tree.map(lambda x: jax.lax.pmean(x, axis), model_state)
    grads = reduce(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    grad_norm = optax.tree.norm(grads) if norm is None else norm(opt_state)
    return ((optax.apply_updates(params, updates), opt_state, model_state),
            (jax.lax.pmean(loss, axis), grad_norm))

  def local_step(state, batch):
    carry = (state.params, state.opt_state, state.model_state)
    (params, opt_state, model_state), (loss, grad_norm) = _scan_micro_batches(
        update, carry, batch, accumulate, lambda x: x.reshape((accumulate, -1) + x.shape[1:]))
    new = jpack.TrainState(params, opt_state, state.step + 1, model_state)
    return new, {"loss": loss, "grad_norm": grad_norm}

  def local_init(p, model_state=None):
    return jpack.TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32), model_state)

  init = jax.jit(jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=P()))
  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(axis)),
                               out_specs=(P(), P())), donate_argnums=0)
  replicated = NamedSharding(mesh, P())
  return jpack.DataParallel(
      lambda p, model_state=None: init(*jax.device_put((p, model_state), replicated)),
      step, lambda state: state.params, _reported_layout(params, mesh))


def zero1_sharding(x: Any, mesh: Any) -> Any:
  """``x`` split over the mesh's last axis (a node's devices, on a (node, gpu) mesh)
  along its largest dimension that splits evenly (the first of equal ones); replicated
  when none does, as adam's step count."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  axis = mesh.axis_names[-1]
  n = mesh.shape[axis]
  for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
    if x.shape[d] and x.shape[d] % n == 0:
      return NamedSharding(mesh, P(*(axis if i == d else None for i in range(x.ndim))))
  return NamedSharding(mesh, P())


def jit_step(loss_fn: Callable, optimizer: Any, params: Any, mesh: Any, *,
             param_dtype: Any = None, accumulate: int = 1, shard_state: bool = False,
             shard_params: bool = False) -> Any:
  """Data parallelism as plain ``jax.jit`` gives it: a step over global arrays, params
  replicated and the batch split over the mesh's axes by their shardings. XLA
  partitions the step and inserts the gradient all-reduces itself.

  ``shard_state``: the optimizer state split over the axis (`zero1_sharding`), so XLA
  updates each device's slice and all-gathers the new params (ZeRO-1 by sharding);
  ``shard_params``: the params split that way too (FSDP by sharding). ``param_dtype``
  and ``accumulate`` (``optax.MultiSteps``) as in `per_leaf_step`. The shardings are
  ``in_shardings`` / ``out_shardings``, which meshes of Explicit and of Auto axes both
  take. Returns a `jpack.DataParallel`; its ``layout`` is only reported.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jpack

  axis = mesh.axis_names  # the batch is split over every axis
  replicated = NamedSharding(mesh, P())
  n = mesh.size
  loss_fn = loss_in(loss_fn, param_dtype)
  optimizer = _multi_steps(optimizer, accumulate)
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
  split = (lambda x: zero1_sharding(x, mesh)) if shard_state else (lambda _: replicated)
  shardings = jpack.TrainState(
      jax.tree.map(split if shard_params else (lambda _: replicated), like),
      jax.tree.map(split, jax.eval_shape(optimizer.init, like)), replicated)

  def update(carry, batch):
    params, opt_state = carry
    # The mean over the global batch: with equal slices, the mean of the per-device
    # means that the shard_map steps average, so every step takes the same gradient.
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), (loss, optax.tree.norm(grads))

  def split_rows(x):
    # Micro-batch j: the j-th of each device's row blocks, so no row changes device.
    x = x.reshape((n, accumulate, -1) + x.shape[1:])
    return jnp.moveaxis(x, 1, 0).reshape((accumulate, -1) + x.shape[3:])

  def global_step(state, batch):
    (params, opt_state), (loss, grad_norm) = _scan_micro_batches(
        update, (state.params, state.opt_state), batch, accumulate, split_rows)
    new = jpack.TrainState(params, opt_state, state.step + 1)
    return new, {"loss": loss, "grad_norm": grad_norm}

  init = jax.jit(lambda p: jpack.TrainState(p, optimizer.init(p), jnp.zeros((), jnp.int32)),
                 out_shardings=shardings)
  step = jax.jit(global_step, in_shardings=(shardings, NamedSharding(mesh, P(axis))),
                 out_shardings=(shardings, replicated), donate_argnums=0)
  # Split params are placed by init itself: never whole on one device first.
  place = (lambda p: p) if shard_params else (lambda p: jax.device_put(p, replicated))
  return jpack.DataParallel(lambda p: init(place(p)), step, lambda state: state.params,
                            _reported_layout(params, mesh))


def _reported_layout(params: Any, mesh: Any) -> Any:
  """The layout ``jpack.data_parallel(mode="packed")`` plans for ``params`` on ``mesh``
  (its plan options are `jpack.step_options`'): what a plain step reports."""
  import jpack

  return jpack.plan(params, **jpack.step_options(mesh)[0])
