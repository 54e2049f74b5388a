"""Packed vs per-leaf all-reduce on 8 forced CPU devices.

Every variant runs as ``jax.jit(jax.shard_map(body, mesh=make_mesh((8,), ("batch",)),
in_specs=P("batch"), out_specs=P()))`` on a tree whose leaves carry a leading axis of 8
(one slice per device, placed with ``NamedSharding(mesh, P("batch"))`` before timing).
All variants of a workload are compiled first; then the two baselines (per-leaf, floor)
are timed in interleaved rounds, and every other variant in rounds with the two
baselines. Each "vs" ratio is paired: the median over one group's rounds of the
variant's time over the baseline's time in the same round (the host drifts between
groups, by up to 2x for a large collective). A baseline's own row shows the median of
its group medians:

  per-leaf       ``tree_map(lax.pmean)`` (XLA merges these into one tuple all-reduce)
  ravel          ``ravel_pytree`` + one pmean + unravel (what ``optax.flatten`` does)
  jpack psum     ``jpack.pmean(method="psum")``: one all-reduce per bucket
  jpack s+g      ``jpack.pmean(method="scatter_gather")`` (= the default "auto" here)
  jpack bf16     ``jpack.pmean(comm_dtype=jnp.bfloat16)``: bf16 on the wire
  jpack Packed   ``jpack.pmean`` of a `jpack.Packed` (gradients already in buckets, as with
                 persistent packed params): buckets in, buckets out, no pack or unpack
  floor          one pmean of a single f32 array with the tree's bytes
  floor, dtypes  one pmean of a single array per dtype of the tree, holding that dtype's
                 bytes (shown when the tree is not all f32; XLA:CPU widens bf16 itself)
  x*2 local      per-leaf ``x * 2`` (no communication): the per-buffer cost of N outputs

    python -m benchmarks collectives              # big workloads cut to ~26 M elements
    python -m benchmarks collectives --full       # + many_small_4000 (compile-bound)
    python -m benchmarks collectives --quick      # small subsets, 5 runs
    python -m benchmarks collectives --workloads resnet50 --markdown coll.md
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from jpack._collectives import reduce  # the collective per bucket chosen by method=
from benchmarks import _common as c

NUM_DEVICES = 8
AXIS = "batch"

PMEAN_VS_FLOOR_GOAL = 3.0

DEFAULT_MAX_ELEMENTS = 26_000_000  # keeps ResNet-50 (25.6 M) whole, cuts the others
QUICK_MAX_ELEMENTS = 1_000_000
QUICK_MAX_LEAVES = 100
QUICK_SMALL_LEAVES = 200
QUICK_WORKLOADS = ("resnet50", "mixed_llama_tiny", "many_small_4000")
SWEEP_MIB = (1, 4, 16, 64)

VARIANTS = {
    # key: (label, is a jpack variant under the goals)
    "per_leaf": "per-leaf pmean",
    "ravel": "ravel + pmean",
    "jpack_psum": "jpack psum",
    "jpack_sg": "jpack s+g",
    "jpack_bf16": "jpack bf16 wire",
    "jpack_packed": "jpack s+g Packed",
    "floor": "floor (1 array)",
    "floor_dtypes": "floor, tree's dtypes",
    "x2": "x*2 local",
}
GOAL_VARIANTS = ("jpack_psum", "jpack_sg", "jpack_packed")
BASELINES = ("per_leaf", "floor")
# Above --slow-leaves leaves only these run by default: every jpack variant (and ravel's
# unravel) returns N slices, and XLA:CPU compiles one kernel per output slice, which
# dominates the run at thousands of leaves. --all-variants runs everything.
SLOW_VARIANTS = ("per_leaf", "jpack_sg", "jpack_packed", "floor", "floor_dtypes")
# Left out of the default run (compiling its per-leaf and tree pmeans dominates the whole
# run): --full, or name it in --workloads.
FULL_ONLY = ("many_small_4000",)


@dataclasses.dataclass
class Result:
  key: str
  compiled: c.Compiled
  timing: c.Timing
  colls: c.Collectives
  # Baseline key -> median over rounds of this variant's time / the baseline's in the
  # same round (see bench_workload).
  paired: dict[str, float] = dataclasses.field(default_factory=dict)
  # Baseline key -> median over compile rounds of this variant's lower + compile time /
  # the baseline's in the same round (see compile_in_rounds).
  compile_paired: dict[str, float] = dataclasses.field(default_factory=dict)

  @property
  def run_s(self) -> float:
    return self.timing.median_s

  def vs(self, baseline: "Result | None") -> float | None:
    """This variant's time over ``baseline``'s: paired by rounds when they were timed
    together, else the ratio of the medians (the sweep, timed after the main table)."""
    return self._over(baseline, self.paired, lambda r: r.run_s)

  def compile_vs(self, baseline: "Result | None") -> float | None:
    """Lower + compile time over ``baseline``'s, paired by compile rounds."""
    return self._over(baseline, self.compile_paired, lambda r: r.compiled.total_s)

  def _over(self, baseline: "Result | None", paired: dict[str, float],
            value: Callable[["Result"], float]) -> float | None:
    if baseline is None:
      return None
    if baseline.key == self.key:
      return 1.0
    if baseline.key in paired:
      return paired[baseline.key]
    return c.ratio(value(self), value(baseline))


