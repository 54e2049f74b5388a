"""Fill the figures in README.md and docs/*.md from the benchmarks' JSON results.

    python -m benchmarks render            # rewrite every marked block in place
    python -m benchmarks render --check    # exit 1, naming the files, if a block is stale

A marked block is ``<!-- figures: NAME -->`` ... ``<!-- /figures -->``, NAME one of
`RENDERERS`; its body is generated from ``benchmarks/results/<bench>.json`` alone (a
missing file renders as the command that makes it). Imports neither JAX nor jpack.
"""

import json
import pathlib
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

from benchmarks import BENCHMARKS

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- figures: *(?P<name>[\w-]+) *-->)\n(?P<body>.*?)(<!-- /figures -->)",
                   re.DOTALL)
Results = Mapping[str, Any]  # benchmark name -> its JSON document (absent: not run)
Row = dict[str, Any]         # {"cells": {column: text}, "values": {...}}


def load_results(results_dir: pathlib.Path = RESULTS_DIR, names: Iterable[str] = BENCHMARKS
                 ) -> dict[str, Any]:
  """``{benchmark: JSON document}`` for each ``<name>.json`` present in ``results_dir``."""
  paths = {name: pathlib.Path(results_dir) / f"{name}.json" for name in names}
  # Results measured on a GPU (benchmarks/gpu_check.sh) sit in gpu/, as "gpu-<name>".
  paths |= {f"gpu-{name}": pathlib.Path(results_dir) / "gpu" / f"{name}.json" for name in names}
  return {name: json.loads(p.read_text()) for name, p in paths.items() if p.is_file()}


def _tables(doc: Mapping[str, Any] | None, *columns: str) -> list[Mapping[str, Any]]:
  """The tables of ``doc`` with rows and all of ``columns`` (titles may be reworded)."""
  return [t for t in (doc or {}).get("tables", [])
          if t["rows"] and all(c in t["columns"] for c in columns)]


def _by_key(table: Mapping[str, Any]) -> dict[str, Row]:
  return {r["values"].get("key"): r for r in table["rows"]}


def _step_table(doc: Mapping[str, Any] | None, model: str) -> Mapping[str, Any] | None:
  """The step benchmark's table of ``model``, if it has one."""
  return next((t for t in _tables(doc, *STEP_REQUIRED)
               if t["rows"][0]["values"].get("model") == model), None)


