"""The program jpack lowers for GPU, checked from its text on this CPU-only machine.

`jax.export(..., platforms=("cuda",))` lowers a step for GPU without one. jpack chooses
its XLA:CPU workarounds with `jax.lax.platform_dependent`, at lowering time, so the GPU
program must hold only the plain path: one collective per bucket in the bucket's own
dtype (bf16 reduced natively), no all-to-all, and no conditionals that run.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack

N = 8
AXIS = "batch"
MLIR_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(64, 32)), jnp.bfloat16),
          "b": jnp.zeros(32, jnp.bfloat16),
          "scale": jnp.ones(32, jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)}


def _loss(p, x):
  h = (x.astype(jnp.bfloat16) @ p["w"] + p["b"]).astype(jnp.float32) * p["scale"]
  return jnp.mean((h @ p["w2"]) ** 2)


def _ops(text):
  """Each op with regions (collectives, case, if, while): its name, its result and
  first operand, the text of each of its regions, and the line that closes it (with its
  type signature)."""
  lines = text.splitlines()
  found = []
  for i, line in enumerate(lines):
    m = re.search(r'(%[\w#:]+) = "stablehlo\.(all_reduce|reduce_scatter|case|if|while)"'
                  r'\((%[\w#]+)', line)
    if not m or not line.rstrip().endswith("({"):
      continue
    depth, regions, body = 1, [], []
    for later in lines[i + 1:]:
      if depth == 1 and later.strip() == "}, {":
        regions.append(body)
        body = []
        continue
      depth += later.count("{") - later.count("}")
      if depth == 0:
        regions.append(body)
        found.append((m.group(2), m.group(1).split(":")[0], m.group(3), regions,
                      later.strip()))
        break
      body.append(later.strip())
  return found


def _runtime_conditionals(text):
  """Conditionals whose branch is chosen when the program runs. A platform choice
  lowers to cases whose index is a constant, or the result of such a case (which XLA
  folds); any other case, and any ``if`` or ``while``, is chosen at run time."""
  chosen_at_compile_time, runtime = set(), []
  for name, result, operand, regions, _ in _ops(text):
    if name == "case" and (operand.startswith("%c") or operand in chosen_at_compile_time):
      chosen_at_compile_time.add(result)
    elif name in ("case", "if", "while"):
      runtime.append(name)
  return runtime


def _collectives(text):
  """(op, operand type) of every collective, e.g. ("all_reduce", "1024xf32")."""
  out = [(name, re.search(r": \(tensor<([^>]*)>", close).group(1))
         for name, _, _, _, close in _ops(text) if name in ("all_reduce", "reduce_scatter")]
  out += [("all_gather", t) for t in
          re.findall(r'"stablehlo\.all_gather"\(.*: \(tensor<([^>]*)>\)', text)]
  return out


def _bucket_types(layout):
  return [f"{b.size}x{MLIR_DTYPES[b.dtype.name]}" for b in layout.buckets]


def _export(step, *args, platform):
  return jax.export.export(jax.jit(step), platforms=(platform,))(*args).mlir_module()


@pytest.fixture(scope="module")
def batch():
  return jnp.asarray(np.random.default_rng(1).normal(size=(4 * N, 64)), jnp.float32)


@pytest.mark.parametrize("mode", ["allreduce", "packed", "sharded"])
def test_gpu_step_has_one_native_dtype_collective_per_bucket(mode, batch):
  params = _params()
  dp = jpack.data_parallel(_loss, optax.adam(1e-3), params, mode=mode)
  state = dp.init(params)
  buckets = _bucket_types(dp.layout)
  assert any("bf16" in b for b in buckets) and any("f32" in b for b in buckets)
  text = _export(dp.step, state, batch, platform="cuda")
  colls = _collectives(text)
  if mode == "sharded":  # reduce-scatter the gradients, all-gather the new params
    scattered = sorted(t for op, t in colls if op == "reduce_scatter")
    assert scattered == sorted(buckets)
    gathered = [t for op, t in colls if op == "all_gather"]
    assert len(gathered) == len(buckets)
    assert sorted(t.split("x")[1] for t in gathered) == sorted(b.split("x")[1] for b in buckets)
  else:  # one all-reduce per bucket, in its own dtype
    reduced = sorted(t for op, t in colls if op == "all_reduce" and "x" in t)
    assert reduced == sorted(buckets)
    assert not any(op == "reduce_scatter" for op, _ in colls)
  assert "stablehlo.all_to_all" not in text
  assert _runtime_conditionals(text) == []
  # The same step lowered for CPU takes the XLA:CPU path: bf16 moves as integer bits
  # through an all-to-all (XLA:CPU would widen a bf16 reduction to f32).
  cpu_text = _export(dp.step, state, batch, platform="cpu")
  assert "stablehlo.all_to_all" in cpu_text


def test_hand_written_allreduce_chain_on_gpu_reduces_each_bucket_once(batch):
  params = _params()
  mesh = jax.make_mesh((N,), (AXIS,))
  tx = optax.chain(jpack.optax.allreduce(AXIS), optax.adam(1e-3))

  def step(params, opt_state, x):
    grads = jax.grad(_loss)(jpack.vary(params, AXIS), x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  sm = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P()))
  x = jax.device_put(batch, NamedSharding(mesh, P(AXIS)))
  text = _export(sm, params, opt_state, x, platform="cuda")
  layout = jpack.plan(params, num_shards=N)
  reduced = sorted(t for op, t in _collectives(text) if op == "all_reduce")
  assert reduced == sorted(_bucket_types(layout))
  assert "stablehlo.all_to_all" not in text
  assert _runtime_conditionals(text) == []
  # On CPU bf16 travels through an all-to-all instead.
  cpu_text = _export(sm, params, opt_state, x, platform="cpu")
  assert "stablehlo.all_to_all" in cpu_text


def test_tree_out_of_a_collective_is_sliced_statically_on_gpu(batch):
  # On CPU the tree `jpack.pmean` returns is sliced at offsets from lax.cond, so that
  # equal sizes share one kernel; on GPU those conds would be read back to the host.
  mesh = jax.make_mesh((N,), (AXIS,))
  tree = {f"l{i}": jnp.ones((N, 6)) for i in range(8)}
  sm = jax.shard_map(lambda t: jpack.pmean(jax.tree.map(lambda v: v[0], t), AXIS),
                     mesh=mesh, in_specs=P(AXIS), out_specs=P())
  tree = jax.device_put(tree, NamedSharding(mesh, P(AXIS)))
  assert _runtime_conditionals(_export(sm, tree, platform="cuda")) == []
  assert "case" in _runtime_conditionals(_export(sm, tree, platform="cpu"))


def test_gpu_zero1_with_bf16_params_reduces_f32_and_gathers_bf16(batch):
  masters = jax.tree.map(lambda x: x.astype(jnp.float32), _params())
  dp = jpack.data_parallel(_loss, optax.adam(1e-3), masters, mode="sharded",
                           precision=jpack.Precision(param_dtype=jnp.bfloat16))
  text = _export(dp.step, dp.init(masters), batch, platform="cuda")
  colls = _collectives(text)
  scattered = [t for op, t in colls if op == "reduce_scatter"]
  gathered = [t for op, t in colls if op == "all_gather"]
  assert scattered and all(t.endswith("xf32") for t in scattered)
  # Each device sends its bf16 slice of every bucket the gradients were scattered from.
  assert (sorted(f"{int(t.split('x')[0]) * N}x{t.split('x')[1]}" for t in gathered)
          == sorted(t.replace("f32", "bf16") for t in scattered))
  assert "stablehlo.all_to_all" not in text


def test_gpu_zero1_on_owned_leaves_moves_each_bucket_once(batch):
  # muon needs whole leaves: each device owns some, under a switch on its index; the
  # same reduce-scatter and all-gather per bucket move them, and no other collective
  # moves arrays.
  params = _params()
  dp = jpack.data_parallel(_loss, optax.contrib.muon(1e-3), params, mode="sharded")
  text = _export(dp.step, dp.init(params), batch, platform="cuda")
  buckets = _bucket_types(dp.layout)
  colls = _collectives(text)
  assert sorted(t for op, t in colls if op == "reduce_scatter") == sorted(buckets)
  assert len([t for op, t in colls if op == "all_gather"]) == len(buckets)
  assert not [t for op, t in colls if op == "all_reduce" and "x" in t]  # scalars only
  assert "stablehlo.all_to_all" not in text
  assert _runtime_conditionals(text) == ["case"]  # the owners' switch
