"""``pmean`` of each workload over 8 CPU devices: jpack against per-leaf ``lax.pmean`` and
the floor (one array of the tree's bytes). Each variant is timed in rounds with the two
baselines; a "vs" ratio is paired by rounds. The sweep replans resnet50's buckets.
"""

import collections
import math
import statistics
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from benchmarks import harness as h
from jpack._collectives import reduce  # jpack.pmean with the method named

TITLE = "jpack collectives benchmark"
DEVICES = 8
MERGE_KEY = "workload"
AXIS = h.AXIS
MODELS = ["small_N", *h.workload_names()]
VARIANTS = {
    "per_leaf": "per-leaf pmean",           # XLA merges these into one tuple all-reduce
    "ravel": "ravel + pmean",               # what optax.flatten does
    "jpack_psum": "jpack psum",             # one all-reduce per bucket
    "jpack_sg": "jpack s+g",                # reduce-scatter + all-gather: "auto" here
    "jpack_bf16": "jpack bf16 wire",
    "jpack_packed": "jpack s+g Packed",     # buckets in, buckets out: no pack or unpack
    "floor": "floor (1 array)",
    "floor_dtypes": "floor, tree's dtypes",  # one array per dtype of a mixed tree
    "x2": "x*2 local",                      # no communication: the cost of N outputs
}
BASELINES = ("per_leaf", "floor")
GOAL_VARIANTS = ("jpack_psum", "jpack_sg", "jpack_packed")
# Above SLOW_LEAVES leaves only these run: XLA:CPU compiles one kernel per output slice.
SLOW_VARIANTS = ("per_leaf", "jpack_sg", "jpack_packed", "floor", "floor_dtypes")
SLOW_LEAVES = 1000
PMEAN_VS_FLOOR_GOAL = 3.0
SWEEP_MIB = (1, 4, 16, 64)
DEFAULTS = dict(rounds=5, max_elements=26_000_000,  # ResNet-50 whole, the others cut
                models=["small_1000", *(n for n in h.workload_names() if n != "many_small_4000")])
QUICK = dict(max_elements=1_000_000, max_leaves=100,
             models=["small_200", "resnet50", "mixed_llama_tiny", "many_small_4000"])


def _local(tree: Any) -> Any:
  """Drop the leading per-device axis of size 1 inside shard_map."""
  return jax.tree.map(lambda x: x.reshape(x.shape[1:]), tree)


def bodies(layout: jpack.Layout) -> dict[str, tuple[Callable, Any]]:
  """Variant -> (shard_map body over the tree, out_specs)."""
  by = lambda method: lambda t: reduce(_local(t), AXIS, mean=True, layout=layout, method=method)
  return {"per_leaf": (lambda t: jax.tree.map(lambda x: lax.pmean(x, AXIS), _local(t)), P()),
          "ravel": (lambda t: h.ravel_pmean(_local(t)), P()), "jpack_psum": (by("psum"), P()),
          "jpack_sg": (by("scatter_gather"), P()),
          "jpack_bf16": (lambda t: jpack.pmean(_local(t), AXIS, layout=layout,
                                               comm_dtype=jnp.bfloat16), P()),
          "x2": (lambda t: jax.tree.map(lambda x: x * 2, t), P(AXIS))}


def smap(mesh, body: Callable, out_specs: Any = P()) -> Callable:
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=out_specs))


