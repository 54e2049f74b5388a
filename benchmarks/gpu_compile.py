"""Data-parallel steps compiled for 8 H100s on any machine: jpack against XLA's own.

No GPU is needed: JAX's CUDA plugin compiles for a GPU described by a target config
(`benchmarks/targets/h100_sxm.txtpb`) over a simulated topology of 8 of them. What comes
back is the scheduled GPU program, which this benchmark reads (``_hlo.analyze_program``):

  kernels       fusions, custom calls, copies and collectives the step launches
  HBM           an estimate of memory traffic: each kernel reads its operands and
                writes its result once
  copy-only     bytes written by kernels that only move bytes (concatenates, slices,
                pads, copies)
  collectives   count, dtype and bytes; "overlapped" counts those with a compute kernel
                scheduled between their start and their done
  temp / args   ``compiled.memory_analysis()`` per device

Nothing runs: these are properties of the program, not timings. The variants, all with
``optax.adamw`` on the same real model (`benchmarks.models`, at the size of its shape
table) and 8-way data parallelism:

  floor         loss + gradients + an SGD update, no reduction: what every step contains
  per_leaf      a shard_map step with one ``lax.pmean`` per gradient leaf
  per_leaf_no_concat    the same, compiled with XLA's all-reduce-contiguous pass off
                (``compiler_options={"xla_disable_hlo_passes": "all-reduce-contiguous"}``):
                its merged all-reduces reduce the leaves in place instead of
                concatenating them into a buffer and slicing the result back out
  hand_pmean    the same step with ``jpack.pmean(grads)``: what the README writes first
  hand_pmean_options    that step with ``jpack.step_options(mesh)``: its plan options to
                ``jpack.pmean`` and its compiler options to the step's ``jax.jit``
  jit           plain ``jax.jit`` with the batch split by ``NamedSharding``
  jit_zero1     the same with adamw's state split over the devices by its shardings
  jit_fsdp      the params split that way too (FSDP by sharding); jit_fsdp_maxtext with
                the GPU flags of MaxText's FSDP recipes
  allreduce, packed, sharded    ``jpack.data_parallel`` in that mode
  packed_bf16_params, sharded_bf16_params    ``precision=jpack.Precision(param_dtype=
                jnp.bfloat16)`` (f32 masters)
  packed_acc4, sharded_acc4     ``accumulate=4``
  sharded_lamb  ZeRO-1 with ``optax.lamb``: its trust ratio computed leaf by leaf on
                each device's slices (one more small psum)
  sharded_adafactor    ZeRO-1 with ``optax.adafactor``: its factored moments need whole
                leaves, so each device owns some, every shard padded to the fullest
                (args show it)
  fsdp, fsdp_keep, fsdp_bf16_params    ``mode="fsdp"`` (ZeRO-3), with
                ``keep_gathered=True``, and with bf16 params and f32 masters

"removed" is the share of per-leaf's kernels (and HBM bytes) above the floor that a
variant does not have: 100 % is the floor itself, 0 % is per-leaf, below 0 is worse.
Not given for accumulate=4 (four forward and backward passes), bf16 params (half the
bytes), lamb or adafactor (other optimizers).

  python -m benchmarks gpu_compile                         # every workload, every variant
  python -m benchmarks gpu_compile --workloads gpt2_small --variants per_leaf,packed
  python -m benchmarks gpu_compile --workloads many_small_4000 --update   # added to the JSON

Needs the CUDA plugin (``pip install "jax[cuda12-local]==$(python -c 'import jax;
print(jax.__version__)')"``, about 180 MB, no NVIDIA libraries) and sets
``JAX_PLATFORMS=cpu`` and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` itself.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jpack  # noqa: E402
from benchmarks import _common as c  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks import step as step_bench  # noqa: E402
from jpack._reference import CollectiveOp, Program, analyze_program  # noqa: E402

AXIS = "batch"
NUM_GPUS = 8
TARGET = pathlib.Path(__file__).resolve().parent / "targets" / "h100_sxm.txtpb"
LEARNING_RATE = 1e-3
ROWS_PER_DEVICE = 4  # sequences of 128 tokens, or 224x224 images, per GPU

VARIANTS = {
    "floor": "floor: grads + SGD, no reduction",
    "per_leaf": "per-leaf pmean",
    "per_leaf_no_concat": "per-leaf pmean, all-reduce-contiguous off",
    "hand_pmean": "hand-written jpack.pmean step",
    "hand_pmean_options": "hand-written jpack.pmean step, jpack.step_options",
    "jit": "jit + NamedSharding",
    "jit_zero1": "jit, ZeRO-1 by sharding",
    "allreduce": "jpack allreduce",
    "packed": "jpack packed (default)",
    "sharded": "jpack sharded (ZeRO-1)",
    "packed_bf16_params": "jpack packed, bf16 params",
    "sharded_bf16_params": "jpack sharded, bf16 params",
    "packed_acc4": "jpack packed, accumulate=4",
    "sharded_acc4": "jpack sharded, accumulate=4",
    "sharded_lamb": "jpack sharded, lamb (trust ratio leaf by leaf)",
    "sharded_adafactor": "jpack sharded, adafactor (owned leaves)",
    "jit_fsdp": "jit, FSDP by sharding (params and state split)",
    "jit_fsdp_maxtext": "jit FSDP, MaxText's GPU flags",
    "fsdp": "jpack fsdp (ZeRO-3)",
    "fsdp_keep": "jpack fsdp, keep_gathered",
    "fsdp_bf16_params": "jpack fsdp, bf16 params",
}
JPACK = {"allreduce": dict(mode="allreduce"), "packed": dict(mode="packed"),
         "sharded": dict(mode="sharded"),
         "packed_bf16_params": dict(mode="packed",
                                    precision=jpack.Precision(param_dtype=jnp.bfloat16)),
         "sharded_bf16_params": dict(mode="sharded",
                                     precision=jpack.Precision(param_dtype=jnp.bfloat16)),
         "packed_acc4": dict(mode="packed", accumulate=4),
         "sharded_acc4": dict(mode="sharded", accumulate=4),
         "sharded_lamb": dict(mode="sharded"), "sharded_adafactor": dict(mode="sharded"),
         "fsdp": dict(mode="fsdp"),
         "fsdp_keep": dict(mode=jpack.Mode("fsdp", keep_gathered=True)),
         "fsdp_bf16_params": dict(mode="fsdp",
                                  precision=jpack.Precision(param_dtype=jnp.bfloat16))}
# Every variant runs adamw but these.
OPTIMIZERS = {"sharded_lamb": lambda: optax.lamb(LEARNING_RATE),
              "sharded_adafactor": lambda: optax.adafactor(LEARNING_RATE)}
# Shares of per-leaf's overhead compare steps of the same params, rows and optimizer
# only: not accumulation (four passes), bf16 params (half the bytes), lamb or adafactor.
UNCOMPARED = ("packed_acc4", "sharded_acc4", "packed_bf16_params", "sharded_bf16_params",
              "sharded_lamb", "sharded_adafactor", "fsdp_bf16_params")
# The GPU flags of MaxText's FSDP recipes (latency-hiding scheduler, pipelined all-gather
# and reduce-scatter, their combine thresholds), for the strongest jit FSDP baseline.
MAXTEXT_FLAGS = {"xla_gpu_enable_latency_hiding_scheduler": True,
                 "xla_gpu_enable_pipelined_all_gather": True,
                 "xla_gpu_enable_pipelined_reduce_scatter": True,
                 "xla_gpu_enable_pipelined_all_reduce": True,
                 "xla_gpu_all_gather_combine_threshold_bytes": 1073741824,
                 "xla_gpu_reduce_scatter_combine_threshold_bytes": 1073741824,
                 "xla_gpu_all_reduce_combine_threshold_bytes": 1073741824}
# Rows per device where a workload's own differ from ROWS_PER_DEVICE.
ROWS = {"gpt_1p3b": 1, "gpt_1p3b_12": 1}
# The baselines compiled with options of their own, per mesh (the jpack steps carry
# theirs).
COMPILER_OPTIONS = {
    "per_leaf_no_concat": lambda mesh: {"xla_disable_hlo_passes": "all-reduce-contiguous"},
    "hand_pmean_options": lambda mesh: jpack.step_options(mesh)[1],
    "jit_fsdp_maxtext": lambda mesh: MAXTEXT_FLAGS}
# Collectives this small are the loss's and the norm's scalars, not a bucket's.
BUCKET_MIN_BYTES = 1024
# The goals jpack's default and ZeRO-1 modes are held to on every workload.
GOALS = {"packed": dict(kernels=0.80, hbm=0.60), "sharded": dict(kernels=0.80, hbm=0.85)}


def gpu_mesh(n: int = NUM_GPUS) -> jax.sharding.Mesh:
  """A 1-D mesh over ``n`` simulated H100s (compile only: nothing can run on them)."""
  from jax.experimental import topologies

  try:
    topology = topologies.get_topology_desc("h100", "cuda",
                                            target_config=TARGET.read_text(),
                                            topology=f"1x1x{n}")
  except Exception as e:  # noqa: BLE001 (jax raises several kinds when the plugin is absent)
    raise RuntimeError(
        "Compiling for GPUs needs JAX's CUDA plugin at jax's version: pip install "
        "-e '.[gpu-compile]' (or 'jax[cuda12-local]==<jax version>'); JAX_PLATFORMS "
        f"must allow it to load. ({type(e).__name__}: {e})") from e
  return jax.sharding.Mesh(np.array(topology.devices), (AXIS,),
                           axis_types=(jax.sharding.AxisType.Explicit,))


def _floor(model: models.Model, mesh) -> step_bench.Step:
  """Loss, gradients and an SGD update on each device's own gradients: no reduction."""

  def local(params, batch):
    grads = jax.grad(model.loss)(step_bench._per_device(params), batch)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g.astype(p.dtype), params, grads)

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(),
                               check_vma=False), donate_argnums=0)
  return step_bench.Step(lambda p: jax.device_put(p, NamedSharding(mesh, P())), step,
                         lambda p: p)