_NUMERIC = re.compile(r"^[-+]?(\d[\d,]*\.?\d*|\.\d+)(e[-+]?\d+)?\s*(x|%|ms|s|B|KiB|MiB|GiB)?$")
_EMPTY = ("", "-", "n/a")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub Markdown table; columns whose cells all look numeric are right-aligned."""
  rows = [[str(c) for c in r] for r in rows]
  cells = [[r[i] for r in rows if r[i] not in ("", "-")] for i in range(len(columns))]
  right = [bool(c) and all(_NUMERIC.match(x.strip()) for x in c) for c in cells]
  line = lambda r: "| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |"
  return "\n".join([line(columns), "|" + "|".join("---:" if r else "---" for r in right) + "|",
                    *map(line, rows)])


def _select(table: Mapping[str, Any], columns: Sequence[str] | None = None,
            rows: Sequence[Row] | None = None) -> str:
  """``table`` with only ``columns`` (those it has, not empty in every row), in order."""
  rows = table["rows"] if rows is None else rows
  shown = [c for c in columns or table["columns"] if c in table["columns"]
           and any(r["cells"].get(c, "") not in _EMPTY for r in rows)]
  return markdown_table(shown, [[r["cells"].get(c, "") for c in shown] for r in rows])


def _versions(m: Mapping[str, Any]) -> str:
  return ", ".join(f"{k} {m[k]}" for k in ("jax", "jaxlib", "optax", "python") if k in m)


def _commands(doc: Mapping[str, Any]) -> str:
  """"Command: `...`", or "Commands: `...`, `...`" for results merged from runs."""
  commands = doc.get("commands", [doc.get("command", "?")])
  return (f"Command{'s' if len(commands) > 1 else ''}: "
          + ", ".join(f"`{x}`" for x in commands))


def machine_line(doc: Mapping[str, Any]) -> str:
  """Where and how a result was measured, in one sentence."""
  m = doc.get("machine", {})
  n, platform = m.get("device_count", "?"), str(m.get("platform", "?"))
  host = f"{m.get('cpu', 'unknown CPU')} ({m.get('cores', '?')} cores)"
  if platform == "cpu" and n == 1:
    devices = f"one CPU device, {host}"
  elif platform == "cpu":
    devices = f"{n} CPU devices simulated on one {host}"
  else:
    devices = f"{n} x {m.get('device_kind', platform)} ({platform}), host {host}"
  return f"Measured on {devices}; {_versions(m)}. {_commands(doc)}."


def _missing(bench: str) -> str:
  if bench.startswith("gpu-"):
    return "*No results yet: run `bash benchmarks/gpu_check.sh` on a GPU.*"
  return f"*No results yet: run `python -m benchmarks {bench}`.*"


def _speedup(base: Row | None, row: Row) -> str:
  """The baseline's step time over the row's."""
  a, b = (None, None) if base is None else (base["values"].get("step_s"),
                                            row["values"].get("step_s"))
  return f"{a / b:.2f}x" if a and b else "-"


def _speedup_and_spread(base: Row | None, row: Row | None) -> str:
  """``1.31x (1.10–1.51)``: the speed-up with the lowest and highest block-by-block ones
  where both rows have block times from the same rounds."""
  ratio = "-" if row is None else _speedup(base, row)
  a, b = base and base["values"].get("block_step_s"), row and row["values"].get("block_step_s")
  if ratio == "-" or not a or not b or len(a) != len(b) or len(a) < 2:
    return ratio
  ratios = [x / y for x, y in zip(a, b)]
  return f"{ratio} ({min(ratios):.2f}–{max(ratios):.2f})"


# The step table's columns as performance.md shows them (not the benchmark's targets).
STEP_REQUIRED = ("variant", "step ms", "speed-up")
STEP_COLUMNS = ("variant", "step ms", "speed-up", "spread", "vs no saves", "compile s",
                "collectives", "coll. bytes", "opt state/dev", "max |Δp| vs per-leaf")
MAIN_MODEL = "mlp_40x256"  # comparison.md's baselines, in this order:
BASELINE_KEYS = ("per_leaf", "jit", "jit_zero1", "ravel", "flatten", "hand_zero1",
                 "optax_chain", "hand_pmean", "allreduce", "packed", "sharded")
BASELINE_COLUMNS = ("variant", "step ms", "speed-up", "spread", "compile s", "opt state/dev")
# The README's comparison: the GPT-2-like model on CPU, and the workloads compiled for GPUs.
HEADLINE_CPU = (("packed", "jit", '`mode="packed"`'),
                ("sharded", "jit_zero1", '`mode="sharded"` (ZeRO-1)'))
HEADLINE_GPU = ("gpt2_small", "bert_base", "resnet50", "mixed_llama_tiny")


def _fewer(ours: Sequence[float], theirs: Sequence[float]) -> str:
  """``14–39 % fewer``: the range over workloads of 1 - ours/theirs."""
  shares = sorted(round(100 * (1 - a / b)) for a, b in zip(ours, theirs))
  if not shares:
    return "-"
  span = f"{shares[0]}" if shares[0] == shares[-1] else f"{shares[0]}–{shares[-1]}"
  return f"{span} % fewer" if shares[0] >= 0 else f"{span} % (negative: more)"


def _overlap_cell(rows: Sequence[Row]) -> str:
  """``all``, or the workload with the most collectives not overlapping compute."""
  worst = None
  for r in rows:
    done, total = (int(x) for x in r["cells"]["overlapped"].split("/"))
    if done < total and (worst is None or total - done > worst[1] - worst[0]):
      worst = (done, total, r["values"]["workload"])
  return "all" if worst is None else f"{worst[0]} of {worst[1]} on {worst[2]}"


def render_headline(results: Results) -> str:
  """The README's table: jpack against `jax.jit` + `NamedSharding` and a per-leaf
  `shard_map` step, step time on CPU and the program compiled for GPUs."""
  step, gpu = results.get("step"), results.get("gpu_compile")
  if not step or not gpu:
    return _missing("step" if not step else "gpu_compile")
  table = _step_table(step, "gpt2_12x64")
  rows = _by_key(table) if table else {}
  out = [[f"CPU step time, GPT-2-like, {label}", _speedup(rows.get(jit), rows[key]) + " faster",
          _speedup_and_spread(rows.get("per_leaf"), rows[key]) + " faster"]
         for key, jit, label in HEADLINE_CPU if key in rows]
  by_workload = {t["rows"][0]["values"]["workload"]: _by_key(t)
                 for t in _tables(gpu, "variant", "kernels", "HBM MiB (est.)")}
  found = [by_workload[w] for w in HEADLINE_GPU if w in by_workload]
  ours = [r["packed"] for r in found]
  for what, value in (("kernels launched", "kernels"), ("bytes moved (HBM, est.)", "hbm_bytes")):
    out.append([f"GPU {what}, `mode=\"packed\"`", *(
        _fewer([o["values"][value] for o in ours], [r[base]["values"][value] for r in found])
        for base in ("jit", "per_leaf"))])
  out.append(["GPU collectives overlapped with compute, `mode=\"packed\"`",
              *(f"{_overlap_cell(ours)}; {name}: {_overlap_cell([r[key] for r in found])}"
                for key, name in (("jit", "jit"), ("per_leaf", "per-leaf")))])
  large = by_workload.get("gpt_1p3b", {})
  if "fsdp" in large and "jit_fsdp" in large:
    peak = lambda r: (float(r["cells"]["args MiB"].replace(",", ""))
                      + r["values"]["temp_bytes"] / 2**20)
    out.append(["GPU peak per device, 1.3 B GPT-like, `mode=\"fsdp\"` (ZeRO-3)",
                f"{peak(large['fsdp']):,.0f} MiB (jit FSDP: {peak(large['jit_fsdp']):,.0f})",
                f"- (ZeRO-1: {peak(large['sharded']):,.0f})" if "sharded" in large else "-"])
  # The table's title up to the model's description: "GPT-2 decoder 12x64 (...)".
  described = table["title"].rsplit("), ", 1)[0] + ")" if table else "gpt2_12x64"
  note = (f"CPU: {described}; the baseline's step time over "
          "jpack's, in the same run, with the lowest and highest over interleaved rounds. "
          f"GPU: {', '.join(HEADLINE_GPU)} compiled for 8 H100s (not run), the range "
          "over the four; peak: arguments + temp of the compiled step. Machines, "
          "commands and every table: "
          "[docs/performance.md](docs/performance.md), [docs/gpu.md](docs/gpu.md).")
  return "\n\n".join([markdown_table(["jpack against", "`jax.jit` + `NamedSharding`",
                                       "per-leaf `shard_map` step"], out), note])


def render_baselines(results: Results) -> str:
  """The plain baselines next to jpack's modes, on the main model."""
  doc = results.get("step")
  tables = _tables(doc, *STEP_REQUIRED)
  if not tables:
    return _missing("step")
  main = _step_table(doc, MAIN_MODEL) or tables[0]
  rows = _by_key(main)
  return "\n\n".join([f"**{main['title']}**", _select(main, BASELINE_COLUMNS, [
      rows[k] for k in BASELINE_KEYS if k in rows]), machine_line(doc)])


