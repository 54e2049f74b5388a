"""Startup: the optimizer check's verdicts are kept for the process, init packs the
params on the host, and the startup benchmark runs (no timing is asserted here)."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jpack
from jpack import _probe

ROOT = pathlib.Path(__file__).resolve().parents[1]


def params0():
  rng = np.random.default_rng(0)
  return {"dense": {"w": rng.normal(size=(6, 4)).astype(np.float32),
                    "b": np.zeros(4, np.float32)},
          "out": rng.normal(size=(4, 3)).astype(np.float32)}


def loss_fn(params, batch):
  h = jax.numpy.tanh(batch @ params["dense"]["w"] + params["dense"]["b"])
  return jax.numpy.mean((h @ params["out"]) ** 2)


@pytest.fixture
def probes(monkeypatch):
  """The probe runs (calls of `_probe._probe`: target, axis), from an empty cache."""
  calls = []
  probe = _probe._probe
  _probe._verdict.cache_clear()
  monkeypatch.setattr(_probe, "_probe", lambda *a: calls.append(a[2:]) or probe(*a))
  yield calls
  _probe._verdict.cache_clear()  # verdicts of the spy's probes


def halving():
  """A transformation of the user's own: not in the table of known ones."""
  return optax.GradientTransformation(
      lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(lambda g: g / 2, u), s))


@pytest.mark.parametrize("mode", ["packed", "sharded", "allreduce"])
def test_a_step_built_again_probes_nothing(mode, probes):
  for _ in range(2):  # known: read from the table, never probed
    jpack.data_parallel(loss_fn, optax.adamw(1e-3), params0(), mode=mode).init(params0())
  assert probes == []
  tx = optax.chain(halving(), optax.sgd(0.1))
  for _ in range(2):
    dp = jpack.data_parallel(loss_fn, tx, params0(), mode=mode)
    dp.init(params0())
  # Once per target: flat's own check and the second build share the verdicts.
  assert len(probes) == len(set(probes)) and probes
  count = len(probes)
  # Another optimizer object (optax transformations are closures, not values) probes.
  jpack.data_parallel(loss_fn, optax.chain(halving(), optax.sgd(0.1)), params0(), mode=mode)
  assert len(probes) > count


def test_refusals_are_kept_and_still_raised(probes):
  # A statistic of the whole gradient kept in the state: ZeRO-1 holds a slice per device.
  tx = optax.chain(optax.transforms.snapshot("norm", optax.tree.norm), optax.sgd(0.1))
  counts = []
  for _ in range(2):
    with pytest.raises(TypeError, match="snapshot cannot run inside"):
      jpack.data_parallel(loss_fn, tx, params0(), mode="sharded")
    counts.append(len(probes))
  assert counts[0] >= 1 and counts[1] == counts[0]  # the second build probes nothing


def test_the_cache_is_bounded(probes):
  txs = [halving() for _ in range(3)]
  for tx in txs + txs[-1:]:
    jpack.optax.flat(tx).init(params0())
  assert len(probes) == 3
  info = _probe._verdict.cache_info()
  assert info.currsize == 3 and info.maxsize == 64


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_init_from_numpy_and_from_arrays_is_the_same_state(mode):
  # init packs host params with numpy: the buckets must be what jpack.pack makes.
  dp = jpack.data_parallel(loss_fn, optax.adam(1e-3), params0(), mode=mode)
  from_numpy = dp.init(params0())
  from_arrays = dp.init(jax.tree.map(jax.numpy.asarray, params0()))
  packed = jpack.pack(params0(), dp.layout)
  for a, b, c in zip(from_numpy.params.buckets, from_arrays.params.buckets, packed.buckets):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes() == np.asarray(c).tobytes()
  assert (jax.tree.structure(from_numpy.opt_state)
          == jax.tree.structure(jax.eval_shape(dp.init, params0()).opt_state))


def test_startup_benchmark_prints_its_table(tmp_path):
  out_json = tmp_path / "startup.json"
  args = ["--models", "mlp_25", "--variants", "packed", "--rounds", "1", "--json",
          str(out_json)]
  out = subprocess.run([sys.executable, "-m", "benchmarks", "startup", *args],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "mlp_25" in out.stdout and "build + init <= 0.5 s" in out.stdout
  doc = json.loads(out_json.read_text())
  assert doc["benchmark"] == "startup"
  (row,) = doc["tables"][0]["rows"]
  values = row["values"]
  assert values["leaves"] == 25 and values["mode"] == "packed"
  assert values["first_s"] == pytest.approx(values["first_build_s"] + values["first_init_s"])
  assert values["again_s"] > 0