def build(key: str, model: models.Model, mesh) -> tuple[Callable, Callable]:
  """Variant ``key``'s ``(init, step)``: init maps params to the step's state."""
  tx = OPTIMIZERS.get(key, lambda: optax.adamw(LEARNING_RATE))()
  if key in JPACK:
    dp = jpack.data_parallel(model.loss, tx, model.params, mesh, **JPACK[key])
    return dp.init, dp.step
  if key == "floor":
    s = _floor(model, mesh)
  elif key in ("per_leaf", "per_leaf_no_concat"):
    s = step_bench._plain_step(model, mesh, optax.stateless(step_bench._per_leaf_pmean), tx)
  elif key in ("hand_pmean", "hand_pmean_options"):  # the README's first step
    options = jpack.step_options(mesh)[0] if key == "hand_pmean_options" else {}
    s = step_bench._plain_step(
        model, mesh, optax.stateless(lambda g, p=None: jpack.pmean(g, AXIS, **options)), tx)
  elif key in ("jit", "jit_zero1", "jit_fsdp", "jit_fsdp_maxtext"):
    # Auto axes: XLA chooses the shardings inside the step, as a plain jit user gets
    # (under Explicit axes an embedding lookup would need its out_sharding spelled out).
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             axis_types=(jax.sharding.AxisType.Auto,))
    s = step_bench._jit_step(model, auto, zero1=key != "jit", optimizer=tx,
                             fsdp=key.startswith("jit_fsdp"))
  else:
    raise ValueError(f"unknown variant {key!r}")
  return s.init, s.step