class Bench:
  def __init__(self, runs: int):
    self.mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,))
    self.sharding = NamedSharding(self.mesh, P(AXIS))
    self.runs = runs

  def smap(self, body: Callable, out_specs: Any = P()) -> Callable:
    return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(AXIS), out_specs=out_specs))

  def measure(self, key: str, label: str, f: Callable, arg: Any) -> Result:
    compiled = c.compile_fn(f, arg)
    colls = c.count_collectives(compiled.text())
    timing = c.time_fn(compiled.fn, arg, runs=self.runs)
    print(f"  {label:<24} run {c.fmt_ms(timing.median_s):>7} ms   lower {compiled.lower_s:6.2f} s"
          f"   compile {compiled.compile_s:6.2f} s   {colls.short()}", flush=True)
    return Result(key, compiled, timing, colls)


def _local(tree: Any) -> Any:
  """Drop the leading per-device axis of size 1 inside shard_map."""
  return jax.tree.map(lambda x: x.reshape(x.shape[1:]), tree)


def bodies(layout: jpack.Layout) -> dict[str, tuple[Callable, Any]]:
  """Variant -> (shard_map body over the tree, out_specs)."""

  def per_leaf(t):
    return jax.tree.map(lambda x: lax.pmean(x, AXIS), _local(t))

  def ravel(t):
    flat, unravel = ravel_pytree(_local(t))
    return unravel(lax.pmean(flat, AXIS))

  def jpack_psum(t):
    return reduce(_local(t), AXIS, mean=True, layout=layout, method="psum")

  def jpack_sg(t):
    return reduce(_local(t), AXIS, mean=True, layout=layout, method="scatter_gather")

  def jpack_bf16(t):
    return jpack.pmean(_local(t), AXIS, layout=layout, comm_dtype=jnp.bfloat16)

  def x2(t):
    return jax.tree.map(lambda x: x * 2, t)

  return {"per_leaf": (per_leaf, P()), "ravel": (ravel, P()), "jpack_psum": (jpack_psum, P()),
          "jpack_sg": (jpack_sg, P()), "jpack_bf16": (jpack_bf16, P()), "x2": (x2, P(AXIS))}


