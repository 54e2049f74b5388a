"""Data-parallel steps (adamw, real model sizes) compiled for 8 H100s on any machine,
nothing run: JAX's CUDA plugin (``pip install -e '.[gpu-compile]'``) compiles for
`TARGET`, and ``jpack._reference.analyze_program`` reads the scheduled program. The
columns: docs/gpu.md.
"""

import dataclasses
import functools
import importlib
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from benchmarks import harness as h
from benchmarks import models
from benchmarks import step as step_bench
from benchmarks.render import GPU_COLUMNS
from jpack._reference import CollectiveOp, Program, analyze_program

TITLE = "Data-parallel steps compiled for 8 H100s (not run)"
MERGE_KEY = "workload"
AXIS = h.AXIS
NUM_GPUS = 8
TARGET = pathlib.Path(__file__).resolve().parent / "targets" / "h100_sxm.txtpb"
ROWS_PER_DEVICE = 4  # sequences of 128 tokens, or 224x224 images, per GPU
MODELS = (*models.FULL_SIZE, *models.LARGE)
DEFAULTS = dict(models=list(models.FULL_SIZE))
QUICK = dict(models=["gpt2_small"], variants=["floor", "per_leaf", "allreduce", "packed",
                                              "sharded"])
_v = functools.partial(step_bench.Variant, optimizer="adamw")
BF16 = jnp.bfloat16
VARIANTS = {
    "floor": _v("floor: grads + SGD, no reduction", kind="floor"),
    "per_leaf": _v("per-leaf pmean", kind="per_leaf"),
    # XLA's all-reduce-contiguous pass off: merged all-reduces without the concatenate.
    "per_leaf_no_concat": _v("per-leaf pmean, all-reduce-contiguous off", kind="per_leaf"),
    "hand_pmean": _v("hand-written jpack.pmean step", kind="hand_pmean"),
    "hand_pmean_options": _v("hand-written jpack.pmean step, jpack.step_options",
                             kind="hand_pmean_options"),
    "jit": _v("jit + NamedSharding", kind="jit"),
    "jit_zero1": _v("jit, ZeRO-1 by sharding", kind="jit_zero1"),
    "allreduce": _v("jpack allreduce", mode="allreduce"),
    "packed": _v("jpack packed (default)", mode="packed"),
    "sharded": _v("jpack sharded (ZeRO-1)", mode="sharded"),
    "packed_bf16_params": _v("jpack packed, bf16 params", mode="packed", param_dtype=BF16),
    "sharded_bf16_params": _v("jpack sharded, bf16 params", mode="sharded", param_dtype=BF16),
    "packed_acc4": _v("jpack packed, accumulate=4", mode="packed", accumulate=4),
    "sharded_acc4": _v("jpack sharded, accumulate=4", mode="sharded", accumulate=4),
    "sharded_lamb": _v("jpack sharded, lamb (trust ratio leaf by leaf)", mode="sharded",
                       optimizer="lamb"),
    # adafactor's factored moments need whole leaves: each device owns some.
    "sharded_adafactor": _v("jpack sharded, adafactor (owned leaves)", mode="sharded",
                            optimizer="adafactor"),
    "jit_fsdp": _v("jit, FSDP by sharding (params and state split)", kind="jit_fsdp"),
    "jit_fsdp_maxtext": _v("jit FSDP, MaxText's GPU flags", kind="jit_fsdp"),
    "fsdp": _v("jpack fsdp (ZeRO-3)", mode="fsdp"),
    "fsdp_keep": _v("jpack fsdp, keep_gathered", mode="fsdp", keep_gathered=True),
    "fsdp_bf16_params": _v("jpack fsdp, bf16 params", mode="fsdp", param_dtype=BF16),
}
# Not compared with per-leaf's overhead: other passes, bytes or optimizer.
UNCOMPARED = tuple(k for k, v in VARIANTS.items()
                   if v.accumulate > 1 or v.param_dtype or v.optimizer != "adamw")