@dataclasses.dataclass
class Result:
  key: str
  program: Program
  temp_bytes: int
  arg_bytes: int
  lower_s: float
  compile_s: float
  hlo: str = dataclasses.field(repr=False, default="")


def compile_variant(key: str, model: models.Model, mesh, rows: int = ROWS_PER_DEVICE
                    ) -> Result:
  """Lower and compile variant ``key``'s step for the mesh, on abstract values."""
  init, step = build(key, model, mesh)
  state = jax.eval_shape(init, model.params)
  # The jit steps place the batch by their own in_shardings (on a mesh of Auto axes).
  split = None if key.startswith("jit") else NamedSharding(mesh, P(AXIS))
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split),
                       model.batch_like(rows * mesh.shape[AXIS]))
  # jpack's steps lower with their own jit (and its compiler options); the others'
  # jit is wrapped around them here.
  lower = getattr(step, "lower", None) or jax.jit(step, donate_argnums=0).lower
  t0 = time.perf_counter()
  lowered = lower(state, batch)
  t1 = time.perf_counter()
  compiled = lowered.compile(COMPILER_OPTIONS[key](mesh) if key in COMPILER_OPTIONS
                             else None)
  t2 = time.perf_counter()
  mem = compiled.memory_analysis()
  text = compiled.as_text()
  return Result(key, analyze_program(text), mem.temp_size_in_bytes,
                mem.argument_size_in_bytes, t1 - t0, t2 - t1, text)


def removed(value: float, base: float, floor: float) -> float | None:
  """The share of ``base - floor`` that ``value`` does not have."""
  return None if base == floor else (base - value) / (base - floor)


