"""Shared helpers for the jpack benchmarks: workloads, inputs, timing, tables, results.

Nothing here touches JAX's backend at import time, so an entry point can still set
``jax_num_cpu_devices`` after importing this module.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import re
import shlex
import statistics
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import numpy as np

from jpack._reference import Collectives, count_collectives  # noqa: F401  (the benches use both)

BENCHMARKS_DIR = pathlib.Path(__file__).resolve().parent
WORKLOADS_DIR = BENCHMARKS_DIR / "workloads"
RESULTS_DIR = BENCHMARKS_DIR / "results"

# -- command-line arguments -------------------------------------------------------------


def positive_int(text: str) -> int:
  """argparse type: an integer >= 1 (0 or -1 runs would divide by zero or crash late)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def output_path(text: str) -> str:
  """argparse type: a file path whose directory exists, checked before the benchmark
  runs for minutes and fails at the end."""
  path = pathlib.Path(text)
  if path.is_dir():
    raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
  if not path.parent.is_dir():
    raise argparse.ArgumentTypeError(f"directory {str(path.parent)!r} of {text!r} does not exist")
  return text


def check_workload_names(names: list[str], flag: str, extra: tuple[str, ...] = ()) -> None:
  """Exit with the list of choices if a name is not a workload (or in ``extra``)."""
  known = set(_available()) | set(extra)
  unknown = [n for n in names if n not in known]
  if unknown:
    raise SystemExit(f"{flag}: unknown workload(s) {', '.join(map(repr, unknown))}; "
                     f"available: {', '.join(sorted(known))}")


# -- workloads -------------------------------------------------------------------------


def workload_names() -> list[str]:
  """Names of the workloads (benchmarks/workloads/*.json), smallest first."""
  names = _available()
  docs = {n: load_workload_doc(n) for n in names}
  return sorted(names, key=lambda n: (docs[n]["num_elements"], n))


def load_workload_doc(name: str) -> dict:
  """The raw JSON document of a workload."""
  path = WORKLOADS_DIR / f"{name}.json"
  try:
    text = path.read_text()
  except FileNotFoundError:
    raise SystemExit(f"Unknown workload {name!r}; available: "
                     f"{', '.join(sorted(_available()))}") from None
  return json.loads(text)


def _available() -> list[str]:
  return [p.stem for p in WORKLOADS_DIR.glob("*.json")]


@dataclasses.dataclass
class Workload:
  """A (possibly subset) workload: a flat ``{path: ShapeDtypeStruct}`` dict."""

  name: str
  shapes: dict[str, jax.ShapeDtypeStruct]
  full_leaves: int
  full_elements: int

  @property
  def num_leaves(self) -> int:
    return len(self.shapes)

  @property
  def num_elements(self) -> int:
    return sum(math.prod(s.shape) for s in self.shapes.values())

  @property
  def nbytes(self) -> int:
    return sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in self.shapes.values())

  @property
  def dtypes(self) -> str:
    return "+".join(sorted({np.dtype(s.dtype).name for s in self.shapes.values()}))

  @property
  def subset(self) -> bool:
    return self.num_leaves != self.full_leaves

  def describe(self) -> str:
    text = (f"{self.name}: {self.num_leaves} leaves, {self.num_elements / 1e6:.2f} M elements, "
            f"{human_bytes(self.nbytes)} ({self.dtypes})")
    if self.subset:
      text += (f"  [subset of {self.full_leaves} leaves / "
               f"{self.full_elements / 1e6:.1f} M elements]")
    return text


def load_workload(name: str, *, max_leaves: int | None = None,
                  max_elements: int | None = None) -> Workload:
  """Load a workload as ``{path: jax.ShapeDtypeStruct}``.

  With ``max_leaves`` / ``max_elements`` a subset is kept: leaves in file order, each
  taken if it still fits both budgets (a leaf larger than the remaining element budget
  is skipped, later smaller ones may still be taken).
  """
  doc = load_workload_doc(name)
  shapes: dict[str, jax.ShapeDtypeStruct] = {}
  total = 0
  for leaf in doc["leaves"]:
    if max_leaves is not None and len(shapes) >= max_leaves:
      break
    shape = tuple(int(d) for d in leaf["shape"])
    size = math.prod(shape)
    if max_elements is not None and total + size > max_elements:
      continue
    shapes[leaf["path"]] = jax.ShapeDtypeStruct(shape, np.dtype(_dtype(leaf["dtype"])))
    total += size
  return Workload(name, shapes, int(doc["num_leaves"]), int(doc["num_elements"]))


