"""The benchmarks run and print their tables (tiny sizes; no timing is asserted here).

Each runs in a subprocess from the repository root, as users run them
(``python -m benchmarks <name>``): the collective benchmarks set up 8 CPU devices before
JAX starts. The step benchmark doubles as a check that every training mode ends where
the per-leaf baseline ends.
"""

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MACHINE_KEYS = {"cpu", "cores", "jax", "jaxlib", "optax", "device_kind", "device_count"}


def run(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                        text=True, timeout=timeout, cwd=ROOT)


def bench(name: str, json_path: pathlib.Path, *args: str) -> tuple[str, dict]:
  out = run("benchmarks", name, *args, "--json", str(json_path))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  doc = json.loads(json_path.read_text())
  assert doc["benchmark"] == name and MACHINE_KEYS <= set(doc["machine"])
  assert doc["command"] == " ".join(["python -m benchmarks", name, *args, "--json",
                                     str(json_path)])
  assert doc["tables"] and all(t["rows"] for t in doc["tables"])
  return out.stdout, doc


def table_rows(text: str, first_cell: str) -> list[list[str]]:
  return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()
          if line.startswith(first_cell)]


@pytest.fixture(scope="module")
def step_run(tmp_path_factory) -> tuple[str, dict]:
  """One run of the step benchmark, every variant, on a model whose buckets need no
  padding in bf16 or f32 (its byte counts compare exactly)."""
  return bench("step", tmp_path_factory.mktemp("step") / "step.json", "--models",
               "mlp_4x256", "--steps", "2", "--blocks", "1")


def step_rows(doc: dict) -> dict[str, dict]:
  return {r["values"]["key"]: r["values"] for r in doc["tables"][0]["rows"]}


@pytest.mark.timeout(600)
def test_step_benchmark_every_mode_matches_per_leaf(step_run):
  text, doc = step_run
  assert "machine:" in text and "speed-up" in text and "gap closed" in text
  labels = ["ravel_pytree", "optax.flatten", "jit + NamedSharding", "jit, ZeRO-1 by sharding",
            "jpack allreduce", "jpack packed", "jpack sharded", "hand-written ZeRO-1",
            "optax.chain(jpack.optax.allreduce, adam)", "per-leaf + MultiSteps k=4",
            "jpack packed, accumulate=4", "jpack sharded, accumulate=4",
            "jpack sharded, acc=4 ZeRO-2"]
  for label in labels:
    rows = [r for r in table_rows(text, label) if r[0] == label]
    assert rows, f"no row {label!r} in\n{text}"
    max_diff = float(rows[-1][-1])  # last column: max |params - per-leaf params|
    assert max_diff < 1e-5, (label, max_diff)
  bf16 = [r for r in table_rows(text, "jpack packed bf16")][-1]
  assert float(bf16[-1]) < 1e-2  # bf16 wire: rounded gradients, same optimizer
  assert any("A2A" in cell for cell in bf16)  # narrow wire: integer bits via all_to_all
  assert table_rows(text, "bound: packed grads only")
  sgd = [r for r in table_rows(text, "bound: ZeRO-1 with sgd")][-1]
  assert any("RS" in cell for cell in sgd) and sgd[-1] == "-"  # not adam: no comparison
  # Per-leaf removes none of its own time above the floor; the floor all of it.
  assert [r for r in table_rows(text, "per-leaf pmean")][-1][6] == "0%"
  assert [r for r in table_rows(text, "bound: grads only")][-1][6] == "100%"

  rows = step_rows(doc)
  t = {key: v["step_s"] for key, v in rows.items()}
  want = (t["per_leaf"] - t["packed"]) / (t["per_leaf"] - t["grad_only"])
  assert rows["packed"]["gap_closed"] == pytest.approx(want)
  assert rows["packed"]["speedup_vs_per_leaf"] == pytest.approx(t["per_leaf"] / t["packed"])
  assert rows["sharded"]["collectives"]["reduce-scatter"] >= 1
  assert rows["per_leaf"]["max_param_diff_vs_per_leaf"] is None
  _check_jit_rows(rows)


