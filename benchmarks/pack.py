"""pack / unpack performance on the workloads in benchmarks/workloads (one device).

Measures, in one run and per workload:
  (a) ``x * 2`` over a single array holding the same bytes as the tree,
  (b) per-leaf ``x * 2`` over the tree (returns the tree),
  (c) ``jpack.pack`` (layout static, returns a ``Packed``),
  (d) ``jpack.unpack`` (input a ``Packed`` already on device), also with
      ``share_kernels=True`` (slices of equal size share one XLA:CPU kernel),
  (e) ``jax.flatten_util.ravel_pytree`` and its unravel, as a baseline,
  (f) ``jpack.pack`` and ``jpack.unpack`` called outside jit: first call and later calls,
plus ``jpack.plan`` (pure Python). Every function is compiled ahead of time
(``jax.jit(f).lower(...).compile()``, lowering and compilation timed separately) and timed
on its own with materialized outputs: XLA cancels ``unpack(pack(x))`` inside one jit.

    python -m benchmarks pack                       # everything (4000-leaf unpack compiles slowly)
    python -m benchmarks pack --skip-slow           # skip unpack/unravel above 1000 leaves
    python -m benchmarks pack --quick               # subsets of <= 300 leaves
    python -m benchmarks pack --workloads resnet50,many_small_4000 --markdown pack.md
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.flatten_util import ravel_pytree

import jpack
from jpack._pack import unpack_shared  # how collectives return trees on CPU
from benchmarks import _common as c

# Targets: pack and unpack should cost about what copying the tree costs.
RUN_GOAL = 1.5            # pack / unpack run time <= 1.5x max(single x*2, per-leaf x*2)
COMPILE_ABS_GOAL_S = 5.0  # compile of pack / unpack < 5 s for many_small_4000
PLAN_GOAL_S = 0.020       # plan <= 20 ms for 4000 leaves
MANY_LEAVES = 4000

QUICK_MAX_LEAVES = 300
QUICK_MAX_ELEMENTS = 4_000_000
QUICK_RUNS = 5


@dataclasses.dataclass
class Result:
  op: str
  output: str
  compiled: c.Compiled | None = None
  timing: c.Timing | None = None
  skipped: str = ""

  @property
  def run_s(self) -> float | None:
    return None if self.timing is None else self.timing.median_s

  @property
  def compile_total_s(self) -> float | None:
    return None if self.compiled is None else self.compiled.total_s


def _measure(op: str, f: Callable, *args: Any, runs: int, output: str = "",
             keep: bool = False) -> tuple[Result, Any]:
  """Compile and time ``f(*args)``; with ``keep`` also return one materialized output."""
  compiled = c.compile_fn(f, *args)
  timing = c.time_fn(compiled.fn, *args, runs=runs)
  out = jax.block_until_ready(compiled.fn(*args)) if keep else None
  print(f"  {op:<22} run {c.fmt_ms(timing.median_s):>7} ms   lower {compiled.lower_s:6.2f} s"
        f"   compile {compiled.compile_s:6.2f} s", flush=True)
  return Result(op, output, compiled, timing), out


@dataclasses.dataclass
class Eager:
  """A call outside jit: its first call (with whatever it compiles) and later calls."""
  op: str
  first_s: float
  later: c.Timing


def _measure_eager(op: str, f: Callable, arg: Any, *, runs: int) -> Eager:
  t0 = time.perf_counter()
  jax.block_until_ready(f(arg))
  first = time.perf_counter() - t0
  later = c.time_fn(f, arg, runs=runs, warmup=0)
  print(f"  {op:<22} first call {first:6.2f} s   later calls {c.fmt_ms(later.median_s):>7} ms",
        flush=True)
  return Eager(op, first, later)


def _describe(x: Any) -> str:
  leaves = jax.tree.leaves(x)
  dtypes = "+".join(sorted({np.dtype(l.dtype).name for l in leaves}))
  if len(leaves) == 1:
    return f"{dtypes}[{leaves[0].size:,}]"
  return f"{len(leaves)} x {dtypes}"


def _label(name: str, w: c.Workload) -> str:
  return name + (f" ({w.num_leaves} lv)" if w.subset else "")


def _base_run(res: dict[str, Any]) -> float:
  """The run-time baseline: the larger of (a) single-array and (b) per-leaf ``x * 2``."""
  return max(res["single"].run_s, res["per_leaf"].run_s)


def _unpack_sharing_kernels(packed: jpack.Packed) -> Any:
  return unpack_shared(packed)


def bench_workload(w: c.Workload, *, runs: int,
                   skip_unpack: str) -> tuple[dict[str, Any], jpack.Layout]:
  print(f"\n{w.describe()}", flush=True)
  tree = c.random_tree(w.shapes, seed=0)
  layout = jpack.plan(w.shapes)
  results: dict[str, Result] = {}

  # (a) one array with the same bytes (f32 elements; bytes rounded down to 4).
  single = c.place(c.random_numpy((w.nbytes // 4,), np.float32, np.random.default_rng(1)))
  results["single"], _ = _measure("x*2 single array", lambda x: x * 2, single, runs=runs,
                                  output=_describe(single))
  del single

  # (b) per-leaf x * 2 over the tree.
  results["per_leaf"], _ = _measure("x*2 per leaf", lambda t: jax.tree.map(lambda x: x * 2, t),
                                    tree, runs=runs, output=_describe(tree))

  # (c) jpack.pack, layout static (closed over).
  results["pack"], packed = _measure("jpack.pack", lambda t: jpack.pack(t, layout), tree,
                                     runs=runs, keep=not skip_unpack,
                                     output=f"Packed {_describe(tuple(layout.bucket_shapes()))}")

  # (d) jpack.unpack of a Packed already on device.
  unpacks = {"unpack": ("jpack.unpack", jpack.unpack),
             "unpack_shared": ("jpack.unpack, shared", _unpack_sharing_kernels)}
  for key, (op, fn) in unpacks.items():
    if skip_unpack:
      results[key] = Result(op, _describe(tree), skipped=skip_unpack)
      print(f"  {op:<22} skipped ({skip_unpack})", flush=True)
    else:
      results[key], _ = _measure(op, fn, packed, runs=runs, output=_describe(tree))
  # (f) the same calls outside jit, as a user's script makes them (pack of a numpy-free
  # tree of device arrays; unpack of a Packed on device), first call included.
  if packed is None:
    packed = jax.block_until_ready(jax.jit(lambda t: jpack.pack(t, layout))(tree))
  results["eager_pack"] = _measure_eager("jpack.pack, eager", lambda t: jpack.pack(t, layout),
                                         tree, runs=runs)
  results["eager_unpack"] = _measure_eager("jpack.unpack, eager", jpack.unpack, packed,
                                           runs=runs)
  del packed

  # (e) ravel_pytree baseline (promotes mixed dtypes to a common one) and its unravel.
  unravel_box = {}

  def ravel(t):
    flat, unravel = ravel_pytree(t)
    unravel_box["fn"] = unravel  # static: sizes, shapes, dtypes only
    return flat

  flat_shape = jax.eval_shape(ravel, w.shapes)
  note = " (promoted)" if len({np.dtype(s.dtype) for s in w.shapes.values()}) > 1 else ""
  results["ravel"], flat = _measure("ravel_pytree", ravel, tree, runs=runs,
                                    keep=not skip_unpack,
                                    output=f"{np.dtype(flat_shape.dtype).name}"
                                           f"[{flat_shape.size:,}]{note}")
  if skip_unpack:
    results["unravel"] = Result("unravel", _describe(tree), skipped=skip_unpack)
    print(f"  {'unravel':<22} skipped ({skip_unpack})", flush=True)
  else:
    results["unravel"], _ = _measure("unravel", unravel_box["fn"], flat, runs=runs,
                                     output=_describe(tree))
  del flat, tree
  return results, layout


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks pack", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workloads", default="",
                      help="comma-separated workload names (default: all of them)")
  parser.add_argument("--quick", action="store_true",
                      help=f"subset every workload to <= {QUICK_MAX_LEAVES} leaves and "
                           f"{QUICK_MAX_ELEMENTS / 1e6:g} M elements, {QUICK_RUNS} runs")
  parser.add_argument("--runs", type=c.positive_int, default=None,
                      help="timed runs per op (median; default 7)")
  parser.add_argument("--max-leaves", type=c.positive_int, default=None,
                      help="keep at most this many leaves")
  parser.add_argument("--max-elements", type=c.positive_int, default=None,
                      help="keep at most this many elements per workload")
  parser.add_argument("--skip-slow", action="store_true",
                      help="skip unpack and unravel (one XLA:CPU kernel per output slice: "
                           "slow to compile) for workloads with more than --slow-leaves "
                           "leaves")
  parser.add_argument("--slow-leaves", type=c.positive_int, default=1000,
                      help="leaf count above which --skip-slow applies (default 1000)")
  parser.add_argument("--plan-runs", type=c.positive_int, default=20,
                      help="runs of jpack.plan (median)")
  c.add_output_args(parser, "pack")
  return parser


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parser().parse_args(argv)
  max_leaves = args.max_leaves if args.max_leaves is not None else (
      QUICK_MAX_LEAVES if args.quick else None)
  max_elements = args.max_elements if args.max_elements is not None else (
      QUICK_MAX_ELEMENTS if args.quick else None)
  runs = args.runs if args.runs is not None else (QUICK_RUNS if args.quick else 7)
  names = [n for n in args.workloads.split(",") if n] or c.workload_names()
  c.check_workload_names(names, "--workloads")

  report = c.Report("jpack pack / unpack benchmark", "pack", argv)
  c.banner("benchmarks.pack", [
      f"workloads: {', '.join(names)}; runs {runs} (median, after 1 warm-up); "
      f"max_leaves {max_leaves}, max_elements {max_elements}"
      f"{'; --skip-slow above ' + str(args.slow_leaves) + ' leaves' if args.skip_slow else ''}"])

  all_results, layouts, workloads, plan_times = {}, {}, {}, {}
  for name in names:
    # plan is pure Python and cheap: always time it on the full tree.
    full = c.load_workload(name)
    plan_times[name] = c.time_python(jpack.plan, full.shapes, runs=args.plan_runs)
    w = c.load_workload(name, max_leaves=max_leaves, max_elements=max_elements)
    workloads[name] = w
    skip = ""
    if args.skip_slow and w.num_leaves > args.slow_leaves:
      skip = f"--skip-slow: {w.num_leaves} > {args.slow_leaves} leaves"
    all_results[name], layouts[name] = bench_workload(w, runs=runs, skip_unpack=skip)
    print(f"  {'jpack.plan (full tree)':<22} {1e3 * plan_times[name].median_s:.2f} ms "
          f"({full.num_leaves} leaves)", flush=True)

  report.table(_ops_table(all_results, workloads))
  report.table(_eager_table(all_results, workloads))
  ratios, goals = _ratio_tables(all_results, workloads, layouts, plan_times)
  report.table(ratios)
  report.table(goals)
  notes = [
      "Notes: (a) is x*2 over one f32 array with the tree's bytes; (b) per-leaf x*2 returns the tree.",
      "  Each op is compiled alone and its output materialized (XLA cancels unpack(pack(x)) in one jit).",
      "  ravel_pytree promotes mixed dtypes (bf16+f32 -> f32); jpack keeps one bucket per dtype.",
  ]
  if any(w.subset for w in workloads.values()):
    notes.append("  'N lv' = workload subset to N leaves (--quick / --max-leaves / --max-elements); "
                 "goals on subsets are indicative only.")
  report.text("\n".join(notes))
  report.write(args)
  return 0


OPS = {"single": "(a) x*2 single", "per_leaf": "(b) x*2 per-leaf", "pack": "(c) jpack.pack",
       "unpack": "(d) jpack.unpack", "unpack_shared": "(d) unpack, share_kernels",
       "ravel": "(e) ravel_pytree", "unravel": "(e) unravel"}


def _ops_table(all_results: dict[str, dict[str, Any]],
               workloads: dict[str, c.Workload]) -> c.Table:
  table = c.Table(["workload", "op", "output", "run ms", "lower s", "compile s",
                   "run/max(a,b)", "compile/per-leaf"],
                  title="Run time (median) and compile time per op; compile/per-leaf "
                        "compares lower + compile")
  for name, res in all_results.items():
    label, base_run = _label(name, workloads[name]), _base_run(res)
    base_compile = res["per_leaf"].compile_total_s
    for key, op in OPS.items():
      r = res[key]
      if r.skipped:
        table.add(label, op, r.output, "skipped", "-", "-", "-", "-", workload=name, key=key,
                  skipped=r.skipped)
        continue
      run_vs, compile_vs = (c.ratio(r.run_s, base_run),
                            c.ratio(r.compile_total_s, base_compile))
      table.add(label, op, r.output, c.fmt_ms(r.run_s), c.fmt_s(r.compiled.lower_s),
                c.fmt_s(r.compiled.compile_s), c.fmt_ratio(run_vs), c.fmt_ratio(compile_vs),
                workload=name, key=key, run_s=r.run_s, run_min_s=r.timing.min_s,
                lower_s=r.compiled.lower_s, compile_s=r.compiled.compile_s,
                run_vs_max_ab=run_vs, compile_vs_per_leaf=compile_vs)
  return table


def _eager_table(all_results: dict[str, dict[str, Any]],
                 workloads: dict[str, c.Workload]) -> c.Table:
  table = c.Table(["workload", "op", "first call s", "later calls ms",
                   "first/per-leaf first", "later/max(a,b)"],
                  title="Called outside jit (f): first call, compile included, and later "
                        "calls; per-leaf first = (b)'s lower + compile + run")
  for name, res in all_results.items():
    label, base_run = _label(name, workloads[name]), _base_run(res)
    per_leaf_first = res["per_leaf"].compile_total_s + res["per_leaf"].run_s
    for key in ("eager_pack", "eager_unpack"):
      e = res[key]
      first_vs, later_vs = (c.ratio(e.first_s, per_leaf_first),
                            c.ratio(e.later.median_s, base_run))
      table.add(label, f"(f) {e.op}", f"{e.first_s:.2f}", c.fmt_ms(e.later.median_s),
                c.fmt_ratio(first_vs), c.fmt_ratio(later_vs), workload=name, key=key,
                first_s=e.first_s, later_s=e.later.median_s,
                first_vs_per_leaf_first=first_vs, later_vs_max_ab=later_vs)
  return table


def _ratio_tables(all_results: dict[str, dict[str, Any]], workloads: dict[str, c.Workload],
                  layouts: dict[str, jpack.Layout], plan_times: dict[str, c.Timing]
                  ) -> tuple[c.Table, c.Table]:
  """The ratios of every workload, and the targets they are held to."""
  ratios = c.Table(["workload", "leaves", "MiB", "buckets", "plan ms", "pack/max(a,b)",
                    "unpack/max(a,b)", "C(pack)/C(leaf)", "C(unpack)/C(leaf)",
                    "C(unpack sk)/C(leaf)", "ravel/max(a,b)", "unravel/max(a,b)"],
                   title="Ratios (run: vs max of (a) single-array and (b) per-leaf x*2; "
                         "C = lower+compile time, vs (b); sk = share_kernels); plan on the "
                         "full tree")
  goals = c.Table(["goal", "workload", "value", "limit", "result"], title="Goals")
  for name, res in all_results.items():
    w, layout = workloads[name], layouts[name]
    base_run, base_c = _base_run(res), res["per_leaf"].compile_total_s
    run = {k: c.ratio(res[k].run_s, base_run)
           for k in ("pack", "unpack", "unpack_shared", "ravel", "unravel")}
    comp = {k: c.ratio(res[k].compile_total_s, base_c)
            for k in ("pack", "unpack", "unpack_shared")}
    label = _label(name, w)
    ratios.add(label, w.num_leaves, f"{w.nbytes / 2**20:.1f}", len(layout.buckets),
               f"{1e3 * plan_times[name].median_s:.2f}", c.fmt_ratio(run["pack"]),
               c.fmt_ratio(run["unpack"]), c.fmt_ratio(comp["pack"]),
               c.fmt_ratio(comp["unpack"]), c.fmt_ratio(comp["unpack_shared"]),
               c.fmt_ratio(run["ravel"]), c.fmt_ratio(run["unravel"]),
               workload=name, leaves=w.num_leaves, bytes=w.nbytes,
               buckets=len(layout.buckets), plan_s=plan_times[name].median_s,
               run_vs_max_ab=run, compile_vs_per_leaf=comp)

    def goal(text, value, limit, bound, fmt=c.fmt_ratio):
      ok = None if value is None else value <= bound
      goals.add(text, label, "-" if value is None else fmt(value), limit, c.verdict(ok),
                workload=name, value=value, limit=bound, ok=ok)

    goal("pack run <= 1.5x max(a,b)", run["pack"], "1.50x", RUN_GOAL)
    goal("unpack run <= 1.5x max(a,b)", run["unpack"], "1.50x", RUN_GOAL)
    goal("compile(pack) <= compile(per-leaf)", comp["pack"], "1.00x", 1.0)
    goal("compile(unpack) <= compile(per-leaf)", comp["unpack"], "1.00x", 1.0)
    goal("unpack(share_kernels) run <= 1.5x", run["unpack_shared"], "1.50x", RUN_GOAL)
    goal("compile(unpack(share_kernels)) <= per-leaf", comp["unpack_shared"], "1.00x", 1.0)
    if name == "many_small_4000":
      for key, op in (("pack", "pack"), ("unpack", "unpack"),
                      ("unpack_shared", "unpack(share_kernels)")):
        goal(f"compile({op}) < 5 s", res[key].compile_total_s, "5 s", COMPILE_ABS_GOAL_S,
             fmt=lambda s: f"{s:.1f} s")
    if w.full_leaves >= MANY_LEAVES:
      goal(f"plan <= 20 ms ({w.full_leaves} leaves)", plan_times[name].median_s, "20 ms",
           PLAN_GOAL_S, fmt=lambda s: f"{1e3 * s:.2f} ms")
  return ratios, goals


if __name__ == "__main__":
  raise SystemExit(main())
