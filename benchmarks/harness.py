"""What every benchmark shares: workloads and inputs, the one way to time, tables and the
results file. Starts no JAX backend at import (`__main__` sets the CPU devices after)."""

import contextlib
import ctypes
import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jaxlib
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

import jpack
from benchmarks.render import _NUMERIC, markdown_table
from jpack._reference import Collectives, count_collectives, human_bytes  # noqa: F401

BENCHMARKS_DIR = pathlib.Path(__file__).resolve().parent
WORKLOADS_DIR = BENCHMARKS_DIR / "workloads"
AXIS = "batch"


def workload_names() -> list[str]:
  """The workloads of benchmarks/workloads/*.json, smallest first."""
  docs = {p.stem: json.loads(p.read_text()) for p in WORKLOADS_DIR.glob("*.json")}
  return sorted(docs, key=lambda n: (docs[n]["num_elements"], n))


def load_workload_doc(name: str) -> dict:
  return json.loads((WORKLOADS_DIR / f"{name}.json").read_text())


@dataclasses.dataclass
class Workload:
  """A (possibly subset) workload: a flat ``{path: ShapeDtypeStruct}`` dict."""
  name: str
  shapes: dict[str, jax.ShapeDtypeStruct]
  full_leaves: int

  num_leaves = property(lambda self: len(self.shapes))
  num_elements = property(lambda self: sum(math.prod(s.shape) for s in self.shapes.values()))
  nbytes = property(lambda self: sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize
                                     for s in self.shapes.values()))
  subset = property(lambda self: self.num_leaves != self.full_leaves)

  def describe(self) -> str:
    dtypes = "+".join(sorted({np.dtype(s.dtype).name for s in self.shapes.values()}))
    text = (f"{self.name}: {self.num_leaves} leaves, {self.num_elements / 1e6:.2f} M "
            f"elements, {human_bytes(self.nbytes)} ({dtypes})")
    return text + (f"  [subset of {self.full_leaves} leaves]" if self.subset else "")


def load_workload(name: str, *, max_leaves: int | None = None,
                  max_elements: int | None = None) -> Workload:
  """Workload ``name``; with budgets, the leaves in file order that still fit both."""
  import jax.numpy as jnp  # bfloat16 & co. come from ml_dtypes through jnp

  if name.startswith("small_"):
    return synthetic_small_leaves(int(name[len("small_"):]))
  doc = load_workload_doc(name)
  shapes: dict[str, jax.ShapeDtypeStruct] = {}
  total = 0
  for leaf in doc["leaves"]:
    if max_leaves is not None and len(shapes) >= max_leaves:
      break
    shape = tuple(int(d) for d in leaf["shape"])
    if max_elements is not None and total + math.prod(shape) > max_elements:
      continue
    shapes[leaf["path"]] = jax.ShapeDtypeStruct(shape, jnp.dtype(leaf["dtype"]))
    total += math.prod(shape)
  return Workload(name, shapes, int(doc["num_leaves"]))


def synthetic_small_leaves(num_leaves: int = 1000, total_bytes: int = 2**20) -> Workload:
  """``num_leaves`` f32 leaves of varied small sizes, ``total_bytes`` in all."""
  weights = np.random.default_rng(0).uniform(0.2, 1.8, num_leaves)
  sizes = np.maximum(1, np.floor(weights / weights.sum() * total_bytes // 4)).astype(int)
  sizes[-1] += total_bytes // 4 - sizes.sum()
  shapes = {f"leaf{i:04d}": jax.ShapeDtypeStruct((int(s),), np.dtype(np.float32))
            for i, s in enumerate(sizes)}
  return Workload(f"small_{num_leaves}", shapes, num_leaves)


def random_numpy(shape: Sequence[int], dtype: Any, rng: np.random.Generator) -> np.ndarray:
  """Uniform [0, 1) values of ``dtype`` (cheap to make, never NaN)."""
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.integer):
    return rng.integers(0, 100, size=shape, dtype=dtype)
  return rng.random(size=shape, dtype=np.float32).astype(dtype)


def random_tree(shapes: dict[str, jax.ShapeDtypeStruct], *, seed: int = 0,
                lead: int | None = None, sharding: Any = None) -> dict[str, jax.Array]:
  """Random arrays for ``shapes`` (with a leading axis ``lead``), placed by ``sharding``."""
  rng = np.random.default_rng(seed)
  full = lambda s: s.shape if lead is None else (lead, *s.shape)
  return jax.block_until_ready({path: jax.device_put(random_numpy(full(s), s.dtype, rng), sharding)
                                for path, s in shapes.items()})


def mesh(n: int) -> jax.sharding.Mesh:
  """A 1-D mesh of the first ``n`` devices over `AXIS`, its axis Explicit."""
  return jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:n])


def bytes_per_device(tree: Any) -> int:
  """Bytes that device 0 holds for ``tree`` (a replicated leaf counts fully)."""
  return sum(x.addressable_shards[0].data.nbytes if hasattr(x, "addressable_shards")
             else np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def max_diff(a: Any, b: Any) -> float:
  """The largest absolute difference between two trees of the same structure."""
  return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if np.size(x)),
             default=0.0)


