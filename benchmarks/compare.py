"""A refactor against the code before it, in one process: paired step-time ratios.

``--baseline REV``'s ``jpack/`` is extracted with ``git archive`` into a temporary
folder as the package ``jpack_base`` (its own imports rewritten), so that it and the
working tree's ``jpack`` run side by side on the same 8 CPU devices. Cases, each built
once per package:

  data_parallel(m)  ``jpack.data_parallel(mode=m)`` with optax.adam, for m in ``--modes``,
                    on the MLPs of ``benchmarks.step``
  optax.chain       ``optax.chain(jpack.optax.allreduce(AXIS), optax.adam)`` in the plain
                    shard_map step of ``benchmarks.step``
  pmean             ``jpack.pmean`` of a tree of 1000 small f32 leaves (1 MiB, the
                    ``small_1000`` tree of ``benchmarks.collectives``), tree in, tree out

Every case is timed in rounds: base then new in even rounds, new then base in odd
ones, each side ``BLOCKS`` blocks of ``--steps`` calls in a row. A side's time in a round
is the median of its blocks; "new/base" is the median over rounds of new's time over
base's in the same round (drifts of the host that last a round cancel out), and the
range is the smallest and largest of those per-round ratios: the noise to judge a
ratio by. "chain / allreduce" is paired the same way, within one package.

    python -m benchmarks.compare                       # HEAD~1 against the working tree
    python -m benchmarks.compare --baseline a77d1f9 --models mlp_4x32 --rounds 2 --steps 3
    python -m benchmarks.compare --quick --baseline HEAD
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import io
import pathlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from typing import Any, Callable

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from benchmarks import _common as c
from benchmarks import collectives as coll
from benchmarks import step as st

NUM_DEVICES = st.NUM_DEVICES
AXIS = st.AXIS
BASE_PACKAGE = "jpack_base"
BASE, NEW = "base", "new"
BLOCKS = 3             # timed blocks per side and round
CHAIN = "optax_chain"  # the hand-written step's key, as in benchmarks.step
CHAIN_GOAL = 1.05      # chain / data_parallel(mode="allreduce"), new code
MODES = tuple(dict.fromkeys(v.mode for v in st.DATA_PARALLEL.values()))
QUICK_MODEL = "mlp_4x32"

# `import jpack...` / `from jpack...` at the start of a line, and `jpack.name` in code
# (not inside a word, a dotted name, a quote or backticks: messages and docs keep it).
_IMPORT_RE = re.compile(r"^(\s*(?:from|import)\s+)jpack\b", re.MULTILINE)
_ATTR_RE = re.compile(r"(?<![\w.`'\"])jpack\.(?=[A-Za-z_])")


def extract_baseline(rev: str, folder: pathlib.Path) -> tuple[types.ModuleType, str]:
  """Import revision ``rev``'s ``jpack/`` as `BASE_PACKAGE` from ``folder``.

  Returns the module and the commit ``rev`` names.
  """
  root = c.BENCHMARKS_DIR.parent
  git = lambda *args: subprocess.run(["git", "-C", str(root), *args], capture_output=True)
  commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
  if commit.returncode:
    raise SystemExit(f"--baseline {rev!r} is not a commit of {root}: "
                     f"{commit.stderr.decode().strip()}")
  archive = git("archive", "--format=tar", rev, "jpack")
  if archive.returncode:
    raise SystemExit(f"git archive {rev} jpack failed: {archive.stderr.decode().strip()}")
  with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
    tar.extractall(folder, filter="data")
  package = folder / BASE_PACKAGE
  (folder / "jpack").rename(package)
  for path in package.rglob("*.py"):
    text = _IMPORT_RE.sub(rf"\g<1>{BASE_PACKAGE}", path.read_text())
    path.write_text(_ATTR_RE.sub(f"{BASE_PACKAGE}.", text))
  sys.path.insert(0, str(folder))
  module = importlib.import_module(BASE_PACKAGE)
  if not module.__file__.startswith(str(folder)):
    raise SystemExit(f"{BASE_PACKAGE} came from {module.__file__}, not from {rev}: rename "
                     f"that package, or remove it from the path")
  return module, commit.stdout.decode().strip()


# -- cases -----------------------------------------------------------------------------


@dataclasses.dataclass
class Side:
  """One package's compiled case: ``block(n)`` makes ``n`` more calls and appends the
  time per call to ``times``."""
  compiled: c.Compiled
  block: Callable[[int], Any]
  times: list[float]

  def per_round(self, rounds: int) -> list[float]:
    return [statistics.median(self.times[r * BLOCKS:(r + 1) * BLOCKS]) for r in range(rounds)]


def step_side(module: types.ModuleType, key: str, model: st.Model, mesh, batch) -> Side:
  """``data_parallel(mode=key)``, or for `CHAIN` step.py's plain step with ``module``'s
  allreduce, compiled and warmed up as ``benchmarks.step`` does."""
  adam = optax.adam(st.LEARNING_RATE)
  if key == CHAIN:
    s = st._plain_step(model, mesh, module.optax.allreduce(AXIS), adam, record_norm=False)
  else:
    # The axis comes from the mesh (AXIS, "batch": also the default of jpacks whose
    # data_parallel took axis_name=), so a baseline of either API builds the same step.
    s = module.data_parallel(model.loss, adam, model.params, mesh, mode=key)
  state = jax.block_until_ready(s.init(model.params))
  compiled = c.compile_fn(s.step, state, batch, jit_kwargs={"donate_argnums": 0})
  state, _ = compiled.fn(state, batch)  # warm-up
  p = st._Prepared(key, s, compiled, jax.block_until_ready(state), [batch], [])
  return Side(compiled, functools.partial(st._time_block, p), p.times)


def pmean_side(module: types.ModuleType, bench: coll.Bench, w: c.Workload, tree: Any) -> Side:
  """``module.pmean`` of the tree in a shard_map, as ``benchmarks.collectives`` runs it."""
  layout = module.plan(w.shapes, num_shards=NUM_DEVICES)
  compiled = c.compile_fn(bench.smap(
      lambda t: module.pmean(coll._local(t), AXIS, layout=layout)), tree)
  jax.block_until_ready(compiled.fn(tree))  # warm-up
  times: list[float] = []

  def block(n: int) -> None:
    t0 = time.perf_counter()
    for _ in range(n):  # one at a time: XLA:CPU's collectives deadlock with many queued
      jax.block_until_ready(compiled.fn(tree))
    times.append((time.perf_counter() - t0) / n)

  return Side(compiled, block, times)


def run_rounds(cases: dict[str, dict[str, Side]], rounds: int, steps: int) -> None:
  for r in range(rounds):
    order = (BASE, NEW) if r % 2 == 0 else (NEW, BASE)
    for sides in cases.values():
      for key in order:
        for _ in range(BLOCKS):
          sides[key].block(steps)


def paired(a: Side, b: Side, rounds: int) -> list[float]:
  """``a``'s time over ``b``'s, round by round."""
  return [x / y for x, y in zip(a.per_round(rounds), b.per_round(rounds))]


# -- tables ----------------------------------------------------------------------------


def add_rows(table: c.Table, name: str, cases: dict[str, dict[str, Side]], rounds: int) -> None:
  for label, sides in cases.items():
    base, new = sides[BASE], sides[NEW]
    ratios = paired(new, base, rounds)
    r = statistics.median(ratios)
    t_base, t_new = statistics.median(base.times), statistics.median(new.times)
    table.add(name, label, c.fmt_ms(t_base), c.fmt_ms(t_new), c.fmt_ratio(r),
              f"{min(ratios):.2f}-{max(ratios):.2f}", c.fmt_s(base.compiled.total_s),
              c.fmt_s(new.compiled.total_s),
              case=name, variant=label, base_s=t_base, new_s=t_new, paired_ratio=r,
              round_ratios=ratios, base_block_s=base.times, new_block_s=new.times,
              base_lower_s=base.compiled.lower_s, base_compile_s=base.compiled.compile_s,
              new_lower_s=new.compiled.lower_s, new_compile_s=new.compiled.compile_s)


def add_chain_row(table: c.Table, name: str, cases: dict[str, dict[str, Side]],
                  rounds: int) -> None:
  chain, allreduce = cases.get(_label(CHAIN)), cases.get(_label("allreduce"))
  if chain is None or allreduce is None:
    return
  r = {k: statistics.median(paired(chain[k], allreduce[k], rounds)) for k in (BASE, NEW)}
  ok = r[NEW] <= CHAIN_GOAL
  table.add(name, c.fmt_ratio(r[BASE]), c.fmt_ratio(r[NEW]), f"<={CHAIN_GOAL:g}x",
            c.verdict(ok), model=name, base_ratio=r[BASE], new_ratio=r[NEW],
            goal=CHAIN_GOAL, ok=ok)


def _label(key: str) -> str:
  return "optax.chain(allreduce, adam)" if key == CHAIN else f"data_parallel({key})"


# -- main ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks compare", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--baseline", default="HEAD~1", metavar="REV",
                      help="git revision whose jpack/ is the baseline (default: %(default)s)")
  parser.add_argument("--models", default="",
                      help=f"comma-separated subset of {', '.join(st.MODELS)} "
                           f"(default: {', '.join(st.DEFAULT_MODELS)})")
  parser.add_argument("--modes", default=",".join(MODES),
                      help="comma-separated data_parallel modes (default: %(default)s)")
  parser.add_argument("--rounds", type=c.positive_int, default=None,
                      help="timed rounds, alternating base-new and new-base (default 6)")
  parser.add_argument("--steps", type=c.positive_int, default=None,
                      help=f"calls per timed block, {BLOCKS} blocks per side and round "
                           "(default 10)")
  parser.add_argument("--quick", action="store_true",
                      help=f"{QUICK_MODEL} and a {coll.QUICK_SMALL_LEAVES}-leaf pmean, "
                           "2 rounds of 3 steps")
  c.add_output_args(parser, "compare")
  return parser


def main(argv: list[str] | None = None) -> int:
  c.set_cpu_devices(NUM_DEVICES)  # before anything creates an array
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = _parser()
  args = parser.parse_args(argv)
  names = [n for n in args.models.split(",") if n] or (
      [QUICK_MODEL] if args.quick else list(st.DEFAULT_MODELS))
  modes = [m for m in args.modes.split(",") if m]
  for flag, chosen, known in (("--models", names, st.MODELS), ("--modes", modes, MODES)):
    if set(chosen) - set(known):
      parser.error(f"{flag}: unknown {sorted(set(chosen) - set(known))}; "
                   f"choose from {', '.join(known)}")
  rounds = args.rounds or (2 if args.quick else 6)
  steps = args.steps or (3 if args.quick else 10)
  c.require_devices(NUM_DEVICES)

  with tempfile.TemporaryDirectory(prefix="jpack_compare_") as folder:
    base, commit = extract_baseline(args.baseline, pathlib.Path(folder))
    modules = {BASE: base, NEW: jpack}
    report = c.Report("jpack: baseline revision against the working tree", "compare", argv)
    c.banner("benchmarks.compare", [
        f"base = {BASE_PACKAGE} from {args.baseline} ({commit[:10]}), new = jpack of the "
        f"working tree; {NUM_DEVICES} CPU devices; {rounds} rounds x {BLOCKS} blocks x "
        f"{steps} calls per side"])
    table = c.Table(["case", "variant", "base ms", "new ms", "new/base", "round range",
                     "base compile s", "new compile s"],
                    title=f"{args.baseline} ({commit[:10]}) -> working tree: median time "
                          "per call; new/base paired by rounds (lower is better)")
    chain = c.Table(["model", "base", "new", "goal", "result"],
                    title="optax.chain(jpack.optax.allreduce, adam) / "
                          "data_parallel(mode='allreduce'), paired by rounds")
    for name in names:
      model = st.MODELS[name]()
      mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,),
                           axis_types=(jax.sharding.AxisType.Explicit,))
      batch = jax.device_put(model.batch(st.PER_DEVICE_BATCH * NUM_DEVICES),
                             NamedSharding(mesh, P(AXIS)))
      print(f"\n-- {model.describe}: {model.num_leaves} leaves, "
            f"{model.num_params / 1e6:.2f} M params", flush=True)
      cases = {}
      for key in [*modes, CHAIN]:
        cases[_label(key)] = {k: step_side(m, key, model, mesh, batch)
                              for k, m in modules.items()}
        print(f"   {_label(key)}: compiled", flush=True)
      run_rounds(cases, rounds, steps)
      add_rows(table, name, cases, rounds)
      add_chain_row(chain, name, cases, rounds)
      del model, cases, batch
      c.release_host_memory()

    w = c.synthetic_small_leaves(coll.QUICK_SMALL_LEAVES if args.quick else 1000, 2**20)
    print(f"\n-- {w.describe()}", flush=True)
    bench = coll.Bench(runs=1)
    tree = c.random_tree(w.shapes, seed=0, lead=NUM_DEVICES, sharding=bench.sharding)
    cases = {"pmean (tree in, tree out)": {k: pmean_side(m, bench, w, tree)
                                           for k, m in modules.items()}}
    run_rounds(cases, rounds, steps)
    add_rows(table, f"{w.num_leaves} small f32 leaves", cases, rounds)

    report.table(table)
    if chain.rows:  # data_parallel(mode="allreduce") was timed
      report.table(chain)
    report.text("round range: the smallest and largest per-round new/base ratio. "
                "Compile = lower + compile of the jitted step (or pmean).")
    report.write(args)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
