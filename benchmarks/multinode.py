"""Data-parallel steps compiled for 64 H100s: 8 nodes of 8, in 8 processes (not run).

The topology is JAX's CUDA plugin's ``8x1x8`` (`gpu_compile`'s target config); the mesh
is ("node", "gpu") = (8, 8), the node axis across processes. For each variant this reads
the compiled program's collectives and their replica groups: the operand bytes per device
of those whose groups span nodes (what crosses the network), next to the formula, and
whether every collective of 1 MiB or more is overlapped with compute, with
``memory_analysis()``'s bytes per device. jpack's ZeRO modes slice over "gpu" and
replicate over "node"; "flat" variants use one axis of all 64 devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from benchmarks import harness as h
from benchmarks import models
from benchmarks.gpu_compile import ROWS, ROWS_PER_DEVICE, TARGET
from jpack import _reference

TITLE = "Data-parallel steps compiled for 64 H100s, 8 nodes x 8 (not run)"
DEVICES = None
MERGE_KEY = "workload"
NODES, PER_NODE = 8, 8
MODELS = ("gpt2_small", "gpt_1p3b")
DEFAULTS = dict(models=["gpt2_small"])
QUICK = dict(models=["gpt2_small"], variants=["packed", "sharded"])
MIB = 2**20
BIG = MIB  # collectives this large must overlap compute


@dataclasses.dataclass(frozen=True)
class Variant:
  label: str
  mode: str | None          # jpack.data_parallel's mode; None: jax.jit
  two_level: bool = True    # ("node", "gpu") mesh; else one axis of 64
  shard: bool = False       # jit: params and state split over "gpu" (HSDP)
  formula: str = ""         # cross-node operand bytes per device, G = gradient bytes
  share: Callable[[int], float] = lambda g: float("nan")


VARIANTS = {
    "packed": Variant("jpack packed", "packed", formula="G (all-reduce over 64)",
                      share=lambda g: g),
    "sharded": Variant("jpack ZeRO-1, sharded", "sharded",
                       formula="G/8 (all-reduce of the node's slice)", share=lambda g: g / 8),
    "fsdp": Variant("jpack ZeRO-3, fsdp", "fsdp", formula="G/8 (all-reduce of the node's slice)",
                    share=lambda g: g / 8),
    "fsdp_flat": Variant("jpack ZeRO-3 over one axis of 64", "fsdp", two_level=False,
                         formula="G + 2 x G/64 (reduce-scatter, 2 gathers over 64)",
                         share=lambda g: g + 2 * g / 64),
    "jit": Variant("jax.jit, params replicated", None, formula="G (XLA's all-reduce)",
                   share=lambda g: g),
    "jit_hsdp": Variant("jax.jit HSDP: params and state split over gpu", None, shard=True,
                        formula="G/8 if XLA reduces within the node first"),
}


def topology_mesh(two_level: bool) -> jax.sharding.Mesh:
  from jax.experimental import topologies

  topology = topologies.get_topology_desc("h100", "cuda", target_config=TARGET.read_text(),
                                          topology=f"{NODES}x1x{PER_NODE}")
  devices = np.array(sorted(topology.devices, key=lambda d: (d.process_index, d.id)))
  shape, names = ((NODES, PER_NODE), ("node", "gpu")) if two_level else ((NODES * PER_NODE,),
                                                                         ("batch",))
  return jax.sharding.Mesh(devices.reshape(shape), names,
                           axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


def compile_step(v: Variant, model: models.Model, rows: int) -> Any:
  mesh = topology_mesh(v.two_level)
  tx = optax.adamw(1e-3)
  batch_sharding = NamedSharding(mesh, P(mesh.axis_names))
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding),
                       model.batch_like(rows * mesh.size))
  if v.mode is not None:
    dp = jpack.data_parallel(model.loss, tx, model.params, mesh, mode=v.mode)
    return dp.step.lower(jax.eval_shape(dp.init, model.params), batch).compile()
  auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
  dp = _reference.jit_step(model.loss, tx, model.params, auto, shard_state=v.shard,
                           shard_params=v.shard)
  state = jax.eval_shape(dp.init, model.params)
  return dp.step.lower(state, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)).compile()


def run(opts: Any, report: h.Report) -> None:
  variants = opts.variants or list(VARIANTS)
  report.text(f"target: {TARGET.name}, {NODES} nodes x {PER_NODE} GPUs, adamw; cross-node: "
              "operand bytes per device of the collectives whose replica groups span nodes")
  for name in opts.models:
    model = models.full_size(name)
    grad = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    table = h.Table(["variant", "cross-node MiB", "formula", "formula MiB",
                     "overlapped >= 1 MiB", "kernels", "temp MiB", "args MiB", "peak MiB"],
                    title=f"{name}: {model.describe}, {model.num_params / 1e6:.0f} M params, "
                          f"G = {grad / MIB:,.0f} MiB; 64 H100s, not run")
    for key in variants:
      v = VARIANTS[key]
      print(f"  {name}: compiling {key} ...", flush=True)
      compiled, seconds = h.timed(lambda: compile_step(v, model, ROWS.get(name, ROWS_PER_DEVICE)))
      text = compiled.as_text()
      program = _reference.analyze_program(text)
      big = [c for c in program.collectives if c.bytes >= BIG]
      crossing = _reference.crossing_bytes(text, PER_NODE)
      mem = compiled.memory_analysis()
      peak = mem.argument_size_in_bytes + mem.temp_size_in_bytes
      table.add(v.label, f"{crossing / MIB:,.1f}", v.formula, f"{v.share(grad) / MIB:,.1f}",
                f"{sum(c.overlapped for c in big)}/{len(big)}", program.kernels,
                f"{mem.temp_size_in_bytes / MIB:,.0f}",
                f"{mem.argument_size_in_bytes / MIB:,.0f}", f"{peak / MIB:,.0f}",
                workload=name, key=key, crossing_bytes=crossing, grad_bytes=grad,
                big_collectives=len(big), big_overlapped=sum(c.overlapped for c in big),
                kernels=program.kernels, temp_bytes=mem.temp_size_in_bytes,
                arg_bytes=mem.argument_size_in_bytes, compile_s=seconds)
    report.table(table)
    opts.save()
