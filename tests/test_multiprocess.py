"""2 processes x 2 CPU devices on 127.0.0.1 (gloo): packed collectives and training steps."""

import json
import os
import socket
import subprocess
import sys
import pathlib

import jax
import numpy as np
import optax
import pytest

from test_train import data, init_cnn, loss_fn

HERE = pathlib.Path(__file__).parent


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(tmp_path, mismatch=False, timeout=240):
  port = free_port()
  env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
  env.pop("XLA_FLAGS", None)
  outs = [tmp_path / f"p{i}.json" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(HERE / "mp" / "worker.py"), str(i), "2",
                             str(port), str(outs[i]), "1" if mismatch else "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    pytest.fail("multi-process workers timed out (a hung peer?)")
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  return [json.loads(o.read_text()) for o in outs]


@pytest.mark.timeout(300)
def test_two_processes_match_single_process_reference(tmp_path):
  results = launch(tmp_path)
  rng = np.random.default_rng(0)
  a = rng.normal(size=(4, 5, 3)).astype(np.float32)
  b = rng.integers(0, 9, (4, 7)).astype(np.int32)
  for r in results:
    np.testing.assert_allclose(r["psum"]["a"], a.sum(0), rtol=1e-5)
    np.testing.assert_array_equal(r["psum"]["b"], b.sum(0))
    np.testing.assert_allclose(r["pmean"], a.mean(0), rtol=1e-5)
    assert "direct_error" not in r
  # Reference: one process, full batch, params of process 0 (the broadcast root).
  params = init_cnn(jax.random.key(0))
  tx = optax.adam(1e-2)
  state = tx.init(params)
  x, y = data(4)
  for i in range(4):
    g = jax.grad(loss_fn)(params, (x[i], y[i]))
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
  for r in results:
    for mode in ("params", "params_fsdp"):  # ZeRO-1, then ZeRO-3
      got = jax.tree.map(np.asarray, r[mode])
      for k in params:
        for kk in params[k]:
          np.testing.assert_allclose(got[k][kk], np.asarray(params[k][kk]), rtol=2e-4,
                                     atol=2e-5, err_msg=f"{mode} {k} {kk}")


@pytest.mark.timeout(300)
def test_layout_mismatch_across_processes_is_a_clear_error(tmp_path):
  results = launch(tmp_path, mismatch=True)
  for r in results:
    assert "different jpack layouts" in r["error"]
    assert "different jpack layouts" in r["direct_error"]