# One row per workload: (header, variant key, column of the benchmark's own table).
COLLECTIVES_COLUMNS = (
    ("per-leaf ms", "per_leaf", "run ms"),
    ("floor ms", "floor", "run ms"),
    ("jpack vs per-leaf", "jpack_sg", "vs per-leaf"),
    ("jpack compile vs per-leaf", "jpack_sg", "C vs per-leaf"),
    ("jpack Packed vs floor", "jpack_packed", "vs floor"),
    ("jpack Packed vs per-leaf", "jpack_packed", "vs per-leaf"),
    ("jpack psum vs per-leaf", "jpack_psum", "vs per-leaf"),
    ("bf16 wire vs per-leaf", "jpack_bf16", "vs per-leaf"),
    ("ravel + pmean vs per-leaf", "ravel", "vs per-leaf"),
)


def render_collectives(results: Results) -> str:
  """``pmean`` of each workload: jpack against per-leaf and the single-array floor."""
  doc = results.get("collectives")
  tables = _tables(doc, "workload", "variant", "vs per-leaf", "vs floor")
  if not tables:
    return _missing("collectives")
  workloads: dict[str, dict[str, Row]] = {}
  for row in tables[0]["rows"]:
    workloads.setdefault(row["cells"]["workload"], {})[row["values"].get("key")] = row
  shown = [c for c in COLLECTIVES_COLUMNS if any(c[1] in v for v in workloads.values())]
  rows = [[label] + [v[key]["cells"].get(column, "-") if key in v else "-"
                     for _, key, column in shown] for label, v in workloads.items()]
  return "\n\n".join([markdown_table(["workload"] + [c[0] for c in shown], rows),
                       machine_line(doc)])