def synthetic_small_leaves(num_leaves: int = 1000, total_bytes: int = 2**20,
                           seed: int = 0) -> Workload:
  """``num_leaves`` f32 leaves of varied small sizes, ``total_bytes`` in all."""
  rng = np.random.default_rng(seed)
  weights = rng.uniform(0.2, 1.8, num_leaves)
  total = total_bytes // 4
  sizes = np.maximum(1, np.floor(weights / weights.sum() * total)).astype(int)
  sizes[-1] += total - sizes.sum()
  shapes = {f"leaf{i:04d}": jax.ShapeDtypeStruct((int(s),), np.dtype(np.float32))
            for i, s in enumerate(sizes)}
  name = f"small_{num_leaves}_{human_bytes(total_bytes).replace(' ', '')}"
  return Workload(name, shapes, num_leaves, int(sizes.sum()))


def _dtype(name: str) -> Any:
  import jax.numpy as jnp  # bfloat16 & co. come from ml_dtypes through jnp
  return jnp.dtype(name)


# -- inputs ----------------------------------------------------------------------------


def random_numpy(shape: Sequence[int], dtype: Any, rng: np.random.Generator) -> np.ndarray:
  """Uniform [0, 1) values of ``dtype`` (cheap to make, never NaN)."""
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.integer):
    return rng.integers(0, 100, size=shape, dtype=dtype)
  return rng.random(size=shape, dtype=np.float32).astype(dtype)


def random_tree(shapes: dict[str, jax.ShapeDtypeStruct], *, seed: int = 0,
                lead: int | None = None, sharding: Any = None) -> dict[str, jax.Array]:
  """Random device arrays for ``shapes``.

  Args:
    shapes: ``{path: ShapeDtypeStruct}``.
    seed: numpy seed.
    lead: prepend a leading axis of this size (one slice per device).
    sharding: a `jax.sharding.Sharding` to place every leaf with (default: device 0).
  """
  rng = np.random.default_rng(seed)
  out = {}
  for path, s in shapes.items():
    shape = tuple(s.shape) if lead is None else (lead, *s.shape)
    out[path] = place(random_numpy(shape, s.dtype, rng), sharding)
  return jax.block_until_ready(out)


def place(x: Any, sharding: Any = None) -> jax.Array:
  if sharding is None:
    return jax.device_put(x, jax.devices()[0])
  return jax.device_put(x, sharding)


# -- timing ----------------------------------------------------------------------------


@dataclasses.dataclass
class Compiled:
  """An AOT-compiled function and how long it took to get it."""

  fn: Any  # jax.stages.Compiled
  lower_s: float
  compile_s: float

  @property
  def total_s(self) -> float:
    return self.lower_s + self.compile_s

  def text(self) -> str:
    return self.fn.as_text()


def compile_fn(f: Callable, *args: Any, jit_kwargs: dict | None = None) -> Compiled:
  """``jax.jit(f).lower(*args).compile()``, timing lowering (incl. tracing) and compile.

  Run the returned ``.fn`` rather than ``jax.jit(f)``: calling the jitted function would
  compile a second time (AOT results do not fill jit's cache).
  """
  jitted = f if isinstance(f, jax.stages.Wrapped) else jax.jit(f, **(jit_kwargs or {}))
  t0 = time.perf_counter()
  lowered = jitted.lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return Compiled(compiled, t1 - t0, t2 - t1)


@dataclasses.dataclass
class Timing:
  median_s: float
  min_s: float
  runs: int
  samples: tuple[float, ...] = ()  # every timed call, in order (rounds, when interleaved)

  @property
  def ms(self) -> float:
    return 1e3 * self.median_s