def bench_workload(mesh, w: h.Workload, variants: list[str], rounds: int
                   ) -> tuple[dict[str, dict], jpack.Layout]:
  """Compile every variant, then time them in groups with the baselines."""
  print(f"\n{w.describe()}  x {DEVICES} devices", flush=True)
  sharding = NamedSharding(mesh, P(AXIS))
  layout = jpack.plan(w.shapes, num_shards=DEVICES)
  tree = h.random_tree(w.shapes, seed=0, lead=DEVICES, sharding=sharding)
  specs = {k: (*v, tree) for k, v in bodies(layout).items()}
  # Gradients already in buckets (persistent packed params), packed outside the timing.
  packed = smap(mesh, lambda t: jax.tree.map(lambda b: b[None], jpack.pack(_local(t), layout)),
                P(AXIS))(tree)
  specs["jpack_packed"] = (lambda p: jpack.pmean(_local(p), AXIS), P(), packed)
  rng = np.random.default_rng(1)
  single = jax.device_put(h.random_numpy((DEVICES, w.nbytes // 4), np.float32, rng), sharding)
  specs["floor"] = (lambda x: lax.pmean(_local(x), AXIS), P(), single)
  per_dtype = collections.Counter()  # bytes of each dtype
  for s in w.shapes.values():
    per_dtype[np.dtype(s.dtype)] += math.prod(s.shape) * np.dtype(s.dtype).itemsize
  if set(per_dtype) != {np.dtype(np.float32)}:
    arrays = [jax.device_put(h.random_numpy((DEVICES, n // d.itemsize), d, rng), sharding)
              for d, n in per_dtype.items()]
    specs["floor_dtypes"] = (lambda xs: lax.pmean(_local(xs), AXIS), P(), arrays)
  specs = {k: specs[k] for k in VARIANTS if k in specs and k in variants}
  compiled = {k: h.compile_fn(smap(mesh, body, out), arg) for k, (body, out, arg) in specs.items()}
  baselines = [k for k in BASELINES if k in compiled]
  groups = [baselines] if baselines else []
  groups += [[k] + baselines for k in compiled if k not in baselines]
  res: dict[str, dict] = {}
  base_timings: dict[str, list[h.Timing]] = {k: [] for k in baselines}
  for group in groups:
    t = h.time_rounds({k: (lambda k=k: compiled[k].fn(specs[k][2])) for k in group}, rounds)
    for k in baselines:
      base_timings[k].append(t[k])
    if group[0] not in baselines:
      res[group[0]] = {"timing": t[group[0]], "vs": {b: t[group[0]].over(t[b]) for b in baselines}}
  # Every group holds both baselines: joined group after group, their samples pair.
  for k, ts in base_timings.items():
    samples = tuple(x for t in ts for x in t.samples)
    res[k] = {"timing": h.Timing(statistics.median(t.median_s for t in ts), min(samples),
                                 len(samples), samples)}
  for k in baselines:
    res[k]["vs"] = {b: res[k]["timing"].over(res[b]["timing"]) for b in baselines}
  for k, r in res.items():
    r.update(compiled=compiled[k], colls=h.count_collectives(compiled[k].text()))
    print(f"  {VARIANTS[k]:<24} run {h.fmt_ms(r['timing'].median_s):>7} ms   "
          f"C {compiled[k].total_s:6.2f} s   {r['colls'].short()}", flush=True)
  return {k: res[k] for k in VARIANTS if k in res}, layout


def run(opts: Any, report: h.Report) -> None:
  mesh = jax.make_mesh((DEVICES,), (AXIS,))
  variants = opts.variants or list(VARIANTS)
  results, layouts, workloads = {}, {}, {}
  for name in opts.models:
    w = workloads[name] = h.load_workload(name, max_leaves=opts.max_leaves,
                                          max_elements=opts.max_elements)
    chosen = variants if w.num_leaves <= SLOW_LEAVES else [
        v for v in variants if v in SLOW_VARIANTS]
    results[name], layouts[name] = bench_workload(mesh, w, chosen, opts.rounds)
  label = lambda n: n if not workloads[n].subset else (
      f"{n} ({workloads[n].num_leaves} lv, {workloads[n].num_elements / 1e6:.2g} M el)")
  main = h.Table(["workload", "variant", "run ms", "vs per-leaf", "vs floor", "lower s",
                  "compile s", "C vs per-leaf", "HLO collectives"],
                 title=f"pmean over {DEVICES} CPU devices (run: median; per-leaf and floor: "
                       "median of their group medians; vs = time ratio paired by rounds, lower "
                       "is better; C = lower + compile)")
  wire = h.Table(["workload", "leaves", "buckets", "leaf MB", "f32 wire MB", "bf16 wire MB",
                  "HLO reduced MB (s+g)", "HLO gathered MB (s+g)", "HLO reduced MB (bf16)",
                  "HLO gathered MB (bf16)"],
                 title="Bytes all-reduced per step (per device). Layout: sum of bucket bytes; "
                       "bf16 wire halves f32 buckets. HLO: all-reduce + reduce-scatter input + "
                       "all-to-all bytes, all-gather output bytes")
  goals = h.Table(["goal", "workload", "variant", "value", "limit", "result"], title="Goals")
  mb = lambda n: f"{n / 1e6:.3g}" if n < 1e8 else f"{n / 1e6:.0f}"
  for name, res in results.items():
    base_c = res["per_leaf"]["compiled"].total_s if "per_leaf" in res else None
    w = workloads[name]
    for key, r in res.items():
      c, t, vs = r["compiled"], r["timing"], r["vs"]
      c_vs = h.ratio(c.total_s, base_c)
      main.add(label(name), VARIANTS[key], h.fmt_ms(t.median_s), h.fmt_ratio(vs.get("per_leaf")),
               h.fmt_ratio(vs.get("floor")), h.fmt_s(c.lower_s), h.fmt_s(c.compile_s),
               h.fmt_ratio(c_vs), r["colls"].short(), workload=name, key=key,
               leaves=w.num_leaves, elements=w.num_elements, run_s=t.median_s,
               run_min_s=t.min_s, runs=t.runs, vs_per_leaf=vs.get("per_leaf"),
               vs_floor=vs.get("floor"), lower_s=c.lower_s, compile_s=c.compile_s,
               compile_vs_per_leaf=c_vs, **h.collective_values(r["colls"]))
      if key in GOAL_VARIANTS:
        checks = [("run <= 3x floor", vs.get("floor"), PMEAN_VS_FLOOR_GOAL),
                  ("run <= per-leaf", vs.get("per_leaf"), 1.0)]
        if w.num_leaves >= 1000:
          checks.append(("compile <= per-leaf (>= 1000 leaves)", c_vs, 1.0))
        for text, v, limit in checks:
          h.add_goal(goals, text, label(name), VARIANTS[key], value=v, limit=limit,
                     workload=name, key=key)
    layout = layouts[name]
    native = sum(b.nbytes for b in layout.buckets)
    bf16 = sum(b.nbytes // 2 if b.dtype == np.float32 else b.nbytes for b in layout.buckets)
    moved = {}  # by the HLO: reduce-scatter's input is N times its result
    for tag, key in (("sg", "jpack_sg"), ("bf16", "jpack_bf16")):
      b = res[key]["colls"].result_bytes if key in res else None
      moved[f"hlo_reduced_bytes_{tag}"] = b and (
          b["all-reduce"] + DEVICES * b["reduce-scatter"] + b["all-to-all"])
      moved[f"hlo_gathered_bytes_{tag}"] = b and b["all-gather"]
    wire.add(label(name), layout.num_leaves, len(layout.buckets), mb(layout.leaf_nbytes),
             mb(native), mb(bf16), *("-" if n is None else mb(n) for n in moved.values()),
             workload=name, leaves=layout.num_leaves, buckets=len(layout.buckets),
             leaf_bytes=layout.leaf_nbytes, wire_bytes=native, bf16_wire_bytes=bf16, **moved)
  report.table(main)
  report.table(wire)
  if "resnet50" in results:
    res = results["resnet50"]
    sweep = h.Table(["bucket_bytes", "method", "buckets", "run ms", "vs per-leaf", "vs floor",
                     "C s", "HLO collectives"],
                    title=f"Bucket-size sweep, jpack.pmean on {label('resnet50')} (timed back "
                          "to back after the main table: compare the rows with each other; "
                          "C = lower + compile)")
    pl, fl = (res[k]["timing"].median_s if k in res else None for k in ("per_leaf", "floor"))
    shapes = workloads["resnet50"].shapes
    tree = h.random_tree(shapes, seed=0, lead=DEVICES, sharding=NamedSharding(mesh, P(AXIS)))
    for mib in SWEEP_MIB[:2] if opts.quick else SWEEP_MIB:
      layout = jpack.plan(shapes, num_shards=DEVICES, bucket_bytes=mib * 2**20)
      for method, key in (("psum", "jpack_psum"), ("scatter_gather", "jpack_sg")):
        c = h.compile_fn(smap(mesh, bodies(layout)[key][0]), tree)
        t = h.time_rounds({key: lambda: c.fn(tree)}, opts.rounds)[key]
        colls = h.count_collectives(c.text())
        vs_pl, vs_fl = h.ratio(t.median_s, pl), h.ratio(t.median_s, fl)
        sweep.add(f"{mib} MiB", method, len(layout.buckets), h.fmt_ms(t.median_s),
                  h.fmt_ratio(vs_pl), h.fmt_ratio(vs_fl), h.fmt_s(c.total_s), colls.short(),
                  workload="resnet50", bucket_bytes=mib * 2**20, method=method,
                  buckets=len(layout.buckets), run_s=t.median_s, vs_per_leaf=vs_pl,
                  vs_floor=vs_fl, lower_s=c.lower_s, compile_s=c.compile_s,
                  **h.collective_values(colls))
    report.table(sweep)
  report.table(goals)
  report.text("Variants and columns: docs/performance.md#collectives. Above "
              f"{SLOW_LEAVES} leaves only {', '.join(SLOW_VARIANTS)} run.")
