"""Data-parallel steps compiled for 64 H100s, 8 nodes of 8 in 8 processes (not run).

JAX's CUDA plugin's ``8x1x8`` topology with `gpu_compile`'s target; the mesh is ("node",
"gpu") = (8, 8), the node axis across processes ("flat": one axis of 64). For each
variant: the operand bytes per device of the collectives whose replica groups span
nodes (`jpack._reference.crossing_bytes`) next to the formula (G: the gradient's bytes),
how many collectives of 1 MiB or more overlap compute, and the memory per device.
"""

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from benchmarks import harness as h
from benchmarks import models
from benchmarks.gpu_compile import ROWS, ROWS_PER_DEVICE, gpu_devices
from jpack import _reference

TITLE = "Data-parallel steps compiled for 64 H100s, 8 nodes x 8 (not run)"
DEVICES, MERGE_KEY = None, "model"
NODES, PER_NODE, MIB = 8, 8, 2**20
MODELS = ("gpt2_small", "gpt_1p3b")
DEFAULTS = dict(models=["gpt2_small"])
QUICK = dict(models=["gpt2_small"], variants=["packed", "sharded"])
# key: (label, jpack mode or None for jax.jit, two-level mesh, jit: state split over gpu,
#       formula, its bytes over G)
VARIANTS = {
    "packed": ("jpack packed", "packed", True, False, "G", 1),
    "sharded": ("jpack ZeRO-1 (sharded)", "sharded", True, False, "G/8", 1 / 8),
    "fsdp": ("jpack ZeRO-3 (fsdp)", "fsdp", True, False, "G/8", 1 / 8),
    "fsdp_flat": ("jpack ZeRO-3, one axis of 64", "fsdp", False, False, "G + 2G/64", 1 + 1 / 32),
    "jit": ("jax.jit, params replicated", None, True, False, "G", 1),
    "jit_hsdp": ("jax.jit HSDP (params, state split over gpu)", None, True, True, "G/8", 1 / 8),
}


def compile_step(key: str, model: models.Model) -> jax.stages.Compiled:
  _, mode, two_level, split, _, _ = VARIANTS[key]
  devices = np.array(gpu_devices(f"{NODES}x1x{PER_NODE}"))
  shape, names = ((NODES, PER_NODE), ("node", "gpu")) if two_level else ((-1,), ("batch",))
  types = (jax.sharding.AxisType.Explicit if mode else jax.sharding.AxisType.Auto,) * len(names)
  mesh = jax.sharding.Mesh(devices.reshape(shape), names, axis_types=types)
  rows = ROWS.get(model.name, ROWS_PER_DEVICE) * mesh.size
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
      mesh, P(names)) if mode else None), model.batch_like(rows))
  dp = (jpack.data_parallel(model.loss, optax.adamw(1e-3), model.params, mesh, mode=mode)
        if mode else _reference.jit_step(model.loss, optax.adamw(1e-3), model.params, mesh,
                                         shard_state=split, shard_params=split))
  return dp.step.lower(jax.eval_shape(dp.init, model.params), batch).compile()


def run(opts, report: h.Report) -> None:
  for name in opts.models:
    model = models.full_size(name)
    grad = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    table = h.Table(["variant", "cross-node MiB", "formula", "formula MiB",
                     "overlapped >= 1 MiB", "kernels", "temp MiB", "args MiB", "peak MiB"],
                    title=f"{name}: {model.describe}, G = {grad / MIB:,.0f} MiB of gradient; "
                          f"per device, {NODES} nodes x {PER_NODE} H100s, adamw")
    for key in opts.variants or VARIANTS:
      print(f"  {name}: compiling {key} ...", flush=True)
      compiled, seconds = h.timed(lambda: compile_step(key, model))
      text, mem = compiled.as_text(), compiled.memory_analysis()
      program = _reference.analyze_program(text)
      big = [c for c in program.collectives if c.bytes >= MIB]
      crossing = _reference.crossing_bytes(text, PER_NODE)
      label, _, _, _, formula, share = VARIANTS[key]
      temp, args = mem.temp_size_in_bytes, mem.argument_size_in_bytes
      table.add(label, f"{crossing / MIB:,.1f}", formula, f"{share * grad / MIB:,.1f}",
                f"{sum(c.overlapped for c in big)}/{len(big)}", program.kernels,
                f"{temp / MIB:,.0f}", f"{args / MIB:,.0f}", f"{(temp + args) / MIB:,.0f}",
                model=name, key=key, crossing_bytes=crossing, grad_bytes=grad,
                temp_bytes=temp, arg_bytes=args, compile_s=seconds)
    report.table(table)
    opts.save()  # after every model: a long run keeps what it has