def goals(results: dict[str, Result], grad_bytes: int) -> dict[str, dict[str, bool]]:
  """Each goal of `GOALS` (and the copy, temp and overlap goals) per mode: met or not."""
  floor, base = results.get("floor"), results.get("per_leaf")
  out = {}
  for key, g in GOALS.items():
    r = results.get(key)
    if r is None or floor is None or base is None:
      continue
    fp, bp, p = floor.program, base.program, r.program
    out[key] = {
        f"kernels removed >= {g['kernels']:.0%}":
            removed(p.kernels, bp.kernels, fp.kernels) >= g["kernels"],
        f"HBM removed >= {g['hbm']:.0%}":
            removed(p.hbm_bytes, bp.hbm_bytes, fp.hbm_bytes) >= g["hbm"],
        "copy-only bytes above floor <= 1 gradient":
            p.copy_bytes - fp.copy_bytes <= grad_bytes,
        "temp <= per-leaf": r.temp_bytes <= base.temp_bytes,
        "every bucket's collective overlapped": all(
            x.overlapped for x in p.collectives if x.bytes > BUCKET_MIN_BYTES),
    }
  return out


def user_model(spec: str) -> models.Model:
  """``--model MODULE:FUNCTION``: ``FUNCTION()`` returns ``(params, loss_fn, batch)``,
  the params (arrays or `jax.ShapeDtypeStruct`s), ``loss_fn(params, batch)`` on one
  device's batch, and one device's batch (arrays or ShapeDtypeStructs, rows first)."""
  import importlib

  module, _, function = spec.partition(":")
  if not function:
    raise SystemExit(f"--model takes MODULE:FUNCTION, got {spec!r}")
  params, loss, batch = getattr(importlib.import_module(module), function)()
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), batch)

  def batch_like(rows: int) -> Any:  # rows = the global batch: NUM_GPUS x one device's
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] * NUM_GPUS,) + x.shape[1:],
                                                       x.dtype), like)

  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params)
  return models.Model(spec, spec, params, loss, lambda n: None, batch_like)


def run_workload(name: str, variants: list[str], report: c.Report,
                 model: models.Model | None = None) -> dict[str, Result]:
  model = model or models.full_size(name)
  mesh = gpu_mesh()
  grad_bytes = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(model.params))
  results: dict[str, Result] = {}
  for key in variants:
    if key.endswith("bf16_params") and all(jnp.dtype(x.dtype).itemsize == 2
                                           for x in jax.tree.leaves(model.params)
                                           if x.ndim == 2):
      continue  # its weights are bf16 already
    print(f"  {name}: compiling {key} ...", flush=True)
    try:
      results[key] = compile_variant(key, model, mesh, ROWS.get(name, ROWS_PER_DEVICE))
    except Exception as e:  # noqa: BLE001 (one variant's failure must not lose the rest)
      print(f"  {name}: {key} failed: {type(e).__name__}: {e}", flush=True)
      report.text(f"{name}: {key} failed to compile: {type(e).__name__}: {e}")
  table = c.Table(["variant", "kernels", "HBM MiB (est.)", "copy-only MiB", "collectives",
                   "overlapped", "temp MiB", "args MiB", "removed: kernels / HBM",
                   "lower + compile s"],
                  title=f"{name}: {model.describe}, {model.num_leaves} leaves, "
                        f"{model.num_params / 1e6:.1f} M params; compiled for 8 H100s, not run")
  for key, r in results.items():
    p = r.program
    kr, hr, share = shares(key, r, results)
    table.add(VARIANTS[key], p.kernels, f"{p.hbm_bytes / 2**20:,.0f}",
              f"{p.copy_bytes / 2**20:,.0f}", p.collective_summary(),
              f"{p.overlapped}/{len(p.collectives)}", f"{r.temp_bytes / 2**20:,.0f}",
              f"{r.arg_bytes / 2**20:,.0f}", share, f"{r.lower_s + r.compile_s:.1f}",
              workload=name, key=key, kernels=p.kernels, hbm_bytes=p.hbm_bytes,
              copy_kernels=p.copy_kernels, copy_bytes=p.copy_bytes,
              collectives=[dataclasses.asdict(x) for x in p.collectives],
              overlapped=p.overlapped, temp_bytes=r.temp_bytes, arg_bytes=r.arg_bytes,
              kernels_removed=kr, hbm_removed=hr, lower_s=r.lower_s, compile_s=r.compile_s,
              grad_bytes=grad_bytes)
  report.table(table)
  g = goals_table(name, results, grad_bytes)
  if g.rows:
    report.table(g)
  return results


