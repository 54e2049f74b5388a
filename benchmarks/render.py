"""Fill the figures in README.md and docs/*.md from the benchmarks' JSON results.

    python -m benchmarks render            # rewrite every marked block in place
    python -m benchmarks render --check    # exit 1, naming the files, if a block is stale

A marked block is

    <!-- figures: NAME -->
    (generated: never edit by hand)
    <!-- /figures -->

where NAME is one of `RENDERERS`. Each renderer reads ``benchmarks/results/<bench>.json``
(written by ``python -m benchmarks <bench>``) and returns Markdown: a table built from
the cells the benchmark printed, and a line naming the machine and the command that
produced it. Rows a JSON file lacks are left out; a missing file renders as a note
saying which command makes it. The output depends on the JSON alone, so rendering twice
changes nothing, and `tests/test_figures.py` fails when a page differs from what this
renders.

This module imports neither JAX nor jpack: it only reads JSON and writes text.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"

BLOCK = re.compile(r"(<!-- figures: *(?P<name>[\w-]+) *-->)\n(?P<body>.*?)(<!-- /figures -->)",
                   re.DOTALL)

Results = Mapping[str, Any]  # benchmark name -> its JSON document (absent: not run)
Row = dict[str, Any]         # {"cells": {column: text}, "values": {...}}


# -- reading the results ----------------------------------------------------------------


def load_results(results_dir: pathlib.Path = RESULTS_DIR,
                 names: Iterable[str] = ("step", "collectives", "pack", "optimizer",
                                         "checkpoint", "gpu_compile", "startup", "multinode")
                 ) -> dict[str, Any]:
  """``{benchmark: JSON document}`` for each ``<name>.json`` present in ``results_dir``."""
  found = {}
  for name in names:
    path = pathlib.Path(results_dir) / f"{name}.json"
    if path.is_file():
      found[name] = json.loads(path.read_text())
  return found


def _tables(doc: Mapping[str, Any], *columns: str) -> list[Mapping[str, Any]]:
  """The tables of ``doc`` that have all of ``columns``: a table is recognised by what
  it holds, not by its title, which benchmarks may reword."""
  return [t for t in doc.get("tables", []) if all(c in t["columns"] for c in columns)]


def _step_tables(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
  """One table per model of a step run."""
  return [t for t in _tables(doc, "variant", "step ms", "speed-up") if t["rows"]]


def _by_key(table: Mapping[str, Any]) -> dict[str, Row]:
  return {r["values"].get("key"): r for r in table["rows"]}


def _model(table: Mapping[str, Any]) -> str:
  return table["rows"][0]["values"].get("model", "") if table["rows"] else ""


# -- formatting -------------------------------------------------------------------------

_NUMERIC = re.compile(r"^[-+]?(\d[\d,]*\.?\d*|\.\d+)(e[-+]?\d+)?\s*(x|%|ms|s|B|KiB|MiB|GiB)?$")


def _numeric(cell: str) -> bool:
  return bool(_NUMERIC.match(cell.strip()))


def _cell(text: Any) -> str:
  return str(text).replace("|", "\\|")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A GitHub Markdown table; columns whose cells all look numeric are right-aligned."""
  rows = [[str(c) for c in r] for r in rows]
  right = []
  for i in range(len(columns)):
    cells = [r[i] for r in rows if r[i] not in ("", "-")]
    right.append(bool(cells) and all(_numeric(c) for c in cells))
  lines = ["| " + " | ".join(_cell(c) for c in columns) + " |",
           "|" + "|".join("---:" if r else "---" for r in right) + "|"]
  lines += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
  return "\n".join(lines)


_EMPTY = ("", "-", "n/a")


def _select(table: Mapping[str, Any], columns: Sequence[str],
            rows: Sequence[Row] | None = None) -> str:
  """``table`` as Markdown with only ``columns`` (those it has, and not empty in every
  row: torch's columns on a machine without torch), in that order."""
  rows = table["rows"] if rows is None else rows
  shown = [c for c in columns if c in table["columns"]
           and any(r["cells"].get(c, "") not in _EMPTY for r in rows)]
  return markdown_table(shown, [[r["cells"].get(c, "") for c in shown] for r in rows])


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
  versions = ", ".join(f"{k} {m[k]}" for k in ("jax", "jaxlib", "optax", "python") if k in m)
  return f"Measured on {devices}; {versions}. {_commands(doc)}."


