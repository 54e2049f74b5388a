"""The benchmarks run and print their tables (tiny sizes; no timing is asserted here).

Each runs in a subprocess, as users run them: the collective benchmarks set up 8 CPU
devices before JAX starts. The step benchmark doubles as a check that every training mode
ends where the per-leaf baseline ends.
"""

import re
import subprocess
import sys

import pytest


def bench(*args: str, timeout: int = 600) -> str:
  out = subprocess.run([sys.executable, "-m", "jpack.bench", *args], capture_output=True,
                       text=True, timeout=timeout)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


def table_rows(text: str, first_cell: str) -> list[list[str]]:
  return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()
          if line.startswith(first_cell)]


@pytest.mark.timeout(600)
def test_step_benchmark_every_mode_matches_per_leaf():
  text = bench("step", "--models", "mlp_4x32", "--steps", "2", "--blocks", "1")
  assert "machine:" in text and "speed-up" in text
  labels = ["ravel_pytree", "optax.flatten", "jpack allreduce", "jpack packed",
            "jpack sharded", "hand-written ZeRO-1", "optax.chain(jpack.optax.allreduce, adam)"]
  for label in labels:
    rows = [r for r in table_rows(text, label) if r[0] == label]
    assert rows, f"no row {label!r} in\n{text}"
    max_diff = float(rows[-1][-1])  # last column: max |params - per-leaf params|
    assert max_diff < 1e-5, (label, max_diff)
  bf16 = [r for r in table_rows(text, "jpack packed bf16")][-1]
  assert float(bf16[-1]) < 1e-2  # bf16 wire: rounded gradients, same optimizer
  assert any("A2A" in cell for cell in bf16)  # narrow wire: integer bits via all_to_all
  assert table_rows(text, "bound: grads only")
  assert table_rows(text, "bound: packed grads only")
  sgd = [r for r in table_rows(text, "bound: ZeRO-1 with sgd")][-1]
  assert any("RS" in cell for cell in sgd) and sgd[-1] == "-"  # not adam: no comparison


@pytest.mark.timeout(600)
def test_pack_benchmark_prints_its_table():
  text = bench("pack", "--workloads", "mixed_llama_tiny", "--max-leaves", "20", "--runs", "2",
               "--plan-runs", "2")
  assert "mixed_llama_tiny" in text and "unpack" in text
  ops = {row[1] for row in table_rows(text, "mixed_llama_tiny") if len(row) > 1}
  assert {"(f) jpack.pack, eager", "(f) jpack.unpack, eager"} <= ops


@pytest.mark.timeout(600)
def test_collectives_benchmark_prints_its_table():
  text = bench("collectives", "--workloads", "resnet50", "--max-leaves", "20", "--runs", "2",
               "--no-sweep", "--compile-rounds", "2")
  assert "per-leaf pmean" in text and "jpack s+g" in text and "jpack s+g Packed" in text


def test_unknown_benchmark_is_a_clear_error():
  out = subprocess.run([sys.executable, "-m", "jpack.bench", "nope"], capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 2 and "Unknown benchmark" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["collectives", "--runs", "0"], "must be >= 1"),
    (["collectives", "--compile-rounds", "0"], "must be >= 1"),
    (["collectives", "--workloads", "resnet5"], "unknown workload(s) 'resnet5'"),
    (["collectives", "--workloads", "small_abc"], "small_N, N a positive number"),
    (["collectives", "--sweep-workload", "nope"], "--sweep-workload: unknown workload"),
    (["collectives", "--markdown", "/no/such/dir/c.md"], "does not exist"),
    (["pack", "--workloads", "gpt3"], "unknown workload(s) 'gpt3'"),
    (["pack", "--max-leaves", "-1"], "must be >= 1"),
    (["step", "--steps", "-1"], "must be >= 1"),
    (["step", "--blocks", "0"], "must be >= 1"),
    (["step", "--solo-bytes", "-5"], "--solo-bytes must be >= 0"),
])
def test_bad_benchmark_flags_fail_before_running(args, message):
  out = subprocess.run([sys.executable, "-m", "jpack.bench", *args], capture_output=True,
                       text=True, timeout=120)
  assert out.returncode != 0, out.stdout
  assert message in out.stdout + out.stderr, out.stdout + out.stderr
  assert "Traceback" not in out.stderr
  assert "machine:" not in out.stdout  # refused before the banner, not after a run


def test_paired_ratio_is_the_median_of_per_round_ratios():
  from jpack.bench import _common as c
  # Round 2 is slow for both (a host drift): paired, it cancels; medians alone would not.
  a = c.Timing(0.0, 0.0, 3, (1.0, 4.0, 1.2))
  b = c.Timing(0.0, 0.0, 3, (2.0, 8.0, 2.0))
  assert c.paired_ratio(a, b) == 0.5
  with pytest.raises(ValueError, match="same interleaved rounds"):
    c.paired_ratio(a, c.Timing(0.0, 0.0, 2, (1.0, 2.0)))