def shares(key: str, r: Result, results: dict[str, Result]
           ) -> tuple[float | None, float | None, str]:
  """``(kernels removed, HBM removed, cell)`` of variant ``key`` against the floor and
  per-leaf rows of ``results``; None and "-" where they are missing or not comparable
  (an accumulating step runs the forward and backward passes 4 times on a quarter of
  the rows: more kernels and weight reads than one step)."""
  floor, base = results.get("floor"), results.get("per_leaf")
  if not (floor and base) or key in ("floor", "per_leaf") or key in UNCOMPARED:
    return None, None, "-"
  kr = removed(r.program.kernels, base.program.kernels, floor.program.kernels)
  hr = removed(r.program.hbm_bytes, base.program.hbm_bytes, floor.program.hbm_bytes)
  return kr, hr, f"{kr:.0%} / {hr:.0%}"


def goals_table(name: str, results: dict[str, Result], grad_bytes: int) -> c.Table:
  """Workload ``name``'s goals per mode (`goals`), met or not; no rows without a floor
  and a per-leaf step to measure against."""
  g = c.Table(["mode", "goal", "result"], title=f"{name}: goals")
  for mode, checks in goals(results, grad_bytes).items():
    for goal, ok in checks.items():
      g.add(VARIANTS[mode], goal, c.verdict(ok), workload=name, key=mode, goal=goal, ok=ok)
  return g


def _result(v: dict[str, Any]) -> Result:
  """A `Result` back from a row's JSON values (no program text)."""
  program = Program(v["kernels"], v["hbm_bytes"], v["copy_kernels"], v["copy_bytes"],
                    tuple(CollectiveOp(**x) for x in v["collectives"]))
  return Result(v["key"], program, v["temp_bytes"], v["arg_bytes"], v["lower_s"],
                v["compile_s"])


def with_shares(doc: dict[str, Any]) -> dict[str, Any]:
  """``doc`` with every row's removed shares and every workload's goals computed again
  from the rows it holds, whichever run compiled them: after ``--update`` merges runs,
  they compare with the floor and per-leaf rows now in the JSON."""
  tables = []
  for table in doc["tables"]:
    if "kernels" not in table["columns"]:
      continue  # a goals table: made again below from its workload's rows
    rows = {r["values"]["key"]: r for r in table["rows"]}
    results = {key: _result(r["values"]) for key, r in rows.items()}
    for key, row in rows.items():
      kr, hr, share = shares(key, results[key], results)
      row["values"].update(kernels_removed=kr, hbm_removed=hr)
      row["cells"]["removed: kernels / HBM"] = share
    tables.append(table)
    first = table["rows"][0]["values"]
    g = goals_table(first["workload"], results, first["grad_bytes"])
    if g.rows:
      tables.append(g.json())
  return {**doc, "tables": tables}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks gpu_compile",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--workloads", default=",".join(models.FULL_SIZE),
                      help="comma-separated, from: " + ", ".join(models.FULL_SIZE + models.LARGE))
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="comma-separated, from: " + ", ".join(VARIANTS))
  parser.add_argument("--model", metavar="MODULE:FUNCTION",
                      help="your own model instead of the workloads: FUNCTION() returns "
                           "(params, loss_fn, one device's batch)")
  parser.add_argument("--quick", action="store_true",
                      help="gpt2_small only, the floor, per-leaf and the three modes")
  c.add_update_arg(parser)
  c.add_output_args(parser, "gpu_compile")
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  workloads = ["gpt2_small"] if args.quick else args.workloads.split(",")
  variants = (["floor", "per_leaf", "allreduce", "packed", "sharded"] if args.quick
              else args.variants.split(","))
  for v in variants:
    if v not in VARIANTS:
      parser.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
  c.check_workload_names(workloads, "--workloads", models.LARGE)
  report = c.Report("Data-parallel steps compiled for 8 H100s (not run)", "gpu_compile",
                    sys.argv[1:] if argv is None else argv)
  report.parts.append(c.banner("gpu_compile", [f"target: {TARGET.name}, 8 devices, "
                                               f"{ROWS_PER_DEVICE} rows per device, adamw"]))
  if args.model:
    run_workload(args.model, variants, report, user_model(args.model))
    report.write(args)
  earlier = c.earlier_results(args)
  for name in [] if args.model else workloads:
    run_workload(name, variants, report)
    # After every workload: a long run keeps what it has.
    report.write_markdown(args.markdown)
    doc = report.json() if earlier is None else merged(earlier, report.json())
    report.write_json(args.json, with_shares(doc))
  return 0


def merged(earlier: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
  """``now``'s JSON with ``earlier``'s results kept where ``now`` has none (`c.merged`),
  variants in the order of `VARIANTS`, workloads in that of `models.FULL_SIZE`."""
  return c.merged(earlier, now, "workload", list(VARIANTS),
                  list(models.FULL_SIZE) + list(models.LARGE))


if __name__ == "__main__":
  raise SystemExit(main())