def _compiled_on(devices: int, how: str = "simulated", cores: bool = False
                 ) -> Callable[[Mapping], str]:
  """The machine line of programs compiled for ``devices`` H100s (``cores``: the host's)."""
  def line(doc: Mapping[str, Any]) -> str:
    m = doc.get("machine", {})
    host = m.get("cpu", "unknown CPU") + (f" ({m.get('cores', '?')} cores)" if cores else "")
    return (f"Compiled for {devices} NVIDIA H100 SXM ({how}) on {host}; {_versions(m)}. "
            f"{_commands(doc)}.")
  return line


def _one_table(bench: str, required: Sequence[str], columns: Sequence[str] | None = None,
               titled: bool = True, note: Callable[[Mapping], str] = lambda doc: "",
               every: bool = False, footer: Callable[[Mapping], str] = machine_line
               ) -> Callable[[Results], str]:
  """A renderer of the first table of ``bench`` (or ``every`` one) that has the ``required``
  columns: its title, its ``columns`` (default: all); then ``note(doc)`` and ``footer(doc)``."""
  def render(results: Results) -> str:
    doc = results.get(bench)
    tables = _tables(doc, *required)
    if not tables:
      return _missing(bench)
    parts = [p for t in (tables if every else tables[:1])
             for p in (f"**{t['title']}**" if titled else "", _select(t, columns))]
    return "\n\n".join(p for p in [*parts, note(doc), footer(doc)] if p)
  return render


render_step = _one_table("step", STEP_REQUIRED, STEP_COLUMNS, every=True)
render_multinode = _one_table("multinode", ("cross-node MiB",), every=True,
                              footer=_compiled_on(64))
render_fits = _one_table("fits", ("GiB per layer",), every=True, footer=_compiled_on(8))
PACK_REQUIRED = ("workload", "pack/max(a,b)", "unpack/max(a,b)")
OPTIMIZER_REQUIRED = ("workload", "per-leaf ms", "jpack ms")
render_pack = _one_table("pack", PACK_REQUIRED, titled=False)
render_optimizer = _one_table("optimizer", OPTIMIZER_REQUIRED)
# The same tables from benchmarks/gpu_check.sh's run on a GPU.
render_gpu_step = _one_table("gpu-step", STEP_REQUIRED, STEP_COLUMNS, every=True)
render_gpu_pack = _one_table("gpu-pack", PACK_REQUIRED, titled=False)
render_gpu_optimizer = _one_table("gpu-optimizer", OPTIMIZER_REQUIRED)
render_checkpoint = _one_table(
    "checkpoint", ("variant", "step ms", "vs no saves"),
    ("variant", "step ms", "vs no saves", "save call ms", "wait at end ms", "checkpoint MiB"),
    note=lambda doc: (
        "vs no saves: the loop's time over the same loop's without saves, in the same "
        "round. save call ms: how long a call of `jpack.checkpoint.save` that "
        "saves holds the loop up, once the steps queued before it are done; wait at "
        "end: `manager.wait_until_finished()` after the loop. On CPU devices the "
        "background write shares the cores with the steps."))
render_startup = _one_table(
    "startup", ("model", "leaves", "mode", "first s"),
    note=lambda doc: (
        "first: the model's first build, with a new optimizer object, which the optimizer "
        "check reads (optax's own from a table; others probed); again: "
        "the same optimizer object, its verdict cached (median over rounds). Before the "
        "first row, a 4-leaf MLP is built in every mode: " + next(
            (n for n in doc.get("notes", []) if n.startswith("JAX's own start")),
            "not counted.")))

