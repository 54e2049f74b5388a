"""pack / unpack on one device, per workload, against (a) ``x * 2`` over one array of the
tree's bytes and (b) per-leaf ``x * 2``, with ``ravel_pytree``, the calls outside jit and
``jpack.plan``. Each op is compiled alone and its output materialized.
"""

from typing import Any, Callable

import jax
import numpy as np
from jax.flatten_util import ravel_pytree

import jpack
from benchmarks import harness as h
from jpack._pack import unpack_shared  # unpack, equal slices sharing kernels

TITLE = "jpack pack / unpack benchmark"
MERGE_KEY = "workload"
MODELS = h.workload_names()
VARIANTS = {"single": "(a) x*2 single", "per_leaf": "(b) x*2 per-leaf",
            "pack": "(c) jpack.pack", "unpack": "(d) jpack.unpack",
            "unpack_shared": "(d) unpack, share_kernels", "ravel": "(e) ravel_pytree",
            "unravel": "(e) unravel"}
DEFAULTS = dict(rounds=7)
QUICK = dict(rounds=5, max_leaves=300, max_elements=4_000_000)
RUN_GOAL = 1.5            # pack / unpack run time <= 1.5x max(a, b)
COMPILE_ABS_GOAL_S = 5.0  # compile of pack / unpack < 5 s for many_small_4000
PLAN_GOAL_S = 0.020       # plan <= 20 ms for 4000 leaves
PLAN_RUNS = 20


def _measure(f: Callable, arg: Any, rounds: int, output: str) -> dict[str, Any]:
  compiled = h.compile_fn(f, arg)
  t = h.time_rounds({"f": lambda: compiled.fn(arg)}, rounds)["f"]
  return {"compiled": compiled, "run_s": t.median_s, "min_s": t.min_s, "output": output}


def _describe(x: Any) -> str:
  leaves = jax.tree.leaves(x)
  dtypes = "+".join(sorted({np.dtype(l.dtype).name for l in leaves}))
  return f"{dtypes}[{leaves[0].size:,}]" if len(leaves) == 1 else f"{len(leaves)} x {dtypes}"