def time_fn(f: Callable, *args: Any, runs: int = 5, warmup: int = 1) -> Timing:
  """Median wall time of ``f(*args)`` over ``runs`` calls, after ``warmup`` calls.

  Every call is followed by `jax.block_until_ready`; the output is dropped before the
  next call so only one result is alive at a time. Place ``args`` on their devices
  first, or this times the transfer.
  """
  for _ in range(warmup):
    out = f(*args)
    jax.block_until_ready(out)
    del out
  times = []
  for _ in range(max(1, runs)):
    t0 = time.perf_counter()
    out = f(*args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
    del out
  return Timing(statistics.median(times), min(times), len(times))


def time_interleaved(calls: dict[str, tuple[Callable, tuple[Any, ...]]], *, runs: int = 5,
                     warmup: int = 1) -> dict[str, Timing]:
  """Median wall time of each ``f(*args)`` in ``calls``, timed in rounds of one call each.

  Variants timed one after the other see different host states (allocator and page
  state move the time of one large CPU collective from run to run, and any ratio
  against it with them). In rounds every variant meets the same drifts, so their
  ratios hold; the order rotates from round to round. Outputs are dropped before the
  next call.
  """
  for f, args in calls.values():
    for _ in range(warmup):
      jax.block_until_ready(f(*args))
  times: dict[str, list[float]] = {key: [] for key in calls}
  keys = list(calls)
  for r in range(max(1, runs)):
    # Each round starts one variant later: a call slowed by the one before it (a large
    # output freed, pages to fault back) is not always slowed by the same one.
    for key in keys[r % len(keys):] + keys[:r % len(keys)]:
      f, args = calls[key]
      t0 = time.perf_counter()
      out = f(*args)
      jax.block_until_ready(out)
      times[key].append(time.perf_counter() - t0)
      del out
  return {key: Timing(statistics.median(t), min(t), len(t), tuple(t))
          for key, t in times.items()}


def paired_ratio(a: Timing, b: Timing) -> float:
  """Median over rounds of ``a``'s time / ``b``'s time in the same round, for two
  timings from one `time_interleaved` call: drifts that last a round cancel out."""
  if not a.samples or len(a.samples) != len(b.samples):
    raise ValueError("paired_ratio needs two timings from the same interleaved rounds")
  return statistics.median(x / y for x, y in zip(a.samples, b.samples))


def time_python(f: Callable, *args: Any, runs: int = 20) -> Timing:
  """Median wall time of a pure-Python call (one warm-up call first)."""
  f(*args)
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    f(*args)
    times.append(time.perf_counter() - t0)
  return Timing(statistics.median(times), min(times), len(times))


# -- tables ----------------------------------------------------------------------------


class Table:
  """A plain table: aligned text for the terminal, GitHub Markdown, or JSON rows."""

  def __init__(self, columns: Sequence[str], title: str = ""):
    self.columns = list(columns)
    self.title = title
    self.rows: list[list[str]] = []
    self.values: list[dict[str, Any]] = []

  def add(self, *cells: Any, **values: Any) -> None:
    """Add a row: one formatted cell per column, and the unrounded numbers behind them
    (seconds, bytes, ratios) as ``values``, which only the JSON results carry."""
    if len(cells) != len(self.columns):
      raise ValueError(f"row has {len(cells)} cells, table has {len(self.columns)} columns")
    self.rows.append(["" if c is None else str(c) for c in cells])
    self.values.append(values)

  def json(self) -> dict[str, Any]:
    rows = [{"cells": dict(zip(self.columns, cells)), "values": values}
            for cells, values in zip(self.rows, self.values)]
    return {"title": self.title, "columns": self.columns, "rows": rows}

  def _right(self, col: int) -> bool:
    """Right-align columns whose cells all look numeric."""
    cells = [r[col] for r in self.rows if r[col] not in ("", "-")]
    return bool(cells) and all(_looks_numeric(c) for c in cells)

  def text(self) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in self.rows]) for i, h in enumerate(self.columns)]
    right = [self._right(i) for i in range(len(self.columns))]

    def line(cells):
      return "  ".join(c.rjust(w) if r else c.ljust(w)
                       for c, w, r in zip(cells, widths, right)).rstrip()

    out = [self.title] if self.title else []
    out += [line(self.columns), line(["-" * w for w in widths])]
    out += [line(r) for r in self.rows]
    return "\n".join(out)

  def markdown(self) -> str:
    right = [self._right(i) for i in range(len(self.columns))]
    esc = lambda c: c.replace("|", "\\|")
    out = [f"**{self.title}**", ""] if self.title else []
    out.append("| " + " | ".join(esc(c) for c in self.columns) + " |")
    out.append("|" + "|".join("---:" if r else "---" for r in right) + "|")
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in self.rows]
    return "\n".join(out)