GPU_COLUMNS = ("variant", "kernels", "HBM MiB (est.)", "copy-only MiB", "collectives",
               "overlapped", "temp MiB", "args MiB", "removed: kernels / HBM",
               "lower + compile s")


def _gpu_goals(doc: Mapping[str, Any]) -> str:
  """The goals of the default and ZeRO-1 modes against per-leaf, then ZeRO-3's."""
  rows = [r for t in _tables(doc, "mode", "goal", "result") for r in t["rows"]]
  zero3 = [r for r in rows if r["values"]["key"].startswith("fsdp")]
  parts = (("The default and the ZeRO-1 mode against the per-leaf step, per workload",
            [r for r in rows if r not in zero3]),
           ("ZeRO-3 against `jax.jit` FSDP, per workload", zero3))
  return "\n\n".join(f"**{title}**\n\n{_goals_table(rows)}" for title, rows in parts if rows)


# Every workload's steps compiled for 8 H100s (the removed shares of the steps not compared
# with per-leaf are "-" already: `gpu_compile.finish`), then the goals.
render_gpu_compile = _one_table(
    "gpu_compile", ("variant", "kernels", "HBM MiB (est.)"), GPU_COLUMNS, every=True,
    note=_gpu_goals, footer=_compiled_on(8, "simulated: nothing ran on a GPU", cores=True))


def _goals_table(rows: Sequence[Row]) -> str:
  """Goal rows as one row per workload and mode, a column per goal: yes or no."""
  goals: dict[tuple[str, str], dict[str, str]] = {}
  names: list[str] = []
  for row in rows:
    v = row["values"]
    goals.setdefault((v["workload"], row["cells"]["mode"]), {})[v["goal"]] = row["cells"]["result"]
    names += [] if v["goal"] in names else [v["goal"]]
  answer = {"PASS": "yes", "MISS": "no"}
  return markdown_table(["workload", "mode", *names],
                        [[w, m, *(answer.get(g.get(n, ""), "") for n in names)]
                         for (w, m), g in goals.items()])


RENDERERS: dict[str, Callable[[Results], str]] = {
    "headline": render_headline, "step": render_step, "baselines": render_baselines,
    "collectives": render_collectives, "pack": render_pack, "optimizer": render_optimizer,
    "checkpoint": render_checkpoint, "gpu_compile": render_gpu_compile,
    "startup": render_startup, "multinode": render_multinode, "fits": render_fits,
    "gpu-step": render_gpu_step, "gpu-pack": render_gpu_pack,
    "gpu-optimizer": render_gpu_optimizer,
}


def render_text(text: str, results: Results) -> str:
  """``text`` with every marked block's body replaced by its rendering."""
  def fill(match: re.Match) -> str:
    name = match.group("name")
    if name not in RENDERERS:
      raise ValueError(f"unknown figures block {name!r}; known: {', '.join(RENDERERS)}")
    # Blank lines around the body: Markdown ends an HTML comment block at a blank line.
    return f"{match.group(1)}\n\n{RENDERERS[name](results)}\n\n{match.group(4)}"
  return BLOCK.sub(fill, text)


def blocks(text: str) -> list[str]:
  """The names of the marked blocks in ``text``, in order."""
  return [m.group("name") for m in BLOCK.finditer(text)]


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
  """README.md and every page under docs/."""
  return [pathlib.Path(root) / "README.md", *sorted((pathlib.Path(root) / "docs").rglob("*.md"))]


def main(check: bool = False) -> int:
  """Rewrite every marked block (``check``: change nothing, exit 1 if one is stale)."""
  results, changed = load_results(), []
  for page in pages():
    text = page.read_text()
    new = render_text(text, results)
    if new != text:
      changed.append(page.relative_to(ROOT))
      if not check:
        page.write_text(new)
  for page in changed:
    print(f"{'out of date' if check else 'updated'}: {page}")
  if not changed:
    print("figures up to date")
  return 1 if check and changed else 0