def _check_jit_rows(rows: dict) -> None:
  """The plain-jit baselines: the per-leaf step's params, collectives XLA inserted, and
  ZeRO-1's adam state split over the 8 devices."""
  jit, zero1 = rows["jit"], rows["jit_zero1"]
  for v in (jit, zero1):
    assert v["max_param_diff_vs_per_leaf"] < 1e-6
    assert v["collectives"]["all-reduce"] >= 1 and sum(v["collective_bytes"].values()) > 0
  assert jit["opt_state_bytes"] == rows["per_leaf"]["opt_state_bytes"]
  assert zero1["collectives"]["all-gather"] >= 1  # the updated slices, to replicated params
  # mlp_4x32: every moment leaf splits 8 ways; adam's count and the norm stay whole.
  assert zero1["opt_state_bytes"] < jit["opt_state_bytes"] / 7


@pytest.mark.timeout(600)
def test_step_benchmark_checkpoint_rows(step_run):
  """The packed and the sharded step with an async Orbax save every 10 steps, timed in
  the same run as the rows without saves and compared with them block by block."""
  text, doc = step_run
  rows = step_rows(doc)
  assert "blocks of 10 steps, not 2" in text  # whole save intervals, for every row
  for key, plain in (("packed_save10", "packed"), ("sharded_save10", "sharded")):
    v = rows[key]
    assert v["no_saves_key"] == plain and v["saves"] == 1, key  # one block, one save
    assert v["vs_no_saves"] == pytest.approx(v["block_step_s"][0]
                                             / rows[plain]["block_step_s"][0])
    assert v["save_call_s"] > 0 and v["save_wait_s"] >= 0 and v["checkpoint_bytes"] > 0
    assert v["max_param_diff_vs_per_leaf"] < 1e-5, key  # saving leaves training alone
    assert rows[plain]["vs_no_saves"] is None and rows[plain]["saves"] == 0
    row = [r for r in table_rows(text, f"jpack {plain}, async save every 10")][-1]
    assert row[7].endswith("x"), row  # vs no saves


@pytest.mark.timeout(600)
def test_step_benchmark_bf16_params_rows(step_run):
  """bf16 params with f32 masters: half the all-gather bytes of f32 ZeRO-1, and about
  2Ψ + 12Ψ/N bytes of params + optimizer state per device."""
  text, doc = step_run
  rows = step_rows(doc)
  assert "jpack sharded, bf16 params" in text and "params+opt/dev" in text
  for v in rows.values():  # every row: params + optimizer state per device
    assert v["state_bytes_per_device"] > 0 and v["psi"] == v["params"]
  psi, n = rows["per_leaf"]["psi"], 8
  f32, bf16 = rows["sharded"], rows["sharded_bf16"]
  assert bf16["param_dtype"] == rows["packed_bf16_params"]["param_dtype"] == "bfloat16"
  assert f32["param_dtype"] == "float32"
  # The new params, gathered in bf16 (integer bits on XLA:CPU, which widens bf16 ones).
  assert bf16["collective_bytes"]["all-gather"] * 2 == f32["collective_bytes"]["all-gather"]
  # The gradients are reduced in f32, the masters' dtype.
  assert bf16["collective_bytes"]["reduce-scatter"] == f32["collective_bytes"]["reduce-scatter"]
  assert bf16["state_bytes_per_device"] <= 1.01 * (2 * psi + 12 * psi / n) + 64
  assert rows["per_leaf"]["state_bytes_per_device"] >= 12 * psi  # f32 params, mu, nu
  # Packed keeps replicated masters next to the moments: 2Ψ + 4Ψ + 8Ψ.
  packed = rows["packed_bf16_params"]
  assert 14 * psi <= packed["state_bytes_per_device"] <= 1.01 * 14 * psi + 64
  for key in ("packed_bf16_params", "sharded_bf16"):
    # Not the same params (bf16), but the same training, to bf16's rounding.
    assert 0 < rows[key]["max_param_diff_vs_per_leaf"] < 3e-2, key
  assert [r for r in table_rows(text, "jpack sharded, bf16 params")][-1][-1].endswith("(bf16)")


