"""pack / unpack performance on the packaged workloads (one device).

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

    python -m jpack.bench pack                       # everything (unpack of 4000 leaves: ~30 s compile)
    python -m jpack.bench pack --skip-slow           # skip unpack/unravel above 1000 leaves
    python -m jpack.bench pack --quick               # subsets of <= 300 leaves (~2 min)
    python -m jpack.bench pack --workloads resnet50,many_small_4000 --markdown pack.md
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.flatten_util import ravel_pytree

import jpack
from jpack.bench import _common as c

# Goals from the issue.
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
  return jpack.unpack(packed, share_kernels=True)


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


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jpack.bench pack", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workloads", default="",
                      help="comma-separated workload names (default: all packaged ones)")
  parser.add_argument("--quick", action="store_true",
                      help=f"subset every workload to <= {QUICK_MAX_LEAVES} leaves and "
                           f"{QUICK_MAX_ELEMENTS / 1e6:g} M elements, {QUICK_RUNS} runs")
  parser.add_argument("--runs", type=c.positive_int, default=None, help="timed runs per op (median; default 7)")
  parser.add_argument("--max-leaves", type=c.positive_int, default=None, help="keep at most this many leaves")
  parser.add_argument("--max-elements", type=c.positive_int, default=None,
                      help="keep at most this many elements per workload")
  parser.add_argument("--skip-slow", action="store_true",
                      help="skip unpack and unravel (one XLA:CPU kernel per output slice: "
                           "~30 s compile at 4000 leaves) for workloads with more than "
                           "--slow-leaves leaves")
  parser.add_argument("--slow-leaves", type=c.positive_int, default=1000,
                      help="leaf count above which --skip-slow applies (default 1000)")
  parser.add_argument("--plan-runs", type=c.positive_int, default=20, help="runs of jpack.plan (median)")
  parser.add_argument("--markdown", metavar="FILE", type=c.markdown_path,
                      help="also write the tables as Markdown")
  args = parser.parse_args(argv)

  max_leaves = args.max_leaves if args.max_leaves is not None else (
      QUICK_MAX_LEAVES if args.quick else None)
  max_elements = args.max_elements if args.max_elements is not None else (
      QUICK_MAX_ELEMENTS if args.quick else None)
  runs = args.runs if args.runs is not None else (QUICK_RUNS if args.quick else 7)
  names = [n for n in args.workloads.split(",") if n] or c.workload_names()
  c.check_workload_names(names, "--workloads")

  report = c.Report("jpack pack / unpack benchmark")
  c.banner("jpack.bench pack", [
      f"workloads: {', '.join(names)}; runs {runs} (median, after 1 warm-up); "
      f"max_leaves {max_leaves}, max_elements {max_elements}"
      f"{'; --skip-slow above ' + str(args.slow_leaves) + ' leaves' if args.skip_slow else ''}"])

  all_results = {}
  layouts = {}
  workloads = {}
  plan_times = {}
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

  # -- table 1: every op ------------------------------------------------------------
  t1 = c.Table(["workload", "op", "output", "run ms", "lower s", "compile s",
                "run/max(a,b)", "compile/per-leaf"],
               title="Run time (median) and compile time per op; compile/per-leaf compares "
                     "lower + compile")
  for name, res in all_results.items():
    label, base_run = _label(name, workloads[name]), _base_run(res)
    base_compile = res["per_leaf"].compile_total_s
    for key in ("single", "per_leaf", "pack", "unpack", "unpack_shared", "ravel", "unravel"):
      r = res[key]
      op = {"single": "(a) x*2 single", "per_leaf": "(b) x*2 per-leaf",
            "pack": "(c) jpack.pack", "unpack": "(d) jpack.unpack",
            "unpack_shared": "(d) unpack, share_kernels",
            "ravel": "(e) ravel_pytree", "unravel": "(e) unravel"}[key]
      if r.skipped:
        t1.add(label, op, r.output, "skipped", "-", "-", "-", "-")
        continue
      t1.add(label, op, r.output, c.fmt_ms(r.run_s), c.fmt_s(r.compiled.lower_s),
             c.fmt_s(r.compiled.compile_s), c.fmt_ratio(c.ratio(r.run_s, base_run)),
             c.fmt_ratio(c.ratio(r.compile_total_s, base_compile)))
  report.table(t1)

  t_eager = c.Table(["workload", "op", "first call s", "later calls ms",
                     "first/per-leaf first", "later/max(a,b)"],
                    title="Called outside jit (f): first call, compile included, and later "
                          "calls; per-leaf first = (b)'s lower + compile + run")
  for name, res in all_results.items():
    label, base_run = _label(name, workloads[name]), _base_run(res)
    per_leaf_first = res["per_leaf"].compile_total_s + res["per_leaf"].run_s
    for key in ("eager_pack", "eager_unpack"):
      e = res[key]
      t_eager.add(label, f"(f) {e.op}", f"{e.first_s:.2f}", c.fmt_ms(e.later.median_s),
                  c.fmt_ratio(c.ratio(e.first_s, per_leaf_first)),
                  c.fmt_ratio(c.ratio(e.later.median_s, base_run)))
  report.table(t_eager)

  # -- table 2: ratios ----------------------------------------------------------------
  t2 = c.Table(["workload", "leaves", "MiB", "buckets", "plan ms", "pack/max(a,b)",
                "unpack/max(a,b)", "C(pack)/C(leaf)", "C(unpack)/C(leaf)",
                "C(unpack sk)/C(leaf)", "ravel/max(a,b)", "unravel/max(a,b)"],
               title="Ratios (run: vs max of (a) single-array and (b) per-leaf x*2; "
                     "C = lower+compile time, vs (b); sk = share_kernels); plan on the "
                     "full tree")
  goals = c.Table(["goal", "workload", "value", "limit", "result"], title="Goals")
  for name, res in all_results.items():
    w = workloads[name]
    layout = layouts[name]
    base_run = _base_run(res)
    base_c = res["per_leaf"].compile_total_s
    r_pack = c.ratio(res["pack"].run_s, base_run)
    r_unpack = c.ratio(res["unpack"].run_s, base_run)
    c_pack = c.ratio(res["pack"].compile_total_s, base_c)
    c_unpack = c.ratio(res["unpack"].compile_total_s, base_c)
    r_shared = c.ratio(res["unpack_shared"].run_s, base_run)
    c_shared = c.ratio(res["unpack_shared"].compile_total_s, base_c)
    label = _label(name, w)
    t2.add(label, w.num_leaves, f"{w.nbytes / 2**20:.1f}", len(layout.buckets),
           f"{1e3 * plan_times[name].median_s:.2f}", c.fmt_ratio(r_pack), c.fmt_ratio(r_unpack),
           c.fmt_ratio(c_pack), c.fmt_ratio(c_unpack), c.fmt_ratio(c_shared),
           c.fmt_ratio(c.ratio(res["ravel"].run_s, base_run)),
           c.fmt_ratio(c.ratio(res["unravel"].run_s, base_run)))

    def goal(text, value, limit, ok, fmt=c.fmt_ratio):
      goals.add(text, label, fmt(value) if value is not None else "-", limit,
                c.verdict(None if value is None else ok))

    goal("pack run <= 1.5x max(a,b)", r_pack, "1.50x", r_pack is not None and r_pack <= RUN_GOAL)
    goal("unpack run <= 1.5x max(a,b)", r_unpack, "1.50x",
         r_unpack is not None and r_unpack <= RUN_GOAL)
    goal("compile(pack) <= compile(per-leaf)", c_pack, "1.00x", c_pack is not None and c_pack <= 1)
    goal("compile(unpack) <= compile(per-leaf)", c_unpack, "1.00x",
         c_unpack is not None and c_unpack <= 1)
    goal("unpack(share_kernels) run <= 1.5x", r_shared, "1.50x",
         r_shared is not None and r_shared <= RUN_GOAL)
    goal("compile(unpack(share_kernels)) <= per-leaf", c_shared, "1.00x",
         c_shared is not None and c_shared <= 1)
    if name == "many_small_4000":
      for key, op in (("pack", "pack"), ("unpack", "unpack"),
                      ("unpack_shared", "unpack(share_kernels)")):
        v = res[key].compile_total_s
        goal(f"compile({op}) < 5 s", v, "5 s", v is not None and v < COMPILE_ABS_GOAL_S,
             fmt=lambda s: f"{s:.1f} s")
  for name in all_results:
    full_leaves = workloads[name].full_leaves
    if full_leaves >= MANY_LEAVES:
      v = plan_times[name].median_s
      goals.add(f"plan <= 20 ms ({full_leaves} leaves)", name, f"{1e3 * v:.2f} ms", "20 ms",
                c.verdict(v <= PLAN_GOAL_S))
  report.table(t2)
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
  report.write_markdown(args.markdown)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