# The GPU flags of MaxText's FSDP recipes, for the strongest jit FSDP baseline.
MAXTEXT_FLAGS = {"xla_gpu_enable_latency_hiding_scheduler": True,
                 "xla_gpu_enable_pipelined_all_gather": True,
                 "xla_gpu_enable_pipelined_reduce_scatter": True,
                 "xla_gpu_enable_pipelined_all_reduce": True,
                 "xla_gpu_all_gather_combine_threshold_bytes": 1073741824,
                 "xla_gpu_reduce_scatter_combine_threshold_bytes": 1073741824,
                 "xla_gpu_all_reduce_combine_threshold_bytes": 1073741824}
ROWS = dict.fromkeys(models.LARGE, 1)  # rows per device, where not ROWS_PER_DEVICE
# The baselines compiled with options of their own (the jpack steps carry theirs).
COMPILER_OPTIONS = {
    "per_leaf_no_concat": lambda mesh: {"xla_disable_hlo_passes": "all-reduce-contiguous"},
    "hand_pmean_options": lambda mesh: jpack.step_options(mesh)[1],
    "jit_fsdp_maxtext": lambda mesh: MAXTEXT_FLAGS}
# Collectives this small are the loss's and the norm's scalars, not a bucket's.
BUCKET_MIN_BYTES = 1024
# The goals jpack's default and ZeRO-1 modes are held to on every workload.
GOALS = {"packed": dict(kernels=0.80, hbm=0.60), "sharded": dict(kernels=0.80, hbm=0.85)}


@functools.cache
def gpu_devices(topology: str) -> tuple[Any, ...]:
  """Simulated H100s of a topology such as ``"1x1x8"`` (compile only: nothing can run on
  them), ordered by process."""
  from jax.experimental import topologies

  try:
    desc = topologies.get_topology_desc("h100", "cuda", target_config=TARGET.read_text(),
                                        topology=topology)
  except Exception as e:  # noqa: BLE001 (jax raises several kinds when the plugin is absent)
    raise RuntimeError(
        "Compiling for GPUs needs JAX's CUDA plugin at jax's version: pip install "
        "-e '.[gpu-compile]' (or 'jax[cuda12-local]==<jax version>'); JAX_PLATFORMS "
        f"must allow it to load. ({type(e).__name__}: {e})") from e
  return tuple(sorted(desc.devices, key=lambda d: (d.process_index, d.id)))


def gpu_mesh(n: int = NUM_GPUS) -> jax.sharding.Mesh:
  """A 1-D mesh over ``n`` simulated H100s."""
  return jax.sharding.Mesh(np.array(gpu_devices(f"1x1x{n}")), (AXIS,),
                           axis_types=(jax.sharding.AxisType.Explicit,))


@dataclasses.dataclass
class Result:
  key: str
  program: Program
  temp_bytes: int
  arg_bytes: int
  lower_s: float
  compile_s: float
  hlo: str = dataclasses.field(repr=False, default="")
  # The step donates its state: its outputs reuse the arguments' buffers.
  peak_bytes = property(lambda self: self.arg_bytes + self.temp_bytes)


def compile_variant(key: str, model: models.Model, mesh, rows: int = ROWS_PER_DEVICE
                    ) -> Result:
  """Lower and compile variant ``key``'s step for the mesh, on abstract values."""
  dp = step_bench.build(VARIANTS[key], model, mesh)
  state = jax.eval_shape(dp.init, model.params)
  # The jit steps place the batch by their own in_shardings (on a mesh of Auto axes).
  split = None if VARIANTS[key].jit_mesh else NamedSharding(mesh, P(AXIS))
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split),
                       model.batch_like(rows * mesh.shape[AXIS]))
  # jpack's steps carry their jit (and compiler options).
  c = h.compile_fn(dp.step, state, batch, jit_kwargs={"donate_argnums": 0},
                   options=COMPILER_OPTIONS[key](mesh) if key in COMPILER_OPTIONS else None)
  mem, text = c.fn.memory_analysis(), c.text()
  return Result(key, analyze_program(text), mem.temp_size_in_bytes,
                mem.argument_size_in_bytes, c.lower_s, c.compile_s, text)