_NUM_RE = re.compile(r"^[-+]?(\d[\d,]*\.?\d*|\.\d+)(e[-+]?\d+)?\s*(x|×|%|ms|s|MB|MiB|KiB|GB)?$")


def _looks_numeric(cell: str) -> bool:
  return bool(_NUM_RE.match(cell.strip()))


def add_output_args(parser: argparse.ArgumentParser, name: str) -> None:
  """``--json PATH`` (default ``benchmarks/results/<name>.json``) and ``--markdown FILE``."""
  parser.add_argument("--json", metavar="PATH", type=output_path,
                      default=str(RESULTS_DIR / f"{name}.json"),
                      help="write the tables, the machine and the command line as JSON "
                           "(default: %(default)s)")
  parser.add_argument("--markdown", metavar="FILE", type=output_path,
                      help="also write the tables as Markdown")


class Report:
  """Collects tables and text blocks; prints them, writes them as Markdown or JSON.

  Args:
    title: the report's heading.
    name: the benchmark, as ``python -m benchmarks <name>`` runs it.
    argv: its command-line arguments, recorded with the results.
  """

  def __init__(self, title: str, name: str, argv: Sequence[str]):
    self.title = title
    self.name = name
    self.command = shlex.join(["python", "-m", "benchmarks", name, *argv])
    self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    self.parts: list[Any] = []

  def table(self, table: Table) -> None:
    self.parts.append(table)
    print("\n" + table.text(), flush=True)

  def text(self, text: str) -> None:
    self.parts.append(text)
    print(text, flush=True)

  def markdown(self) -> str:
    out = [f"# {self.title}", "", f"Machine: `{machine()}`", ""]
    for p in self.parts:
      if isinstance(p, Table):
        out += [p.markdown(), ""]
      else:
        out += ["```", p.rstrip("\n"), "```", ""] if "\n" in p.strip() else [p, ""]
    return "\n".join(out)

  def write_markdown(self, path: str | None) -> None:
    if not path:
      return
    with open(path, "w") as f:
      f.write(self.markdown())
    print(f"\nWrote {path}", flush=True)

  def json(self) -> dict[str, Any]:
    return {"benchmark": self.name, "title": self.title, "command": self.command,
            "started": self.started, "machine": machine_info(),
            "tables": [p.json() for p in self.parts if isinstance(p, Table)],
            "notes": [p for p in self.parts if not isinstance(p, Table)]}

  def write_json(self, path: str | None, doc: dict[str, Any] | None = None) -> None:
    """Write ``doc`` (by default this report's `json`) to ``path``, if given."""
    if not path:
      return
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
      json.dump(_finite(self.json() if doc is None else doc), f, indent=1)
      f.write("\n")
    print(f"\nWrote {path}", flush=True)

  def write(self, args: argparse.Namespace) -> None:
    """Write the files `add_output_args` asked for."""
    self.write_markdown(args.markdown)
    self.write_json(args.json)


def merged(earlier: dict[str, Any], now: dict[str, Any], name: str, row_order: list[str],
           table_order: list[str]) -> dict[str, Any]:
  """``now``'s JSON with ``earlier``'s results kept where ``now`` has none: the tables
  of the workloads (``values[name]`` of their rows) it did not run, and in those it did,
  the rows of the variants (``values["key"]``) it did not run. Rows follow
  ``row_order`` and tables ``table_order``; both runs' commands are listed."""
  def table_name(table):
    return table["rows"][0]["values"].get(name) if table["rows"] else None

  def row_key(row):
    v = row["values"]
    return v.get("key"), v.get("goal")

  order = {key: i for i, key in enumerate(row_order)}
  fresh = {(table_name(t), tuple(t["columns"])): t for t in now["tables"]}
  tables = []
  for old in earlier["tables"]:
    new = fresh.pop((table_name(old), tuple(old["columns"])), None)
    if new is not None:
      rows = {row_key(r): r for r in old["rows"]} | {row_key(r): r for r in new["rows"]}
      new = {**new, "rows": sorted(rows.values(),
                                   key=lambda r: order.get(row_key(r)[0], len(order)))}
    tables.append(new or old)
  tables += fresh.values()
  by_name = {n: i for i, n in enumerate(table_order)}
  tables.sort(key=lambda t: by_name.get(table_name(t), len(by_name)))  # stable
  commands = earlier.get("commands", [earlier["command"]])
  return {**now, "tables": tables, "commands": [*commands, now["command"]]}


