"""The figures in README.md and docs/ are exactly what the benchmarks' JSON renders.

`benchmarks/render.py` (``python -m benchmarks render``) fills every
``<!-- figures: NAME -->`` block from ``benchmarks/results/*.json``. These tests render
the blocks again from the committed JSON and compare, so a hand-edited or stale figure
fails; they also check that no benchmark figure is quoted outside the blocks, and that
the user-facing pages hold no development history. Nothing here runs a benchmark.
"""

import json
import pathlib
import re

import pytest

from benchmarks import render

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = render.pages(ROOT)
RESULTS = render.load_results(render.RESULTS_DIR)

# Fenced code (```python, ```text, ...) and the generated blocks are not prose.
_FENCE = re.compile(r"^([ \t]*)(```|~~~).*?^\1\2[ \t]*$", re.MULTILINE | re.DOTALL)
# What a quoted benchmark figure looks like: a ratio (1.5x, 3×), a time (80 ms, 2.3 s,
# 5 µs) or a percentage. Shapes such as 40x256 or 512x512 are not ratios.
# A number glued to a name (H100s, A100s) is a name, not a figure.
_FIGURE = re.compile(r"(?<![A-Za-z\d.])\d+(?:\.\d+)?\s*(?:[x×](?![\w])|ms\b|µs\b|s\b(?!-)|%)")
# Development history: work periods, machine nicknames, what an issue or a review said,
# targets met or missed, dates of runs. ("Re-run" is left out: re-running a notebook is
# what a reader does.)
_HISTORY = re.compile(r"\bsessions?\b|\bxeon\b|\bVM\b|\bissues?\b|\breviews?\b"
                      r"|\bgoals?\b|\bmissed\b|\bearlier runs?\b|\bfeasibility study\b"
                      r"|\b20\d\d-\d\d\b|performance-log", re.IGNORECASE)


def _rel(path):
  return str(path.relative_to(ROOT))


def _prose(text):
  """``text`` without fenced code and without the generated blocks."""
  return _FENCE.sub("", render.BLOCK.sub("", text))


def test_results_exist():
  for name in ("step", "collectives", "pack", "checkpoint"):
    assert name in RESULTS, f"benchmarks/results/{name}.json is missing"


def test_pages_match_the_json():
  stale = [_rel(p) for p in PAGES if render.render_text(p.read_text(), RESULTS) != p.read_text()]
  assert not stale, (f"figures out of date in {stale}: run `python -m benchmarks render` "
                     "(never edit the generated blocks by hand)")


def test_rendering_is_idempotent():
  for page in PAGES:
    once = render.render_text(page.read_text(), RESULTS)
    assert render.render_text(once, RESULTS) == once, _rel(page)


def test_the_figures_are_where_they_belong():
  where = {_rel(p): render.blocks(p.read_text()) for p in PAGES}
  assert where["README.md"] == ["headline"]
  assert where["docs/performance.md"] == ["step", "collectives", "pack", "optimizer",
                                          "checkpoint", "startup"]
  assert where["docs/comparison.md"] == ["baselines"]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_figures_outside_the_blocks(page):
  quoted = sorted({m.group(0) for m in _FIGURE.finditer(_prose(page.read_text()))})
  assert not quoted, (f"{_rel(page)} quotes figures {quoted} outside a generated block: "
                      "link to docs/performance.md, or add a `<!-- figures: ... -->` block")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_development_history(page):
  # The generated machine lines name the CPU as its vendor does ("Intel(R) Xeon(R) ...").
  text = "\n".join(line for line in page.read_text().splitlines()
                   if not line.startswith(("Measured on ", "Compiled for ")))
  found = sorted({m.group(0) for m in _HISTORY.finditer(text)})
  assert not found, f"{_rel(page)} reads like a development log: {found}"


def test_performance_page_is_short():
  """About 200 lines: the text around the tables stays short, and the tables grow only
  with the models and workloads a run measures."""
  text = (ROOT / "docs" / "performance.md").read_text()
  # 6 for the checkpoint section, 8 for the real architectures and their optimizers, 6
  # for startup
  assert len(render.BLOCK.sub("", text).splitlines()) <= 161
  # The step section shows one table per model: three real architectures, two MLPs; the
  # startup table one row per model and mode.
  assert len(text.splitlines()) <= 345
  assert not (ROOT / "docs" / "performance-log.md").exists()


def test_readme_table_has_at_most_eight_rows_and_leads_with_the_transformer():
  text = (ROOT / "README.md").read_text()
  body = next(render.BLOCK.finditer(text)).group("body")
  rows = [line for line in body.splitlines() if line.startswith("| ")]
  assert 2 <= len(rows) <= 9, rows  # the header and at most eight rows
  assert rows[1].startswith("| CPU step time, GPT-2-like"), rows[1]


# -- the renderer itself, on made-up results ------------------------------------------


def _row(model, key, variant, step_s, compile_s="1.00", state="1.0 MiB", blocks=None):
  values = {"model": model, "key": key, "step_s": step_s}
  if blocks:
    values["block_step_s"] = blocks
  return {"cells": {"variant": variant, "step ms": f"{1e3 * step_s:.3g}",
                    "speed-up": "-", "compile s": compile_s, "opt state/dev": state},
          "values": values}


def _step(*rows, model="mlp_40x256"):
  columns = ["variant", "step ms", "speed-up", "compile s", "goal", "opt state/dev"]
  return {"benchmark": "step", "command": "python -m benchmarks step",
          "machine": {"cpu": "Test CPU", "cores": 4, "jax": "0", "platform": "cpu",
                      "device_count": 8},
          "tables": [{"title": model, "columns": columns, "rows": list(rows)}]}


def test_step_tables_drop_the_benchmarks_targets():
  doc = _step(_row("mlp_40x256", "per_leaf", "per-leaf", 0.1))
  text = render.render_step({"step": doc})
  assert "goal" not in text and "| per-leaf | 100 |" in text


def test_missing_results_say_how_to_make_them():
  assert "python -m benchmarks pack" in render.render_pack({})
  page = "a\n<!-- figures: step -->\nold\n<!-- /figures -->\nb\n"
  assert "old" not in render.render_text(page, {})
  with pytest.raises(ValueError, match="unknown figures block"):
    render.render_text("<!-- figures: nope -->\n<!-- /figures -->", {})


def test_committed_json_is_what_the_benchmarks_write():
  for name, doc in RESULTS.items():
    # gpu-<name>: benchmarks/results/gpu/<name>.json, written on a GPU by gpu_check.sh
    assert doc["benchmark"] == name.removeprefix("gpu-")
    assert doc["command"].startswith("python -m benchmarks")
    assert (doc["machine"]["platform"] == "gpu") == name.startswith("gpu-")
    assert {"cpu", "cores", "jax", "platform", "device_count"} <= set(doc["machine"])
    json.dumps(doc)  # plain JSON, no NaN smuggled in