@pytest.mark.timeout(600)
def test_step_benchmark_accumulation_rows(step_run):
  """accumulate=4 ends where per-leaf + optax.MultiSteps(adam, 4) ends, each compared
  with it; ZeRO-2's reduce-scatter runs in the micro-step loop."""
  text, doc = step_run
  rows = step_rows(doc)
  multi = rows["per_leaf_multisteps4"]
  assert multi["calls_per_step"] == 4 and multi["accumulate"] == 4
  assert multi["speedup_vs_multisteps"] == 1.0
  assert multi["max_param_diff_vs_per_leaf"] < 1e-5  # one update of the same whole batch
  assert any(c.endswith("x4 calls") for c in table_rows(text, "per-leaf + MultiSteps")[-1])
  t = multi["step_s"]
  for key in ("packed_acc4", "sharded_acc4", "sharded_acc4_zero2"):
    v = rows[key]
    assert v["accumulate"] == 4 and v["calls_per_step"] == 1, key
    assert v["max_param_diff_vs_multisteps"] < 1e-5, (key, v["max_param_diff_vs_multisteps"])
    assert v["speedup_vs_multisteps"] == pytest.approx(t / v["step_s"])
  assert rows["packed"]["speedup_vs_multisteps"] is None  # not accumulating
  assert rows["sharded_acc4_zero2"]["collectives_in_loop"]["reduce-scatter"] >= 1
  for key in ("packed_acc4", "sharded_acc4"):  # reduced once, after the loop
    assert sum(rows[key]["collectives_in_loop"].values()) == 0, key
  zero2 = table_rows(text, "jpack sharded, acc=4 ZeRO-2")[-1]
  assert any(c.endswith("(RS1 in loop)") for c in zero2)
  assert "vs MultiSteps" in text


@pytest.mark.timeout(900)
def test_step_benchmark_real_models(tmp_path):
  """The real architectures in their tiny forms: GPT-2 with its optimizers (ZeRO-1 runs
  lamb on owned leaves), and the ResNet-18 whose BatchNorm statistics are model state,
  carried by the per-leaf step and jpack's modes alike."""
  text, doc = bench("step", tmp_path / "step.json", "--models", "gpt2_2x16,resnet18_tiny",
                    "--steps", "1", "--blocks", "2", "--variants",
                    "per_leaf,hand_pmean,packed,sharded,per_leaf_adamw_mask,"
                    "packed_adamw_mask,per_leaf_lamb,sharded_lamb")
  gpt, resnet = ({r["values"]["key"]: r for r in t["rows"]} for t in doc["tables"])
  assert {r["values"]["leaves"] for r in gpt.values()} == {28}
  for key in ("hand_pmean", "packed", "sharded"):
    # adam turns float noise on zero-gradient leaves (the key bias) into O(lr) updates
    assert gpt[key]["values"]["max_param_diff_vs_per_leaf"] < 1e-3, key
  for key, base in (("packed_adamw_mask", "per_leaf_adamw_mask"),
                    ("sharded_lamb", "per_leaf_lamb")):  # against the same optimizer
    v = gpt[key]["values"]
    assert v["baseline"] == base and v["max_param_diff_vs_per_leaf"] < 1e-3
    assert v["speedup_vs_per_leaf"] == pytest.approx(
        gpt[base]["values"]["step_s"] / v["step_s"])
  per_leaf = gpt["per_leaf"]["values"]
  assert per_leaf["speedup_min"] == per_leaf["speedup_max"] == 1.0
  assert gpt["packed"]["values"]["speedup_min"] <= gpt["packed"]["values"]["speedup_max"]
  assert gpt["packed"]["cells"]["spread"].count("–") == 1
  # The ResNet: model state, so no jit step and no optimizer rows; the rest agree.
  assert "resnet18_tiny has model state" in text
  assert set(resnet) == {"per_leaf", "hand_pmean", "packed", "sharded"}
  for key in ("hand_pmean", "packed", "sharded"):
    assert resnet[key]["values"]["max_param_diff_vs_per_leaf"] < 1e-5, key