def bench_workload(bench: Bench, w: c.Workload, variants: tuple[str, ...],
                   compile_rounds: int = 1) -> tuple[dict[str, Result], jpack.Layout]:
  """Compile every variant (`compile_rounds` times, see `compile_in_rounds`), then time them
  in interleaved rounds (`c.time_interleaved`)."""
  print(f"\n{w.describe()}  x {NUM_DEVICES} devices", flush=True)
  layout = jpack.plan(w.shapes, num_shards=NUM_DEVICES)
  tree = c.random_tree(w.shapes, seed=0, lead=NUM_DEVICES, sharding=bench.sharding)
  fns = bodies(layout)
  # key -> (shard_map body, out_specs, argument)
  specs: dict[str, tuple[Callable, Any, Any]] = {}
  for key in variants:
    if key in fns:
      specs[key] = (*fns[key], tree)
  if "jpack_packed" in variants:
    # Gradients that are already buckets (persistent packed params): packed outside the
    # timed call, reduced bucket by bucket, returned as buckets.
    packed = bench.smap(lambda t: jax.tree.map(lambda b: b[None], jpack.pack(_local(t), layout)),
                        P(AXIS))(tree)
    specs["jpack_packed"] = (lambda p: jpack.pmean(_local(p), AXIS), P(), packed)
  rng = np.random.default_rng(1)
  if "floor" in variants:
    single = c.place(c.random_numpy((NUM_DEVICES, w.nbytes // 4), np.float32, rng),
                     bench.sharding)
    specs["floor"] = (lambda x: lax.pmean(_local(x), AXIS), P(), single)
  per_dtype = _bytes_per_dtype(w)
  if "floor_dtypes" in variants and set(per_dtype) != {np.dtype(np.float32)}:
    arrays = [c.place(c.random_numpy((NUM_DEVICES, n // d.itemsize), d, rng), bench.sharding)
              for d, n in per_dtype.items()]
    specs["floor_dtypes"] = (lambda xs: lax.pmean(_local(xs), AXIS), P(), arrays)
  specs = {k: specs[k] for k in VARIANTS if k in specs}
  compiled, compile_paired = compile_in_rounds(bench, specs, compile_rounds)
  # Each variant is timed in rounds with the baselines only: in rounds of all variants,
  # one variant can slow the next (a large output freed, pages to fault back). The host
  # also drifts from group to group, so every ratio is paired: the median, over the
  # rounds of one group, of the variant's time over the baseline's in that round.
  # A baseline's own row shows the median of its group medians.
  baselines = [k for k in BASELINES if k in compiled]
  groups = [baselines] if baselines else []
  groups += [[k] + baselines for k in compiled if k not in baselines]
  results: dict[str, Result] = {}
  base_timings: dict[str, list[c.Timing]] = {k: [] for k in baselines}
  for group in groups:
    timings = c.time_interleaved({k: (compiled[k].fn, (specs[k][2],)) for k in group},
                                 runs=bench.runs)
    for k in baselines:
      base_timings[k].append(timings[k])
    key = group[0]
    if key not in baselines:
      results[key] = Result(key, compiled[key], timings[key],
                            c.count_collectives(compiled[key].text()),
                            {b: c.paired_ratio(timings[key], timings[b]) for b in baselines},
                            compile_paired[key])
  # Every group holds both baselines, so their samples, joined group after group, pair
  # round by round: one baseline against the other over all the rounds of the workload.
  joined = {}
  for k, ts in base_timings.items():
    samples = tuple(x for t in ts for x in t.samples)
    joined[k] = c.Timing(statistics.median(t.median_s for t in ts), min(samples),
                         len(samples), samples)
  for k in baselines:
    results[k] = Result(k, compiled[k], joined[k], c.count_collectives(compiled[k].text()),
                        {b: c.paired_ratio(joined[k], joined[b]) for b in baselines if b != k},
                        compile_paired[k])
  for key in (k for k in VARIANTS if k in results):
    r = results[key]
    print(f"  {VARIANTS[key]:<24} run {c.fmt_ms(r.run_s):>7} ms   lower "
          f"{r.compiled.lower_s:6.2f} s   compile {r.compiled.compile_s:6.2f} s   "
          f"{r.colls.short()}", flush=True)
  del specs, tree
  return results, layout


def compile_in_rounds(bench: Bench, specs: dict[str, tuple[Callable, Any, Any]], rounds: int
                      ) -> tuple[dict[str, c.Compiled], dict[str, dict[str, float]]]:
  """Lower and compile every variant ``rounds`` times, in rounds whose order rotates, each
  time from a new function (so that no trace or compile is reused).

  Returns each variant's first executable with its median lower and compile times, and
  key -> {other key: median over rounds of this variant's lower + compile time over the
  other's in the same round}. One compile of a 4000-leaf tree varies by +-5% from run to
  run, as much as the differences the compile goal is about.
  """
  samples: dict[str, list[c.Compiled]] = {k: [] for k in specs}
  keys = list(specs)
  for r in range(rounds):
    for k in keys[r % len(keys):] + keys[:r % len(keys)]:
      body, out_specs, arg = specs[k]
      fresh = lambda *a, body=body: body(*a)  # a new function: nothing cached
      samples[k].append(c.compile_fn(bench.smap(fresh, out_specs), arg))
  compiled = {k: c.Compiled(ss[0].fn, statistics.median(x.lower_s for x in ss),
                            statistics.median(x.compile_s for x in ss))
              for k, ss in samples.items()}
  paired = {k: {b: statistics.median(x.total_s / y.total_s
                                     for x, y in zip(samples[k], samples[b]))
                for b in keys if b != k}
            for k in keys}
  return compiled, paired


def _bytes_per_dtype(w: c.Workload) -> dict[np.dtype, int]:
  out: dict[np.dtype, int] = {}
  for s in jax.tree.leaves(w.shapes):
    d = np.dtype(s.dtype)
    out[d] = out.get(d, 0) + math.prod(s.shape) * d.itemsize
  return out


def bucket_sweep(bench: Bench, w: c.Workload, sizes_mib: tuple[int, ...]
                 ) -> list[tuple[int, str, jpack.Layout, Result]]:
  print(f"\nbucket sweep on {w.describe()}", flush=True)
  tree = c.random_tree(w.shapes, seed=0, lead=NUM_DEVICES, sharding=bench.sharding)
  out = []
  for mib in sizes_mib:
    layout = jpack.plan(w.shapes, num_shards=NUM_DEVICES, bucket_bytes=mib * 2**20)
    fns = bodies(layout)
    for method, key in (("psum", "jpack_psum"), ("scatter_gather", "jpack_sg")):
      r = bench.measure(key, f"{mib} MiB {method}", bench.smap(fns[key][0]), tree)
      out.append((mib, method, layout, r))
  del tree
  return out


def wire_bytes(layout: jpack.Layout) -> tuple[int, int, int]:
  """(leaf bytes, bucket bytes with native wire, bucket bytes with bf16 wire for f32)."""
  native = sum(b.nbytes for b in layout.buckets)
  bf16 = sum(b.nbytes // 2 if b.dtype == np.float32 else b.nbytes for b in layout.buckets)
  return layout.leaf_nbytes, native, bf16


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks collectives", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workloads", default="",
                      help="comma-separated workload names (default: all of them); "
                           "'small_1000' is the synthetic 1000-leaf (1 MiB) tree")
  parser.add_argument("--quick", action="store_true",
                      help=f"{', '.join(QUICK_WORKLOADS)} cut to <= {QUICK_MAX_LEAVES} leaves / "
                           f"{QUICK_MAX_ELEMENTS / 1e6:g} M elements, synthetic tree of "
                           f"{QUICK_SMALL_LEAVES} leaves, 5 runs, sweep on 1/4 MiB")
  parser.add_argument("--runs", type=c.positive_int, default=None,
                      help="timed runs (median; default 5)")
  parser.add_argument("--max-elements", type=c.positive_int, default=None,
                      help=f"elements kept per workload (default {DEFAULT_MAX_ELEMENTS:,}: "
                           "ResNet-50 whole, the others cut)")
  parser.add_argument("--max-leaves", type=c.positive_int, default=None,
                      help="leaves kept per workload")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help=f"comma-separated subset of {', '.join(VARIANTS)}")
  parser.add_argument("--slow-leaves", type=c.positive_int, default=1000,
                      help="above this many leaves run only " + ", ".join(SLOW_VARIANTS)
                           + " (default 1000)")
  parser.add_argument("--all-variants", action="store_true",
                      help="run every variant on every workload (slow to compile above "
                           "--slow-leaves)")
  parser.add_argument("--full", action="store_true",
                      help=f"also run {', '.join(FULL_ONLY)} (compile-bound)")
  parser.add_argument("--compile-rounds", type=c.positive_int, default=1,
                      help="compile every variant this many times, in rotating order, and "
                           "report median compile times and paired compile ratios (default 1)")
  parser.add_argument("--no-sweep", action="store_true", help="skip the bucket-size sweep")
  parser.add_argument("--sweep-workload", default=None,
                      help="workload of the bucket-size sweep (default: resnet50 when it "
                           "is selected, else no sweep)")
  c.add_output_args(parser, "collectives")
  return parser


def _workloads(args: argparse.Namespace, small: c.Workload) -> tuple[list[str], list[str]]:
  """The workloads to run and those left out of a default run; exits on a bad name."""
  names = [n for n in args.workloads.split(",") if n]
  bad_small = [n for n in names if n.startswith("small_")
               and not (n[len("small_"):].isdigit() and int(n[len("small_"):]) > 0)]
  if bad_small:
    raise SystemExit(f"--workloads: {', '.join(map(repr, bad_small))}: a synthetic tree is "
                     "named small_N, N a positive number of leaves (e.g. small_1000)")
  c.check_workload_names([n for n in names if not n.startswith("small_")], "--workloads",
                         extra=("small_N",))
  if args.sweep_workload is not None:
    c.check_workload_names([args.sweep_workload], "--sweep-workload")
  if names:
    return names, []
  names = [small.name] + list(QUICK_WORKLOADS if args.quick else c.workload_names())
  if args.quick or args.full:
    return names, []
  return [n for n in names if n not in FULL_ONLY], [n for n in names if n in FULL_ONLY]


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  # First, before anything creates an array: the CPU backend reads this once, at start.
  c.set_cpu_devices(NUM_DEVICES)
  args = _parser().parse_args(argv)
  runs = args.runs if args.runs is not None else 5
  max_elements = args.max_elements if args.max_elements is not None else (
      QUICK_MAX_ELEMENTS if args.quick else DEFAULT_MAX_ELEMENTS)
  max_leaves = args.max_leaves if args.max_leaves is not None else (
      QUICK_MAX_LEAVES if args.quick else None)
  small = c.synthetic_small_leaves(QUICK_SMALL_LEAVES if args.quick else 1000, 2**20)
  variants = tuple(v for v in args.variants.split(",") if v)
  unknown = set(variants) - set(VARIANTS)
  if unknown:
    raise SystemExit(f"Unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
  names, left_out = _workloads(args, small)
  c.require_devices(NUM_DEVICES)

  report = c.Report("jpack collectives benchmark", "collectives", argv)
  c.banner("benchmarks.collectives", [
      f"{NUM_DEVICES} CPU devices, shard_map over ('{AXIS}',); runs {runs} (median of "
      f"interleaved rounds, after 1 warm-up); max_elements {max_elements:,}, max_leaves {max_leaves}"
      + (f"; left out (--full): {', '.join(left_out)}" if left_out else "")])
  bench = Bench(runs)

  all_results, layouts, workloads = {}, {}, {}
  for name in names:
    if name == small.name:
      w = small
    elif name.startswith("small_"):
      w = c.synthetic_small_leaves(int(name.split("_")[1]), 2**20)
    else:
      w = c.load_workload(name, max_leaves=max_leaves, max_elements=max_elements)
    workloads[name] = w
    chosen = variants
    if w.num_leaves > args.slow_leaves and not args.all_variants:
      chosen = tuple(v for v in variants if v in SLOW_VARIANTS)
      print(f"\n{name}: {w.num_leaves} leaves > --slow-leaves {args.slow_leaves}: only "
            f"{', '.join(chosen)} (--all-variants for all)", flush=True)
    all_results[name], layouts[name] = bench_workload(bench, w, chosen, args.compile_rounds)

  sweep_name = args.sweep_workload or ("resnet50" if "resnet50" in names else None)
  if not args.no_sweep and sweep_name is None:
    print("\nNo bucket-size sweep: resnet50 is not among the workloads "
          "(--sweep-workload NAME runs it on another).", flush=True)
  report.table(_main_table(all_results, workloads))
  report.table(_bytes_table(all_results, workloads, layouts))
  if not args.no_sweep and sweep_name is not None:
    sw = c.load_workload(sweep_name, max_leaves=max_leaves, max_elements=max_elements)
    sweep = bucket_sweep(bench, sw, SWEEP_MIB[:2] if args.quick else SWEEP_MIB)
    report.table(_sweep_table(sweep, _label(sweep_name, sw), sweep_name,
                              all_results.get(sweep_name, {})))
  report.table(_goals_table(all_results, workloads, left_out))
  report.text(_notes(args, workloads, left_out))
  report.write(args)
  return 0


def _main_table(all_results: dict[str, dict[str, Result]],
                workloads: dict[str, c.Workload]) -> c.Table:
  table = c.Table(["workload", "variant", "run ms", "vs per-leaf", "vs floor", "lower s",
                   "compile s", "C vs per-leaf", "HLO collectives"],
                  title=f"pmean over {NUM_DEVICES} CPU devices (run: median; per-leaf and "
                        "floor: median of their group medians; vs = time ratio paired by "
                        "rounds, lower is better; C = lower + compile)")
  for name, res in all_results.items():
    w = workloads[name]
    base, floor = res.get("per_leaf"), res.get("floor")
    for key in (k for k in VARIANTS if k in res):
      r = res[key]
      table.add(_label(name, w), VARIANTS[key], c.fmt_ms(r.run_s),
                c.fmt_ratio(r.vs(base)), c.fmt_ratio(r.vs(floor)),
                c.fmt_s(r.compiled.lower_s), c.fmt_s(r.compiled.compile_s),
                c.fmt_ratio(r.compile_vs(base)), r.colls.short(),
                workload=name, key=key, leaves=w.num_leaves, elements=w.num_elements,
                run_s=r.run_s, run_min_s=r.timing.min_s, runs=r.timing.runs,
                vs_per_leaf=r.vs(base), vs_floor=r.vs(floor), lower_s=r.compiled.lower_s,
                compile_s=r.compiled.compile_s, compile_vs_per_leaf=r.compile_vs(base),
                **c.collective_values(r.colls))
  return table


def _hlo_bytes(res: dict[str, Result], key: str) -> tuple[int | None, int | None]:
  """Bytes variant ``key`` reduces (all-reduce + reduce-scatter input + all-to-all) and
  gathers (all-gather output) in its compiled program."""
  if key not in res:
    return None, None
  b = res[key].colls.result_bytes
  return (b["all-reduce"] + NUM_DEVICES * b["reduce-scatter"] + b["all-to-all"],
          b["all-gather"])


def _bytes_table(all_results: dict[str, dict[str, Result]],
                 workloads: dict[str, c.Workload],
                 layouts: dict[str, jpack.Layout]) -> c.Table:
  table = c.Table(["workload", "leaves", "buckets", "leaf MB", "f32 wire MB", "bf16 wire MB",
                   "HLO reduced MB (s+g)", "HLO gathered MB (s+g)", "HLO reduced MB (bf16)",
                   "HLO gathered MB (bf16)"],
                  title="Bytes all-reduced per step (per device). Layout: sum of bucket "
                        "bytes; bf16 wire halves f32 buckets. HLO: all-reduce + "
                        "reduce-scatter input + all-to-all bytes, all-gather output bytes")
  for name, layout in layouts.items():
    leaf, native, bf16 = wire_bytes(layout)
    sg = _hlo_bytes(all_results[name], "jpack_sg")
    bf = _hlo_bytes(all_results[name], "jpack_bf16")
    table.add(_label(name, workloads[name]), layout.num_leaves, len(layout.buckets),
              c.fmt_mb(leaf), c.fmt_mb(native), c.fmt_mb(bf16),
              *(c.fmt_mb(n) if n is not None else "-" for n in (*sg, *bf)),
              workload=name, leaves=layout.num_leaves, buckets=len(layout.buckets),
              leaf_bytes=leaf, wire_bytes=native, bf16_wire_bytes=bf16,
              hlo_reduced_bytes_sg=sg[0], hlo_gathered_bytes_sg=sg[1],
              hlo_reduced_bytes_bf16=bf[0], hlo_gathered_bytes_bf16=bf[1])
  return table


def _sweep_table(sweep: list[tuple[int, str, jpack.Layout, Result]], label: str, name: str,
                 base: dict[str, Result]) -> c.Table:
  table = c.Table(["bucket_bytes", "method", "buckets", "run ms", "vs per-leaf", "vs floor",
                   "C s", "HLO collectives"],
                  title=f"Bucket-size sweep, jpack.pmean on {label} (timed back to back "
                        "after the main table, against its baselines: compare the rows with "
                        "each other; C = lower + compile)")
  pl, fl = base.get("per_leaf"), base.get("floor")
  for mib, method, layout, r in sweep:
    vs_pl, vs_fl = c.ratio(r.run_s, pl and pl.run_s), c.ratio(r.run_s, fl and fl.run_s)
    table.add(f"{mib} MiB", method, len(layout.buckets), c.fmt_ms(r.run_s),
              c.fmt_ratio(vs_pl), c.fmt_ratio(vs_fl), c.fmt_s(r.compiled.total_s),
              r.colls.short(), workload=name, bucket_bytes=mib * 2**20, method=method,
              buckets=len(layout.buckets), run_s=r.run_s, vs_per_leaf=vs_pl, vs_floor=vs_fl,
              lower_s=r.compiled.lower_s, compile_s=r.compiled.compile_s,
              **c.collective_values(r.colls))
  return table


def _goals_table(all_results: dict[str, dict[str, Result]],
                 workloads: dict[str, c.Workload], left_out: list[str]) -> c.Table:
  goals = c.Table(["goal", "workload", "variant", "value", "limit", "result"], title="Goals")
  for name, res in all_results.items():
    fl, pl = res.get("floor"), res.get("per_leaf")
    for key in (k for k in GOAL_VARIANTS if k in res):
      r = res[key]
      checks = [("run <= 3x floor", r.vs(fl), PMEAN_VS_FLOOR_GOAL),
                ("run <= per-leaf", r.vs(pl), 1.0)]
      if workloads[name].num_leaves >= 1000:
        checks.append(("compile <= per-leaf (>= 1000 leaves)", r.compile_vs(pl), 1.0))
      for text, v, limit in checks:
        ok = None if v is None else v <= limit
        goals.add(text, _label(name, workloads[name]), VARIANTS[key], c.fmt_ratio(v),
                  c.fmt_ratio(limit), c.verdict(ok), workload=name, key=key, value=v,
                  limit=limit, ok=ok)
  for name in left_out:
    goals.add("compile <= per-leaf (>= 1000 leaves)", name, "-", "-", "1.00x",
              "SKIP (--full)")
  if not left_out and all(w.num_leaves < 1000 for w in workloads.values()):
    goals.add("compile <= per-leaf (>= 1000 leaves)", "(none >= 1000 leaves)", "-", "-",
              "1.00x", "SKIP")
  return goals


def _notes(args: argparse.Namespace, workloads: dict[str, c.Workload],
           left_out: list[str]) -> str:
  notes = ["Notes: inputs are (8, *shape) per leaf, sharded P('batch'); every variant returns the "
           "tree replicated (out_specs=P()), except 'x*2 local' (out_specs=P('batch')).",
           "  'jpack s+g' = method='scatter_gather' (what method='auto' picks here); 'jpack bf16 "
           "wire' = comm_dtype=bfloat16, method auto.",
           "  HLO collectives: AR all-reduce, RS reduce-scatter, AG all-gather, A2A all-to-all ops in "
           "compiled.as_text() (per-leaf pmeans are merged by XLA into one tuple all-reduce).",
           "  Practical floor for a standalone call returning N leaves ~ floor + 'x*2 local' "
           "(per-buffer cost; see docs/performance.md).",
           "  bf16 wire: XLA:CPU widens bf16 collectives to f32, so jpack sends a narrow "
           "wire as u16 bits (all-to-all + local f32 sum, all-gather of the bf16 result); "
           "the HLO columns show the bytes that really travel."]
  if left_out:
    notes.append(f"  {', '.join(left_out)} left out of the default run (compile-bound); "
                 "add --full, or run --workloads " + ",".join(left_out) + ".")
  skipped = [n for n, w in workloads.items() if w.num_leaves > args.slow_leaves]
  if skipped and not args.all_variants:
    notes.append(f"  {', '.join(skipped)}: > {args.slow_leaves} leaves, only "
                 f"{', '.join(SLOW_VARIANTS)} run (--all-variants for all).")
  if any(w.subset for w in workloads.values()):
    notes.append("  'N lv' / 'M el' = workload subset (--max-elements / --max-leaves / --quick).")
  return "\n".join(notes)


def _label(name: str, w: c.Workload) -> str:
  if not w.subset:
    return name
  return f"{name} ({w.num_leaves} lv, {w.num_elements / 1e6:.2g} M el)"


if __name__ == "__main__":
  raise SystemExit(main())
