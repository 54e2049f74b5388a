"""`python -m jpack demo` end to end (in a subprocess: it sets its own device count)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jpack import __main__ as cli
from jpack._demo import ALL_MODES, count_collectives

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
  # ZeRO-1 keeps 1/4 of the optimizer's moments per device.
  assert results["sharded"]["opt_state_bytes"] < results["allreduce"]["opt_state_bytes"] / 3
  # Plain jit takes the mean over the global batch: per_leaf's losses, step by step, with
  # every gradient leaf all-reduced by the collectives XLA inserts.
  jit, per_leaf = results["jit"], results["per_leaf"]
  assert max(abs(a - b) for a, b in zip(jit["losses"], per_leaf["losses"])) < 1e-4
  assert jit["collectives"]["all-reduce"] >= 1 and jit["collective_arrays"] > 12 * 4
  assert jit["opt_state_bytes"] == per_leaf["opt_state_bytes"]
  assert jit["grad_bytes"] == per_leaf["grad_bytes"]


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
    ends[mode] = (dp.params(state), float(metrics["loss"]), float(metrics["grad_norm"]))
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
    (["demo", "--bucket-mib", "-1"], "positive number"),
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
  for flag in ("--devices", "--steps", "--batch-size", "--bucket-mib", "--modes",
               "--comm-dtype", "--out", "--seed", "--quick"):
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
  count, arrays = count_collectives(hlo)
  assert count == {"all-reduce": 1, "reduce-scatter": 1, "all-gather": 1, "all-to-all": 1}
  assert arrays == 6
  assert count_collectives("%m = f32[2]{0} multiply(%a, %b)") == (dict.fromkeys(count, 0), 0)