def test_real_models_have_the_real_leaf_counts():
  import jax

  from benchmarks import models, step
  assert models.gpt2(abstract=True).num_leaves == 148
  vit = models.vit(abstract=True)
  assert vit.num_leaves == 152 and round(vit.num_params / 1e6, 1) == 86.6  # ViT-B/16
  r18 = models.resnet(models.RESNET18_BLOCKS, block="basic", abstract=True)
  assert r18.num_leaves == 62 and round(r18.num_params / 1e6, 1) == 11.7
  assert models.resnet(abstract=True).num_leaves == 161  # ResNet-50's table
  narrow = {n: step.MODELS[n]() for n in step.REAL_MODELS}
  assert [m.num_leaves for m in narrow.values()] == [148, 152, 62]
  assert narrow["resnet18_narrow"].has_state
  assert len(jax.tree.leaves(narrow["resnet18_narrow"].state)) == 40  # 20 BNs' mean, var


def test_loop_collectives_counts_what_while_bodies_reach():
  from jpack import _reference
  hlo = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%inner (p: f32[8]) -> f32[1] {
  ROOT %rs = f32[1]{0} reduce-scatter(%p), dimensions={0}, to_apply=%add
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %c = f32[1]{0} call(%x), to_apply=%inner
  %ar = f32[8]{0} all-reduce(%y), to_apply=%add
}