def bench_workload(w: h.Workload, rounds: int) -> tuple[dict[str, dict], jpack.Layout]:
  print(f"\n{w.describe()}", flush=True)
  tree = h.random_tree(w.shapes, seed=0)
  layout = jpack.plan(w.shapes)
  single = jax.device_put(h.random_numpy((w.nbytes // 4,), np.float32, np.random.default_rng(1)))
  flat, unravel = ravel_pytree(tree)  # unravel keeps sizes, shapes and dtypes only
  promoted = " (promoted)" if len({np.dtype(s.dtype) for s in w.shapes.values()}) > 1 else ""
  ops = {"single": (lambda x: x * 2, single, _describe(single)),
         "per_leaf": (lambda t: jax.tree.map(lambda x: x * 2, t), tree, _describe(tree)),
         "pack": (lambda t: jpack.pack(t, layout), tree,
                  f"Packed {_describe(tuple(layout.bucket_shapes()))}"),
         "ravel": (lambda t: ravel_pytree(t)[0], tree,
                   f"{np.dtype(flat.dtype).name}[{flat.size:,}]{promoted}")}
  res = {key: _measure(f, arg, rounds, output) for key, (f, arg, output) in ops.items()}
  packed, flat = (jax.block_until_ready(res[k]["compiled"].fn(tree)) for k in ("pack", "ravel"))
  for key, f, arg in (("unpack", jpack.unpack, packed), ("unpack_shared", unpack_shared, packed),
                      ("unravel", unravel, flat)):
    res[key] = _measure(f, arg, rounds, _describe(tree))
  # The same calls outside jit, as a script makes them: the first call compiles.
  for key, f, arg in (("eager_pack", lambda t: jpack.pack(t, layout), tree),
                      ("eager_unpack", jpack.unpack, packed)):
    res[key] = {"first_s": h.timed(lambda: f(arg))[1],
                "later_s": h.time_rounds({"f": lambda: f(arg)}, rounds, warmup=0)["f"].median_s}
  for key, r in res.items():
    print(f"  {key:<14} " + "  ".join(f"{k} {v:.4g}" for k, v in r.items()
                                       if isinstance(v, float)), flush=True)
  return res, layout


def run(opts: Any, report: h.Report) -> None:
  results, layouts, workloads, plans = {}, {}, {}, {}
  for name in opts.models or MODELS:
    full = h.load_workload(name)
    plans[name] = h.time_rounds({"plan": lambda: jpack.plan(full.shapes)}, PLAN_RUNS)["plan"]
    workloads[name] = w = h.load_workload(name, max_leaves=opts.max_leaves,
                                          max_elements=opts.max_elements)
    results[name], layouts[name] = bench_workload(w, opts.rounds)
  label = lambda n: n + (f" ({workloads[n].num_leaves} lv)" if workloads[n].subset else "")
  ops = h.Table(["workload", "op", "output", "run ms", "lower s", "compile s",
                 "run/max(a,b)", "compile/per-leaf"],
                title="Run time (median) and compile time per op; compile/per-leaf "
                      "compares lower + compile")
  eager = h.Table(["workload", "op", "first call s", "later calls ms", "first/per-leaf first",
                   "later/max(a,b)"],
                  title="Called outside jit (f): first call, compile included, and later "
                        "calls; per-leaf first = (b)'s lower + compile + run")
  ratios = h.Table(["workload", "leaves", "MiB", "buckets", "plan ms", "pack/max(a,b)",
                    "unpack/max(a,b)", "C(pack)/C(leaf)", "C(unpack)/C(leaf)",
                    "C(unpack sk)/C(leaf)", "ravel/max(a,b)", "unravel/max(a,b)"],
                   title="Ratios (run: vs max of (a) single-array and (b) per-leaf x*2; C = "
                         "lower+compile time, vs (b); sk = share_kernels); plan on the full tree")
  goals = h.Table(["goal", "workload", "value", "limit", "result"], title="Goals")
  for name, res in results.items():
    w, leaf_c = workloads[name], res["per_leaf"]["compiled"].total_s
    b = max(res["single"]["run_s"], res["per_leaf"]["run_s"])  # max(a, b)
    run = {k: h.ratio(res[k]["run_s"], b) for k in VARIANTS}
    comp = {k: h.ratio(res[k]["compiled"].total_s, leaf_c) for k in VARIANTS}
    for key, op in VARIANTS.items():
      r, c = res[key], res[key]["compiled"]
      ops.add(label(name), op, r["output"], h.fmt_ms(r["run_s"]), h.fmt_s(c.lower_s),
              h.fmt_s(c.compile_s), h.fmt_ratio(run[key]), h.fmt_ratio(comp[key]),
              workload=name, key=key, run_s=r["run_s"], run_min_s=r["min_s"],
              lower_s=c.lower_s, compile_s=c.compile_s, run_vs_max_ab=run[key],
              compile_vs_per_leaf=comp[key])
    per_leaf_first = leaf_c + res["per_leaf"]["run_s"]
    for key, op in (("eager_pack", "jpack.pack, eager"), ("eager_unpack", "jpack.unpack, eager")):
      e = res[key]
      first_vs, later_vs = h.ratio(e["first_s"], per_leaf_first), h.ratio(e["later_s"], b)
      eager.add(label(name), f"(f) {op}", f"{e['first_s']:.2f}", h.fmt_ms(e["later_s"]),
                h.fmt_ratio(first_vs), h.fmt_ratio(later_vs), workload=name, key=key, **e,
                first_vs_per_leaf_first=first_vs, later_vs_max_ab=later_vs)
    ratios.add(label(name), w.num_leaves, f"{w.nbytes / 2**20:.1f}",
               len(layouts[name].buckets), f"{1e3 * plans[name].median_s:.2f}",
               *(h.fmt_ratio(x) for x in (run["pack"], run["unpack"], comp["pack"],
                                          comp["unpack"], comp["unpack_shared"], run["ravel"],
                                          run["unravel"])),
               workload=name, leaves=w.num_leaves, bytes=w.nbytes,
               buckets=len(layouts[name].buckets), plan_s=plans[name].median_s,
               run_vs_max_ab={k: run[k] for k in ("pack", "unpack", "unpack_shared", "ravel",
                                                  "unravel")},
               compile_vs_per_leaf={k: comp[k] for k in ("pack", "unpack", "unpack_shared")})
    goal = lambda text, value, limit, **kw: h.add_goal(goals, text, label(name), value=value,
                                                       limit=limit, workload=name, **kw)
    for text, value, limit in (
        ("pack run <= 1.5x max(a,b)", run["pack"], RUN_GOAL),
        ("unpack run <= 1.5x max(a,b)", run["unpack"], RUN_GOAL),
        ("compile(pack) <= compile(per-leaf)", comp["pack"], 1.0),
        ("compile(unpack) <= compile(per-leaf)", comp["unpack"], 1.0),
        ("unpack(share_kernels) run <= 1.5x", run["unpack_shared"], RUN_GOAL),
        ("compile(unpack(share_kernels)) <= per-leaf", comp["unpack_shared"], 1.0)):
      goal(text, value, limit)
    if name == "many_small_4000":
      for op, key in (("pack", "pack"), ("unpack", "unpack"),
                      ("unpack(share_kernels)", "unpack_shared")):
        goal(f"compile({op}) < 5 s", res[key]["compiled"].total_s, COMPILE_ABS_GOAL_S,
             shown="5 s", fmt=lambda s: f"{s:.1f} s")
    if w.full_leaves >= 4000:
      goal(f"plan <= 20 ms ({w.full_leaves} leaves)", plans[name].median_s, PLAN_GOAL_S,
           shown="20 ms", fmt=lambda s: f"{1e3 * s:.2f} ms")
  for t in (ops, eager, ratios, goals):
    report.table(t)
  report.text("Notes: (a) is x*2 over one f32 array with the tree's bytes; (b) per-leaf x*2 "
              "returns the tree. Each op is compiled alone and its output materialized. "
              "ravel_pytree promotes mixed dtypes; jpack keeps one bucket per dtype."
              + (" 'N lv': a subset of N leaves; goals on subsets are indicative only."
                 if any(w.subset for w in workloads.values()) else ""))
