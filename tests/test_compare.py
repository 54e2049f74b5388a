"""benchmarks.compare runs HEAD's jpack beside the working tree's and prints finite ratios
(tiny sizes; no timing is asserted)."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_compare_quick_against_head(tmp_path):
  if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                    capture_output=True).returncode:
    pytest.skip("not a git checkout: no baseline revision to extract")
  path = tmp_path / "compare.json"
  out = subprocess.run([sys.executable, "-m", "benchmarks", "compare", "--quick", "--baseline",
                        "HEAD", "--json", str(path)],
                       capture_output=True, text=True, timeout=240, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "new/base" in out.stdout and "round range" in out.stdout
  main, chain = json.loads(path.read_text())["tables"]
  variants = {r["values"]["variant"] for r in main["rows"]}
  assert variants == {"data_parallel(allreduce)", "data_parallel(packed)",
                      "data_parallel(sharded)", "data_parallel(fsdp)",
                      "optax.chain(allreduce, adam)",
                      "pmean (tree in, tree out)"}
  ratios = [r["values"]["paired_ratio"] for r in main["rows"]]
  ratios += [r["values"][k] for r in chain["rows"] for k in ("base_ratio", "new_ratio")]
  assert len(chain["rows"]) == 1
  for x in ratios:
    assert isinstance(x, float) and math.isfinite(x) and x > 0, ratios