%cond (t: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t), condition=%cond, body=%body
  %ag = f32[64]{0} all-gather(%x), dimensions={0}
}
"""
  loop = _reference.loop_collectives(hlo)
  assert loop.count == {"all-reduce": 1, "reduce-scatter": 1, "all-gather": 0,
                        "all-to-all": 0}
  assert loop.result_bytes["reduce-scatter"] == 4
  no_loop = hlo.replace("while(%t), condition=%cond, body=", "call(%t), to_apply=")
  assert sum(_reference.loop_collectives(no_loop).count.values()) == 0


def test_zero1_sharding_splits_the_largest_dimension_that_divides():
  import jax
  from jax.sharding import PartitionSpec as P

  from jpack._reference import zero1_sharding
  mesh = jax.make_mesh((8,), ("batch",), devices=jax.devices()[:8])
  spec = lambda *shape: zero1_sharding(jax.ShapeDtypeStruct(shape, "float32"), mesh).spec
  assert spec(256, 1024) == P(None, "batch")
  assert spec(24, 16) == P("batch", None)  # the largest divides
  assert spec(12, 16) == P(None, "batch")  # the largest that divides
  assert spec(16, 16) == P("batch", None)  # the first of equal ones
  assert spec(3, 5) == spec(0) == spec() == P()  # nothing to split: replicated


@pytest.mark.timeout(600)
def test_pack_benchmark_prints_its_table(tmp_path):
  text, doc = bench("pack", tmp_path / "pack.json", "--workloads", "mixed_llama_tiny",
                    "--max-leaves", "20", "--runs", "2")
  assert "mixed_llama_tiny" in text and "unpack" in text
  ops = {row[1] for row in table_rows(text, "mixed_llama_tiny") if len(row) > 1}
  assert {"(f) jpack.pack, eager", "(f) jpack.unpack, eager"} <= ops
  pack = next(r["values"] for r in doc["tables"][0]["rows"] if r["values"]["key"] == "pack")
  assert pack["run_s"] > 0 and pack["compile_s"] > 0 and pack["run_vs_max_ab"] > 0


@pytest.mark.timeout(600)
def test_collectives_benchmark_prints_its_table(tmp_path):
  text, doc = bench("collectives", tmp_path / "c.json", "--workloads", "resnet50",
                    "--max-leaves", "20", "--runs", "2", "--quick")
  assert "per-leaf pmean" in text and "jpack s+g" in text and "jpack s+g Packed" in text
  rows = {r["values"]["key"]: r["values"] for r in doc["tables"][0]["rows"]}
  assert rows["per_leaf"]["vs_per_leaf"] == 1.0 and rows["jpack_sg"]["vs_floor"] > 0


def test_the_runner_lists_and_refuses():
  out = run("benchmarks", "--help", timeout=120)
  assert out.returncode == 0 and "pack, collectives, step" in out.stdout
  out = run("benchmarks", "nope", timeout=120)
  assert out.returncode == 2 and "invalid choice: 'nope'" in out.stderr
  out = run("benchmarks", "step", "--list", timeout=120)
  assert out.returncode == 0 and "per_leaf" in out.stdout and "mlp_40x256" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["collectives", "--runs", "0"], "must be >= 1"),
    (["collectives", "--workloads", "resnet5"], "unknown 'resnet5'"),
    (["collectives", "--workloads", "small_abc"], "unknown 'small_abc'"),
    (["collectives", "--markdown", "/no/such/dir/c.md"], "does not exist"),
    (["pack", "--workloads", "gpt3"], "unknown 'gpt3'"),
    (["pack", "--max-leaves", "-1"], "must be >= 1"),
    (["pack", "--json", "/no/such/dir/p.json"], "does not exist"),
    (["step", "--steps", "-1"], "must be >= 1"),
    (["step", "--blocks", "0"], "must be >= 1"),
    (["step", "--variants", "per_leaf,nope"], "unknown 'nope'"),
    (["step", "--batch", "6", "--variants", "packed_acc4"], "does not split into 4 micro"),
    (["optimizer", "--scale", "1.5"], "--scale"),
])
def test_bad_benchmark_flags_fail_before_running(args, message):
  out = run("benchmarks", *args, timeout=120)
  assert out.returncode != 0, out.stdout
  assert message in out.stdout + out.stderr, out.stdout + out.stderr
  assert "Traceback" not in out.stderr
  assert "machine:" not in out.stdout  # refused before the banner, not after a run


def test_paired_ratio_is_the_median_of_per_round_ratios():
  from benchmarks import harness as h
  # Round 2 is slow for both (a host drift): paired, it cancels; medians alone would not.
  a = h.Timing(0.0, 0.0, 3, (1.0, 4.0, 1.2))
  b = h.Timing(0.0, 0.0, 3, (2.0, 8.0, 2.0))
  assert a.over(b) == 0.5
  with pytest.raises(ValueError, match="same interleaved rounds"):
    a.over(h.Timing(0.0, 0.0, 2, (1.0, 2.0)))


def test_results_json_has_no_nan_and_plain_numbers():
  import numpy as np

  from benchmarks import harness as h
  table = h.Table(["a"])
  table.add("1", x=np.float32(0.5), y=float("nan"), z=[np.int64(3), float("inf")])
  assert h.finite(table.json())["rows"][0]["values"] == {"x": 0.5, "y": None,
                                                          "z": [3, None]}


def test_results_json_reads_row_by_row():
  import json

  from benchmarks import harness as h
  report = h.Report("demo", "Demo", ["demo", "--quick"])
  table = h.Table(["a", "b"])
  table.add("1", "2", key="x", nested={"deep": [1, {"k": None}]})
  table.add("3", "4", key="y", nested={})
  report.parts.append(table)
  doc = report.json()
  text = h.dumps(doc)
  assert json.loads(text) == doc
  rows = [line for line in text.splitlines() if '"cells"' in line]
  assert [json.loads(line.strip().rstrip(","))["values"]["key"] for line in rows] == ["x", "y"]
  assert all(r["command"] == "python -m benchmarks demo --quick" for r in doc["tables"][0]["rows"])