def zero3_goals(results: dict[str, Result], grad_bytes: int, large: bool
                ) -> dict[str, dict[str, bool]]:
  """ZeRO-3's goals against jit FSDP (with XLA's and with MaxText's flags): per device,
  G the gradient's bytes in float32 (or the params' dtype), N = `NUM_GPUS`; half of jit
  FSDP's peak on the ``large`` models only (activations dominate the small ones)."""
  jit = [results[k] for k in ("jit_fsdp", "jit_fsdp_maxtext") if k in results]
  if not jit:
    return {}
  best = min(r.peak_bytes for r in jit)
  out = {}
  for key in ("fsdp", "fsdp_bf16_params"):
    if (r := results.get(key)) is None:
      continue
    big = [c for c in r.program.collectives
           if c.op in ("all-gather", "reduce-scatter") and c.bytes >= 2**20]
    gathers = [c for c in big if c.op == "all-gather"]
    scatters = [c for c in big if c.op == "reduce-scatter"]
    # Nothing to overlap at the step's two ends: before the first matmul, after the last.
    exempt = [c for c in gathers if c.leading] + scatters[-1:]
    checks = {
        "args <= 3 G/N + 1% (12 bytes a param with adam)":
            r.arg_bytes <= 1.01 * 3 * grad_bytes / NUM_GPUS,
        "peak <= jit FSDP's": all(r.peak_bytes <= j.peak_bytes for j in jit),
        "collectives >= 1 MiB overlapped, but the gathers before the first matmul and "
        "the last reduce-scatter":
            all(c.overlapped for c in big if not any(c is e for e in exempt)),
        "fewer kernels than jit FSDP": all(r.program.kernels < j.program.kernels for j in jit),
        "fewer collectives than jit FSDP":
            all(len(r.program.collectives) < len(j.program.collectives) for j in jit)}
    if large:
      checks["peak <= half of jit FSDP's"] = 2 * r.peak_bytes <= best
    if key == "fsdp_bf16_params":
      checks["all-gathers in bf16"] = {c.dtype for c in gathers} == {"bf16"}
    out[key] = checks
  return out


def user_model(spec: str) -> models.Model:
  """``--model MODULE:FUNCTION``: ``FUNCTION()`` returns ``(params, loss_fn, batch)``,
  arrays or ShapeDtypeStructs, ``batch`` one device's (rows first)."""
  module, _, function = spec.partition(":")
  if not function:
    raise SystemExit(f"--model takes MODULE:FUNCTION, got {spec!r}")
  params, loss, batch = getattr(importlib.import_module(module), function)()
  sds = lambda x, shape: jax.ShapeDtypeStruct(shape, jnp.result_type(x))
  params = jax.tree.map(lambda x: sds(x, np.shape(x)), params)
  # The global batch: NUM_GPUS times one device's rows.
  batch = jax.tree.map(lambda x: sds(x, (np.shape(x)[0] * NUM_GPUS, *np.shape(x)[1:])), batch)
  return models.Model(spec, spec, params, loss, lambda n: None, lambda rows: batch)