def add_update_arg(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--update", action="store_true",
                      help="keep the results of the --json file that this run does not "
                           "measure again (other workloads, other variants)")


def earlier_results(args: argparse.Namespace) -> dict[str, Any] | None:
  """The --json file's results, with --update and if it exists."""
  if not (getattr(args, "update", False) and args.json and pathlib.Path(args.json).is_file()):
    return None
  return json.loads(pathlib.Path(args.json).read_text())


def _finite(x: Any) -> Any:
  """``x`` with NaN and infinities as None (JSON has no such numbers) and numpy scalars
  as Python numbers."""
  if isinstance(x, dict):
    return {str(k): _finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_finite(v) for v in x]
  if isinstance(x, np.generic):
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


# -- formatting ------------------------------------------------------------------------


def fmt_ms(seconds: float | None) -> str:
  if seconds is None:
    return "-"
  ms = 1e3 * seconds
  return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def fmt_s(seconds: float | None) -> str:
  if seconds is None:
    return "-"
  return f"{seconds:.2f}" if seconds < 10 else f"{seconds:.1f}"


def fmt_ratio(x: float | None) -> str:
  if x is None or not math.isfinite(x):
    return "-"
  return f"{x:.2f}x"


def ratio(a: float | None, b: float | None) -> float | None:
  if a is None or b is None or b <= 0:
    return None
  return a / b


def human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if abs(n) < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return str(n)


def fmt_mb(n: float) -> str:
  return f"{n / 1e6:.3g}" if n < 1e8 else f"{n / 1e6:.0f}"


def collective_values(colls: Collectives) -> dict[str, Any]:
  """A row's JSON values for the collectives in a compiled program."""
  return {"collectives": colls.count, "collective_bytes": colls.result_bytes,
          "collective_arrays": colls.arrays}


def verdict(ok: bool | None) -> str:
  return "SKIP" if ok is None else ("PASS" if ok else "MISS")


# -- machine ---------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
  """CPU model and cores, library versions, and the devices JAX runs on."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          cpu = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  import jaxlib
  import optax

  import jpack

  devices = jax.devices()
  return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__,
          "jpack": jpack.__version__, "platform": devices[0].platform,
          "device_kind": devices[0].device_kind, "device_count": len(devices)}


def machine() -> str:
  """`machine_info` on one line."""
  m = machine_info()
  return (f"{m['cpu']}, {m['cores']} cores, jax {m['jax']} (jaxlib {m['jaxlib']}), "
          f"optax {m['optax']}, {m['device_count']} {m['platform']} device(s) "
          f"({m['device_kind']}), python {m['python']}")


def release_host_memory() -> None:
  """Return freed device buffers to the OS between benchmark phases (glibc only).

  XLA:CPU device buffers are malloc'ed. Once a few large buffers have been freed, glibc
  serves buffers of several MiB from its heap, and what is freed there stays in the
  process, so a run over several big models can exhaust the host's memory.
  ``malloc_trim`` hands the free pages back; it is called outside the timed regions, so
  the allocation policy the steps see is unchanged.
  """
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc
    pass


def set_cpu_devices(n: int) -> None:
  """Ask for ``n`` CPU devices; must run before JAX's backend initializes."""
  jax.config.update("jax_num_cpu_devices", n)


def require_devices(n: int) -> None:
  if jax.device_count() < n:
    raise SystemExit(
        f"Need {n} devices, have {jax.device_count()}: JAX's backend was initialized before "
        f"jax_num_cpu_devices could be set. Run the benchmark in a fresh process "
        f"(python -m benchmarks <name>).")


def banner(title: str, lines: Iterable[str] = ()) -> str:
  text = "\n".join([f"== {title} ==", f"machine: {machine()}", *lines])
  print(text, flush=True)
  return text
