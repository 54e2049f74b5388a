"""One process of the 2-process x 2-CPU-device test (run by tests/test_multiprocess.py)."""

import json
import sys

import jax

proc, nproc, port, out, mismatch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1"
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=proc,
                           initialization_timeout=60)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jpack  # noqa: E402
from test_train import data, init_cnn, loss_fn  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("batch",))
result = {}

# Packed pmean of per-device values across processes.
rng = np.random.default_rng(0)
glob = {"a": rng.normal(size=(4, 5, 3)).astype(np.float32), "b": rng.integers(0, 9, (4, 7)).astype(np.int32)}
sharding = NamedSharding(mesh, P("batch"))
local = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx]), glob)
f = jax.jit(jax.shard_map(lambda t: jpack.psum(jax.tree.map(lambda x: x[0], t), "batch"),
                          mesh=mesh, in_specs=P("batch"), out_specs=P()))
summed = f(local)
result["psum"] = {k: np.asarray(v.addressable_shards[0].data).tolist() for k, v in summed.items()}
g = jax.jit(jax.shard_map(lambda t: jpack.pmean(t[0], "batch"), mesh=mesh, in_specs=P("batch"),
                          out_specs=P()))
result["pmean"] = np.asarray(g(local["a"]).addressable_shards[0].data).tolist()

# A few training steps; process 1 starts from different params: broadcast fixes it.
params = init_cnn(jax.random.key(0 if proc == 0 else 99))
if mismatch and proc == 1:
  params["extra"] = jax.numpy.zeros(3)
try:  # the check a hand-built step makes before its first collective
  jpack.assert_same_layout(jpack.plan(params))
except ValueError as e:
  result["direct_error"] = str(e)
dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh, mode="sharded")
try:
  state = dp.init(params)
except ValueError as e:
  result["error"] = str(e)
  json.dump(result, open(out, "w"))
  sys.exit(0)
x, y = data(4)
for i in range(4):
  if i % 2:  # host values: this process's rows of the global batch, placed by dp.step
    rows = slice(proc * len(x[i]) // nproc, (proc + 1) * len(x[i]) // nproc)
    batch = (x[i][rows], y[i][rows])
  else:      # a global array, used as is
    batch = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, sharding,
                                                                lambda idx: a[idx]), (x[i], y[i]))
  state, metrics = dp.step(state, batch)
params_out = jax.jit(jpack.unpack, out_shardings=NamedSharding(mesh, P()))(state.params)
result["params"] = jax.tree.map(lambda v: np.asarray(v.addressable_shards[0].data).tolist(), params_out)
result["loss"] = float(np.asarray(metrics["loss"].addressable_shards[0].data))

# The same steps in ZeRO-3: the params split over the processes' devices too.
dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh, mode="fsdp")
state = dp.init(params)
for i in range(4):
  rows = slice(proc * len(x[i]) // nproc, (proc + 1) * len(x[i]) // nproc)
  state, metrics = dp.step(state, (x[i][rows], y[i][rows]))
result["params_fsdp"] = jax.tree.map(lambda v: np.asarray(v).tolist(), dp.unpack(state))
json.dump(result, open(out, "w"))
jax.distributed.shutdown()