def _missing(bench: str) -> str:
  return f"*No results yet: run `python -m benchmarks {bench}`.*"


def _speedup(base: Row | None, row: Row) -> str:
  """The baseline's step time over the row's, as the step benchmark prints ratios."""
  if base is None:
    return "-"
  a, b = base["values"].get("step_s"), row["values"].get("step_s")
  if not a or not b:
    return "-"
  return f"{a / b:.2f}x"


# -- renderers --------------------------------------------------------------------------

# The step table's columns, as performance.md shows them (the benchmark also prints its
# own targets, which are not figures for users). "vs no saves" (the checkpoint rows) shows
# only where the results have it.
STEP_COLUMNS = ("variant", "step ms", "speed-up", "spread", "vs no saves", "compile s",
                "collectives", "coll. bytes", "opt state/dev", "max |Δp| vs per-leaf")
# README rows, in order, those the step run has: (model, step key, the jax.jit baseline it
# is compared with). The transformer leads; then the MLP of many equal leaves, a CNN of
# fewer, larger leaves, and a large MLP.
README_ROWS = (
    ("gpt2_12x64", "packed", "jit"),
    ("gpt2_12x64", "sharded", "jit_zero1"),
    ("mlp_40x256", "packed", "jit"),
    ("mlp_40x256", "sharded", "jit_zero1"),
    ("mlp_40x256", "allreduce", "jit"),
    ("mlp_40x256", "packed_bf16", "jit"),
    ("resnet18_narrow", "packed", "jit"),
    ("mlp_24x1024", "sharded", "jit_zero1"),
)
MODEL_LABELS = {"gpt2_12x64": "GPT-2-like", "vit_12x64": "ViT-like",
                "mlp_40x256": "MLP 40x256", "resnet18_narrow": "ResNet-18-like",
                "mlp_24x1024": "MLP 24x1024"}
MODE_LABELS = {"packed": '`mode="packed"`', "sharded": '`mode="sharded"` (ZeRO-1)',
               "allreduce": '`mode="allreduce"`', "packed_bf16": '`mode="packed"`, bf16 wire'}
MAIN_MODEL = "mlp_40x256"  # comparison.md's baselines
# comparison.md: the baselines next to jpack's modes, in this order.
BASELINE_KEYS = ("per_leaf", "jit", "jit_zero1", "ravel", "flatten", "hand_zero1",
                 "optax_chain", "hand_pmean", "allreduce", "packed", "sharded")
BASELINE_COLUMNS = ("variant", "step ms", "speed-up", "spread", "compile s", "opt state/dev")


