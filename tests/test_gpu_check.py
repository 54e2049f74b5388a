"""The one-GPU check and the optimizer benchmark it runs, exercised on the CPU.

benchmarks/gpu_check.sh runs on a lent machine that gets only the repository, so what
can break it here must fail here: a shell syntax error, a file it names that moved, the
optimizer benchmark, and the summary that reads the benchmark's JSON back.
"""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from benchmarks import BENCHMARKS, optimizer, step
from benchmarks import harness as c
from benchmarks.__main__ import parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_script_parses():
  result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr


def test_script_names_only_files_that_exist():
  text = SCRIPT.read_text()
  paths = set(re.findall(r"\b((?:benchmarks|tests|jpack|docs)/[\w/.-]+\.(?:py|sh|json|md))",
                         text))
  names = set(re.findall(r"-m benchmarks (\w+)", text))
  assert "tests/test_gpu_path.py" in paths and {"optimizer", "step", "pack"} <= names
  missing = [p for p in paths if not (ROOT / p).is_file()] + sorted(names - set(BENCHMARKS))
  assert not missing, f"benchmarks/gpu_check.sh names files that do not exist: {missing}"
  workloads = re.findall(r"GPU_CHECK_WORKLOADS:-([\w,]+)", text)
  models = re.findall(r"--models ([\w,]+)", text)
  variants = re.findall(r"--variants ([\w,]+)", text)
  assert workloads and models and variants
  for names in workloads:
    assert set(names.split(",")) <= set(c.workload_names())
  assert set(",".join(models).split(",")) <= set(step.MODELS)
  assert set(",".join(variants).split(",")) <= set(step.VARIANTS)


def test_scale_keeps_every_leaf_and_its_rank():
  w = c.load_workload("resnet50")
  small = optimizer.scaled(w, 0.01)
  assert list(small.shapes) == list(w.shapes)
  assert all(len(a.shape) == len(b.shape) and a.dtype == b.dtype
             for a, b in zip(small.shapes.values(), w.shapes.values()))
  assert 0.005 * w.num_elements < small.num_elements < 0.05 * w.num_elements
  assert optimizer.scaled(w, 1) is w


@pytest.mark.parametrize("value", ["0", "1.5", "-1", "x"])
def test_scale_out_of_range_is_refused(value, capsys):
  with pytest.raises(SystemExit):
    parser().parse_args(["optimizer", "--scale", value])
  assert "--scale" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_optimizer_benchmark_and_the_summary_of_goals(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable, "OUT": str(tmp_path)}
  json_path = tmp_path / "optimizer.json"
  args = ["--workloads", "resnet50,gpt2_small", "--scale", "0.01", "--runs", "2"]
  result = subprocess.run([sys.executable, "-m", "benchmarks", "optimizer", *args, "--json",
                           str(json_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "| workload | leaves |" in result.stdout  # the Markdown table
  doc = json.loads(json_path.read_text())
  assert doc["benchmark"] == "optimizer" and doc["machine"]["platform"] == "cpu"
  rows = [r["values"] for r in doc["tables"][0]["rows"]]
  assert [r["workload"] for r in rows] == ["resnet50", "gpt2_small"]
  has_torch = importlib.util.find_spec("torch") is not None
  for r in rows:
    assert r["leaves"] == c.load_workload(r["workload"]).num_leaves
    assert r["per_leaf_s"] > 0 and r["jpack_s"] > 0 and r["speedup_vs_per_leaf"] > 0
    assert r["max_param_diff_vs_per_leaf"]["jpack"] < 1e-6  # the same adam
    assert (r["torch_adam"] == "n/a") == (not has_torch)

  # The script's last step reads the JSON back into one table of goals.
  summary = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                           env={**env, "GPU_CHECK_STEPS": "summary"}, timeout=120)
  assert summary.returncode == 0, summary.stdout[-3000:] + summary.stderr[-3000:]
  table = [line for line in summary.stdout.splitlines() if line.startswith("| adam update")]
  assert len(table) == 6 and "resnet50" in table[0] and "gpt2_small" in table[3]
  assert "step.json: missing" in summary.stdout
