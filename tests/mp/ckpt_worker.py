"""One process of the 2-process x 4-CPU-device checkpoint test (run by
tests/test_checkpoint_multiprocess.py).

Trains in every mode on a two-level mesh, ("node", "gpu") = (2 processes, 4 devices
each): ZeRO slices over "gpu" within a process, replicated over "node". Saves each run with
`jpack.checkpoint.save` at step SAVE (every process calls it, as Orbax requires),
trains on to TOTAL, then restores each checkpoint into the other mode's run, here too on
several processes, and trains that on to TOTAL. Writes every run's final params (and the
saved key) as JSON.
"""

import json
import pathlib
import sys

import jax

proc, nproc, port, directory, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                     pathlib.Path(sys.argv[4]), sys.argv[5])
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=proc,
                           initialization_timeout=60)

import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import jpack  # noqa: E402
from test_train import data, init_cnn, loss_fn  # noqa: E402

SAVE, TOTAL = 3, 5
MODES = ("sharded", "packed", "fsdp", "allreduce")
# The outer axis across processes (nodes), the inner one within a process (a node's GPUs).
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = jax.sharding.Mesh(np.array(devices).reshape(nproc, -1), ("node", "gpu"))
x, y = data(TOTAL)


def local_rows(step):
  """This process's rows of the step's global batch (dp.step assembles the global one)."""
  rows = slice(proc * len(x[step]) // nproc, (proc + 1) * len(x[step]) // nproc)
  return x[step][rows], y[step][rows]


def train(dp, state, start, stop):
  for step in range(start, stop):
    state, _ = dp.step(state, local_rows(step))
  return state


def final_params(dp, state):
  # Replicated over both processes: this process's copy is the whole value.
  return jax.tree.map(lambda v: np.asarray(v.addressable_data(0)).tolist(), dp.unpack(state))


# Process 1 starts from other params: init's broadcast from process 0 makes them equal.
params = init_cnn(jax.random.key(0 if proc == 0 else 99))
runs = {mode: jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh, mode=mode)
        for mode in MODES}
result = {"final": {}, "restored_final": {}}
for mode, dp in runs.items():
  state = train(dp, dp.init(params), 0, SAVE)
  with ocp.CheckpointManager(directory / mode) as manager:
    assert jpack.checkpoint.save(manager, SAVE, state, key=jax.random.key(7))
    # The save is asynchronous: the next steps run while it is written.
    state = train(dp, state, SAVE, TOTAL)
  result["final"][mode] = final_params(dp, state)

# The axes the other way round (the inner axis across processes) are refused.
try:
  jpack.data_parallel(loss_fn, optax.adam(1e-2), params,
                      jax.sharding.Mesh(mesh.devices.T, ("node", "gpu")), mode="sharded")
except ValueError as e:
  result["order_error"] = str(e)

# Each checkpoint restored into another mode on the same processes; jpack.checkpoint.restore
# gives host values, which dp.step places as global arrays. `like` is abstract for one
# (jax.eval_shape(dp.init, ...)), a real state for the other (its values are not read).
for mode, other in zip(MODES, MODES[::-1]):
  dp = runs[other]
  like = jax.eval_shape(dp.init, params) if mode == MODES[0] else dp.init(params)
  restored, key = jpack.checkpoint.restore(directory / mode, like)
  assert int(restored.step) == SAVE and bool(key == jax.random.key(7)), (restored.step, key)
  result["restored_final"][mode] = final_params(dp, train(dp, restored, SAVE, TOTAL))
json.dump(result, open(out, "w"))
jax.distributed.shutdown()
