"""`python -m jpack demo` end to end (in a subprocess: it sets its own device count)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jpack import __main__ as cli
from jpack._demo import ALL_MODES
from jpack._reference import count_collectives

WORKLOADS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "workloads"

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


def _run(*args, timeout=300):
  env = {**os.environ, "PYTHONWARNINGS": "ignore"}
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-m", "jpack", *args], capture_output=True,
                        text=True, timeout=timeout, env=env)


@pytest.mark.timeout(320)
def test_demo_quick_runs_all_modes(tmp_path):
  out = tmp_path / "demo-out"
  proc = _run("demo", "--quick", "--devices", "4", "--modes", ",".join(ALL_MODES),
              "--out", str(out), "--no-progress")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  text = proc.stdout
  assert "mode" in text and "step ms (median)" in text and "test acc" in text, text
  assert "speed-up vs per_leaf" in text and "(above 1x: faster)" in text, text
  assert "Parameter layout" in text and "bucket" in text, text
  table = text[text.index("step ms (median)"):]
  for mode in ALL_MODES:
    assert f"\n{mode} " in table, (mode, text)

  png = out / "jpack-demo.png"
  assert png.is_file() and png.stat().st_size > 10_000
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert str(png) in text

  doc = json.loads((out / "results.json").read_text())
  assert doc["devices"] == 4
  results = {r["mode"]: r for r in doc["results"]}
  assert set(results) == set(ALL_MODES)
  for mode, r in results.items():
    assert len(r["losses"]) == doc["steps"]
    assert r["test_accuracy"] > 0.8, (mode, r["test_accuracy"])  # 10 classes: chance 0.1
    assert r["losses"][-1] < r["losses"][0]
    assert r["median_ms"] > 0 and r["compile_s"] > 0
  # All modes compute the same mean gradient: the same data gives nearly the same loss.
  finals = [r["final_loss"] for r in results.values()]
  assert max(finals) - min(finals) < 0.05, finals
  # per_leaf reduces every leaf (XLA may merge them into one tuple op, but the arrays
  # stay separate); jpack modes reduce one bucket.
  assert results["per_leaf"]["collective_arrays"] > 12 * 4  # 12 blocks of 4 leaves
  assert results["allreduce"]["collective_arrays"] < 10
  for r in results.values():
    assert sum(r["collectives"].values()) >= 1
  # ZeRO-1 keeps 1/4 of the optimizer's moments per device, ZeRO-3 of the params too.
  assert results["sharded"]["opt_state_bytes"] < results["allreduce"]["opt_state_bytes"] / 3
  assert results["fsdp"]["opt_state_bytes"] == results["sharded"]["opt_state_bytes"]
  # On 4 devices with adamw: ZeRO-3 keeps 12 bytes a param / 4, ZeRO-1 4 + 8 / 4.
  assert results["fsdp"]["state_bytes"] == pytest.approx(
      results["sharded"]["state_bytes"] / 2, rel=0.01)
  # Plain jit takes the mean over the global batch: per_leaf's losses, step by step, with
  # every gradient leaf all-reduced by the collectives XLA inserts.
  jit, per_leaf = results["jit"], results["per_leaf"]
  assert max(abs(a - b) for a, b in zip(jit["losses"], per_leaf["losses"])) < 1e-4
  assert jit["collectives"]["all-reduce"] >= 1 and jit["collective_arrays"] > 12 * 4
  assert jit["opt_state_bytes"] == per_leaf["opt_state_bytes"]
  assert jit["grad_bytes"] == per_leaf["grad_bytes"]


@pytest.mark.timeout(320)
def test_demo_bf16_params_and_accumulation_flags(tmp_path):
  out = tmp_path / "demo-out"
  modes = ("per_leaf", "packed", "sharded", "fsdp")  # jit computes what per_leaf does
  # Width 128: leaves of whole 256-byte blocks in bf16, so the buckets barely pad.
  proc = _run("demo", "--devices", "4", "--steps", "8", "--width", "128", "--depth", "4",
              "--modes", ",".join(modes), "--param-dtype", "bfloat16", "--accumulate", "2",
              "--out", str(out), "--no-progress")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  text = proc.stdout
  assert "param dtype bfloat16, accumulate 2" in text, text
  table = text[text.index("step ms (median)"):]
  assert "params+opt/device" in table and "test acc" in table
  assert "bfloat16 + f32 master" in table and "float32, bfloat16 in loss" in table
  assert "2 MultiSteps" in table, table

  doc = json.loads((out / "results.json").read_text())
  assert doc["param_dtype"] == "bfloat16" and doc["accumulate"] == 2
  r = {x["mode"]: x for x in doc["results"]}
  assert set(r) == set(modes) and all(x["accumulate"] == 2 for x in r.values())
  assert r["sharded"]["params_as"] == "bfloat16 + f32 master"
  assert r["fsdp"]["params_as"] == "f32 master, bfloat16 gathered"
  assert r["per_leaf"]["params_as"] == "float32, bfloat16 in loss"
  # The same forward and backward (bf16 params or f32 ones cast for the loss) and the
  # same mean gradient (MultiSteps or jpack's accumulation): nearly the same losses.
  for mode in ("packed", "sharded", "fsdp"):
    diff = max(abs(a - b) for a, b in zip(r[mode]["losses"], r["per_leaf"]["losses"]))
    assert diff < 0.02, (mode, diff)
  import jax

  from jpack import _demo
  psi = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
      lambda: _demo.init_mlp(jax.random.key(0), 64, 128, 4, 10))))  # the parameter count
  # MultiSteps reduces on each of 2 micro-batches, jpack once, in the f32 masters' dtype.
  assert r["per_leaf"]["grad_bytes"] == 2 * 4 * psi
  assert r["packed"]["grad_bytes"] == pytest.approx(4 * psi, rel=0.02)
  # Params + state per device: bf16 params next to f32 masters and moments, which
  # ZeRO-1 splits 4 ways (ZeRO-3 keeps the split masters only); per_leaf keeps f32
  # params, its moments and MultiSteps' sum.
  assert r["packed"]["state_bytes"] == pytest.approx(14 * psi, rel=0.02)
  assert r["sharded"]["state_bytes"] == pytest.approx(2 * psi + 12 * psi / 4, rel=0.02)
  assert r["fsdp"]["state_bytes"] == pytest.approx(12 * psi / 4, rel=0.02)  # no bf16 copy
  assert r["per_leaf"]["state_bytes"] == pytest.approx(16 * psi, rel=0.02)
  for x in r.values():
    assert x["test_accuracy"] > 0.5, (x["mode"], x["test_accuracy"])  # chance: 0.1


@pytest.mark.timeout(120)
def test_bf16_params_reach_the_test_accuracy_of_float32():
  """On the demo's digits model, ZeRO-1 training with bf16 params (f32 masters) ends
  within 1 point of test accuracy of float32 training from the same start and batches."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from jpack import _demo
  x_train, y_train, x_test, y_test = _demo.load_digits(0)
  mesh = jax.make_mesh((8,), ("batch",), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  sharding = jax.sharding.NamedSharding(mesh, jax.P("batch"))
  params = _demo.init_mlp(jax.random.key(0), x_train.shape[1], 128, 12, 10)
  rng = np.random.default_rng(0)
  batches = [(x_train[i], y_train[i]) for i in
             (rng.choice(len(x_train), 256, replace=False) for _ in range(100))]
  accuracy, kept = {}, {}
  for name, dtype in (("float32", None), ("bfloat16", jnp.bfloat16)):
    dp = _demo.build_step("sharded", _demo.loss_fn, optax.adamw(1e-3, weight_decay=1e-4),
                          params, mesh, param_dtype=dtype)
    state, *_ = _demo._train(dp, params, batches, sharding)
    kept[name] = {x.dtype for x in jax.tree.leaves(dp.unpack(state))}
    accuracy[name] = _demo.accuracy(dp.unpack(state), x_test, y_test, dtype)
  assert kept == {"float32": {jnp.dtype(jnp.float32)}, "bfloat16": {jnp.dtype(jnp.bfloat16)}}
  assert accuracy["float32"] >= 0.95, accuracy
  assert abs(accuracy["bfloat16"] - accuracy["float32"]) <= 0.01, accuracy


def test_jit_step_ends_where_the_per_leaf_step_ends():
  import jax
  import numpy as np
  import optax

  from jpack import _demo
  mesh = jax.make_mesh((8,), ("batch",), devices=jax.devices()[:8])
  params = _demo.init_mlp(jax.random.key(0), 16, 32, 3, 10)
  rng = np.random.default_rng(0)
  batches = [(rng.standard_normal((64, 16)).astype(np.float32),
              rng.integers(0, 10, 64).astype(np.int32)) for _ in range(3)]
  sharding = jax.sharding.NamedSharding(mesh, jax.P("batch"))
  ends = {}
  for mode in ("per_leaf", "jit"):
    dp = _demo.build_step(mode, _demo.loss_fn, optax.adamw(1e-2), params, mesh)
    state = dp.init(params)
    for batch in batches:
      state, metrics = dp.step(state, jax.device_put(batch, sharding))
    ends[mode] = (dp.unpack(state), float(metrics["loss"]), float(metrics["grad_norm"]))
  (p_leaf, loss_leaf, norm_leaf), (p_jit, loss_jit, norm_jit) = ends["per_leaf"], ends["jit"]
  assert int(state.step) == 3
  for a, b in zip(jax.tree.leaves(p_leaf), jax.tree.leaves(p_jit)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  assert abs(loss_leaf - loss_jit) < 1e-5 and abs(norm_leaf - norm_jit) < 1e-4 * norm_leaf


@pytest.mark.parametrize("argv, message", [
    (["demo", "--modes", "per_leaf,bogus"], "unknown mode(s) 'bogus'"),
    (["demo", "--modes", ","], "at least one mode"),
    (["demo", "--devices", "0"], "must be >= 1"),
    (["demo", "--steps", "0"], "must be >= 1"),
    (["demo", "--steps", "ten"], "expected a positive integer"),
    (["demo", "--steps", "1"], "give at least 2"),
    (["demo", "--comm-dtype", "int8"], "invalid choice"),
    (["demo", "--param-dtype", "float16"], "invalid choice"),
    (["demo", "--accumulate", "0"], "must be >= 1"),
    (["demo", "--accumulate", "3"], "must divide the per-device batch 32"),
    (["demo", "--lr", "-1"], "positive number"),
    (["demo", "--devices", "3", "--batch-size", "256"], "divisible"),
    (["demo", "--frobnicate"], "unrecognized arguments"),
    (["layout", "no_such_workload"], "no workload file 'no_such_workload'"),
    (["nope"], "invalid choice"),
])
def test_bad_flags_exit_with_a_clear_message(argv, message, capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(argv)
  assert info.value.code != 0
  assert message in capsys.readouterr().err


def test_an_out_path_that_is_a_file_is_refused_before_training(tmp_path, capsys):
  taken = tmp_path / "results"
  taken.write_text("not a directory")
  with pytest.raises(SystemExit):
    cli.main(["demo", "--out", str(taken)])
  assert "exists and is not a directory" in capsys.readouterr().err
  from jpack import _demo
  with pytest.raises(ValueError, match="not a directory"):
    _demo.run(out=taken)
  with pytest.raises(ValueError, match="steps must be >= 2"):
    _demo.run(steps=1, out=tmp_path / "new")
  with pytest.raises(ValueError, match="divide the per-device batch"):
    _demo.run(accumulate=3, out=tmp_path / "new")
  with pytest.raises(ValueError, match="param_dtype must be one of"):
    _demo.run(param_dtype="float16", out=tmp_path / "new")


def test_bad_flags_in_a_subprocess():
  proc = _run("demo", "--modes", "per_leaf,nope", timeout=120)
  assert proc.returncode == 2
  assert "unknown mode(s) 'nope'" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_help_and_no_command(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["demo", "--help"])
  assert info.value.code == 0
  help_text = capsys.readouterr().out
  for flag in ("--devices", "--steps", "--batch-size", "--modes",
               "--comm-dtype", "--param-dtype", "--accumulate", "--out", "--seed",
               "--quick"):
    assert flag in help_text
  assert cli.main([]) == 2
  assert "demo" in capsys.readouterr().out


def test_layout_command(capsys):
  path = str(WORKLOADS / "gpt2_small.json")
  assert cli.main(["layout", path, "--num-shards", "8", "--bucket-mib", "16"]) == 0
  text = capsys.readouterr().out
  assert text.startswith("gpt2_small:")
  assert "Layout " in text and "bucket" in text and "float32" in text


@pytest.mark.parametrize("leaves,message", [
    ([{"path": "a", "shape": [3], "dtype": "float32"},
      {"path": "a", "shape": [2], "dtype": "float32"}], "leaf path 'a' is repeated"),
    ([{"path": "a", "shape": [-3], "dtype": "float32"}], "non-negative integers"),
    ([{"path": "a", "shape": [2.5], "dtype": "float32"}], "non-negative integers"),
    ([{"path": "a", "shape": [3], "dtype": "float64"}], "64-bit types are disabled"),
])
def test_layout_of_a_bad_workload_file_is_a_clear_error(tmp_path, capsys, leaves, message):
  path = tmp_path / "bad.json"
  path.write_text(json.dumps({"leaves": leaves}))
  with pytest.raises(SystemExit):
    cli.main(["layout", str(path)])
  err = capsys.readouterr().err
  assert message in err and "Traceback" not in err


def test_missing_demo_extra_says_what_to_install(monkeypatch, capsys, tmp_path):
  monkeypatch.setitem(sys.modules, "sklearn", None)
  monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
  assert cli.main(["demo", "--steps", "2", "--no-progress", "--out", str(tmp_path)]) == 1
  assert "pip install 'jpack[demo]'" in capsys.readouterr().err


def test_collective_counter_counts_ops_and_the_arrays_they_move():
  hlo = """
  %all-reduce = (f32[1]{0}, /*index=5*/f32[2]{0}) all-reduce(%p.8, /*index=5*/%p.9), to_apply=%r
  %gte = f32[1]{0} get-tuple-element(%all-reduce), index=0
  %rs = f32[2]{0} reduce-scatter(%z), dimensions={0}
  %ags = f32[8]{0} all-gather-start(%rs), dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  %a2a = (u16[1,4]{1,0}, u16[1,4]{1,0}) all-to-all(%p, %q), dimensions={0}
  """
  colls = count_collectives(hlo)
  assert colls.count == {"all-reduce": 1, "reduce-scatter": 1, "all-gather": 1,
                         "all-to-all": 1}
  assert colls.arrays == 6
  none = count_collectives("%m = f32[2]{0} multiply(%a, %b)")
  assert none.count == dict.fromkeys(colls.count, 0) and none.arrays == 0