def _main_table(tables: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
  return next((t for t in tables if _model(t) == MAIN_MODEL), tables[0])


def _spread(base: Row | None, row: Row) -> str:
  """`` (lo–hi)``: the lowest and highest block-by-block speed-ups, where both rows have
  their block times from the same rounds; else nothing."""
  a = base and base["values"].get("block_step_s")
  b = row["values"].get("block_step_s")
  if not a or not b or len(a) != len(b) or len(a) < 2:
    return ""
  ratios = [x / y for x, y in zip(a, b)]
  return f" ({min(ratios):.2f}–{max(ratios):.2f})"


def _speedup_and_spread(base: Row | None, row: Row | None) -> str:
  """``1.31x (1.10–1.51)``: `_speedup` with its `_spread`, or "-"."""
  ratio = "-" if row is None else _speedup(base, row)
  return ratio if ratio == "-" else ratio + _spread(base, row)


def _readme_rows(tables: Sequence[Mapping[str, Any]]
                 ) -> list[tuple[str, Row, Row | None, Row | None]]:
  """(label, jpack's row, per-leaf's row, the jax.jit row to compare with) for each
  README row the step run has, in `README_ROWS`' order."""
  by_model = {_model(t): _by_key(t) for t in tables}
  picked = []
  for model, key, jit in README_ROWS:
    rows = by_model.get(model, {})
    if key in rows and "step_s" in rows[key]["values"]:
      label = f"{MODEL_LABELS.get(model, model)}, {MODE_LABELS.get(key, key)}"
      picked.append((label, rows[key], rows.get("per_leaf"), rows.get(jit)))
  return picked


def _startup(results: Results) -> dict[tuple[str, str], str]:
  """``{(model, mode): "first (again)"}`` from the startup benchmark: building the step
  and ``init``, the first time (the optimizer check probes) and again (cached)."""
  doc = results.get("startup")
  out = {}
  for table in _tables(doc, "model", "mode", "first s", "again s") if doc else []:
    for r in table["rows"]:
      c = r["cells"]
      if c.get("optimizer", "adamw") == "adamw":  # the step benchmark's optimizer
        out[(c["model"], c["mode"])] = f"{c['first s']} ({c['again s']})"
  return out


def render_readme(results: Results) -> str:
  """jpack's modes on the transformer first, then on an MLP of many equal leaves, a CNN
  and a large MLP (`README_ROWS`), against per-leaf and jax.jit, with the spread over the
  interleaved rounds; compile time and state included."""
  doc = results.get("step")
  tables = _step_tables(doc) if doc else []
  if not tables:
    return _missing("step")
  picked = _readme_rows(tables)
  with_jit = any(jit is not None for *_, jit in picked)
  columns = ["step (Adam)", "speed-up vs per-leaf `shard_map`"]
  columns += ["speed-up vs `jax.jit` + `NamedSharding`"] if with_jit else []
  columns += ["compile s: jpack (per-leaf)", "build + init s: first (again)",
              "optimizer state per device"]
  startup = _startup(results)
  out = []
  for label, row, base, jit in picked:
    base_compile = base["cells"].get("compile s", "-") if base else "-"
    out.append([label, _speedup_and_spread(base, row),
                *([_speedup(jit, row)] if with_jit else []),
                f"{row['cells'].get('compile s', '-')} ({base_compile})",
                startup.get((row["values"].get("model"), row["values"].get("key")), "-"),
                row["cells"].get("opt state/dev", "-")])
  models = {row["values"].get("model") for _, row, *_ in picked}
  # "GPT-2 decoder 12x64 (148 leaves, 0.67 M params), adam, 8 devices": up to ")".
  shown = [t["title"].rsplit("), ", 1)[0] + ")" for t in tables if _model(t) in models]
  note = ("Speed-up: the baseline's step time over jpack's, in the same run (above 1x, jpack "
          "is faster); in brackets, the lowest and the highest over the interleaved rounds. "
          "Build + init: `jpack.data_parallel` and `init` before the first step, from "
          "`python -m benchmarks startup` (the first build of a model probes the "
          "optimizer; again, the verdict is cached). "
          f"Models: {'; '.join(shown) or _main_table(tables)['title']}.")
  if with_jit:
    note += (" ZeRO-1 is compared with `jax.jit` sharding the optimizer state by "
             "`NamedSharding`.")
  return "\n\n".join([markdown_table(columns, out), note, machine_line(doc)])


# The README's comparison: the GPT-2-like model on CPU, the four real workloads compiled
# for GPUs, each with the baseline it is compared against.
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
  """``all`` when every collective of every workload overlaps compute, else the workload
  with the most left alone: ``107 of 208 (resnet50)``."""
  worst = None
  for r in rows:
    done, total = (int(x) for x in r["cells"]["overlapped"].split("/"))
    if done < total and (worst is None or total - done > worst[1] - worst[0]):
      worst = (done, total, r["values"]["workload"])
  return "all" if worst is None else f"{worst[0]} of {worst[1]} on {worst[2]}"


def render_headline(results: Results) -> str:
  """The README's one table: jpack against `jax.jit` + `NamedSharding` and against a
  per-leaf `shard_map` step, step time on CPU and the program compiled for GPUs."""
  step, gpu = results.get("step"), results.get("gpu_compile")
  if not step or not gpu:
    return _missing("step" if not step else "gpu_compile")
  rows = next((_by_key(t) for t in _step_tables(step) if _model(t) == "gpt2_12x64"), {})
  out = []
  for key, jit, label in HEADLINE_CPU:
    if key in rows:
      out.append([f"CPU step time, GPT-2-like, {label}",
                  _speedup(rows.get(jit), rows[key]) + " faster",
                  _speedup_and_spread(rows.get("per_leaf"), rows[key]) + " faster"])
  by_workload = {t["rows"][0]["values"]["workload"]: _by_key(t)
                 for t in _tables(gpu, "variant", "kernels", "HBM MiB (est.)")}
  found = [by_workload[w] for w in HEADLINE_GPU if w in by_workload]
  ours = [r["packed"] for r in found]
  for what, value in (("kernels launched", "kernels"), ("bytes moved (HBM, est.)", "hbm_bytes")):
    out.append([f"GPU {what}, `mode=\"packed\"`",
                *(_fewer([o["values"][value] for o in ours],
                         [r[base]["values"][value] for r in found]) for base in ("jit", "per_leaf"))])
  out.append(["GPU collectives overlapped with compute, `mode=\"packed\"`",
              *(f"{_overlap_cell(ours)}; {name}: {_overlap_cell([r[key] for r in found])}"
                for key, name in (("jit", "jit"), ("per_leaf", "per-leaf")))])
  mib = lambda r: r["values"]["args_bytes"] / 2**20 if "args_bytes" in r["values"] else float(
      r["cells"]["args MiB"].replace(",", ""))
  large = by_workload.get("gpt_1p3b", {})
  if "fsdp" in large and "jit_fsdp" in large:
    peak = lambda r: mib(r) + r["values"]["temp_bytes"] / 2**20
    out.append(["GPU peak per device, 1.3 B GPT-like, `mode=\"fsdp\"` (ZeRO-3)",
                f"{peak(large['fsdp']):,.0f} MiB (jit FSDP: {peak(large['jit_fsdp']):,.0f})",
                f"- (ZeRO-1: {peak(large['sharded']):,.0f})" if "sharded" in large else "-"])
  note = (f"CPU: {_model_title(step, 'gpt2_12x64')}; the baseline's step time over "
          "jpack's, in the same run, with the lowest and highest over interleaved rounds. "
          f"GPU: {', '.join(HEADLINE_GPU)} compiled for 8 H100s (not run), the range "
          "over the four; peak: arguments + temp of the compiled step. Machines, "
          "commands and every table: "
          "[docs/performance.md](docs/performance.md), [docs/gpu.md](docs/gpu.md).")
  return "\n\n".join([markdown_table(["jpack against", "`jax.jit` + `NamedSharding`",
                                       "per-leaf `shard_map` step"], out), note])


def _model_title(doc: Mapping[str, Any], model: str) -> str:
  """A step table's title up to its model's description: "GPT-2 decoder 12x64 (...)"."""
  for t in _step_tables(doc):
    if _model(t) == model:
      return t["title"].rsplit("), ", 1)[0] + ")"
  return model


# The real architectures, and the modes the README's "skip it when" shows on them.
REAL_MODELS = ("gpt2_12x64", "vit_12x64", "resnet18_narrow")
REAL_MODEL_KEYS = (("packed", '`mode="packed"`'), ("sharded", '`mode="sharded"`'),
                   ("hand_pmean", "hand-written `jpack.pmean` step"))


def render_real_models(results: Results) -> str:
  """Speed-ups over the per-leaf step on the real architectures (`REAL_MODELS`), with
  their spread: one row per model, one column per mode (`REAL_MODEL_KEYS`)."""
  doc = results.get("step")
  tables = [t for t in (_step_tables(doc) if doc else []) if _model(t) in REAL_MODELS]
  if not tables:
    return _missing("step")
  out = []
  for model in REAL_MODELS:
    rows = next((_by_key(t) for t in tables if _model(t) == model), None)
    if rows is None:
      continue
    out.append([MODEL_LABELS[model], *(_speedup_and_spread(rows.get("per_leaf"),
                                                          rows.get(key))
                                       for key, _ in REAL_MODEL_KEYS)])
  columns = ["speed-up over per-leaf", *(label for _, label in REAL_MODEL_KEYS)]
  return "\n\n".join([markdown_table(columns, out),
                       "In brackets, the lowest and the highest over the interleaved "
                       "rounds. The models and their full tables: "
                       "[docs/performance.md](docs/performance.md#training-step).",
                       machine_line(doc)])


def render_step(results: Results) -> str:
  """Every model of the step run, one table each."""
  doc = results.get("step")
  tables = _step_tables(doc) if doc else []
  if not tables:
    return _missing("step")
  parts = []
  for t in tables:
    parts += [f"**{t['title']}**", _select(t, STEP_COLUMNS)]
  return "\n\n".join(parts + [machine_line(doc)])


def render_baselines(results: Results) -> str:
  """The plain baselines next to jpack's modes, on the main model."""
  doc = results.get("step")
  tables = _step_tables(doc) if doc else []
  if not tables:
    return _missing("step")
  main = _main_table(tables)
  rows = _by_key(main)
  picked = [rows[k] for k in BASELINE_KEYS if k in rows]
  return "\n\n".join([f"**{main['title']}**", _select(main, BASELINE_COLUMNS, picked),
                      machine_line(doc)])


# The collectives table, one row per workload: (header, variant key, column of the
# benchmark's own table). The benchmark's table has one row per variant; this keeps its
# cells and shows the comparisons side by side.
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
  tables = _tables(doc, "workload", "variant", "vs per-leaf", "vs floor") if doc else []
  if not tables:
    return _missing("collectives")
  workloads: dict[str, dict[str, Row]] = {}
  for row in tables[0]["rows"]:
    workloads.setdefault(row["cells"]["workload"], {})[row["values"].get("key")] = row
  shown = [c for c in COLLECTIVES_COLUMNS
           if any(c[1] in variants for variants in workloads.values())]
  rows = [[label] + [v[key]["cells"].get(column, "-") if key in v else "-"
                     for _, key, column in shown]
          for label, v in workloads.items()]
  return "\n\n".join([markdown_table(["workload"] + [c[0] for c in shown], rows),
                       machine_line(doc)])


def render_pack(results: Results) -> str:
  """pack / unpack against per-leaf and single-array copies, one device: the benchmark's
  table of ratios, one row per workload."""
  doc = results.get("pack")
  tables = _tables(doc, "workload", "pack/max(a,b)", "unpack/max(a,b)") if doc else []
  if not tables:
    return _missing("pack")
  table = tables[0]
  return "\n\n".join([_select(table, table["columns"]), machine_line(doc)])


def render_optimizer(results: Results) -> str:
  """One Adam update: jpack on buckets against per-leaf optax (and torch where present)."""
  doc = results.get("optimizer")
  tables = _tables(doc, "workload", "per-leaf ms", "jpack ms") if doc else []
  if not tables:
    return _missing("optimizer")
  table = tables[0]
  return "\n\n".join([f"**{table['title']}**", _select(table, table["columns"]),
                       machine_line(doc)])


CHECKPOINT_COLUMNS = ("variant", "step ms", "vs no saves", "save call ms", "wait at end ms",
                      "checkpoint MiB")


def render_checkpoint(results: Results) -> str:
  """The step loop with an Orbax checkpoint every 10 steps, asynchronous and not, against
  the same loop without checkpoints."""
  doc = results.get("checkpoint")
  tables = _tables(doc, "variant", "step ms", "vs no saves") if doc else []
  if not tables:
    return _missing("checkpoint")
  table = tables[0]
  note = ("vs no saves: the loop's time over the same loop's without saves, in the same "
          "round. save call ms: how long a call of `jpack.checkpoint.save` that "
          "saves holds the loop up, once the steps queued before it are done; wait at "
          "end: `manager.wait_until_finished()` after the loop. On CPU devices the "
          "background write shares the cores with the steps.")
  return "\n\n".join([f"**{table['title']}**", _select(table, CHECKPOINT_COLUMNS), note,
                       machine_line(doc)])


def render_startup(results: Results) -> str:
  """Building a data_parallel step and its init, the first time (the optimizer probed)
  and again (its verdict cached), per model and mode."""
  doc = results.get("startup")
  tables = _tables(doc, "model", "leaves", "mode", "first s") if doc else []
  if not tables:
    return _missing("startup")
  table = tables[0]
  note = ("first: the model's first build, with a new optimizer object, which the "
          "optimizer check reads (optax's own from a table; others probed); again: "
          "the same optimizer object, its verdict cached (median over rounds). Before the first row, a 4-leaf MLP is built in every mode: ")
  start = [n for n in doc.get("notes", []) if n.startswith("JAX's own start")]
  return "\n\n".join([f"**{table['title']}**", _select(table, table["columns"]),
                       note + (start[0] if start else "not counted."), machine_line(doc)])


GPU_COLUMNS = ("variant", "kernels", "HBM MiB (est.)", "copy-only MiB", "collectives",
               "overlapped", "temp MiB", "args MiB", "removed: kernels / HBM",
               "lower + compile s")


def render_gpu_compile(results: Results) -> str:
  """Every workload's steps compiled for 8 H100s, then the goals of the default and
  ZeRO-1 modes, one row per workload and mode."""
  doc = results.get("gpu_compile")
  tables = _tables(doc, "variant", "kernels", "HBM MiB (est.)") if doc else []
  if not tables:
    return _missing("gpu_compile")
  parts = []
  for table in tables:
    # Shares of per-leaf's overhead only compare steps of the same params and rows: not
    # bf16 params (half the bytes) or accumulation (four passes).
    rows = [r if not str(r["values"].get("key", "")).endswith(("bf16_params", "acc4")) else
            {**r, "cells": {**r["cells"], "removed: kernels / HBM": "-"}}
            for r in table["rows"]]
    parts += [f"**{table['title']}**", _select(table, GPU_COLUMNS, rows)]
  goals: dict[tuple[str, str], dict[str, str]] = {}
  names: list[str] = []
  for table in _tables(doc, "mode", "goal", "result"):
    for row in table["rows"]:
      v = row["values"]
      goals.setdefault((v["workload"], row["cells"]["mode"]), {})[v["goal"]] = \
          row["cells"]["result"]
      if v["goal"] not in names:
        names.append(v["goal"])
  if goals:
    answer = {"PASS": "yes", "MISS": "no"}
    parts += ["**The default and the ZeRO-1 mode against the per-leaf step, per workload**",
              markdown_table(["workload", "mode", *names],
                             [[w, m, *(answer.get(g.get(n, ""), "") for n in names)]
                              for (w, m), g in goals.items()])]
  m = doc.get("machine", {})
  versions = ", ".join(f"{k} {m[k]}" for k in ("jax", "jaxlib", "optax", "python") if k in m)
  parts.append(f"Compiled for 8 NVIDIA H100 SXM (simulated: nothing ran on a GPU) on "
               f"{m.get('cpu', 'unknown CPU')} ({m.get('cores', '?')} cores); {versions}. "
               f"{_commands(doc)}.")
  return "\n\n".join(parts)


def render_multinode(results: Results) -> str:
  """Each model's steps compiled for 8 nodes x 8 H100s: bytes across nodes, overlap,
  memory."""
  doc = results.get("multinode")
  tables = _tables(doc, "variant", "cross-node MiB") if doc else []
  if not tables:
    return _missing("multinode")
  parts = [x for t in tables for x in (f"**{t['title']}**", _select(t, t["columns"]))]
  m = doc.get("machine", {})
  parts.append(f"Compiled for 64 NVIDIA H100 SXM (simulated: nothing ran on a GPU) on "
               f"{m.get('cpu', 'unknown CPU')}; jax {m.get('jax', '?')}. {_commands(doc)}.")
  return "\n\n".join(parts)


def _commands(doc: Mapping[str, Any]) -> str:
  """"Command: `...`", or "Commands: `...`, `...`" for results merged from runs."""
  commands = doc.get("commands", [doc.get("command", "?")])
  return (f"Command{'s' if len(commands) > 1 else ''}: "
          + ", ".join(f"`{x}`" for x in commands))


RENDERERS: dict[str, Callable[[Results], str]] = {
    "readme": render_readme,
    "headline": render_headline,
    "real_models": render_real_models,
    "step": render_step,
    "baselines": render_baselines,
    "collectives": render_collectives,
    "pack": render_pack,
    "optimizer": render_optimizer,
    "checkpoint": render_checkpoint,
    "gpu_compile": render_gpu_compile,
    "startup": render_startup,
    "multinode": render_multinode,
}


# -- pages ------------------------------------------------------------------------------


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
  """The user-facing Markdown files: README.md and every page under docs/."""
  root = pathlib.Path(root)
  return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def stale(root: pathlib.Path = ROOT, results_dir: pathlib.Path = RESULTS_DIR
          ) -> list[pathlib.Path]:
  """The pages whose blocks differ from what the results render."""
  results = load_results(results_dir)
  return [p for p in pages(root) if render_text(p.read_text(), results) != p.read_text()]


def main(check: bool = False) -> int:
  """Rewrite every marked block (``check``: change nothing, exit 1 if one is stale)."""
  results = load_results()
  changed = []
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