def ravel_pmean(tree: Any) -> Any:
  """The mean of ``tree`` over `AXIS` as ``optax.flatten`` takes it: one raveled array."""
  flat, unravel = ravel_pytree(tree)
  return unravel(jax.lax.pmean(flat, AXIS))


@dataclasses.dataclass
class Compiled:
  """An AOT-compiled function (call ``fn``), and its lowering and compile times."""
  fn: Any
  lower_s: float
  compile_s: float
  total_s = property(lambda self: self.lower_s + self.compile_s)
  text = lambda self: self.fn.as_text()


def compile_fn(f: Callable, *args: Any, jit_kwargs: dict | None = None,
               options: dict | None = None) -> Compiled:
  """``jax.jit(f).lower(*args).compile(options)``, timed (``f`` may be jitted already)."""
  jitted = f if hasattr(f, "lower") else jax.jit(f, **(jit_kwargs or {}))
  lowered, lower_s = timed(lambda: jitted.lower(*args))
  compiled, compile_s = timed(lambda: lowered.compile(options))
  return Compiled(compiled, lower_s, compile_s)


@dataclasses.dataclass
class Timing:
  median_s: float
  min_s: float
  runs: int
  samples: tuple[float, ...] = ()  # every timed call, in order of the rounds

  def over(self, other: "Timing") -> float:
    """The median over rounds of this time / ``other``'s in the same round."""
    if not self.samples or len(self.samples) != len(other.samples):
      raise ValueError("paired ratios need two timings from the same interleaved rounds")
    return statistics.median(x / y for x, y in zip(self.samples, other.samples))


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  """``fn()`` and its wall time, until its result is ready on the devices."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t0


def time_rounds(calls: dict[str, Callable[[], Any]], rounds: int = 5, warmup: int = 1,
                after: Callable[[str], Any] | None = None) -> dict[str, Timing]:
  """Every call's wall time in interleaved rounds (each starting one call later), after
  ``warmup`` untimed rounds; ``after(key)`` runs after each timed call, untimed."""
  keys = list(calls)
  for key in keys * warmup:
    timed(calls[key])
  times: dict[str, list[float]] = {key: [] for key in keys}
  for r in range(max(1, rounds)):
    for key in keys[r % len(keys):] + keys[:r % len(keys)]:
      times[key].append(timed(calls[key])[1])
      if after is not None:
        after(key)
  return {k: Timing(statistics.median(t), min(t), len(t), tuple(t)) for k, t in times.items()}


class Table:
  """Rows of formatted cells, with the numbers behind them (``values``, in the JSON)."""

  def __init__(self, columns: Sequence[str], title: str = ""):
    self.columns, self.title = list(columns), title
    self.rows: list[list[str]] = []
    self.values: list[dict[str, Any]] = []

  def add(self, *cells: Any, **values: Any) -> None:
    if len(cells) != len(self.columns):
      raise ValueError(f"row has {len(cells)} cells, table has {len(self.columns)} columns")
    self.rows.append(["" if c is None else str(c) for c in cells])
    self.values.append(values)

  def json(self) -> dict[str, Any]:
    return {"title": self.title, "columns": self.columns,
            "rows": [{"cells": dict(zip(self.columns, cells)), "values": values}
                     for cells, values in zip(self.rows, self.values)]}

  def text(self) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in self.rows]) for i, h in enumerate(self.columns)]
    cells = [[r[i] for r in self.rows if r[i] not in ("", "-")] for i in range(len(widths))]
    right = [bool(c) and all(_NUMERIC.match(x.strip()) for x in c) for c in cells]
    line = lambda cells: "  ".join(c.rjust(w) if r else c.ljust(w)
                                   for c, w, r in zip(cells, widths, right)).rstrip()
    return "\n".join(([self.title] if self.title else []) + [
        line(self.columns), line(["-" * w for w in widths]), *map(line, self.rows)])

  def markdown(self) -> str:
    return (f"**{self.title}**\n\n" if self.title else "") + markdown_table(self.columns,
                                                                           self.rows)


class Report:
  """The tables and notes of one run: printed as they come, written as Markdown and JSON
  with the machine and the command line (``argv``, the benchmark's name first)."""

  def __init__(self, name: str, title: str, argv: Sequence[str]):
    self.name, self.title = name, title
    self.command = shlex.join(["python", "-m", "benchmarks", *argv])
    self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    self.parts: list[Table | str] = []

  def table(self, part: Table | str) -> None:
    """Add a table (or a note) and print it."""
    self.parts.append(part)
    print("\n" + part.text() if isinstance(part, Table) else part, flush=True)

  text = table

  def markdown(self) -> str:
    out = [f"# {self.title}", "", f"Machine: `{machine()}`", ""]
    for p in self.parts:
      if isinstance(p, Table):
        out += [p.markdown(), ""]
      else:
        out += ["```", p.rstrip("\n"), "```", ""] if "\n" in p.strip() else [p, ""]
    return "\n".join(out)

  def json(self) -> dict[str, Any]:
    return {"benchmark": self.name, "title": self.title, "command": self.command,
            "started": self.started, "machine": machine_info(),
            "tables": [{**t, "rows": [{**r, "command": self.command} for r in t["rows"]]}
                       for t in (p.json() for p in self.parts if isinstance(p, Table))],
            "notes": [p for p in self.parts if not isinstance(p, Table)]}

  def write(self, doc: dict[str, Any], json_path: str, markdown_path: str | None) -> None:
    """Write ``doc`` (`json`, maybe merged) and, if asked, the Markdown (folders exist)."""
    if markdown_path:
      pathlib.Path(markdown_path).write_text(self.markdown())
    pathlib.Path(json_path).write_text(dumps(finite(doc)) + "\n")
    print(f"\nWrote {json_path}", flush=True)


def merged(earlier: dict[str, Any], now: dict[str, Any], name: str, row_order: list[str],
           table_order: list[str]) -> dict[str, Any]:
  """``now``'s JSON with ``earlier``'s tables (by ``values[name]``) and rows (by
  ``values["key"]``) that it did not run; ordered by ``row_order`` and ``table_order``."""
  table_name = lambda t: t["rows"][0]["values"].get(name) if t["rows"] else None
  row_key = lambda r: (r["values"].get("key"), r["values"].get("goal"))
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
  # The commands listed are those whose rows are still there (a row without one predates
  # rows recording their command and keeps every earlier command listed).
  ran = {r.get("command") for t in tables for r in t["rows"]} | {now["command"]}
  commands = [c for c in dict.fromkeys([*earlier.get("commands", [earlier["command"]]),
                                        now["command"]]) if c in ran or None in ran]
  return {**now, "tables": tables, "commands": commands}


def dumps(doc: Any, depth: int = 0) -> str:
  """``doc`` as JSON, indented down to the tables' rows and one line per row from there,
  so that a results file reads (and diffs) row by row."""
  pad = "\n" + " " * (depth + 1)
  if depth >= 4 or not isinstance(doc, (dict, list)) or not doc:
    return json.dumps(doc)
  if isinstance(doc, dict):
    items = [f"{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in doc.items()]
    return "{" + pad + ("," + pad).join(items) + "\n" + " " * depth + "}"
  return "[" + pad + ("," + pad).join(dumps(v, depth + 1) for v in doc) + "\n" + " " * depth + "]"


def finite(x: Any) -> Any:
  """``x`` with NaN and infinities as None and numpy scalars as Python numbers."""
  if isinstance(x, dict):
    return {str(k): finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [finite(v) for v in x]
  if isinstance(x, np.generic):
    x = x.item()
  return None if isinstance(x, float) and not math.isfinite(x) else x


def fmt_ms(seconds: float | None) -> str:
  return "-" if seconds is None else f"{1e3 * seconds:{'.3g' if seconds < 0.1 else '.0f'}}"


def fmt_s(seconds: float | None) -> str:
  return "-" if seconds is None else f"{seconds:{'.2f' if seconds < 10 else '.1f'}}"


def fmt_ratio(x: float | None) -> str:
  return "-" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def ratio(a: float | None, b: float | None) -> float | None:
  return None if a is None or b is None or b <= 0 else a / b


def collective_values(colls: Collectives) -> dict[str, Any]:
  """A row's JSON values for the collectives in a compiled program."""
  return {"collectives": colls.count, "collective_bytes": colls.result_bytes,
          "collective_arrays": colls.arrays}


def verdict(ok: bool | None) -> str:
  return "SKIP" if ok is None else ("PASS" if ok else "MISS")


def add_goal(table: Table, text: str, *cells: Any, value: float | None, limit: float,
             shown: str | None = None, fmt: Callable[[float], str] = fmt_ratio,
             strict: bool = False, skip: bool = False, **values: Any) -> None:
  """A row of a Goals table: ``text``, ``cells``, the value, the limit (``shown``, else
  ``fmt(limit)``), met if ``value <= limit`` (``<`` if ``strict``); SKIP without a value."""
  ok = None if value is None or skip else (value < limit if strict else value <= limit)
  table.add(text, *cells, "-" if value is None else fmt(value), shown or fmt(limit),
            verdict(ok), **values, value=value, limit=limit, ok=ok)


def machine_info() -> dict[str, Any]:
  """CPU model and cores, library versions, and the devices JAX runs on."""
  cpu = platform.processor() or platform.machine()
  with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
    cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  devices = jax.devices()
  return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__,
          "jpack": jpack.__version__, "platform": devices[0].platform,
          "device_kind": devices[0].device_kind, "device_count": len(devices)}


def machine() -> str:
  m = machine_info()
  return (f"{m['cpu']}, {m['cores']} cores, jax {m['jax']} (jaxlib {m['jaxlib']}), "
          f"optax {m['optax']}, {m['device_count']} {m['platform']} device(s) "
          f"({m['device_kind']}), python {m['python']}")


def release_host_memory() -> None:
  """Hand freed (malloc'ed XLA:CPU) buffers back to the OS between phases (glibc only)."""
  gc.collect()
  with contextlib.suppress(OSError, AttributeError):  # not glibc
    ctypes.CDLL("libc.so.6").malloc_trim(0)