def run_workload(name: str, variants: list[str], report: h.Report,
                 model: models.Model | None = None) -> dict[str, Result]:
  model = model or models.full_size(name)
  mesh = gpu_mesh()
  leaves = jax.tree.leaves(model.params)
  grad_bytes = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)
  bf16_weights = all(jnp.dtype(x.dtype).itemsize == 2 for x in leaves if x.ndim == 2)
  results: dict[str, Result] = {}
  for key in variants:
    if key.endswith("bf16_params") and bf16_weights:
      continue  # its weights are bf16 already
    print(f"  {name}: compiling {key} ...", flush=True)
    try:
      results[key] = compile_variant(key, model, mesh, ROWS.get(name, ROWS_PER_DEVICE))
    except Exception as e:  # noqa: BLE001 (one variant's failure must not lose the rest)
      report.text(f"{name}: {key} failed to compile: {type(e).__name__}: {e}")  # and prints
  table = h.Table(GPU_COLUMNS, title=f"{name}: {model.describe}, {model.num_leaves} leaves, "
                        f"{model.num_params / 1e6:.1f} M params; compiled for 8 H100s, not run")
  for key, r in results.items():
    p = r.program
    kr, hr, share = shares(key, r, results)
    table.add(VARIANTS[key].label, p.kernels, f"{p.hbm_bytes / 2**20:,.0f}",
              f"{p.copy_bytes / 2**20:,.0f}", p.collective_summary(),
              f"{p.overlapped}/{len(p.collectives)}", f"{r.temp_bytes / 2**20:,.0f}",
              f"{r.arg_bytes / 2**20:,.0f}", share, f"{r.lower_s + r.compile_s:.1f}",
              workload=name, key=key, kernels=p.kernels, hbm_bytes=p.hbm_bytes,
              copy_kernels=p.copy_kernels, copy_bytes=p.copy_bytes,
              collectives=[dataclasses.astuple(x) for x in p.collectives],  # CollectiveOp's fields
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
  """``(kernels removed, HBM removed, cell)``: the shares of per-leaf's excess over the floor
  that ``key`` does not have; None and "-" where either is missing or not comparable."""
  floor, base = results.get("floor"), results.get("per_leaf")
  if not (floor and base) or key in ("floor", "per_leaf") or key in UNCOMPARED:
    return None, None, "-"
  removed = lambda f: None if f(base) == f(floor) else (f(base) - f(r)) / (f(base) - f(floor))
  kr, hr = removed(lambda x: x.program.kernels), removed(lambda x: x.program.hbm_bytes)
  return kr, hr, f"{kr:.0%} / {hr:.0%}"


def goals_table(name: str, results: dict[str, Result], grad_bytes: int) -> h.Table:
  """Workload ``name``'s goals per mode, met or not: `GOALS` and the copy, temp and overlap
  goals against per-leaf and the floor, then ZeRO-3's (`zero3_goals`)."""
  checks, floor, base = {}, results.get("floor"), results.get("per_leaf")
  for key, g in GOALS.items():
    if (r := results.get(key)) and floor and base:
      kr, hr, _ = shares(key, r, results)
      checks[key] = {
          f"kernels removed >= {g['kernels']:.0%}": kr >= g["kernels"],
          f"HBM removed >= {g['hbm']:.0%}": hr >= g["hbm"],
          "copy-only bytes above floor <= 1 gradient":
              r.program.copy_bytes - floor.program.copy_bytes <= grad_bytes,
          "temp <= per-leaf": r.temp_bytes <= base.temp_bytes,
          "every bucket's collective overlapped": all(
              x.overlapped for x in r.program.collectives if x.bytes > BUCKET_MIN_BYTES)}
  checks.update(zero3_goals(results, grad_bytes, large=name in models.LARGE))
  table = h.Table(["mode", "goal", "result"], title=f"{name}: goals")
  for mode, goals in checks.items():
    for goal, ok in goals.items():
      table.add(VARIANTS[mode].label, goal, h.verdict(ok), workload=name, key=mode, goal=goal,
                ok=ok)
  return table


def _result(v: dict[str, Any]) -> Result:
  """A `Result` back from a row's JSON values (no program text)."""
  program = Program(v["kernels"], v["hbm_bytes"], v["copy_kernels"], v["copy_bytes"],
                    tuple(CollectiveOp(**x) if isinstance(x, dict) else CollectiveOp(*x)
                          for x in v["collectives"]))  # dicts: files written before
  return Result(v["key"], program, v["temp_bytes"], v["arg_bytes"], v["lower_s"],
                v["compile_s"])


def finish(doc: dict[str, Any]) -> dict[str, Any]:
  """``doc`` with the removed shares and goals computed again from its rows (after
  ``--update`` merged runs)."""
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


def run(opts: Any, report: h.Report) -> None:
  variants = opts.variants or list(VARIANTS)
  report.text(f"target: {TARGET.name}, 8 devices, {ROWS_PER_DEVICE} rows per device, adamw")
  if opts.model:
    run_workload(opts.model, variants, report, user_model(opts.model))
    return
  for name in opts.models:
    run_workload(name, variants, report)
    opts.save()  # after every workload: a long run keeps what it has
