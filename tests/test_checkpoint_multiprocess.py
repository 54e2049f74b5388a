"""Training on a two-level mesh of 2 processes x 4 CPU devices (gloo on 127.0.0.1), and
its checkpoints restored in one process on other meshes.

tests/mp/ckpt_worker.py trains in every mode on the ("node", "gpu") = (2, 4) mesh, saves
at step SAVE with `jpack.checkpoint.save` (every process calls it), trains on to TOTAL,
and restores each checkpoint into another mode on the same processes. Here, in one process on 8 CPU devices (conftest.py), each checkpoint is
restored on 8 and 2 devices, checked against plain optax on one device at step SAVE,
and trained on to TOTAL, where it must match the multi-process runs.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jpack
from jpack import _checkpoint
from test_train import data, init_cnn, loss_fn

HERE = pathlib.Path(__file__).parent
SAVE, TOTAL = 3, 5  # as in mp/ckpt_worker.py
MODES = ("sharded", "packed", "fsdp", "allreduce")  # as in mp/ckpt_worker.py


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def multiprocess_run(tmp_path_factory):
  """The workers' checkpoint directory and their JSON results (one run for all tests)."""
  tmp = tmp_path_factory.mktemp("ckpt_mp")
  port = free_port()
  env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
  env.pop("XLA_FLAGS", None)  # the workers have 4 devices each, not conftest's 8
  outs = [tmp / f"p{i}.json" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(HERE / "mp" / "ckpt_worker.py"), str(i), "2",
                             str(port), str(tmp / "ckpt"), str(outs[i])], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    logs = [p.communicate(timeout=480)[0] for p in procs]
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
      p.communicate()
    pytest.fail("multi-process checkpoint workers timed out (a hung peer or barrier?)")
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  # Each param a nested list in the JSON: an array again.
  return tmp / "ckpt", [jax.tree.map(np.asarray, json.loads(o.read_text()),
                                     is_leaf=lambda x: isinstance(x, list)) for o in outs]


def mesh_of(n):
  return jax.make_mesh((n,), ("batch",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Explicit,))


TX = optax.adam(1e-2)


@jax.jit  # one compile instead of many eager ops per step
def reference_step(params, state, batch):
  updates, state = TX.update(jax.grad(loss_fn)(params, batch), state, params)
  return optax.apply_updates(params, updates), state


def reference(steps):
  """One device, full batch, plain optax: the params and adam state after ``steps``."""
  params = init_cnn(jax.random.key(0))  # process 0's: init broadcasts them
  state = TX.init(params)
  x, y = data(TOTAL)
  for i in range(steps):
    params, state = reference_step(params, state, (x[i], y[i]))
  return params, state


def assert_close(got, want, tol):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=tol, atol=tol / 10, err_msg=jax.tree_util.keystr(path))


@pytest.mark.timeout(600)
def test_processes_agree_and_restore_each_others_checkpoints(multiprocess_run):
  _, results = multiprocess_run
  want, _ = reference(TOTAL)
  for mode in MODES:
    # Both processes hold the same params, those of one device on the full batch.
    np.testing.assert_equal(results[0]["final"][mode], results[1]["final"][mode])
    assert_close(results[0]["final"][mode], want, 1e-5)
    # A checkpoint restored into the other mode on the same 2 processes goes on alike.
    for r in results:
      assert_close(r["restored_final"][mode], r["final"][mode], 1e-5)


def test_the_inner_axis_across_processes_is_refused(multiprocess_run):
  _, results = multiprocess_run
  for r in results:
    error = str(r["order_error"])
    assert "inner data axis 'gpu' spans processes" in error
    assert "jax.make_mesh((jax.process_count(), jax.local_device_count())" in error


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,n,new_mode", [("sharded", 8, "sharded"),
                                             ("packed", 2, "sharded"),
                                             ("sharded", 1, "packed"),
                                             ("fsdp", 8, "fsdp"),
                                             ("fsdp", 1, "packed")])
def test_a_multiprocess_checkpoint_restores_in_one_process(multiprocess_run, mode, n,
                                                           new_mode):
  directory, results = multiprocess_run
  params = init_cnn(jax.random.key(0))
  dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh_of(n), mode=new_mode)
  state, key = jpack.checkpoint.restore(directory / mode,
                                              jax.eval_shape(dp.init, params))
  assert int(state.step) == SAVE and bool(key == jax.random.key(7))
  # What the 2 processes saved (sharded: the buckets gathered from both) is plain
  # optax's state at step SAVE.
  ref_params, ref_opt = reference(SAVE)
  assert_close(dp.unpack(state), ref_params, 2e-4)
  assert_close(jpack.checkpoint.gather_state(_checkpoint._optimizer_part(state.opt_state)),
               ref_opt, 2e-4)
  # The same remaining steps here end where the multi-process run did.
  x, y = data(TOTAL)
  for i in range(SAVE, TOTAL):
    state, _ = dp.step(state, (x[i], y[i]))
  assert_close(dp.unpack(state), results[0]["final"][mode], 1e-5)
