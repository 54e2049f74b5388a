"""A change against ``--baseline REV``, in one process: REV's ``jpack/`` imported as
``jpack_base`` beside the working tree's, each ``data_parallel`` mode, the optax chain and
``jpack.pmean`` of small leaves timed in rounds, base and new in turn (paired ratios).
"""

import importlib
import io
import pathlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from benchmarks import collectives as coll
from benchmarks import harness as h
from benchmarks import step as st
from jpack import _reference

TITLE = "jpack: baseline revision against the working tree"
DEVICES = 8
MERGE_KEY = "case"
AXIS = h.AXIS
BASE_PACKAGE, BASE, NEW = "jpack_base", "base", "new"
CHAIN = "optax_chain"
CHAIN_GOAL = 1.05  # chain / data_parallel(mode="allreduce"), new code
MODELS = st.MODELS
VARIANTS = ("allreduce", "packed", "sharded", "fsdp")  # the modes
DEFAULTS = dict(rounds=6, steps=10, models=list(st.DEFAULT_MODELS))
QUICK = dict(rounds=2, steps=3, models=["mlp_4x32"])

# `import jpack...`, and `jpack.name` in code (not in words, names, quotes or backticks).
_IMPORT_RE = re.compile(r"^(\s*(?:from|import)\s+)jpack\b", re.MULTILINE)
_ATTR_RE = re.compile(r"(?<![\w.`'\"])jpack\.(?=[A-Za-z_])")


def extract_baseline(rev: str, folder: pathlib.Path) -> tuple[types.ModuleType, str]:
  """Revision ``rev``'s ``jpack/`` imported as `BASE_PACKAGE`, and its commit."""
  root = h.BENCHMARKS_DIR.parent
  git = lambda *args: subprocess.run(["git", "-C", str(root), *args], capture_output=True)
  commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
  archive = git("archive", "--format=tar", rev, "jpack")
  if commit.returncode or archive.returncode:
    raise SystemExit(f"--baseline {rev!r}: {(commit.stderr or archive.stderr).decode().strip()}")
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
    raise SystemExit(f"{BASE_PACKAGE} came from {module.__file__}, not from {rev}")
  return module, commit.stdout.decode().strip()


def step_side(module: types.ModuleType, key: str, model: Any, mesh, batch: Any
              ) -> tuple[h.Compiled, Callable[[int], Any]]:
  """``module.data_parallel(mode=key)`` (or the `CHAIN` step) compiled and warmed up,
  and a function running ``n`` steps."""
  adam = optax.adam(st.LEARNING_RATE)
  if key == CHAIN:
    dp = _reference.per_leaf_step(
        model.loss, optax.chain(module.optax.allreduce(AXIS), adam), model.params, mesh,
        reduce=lambda g: g, norm=lambda s: jnp.zeros(()))
  else:  # the axis comes from the mesh, so a baseline of either API builds the same step
    dp = module.data_parallel(model.loss, adam, model.params, mesh, mode=key)
  compiled = h.compile_fn(dp.step, dp.init(model.params), batch,
                          jit_kwargs={"donate_argnums": 0})
  box = [compiled.fn(dp.init(model.params), batch)[0]]  # warm-up

  def steps(n: int) -> Any:
    for _ in range(n):
      box[0], metrics = compiled.fn(box[0], batch)
    return box[0]

  return compiled, steps


def pmean_side(module: types.ModuleType, mesh, w: h.Workload, tree: Any
               ) -> tuple[h.Compiled, Callable[[int], Any]]:
  layout = module.plan(w.shapes, num_shards=DEVICES)
  compiled = h.compile_fn(coll.smap(mesh, lambda t: module.pmean(coll._local(t), AXIS,
                                                                 layout=layout)), tree)

  def calls(n: int) -> None:
    for _ in range(n):  # one at a time: XLA:CPU's collectives deadlock with many queued
      jax.block_until_ready(compiled.fn(tree))

  return compiled, calls


def add_rows(table: h.Table, name: str, label: str, sides: dict, rounds: int, steps: int
             ) -> dict[str, list[float]]:
  """A row of the two sides timed in rounds; each side's time per step in each round."""
  t = h.time_rounds({k: (lambda k=k: sides[k][1](steps)) for k in (BASE, NEW)}, rounds)
  block_s = {k: [x / steps for x in t[k].samples] for k in (BASE, NEW)}
  ratios = [x / y for x, y in zip(t[NEW].samples, t[BASE].samples)]
  r = statistics.median(ratios)
  (cb, _), (cn, _) = sides[BASE], sides[NEW]
  base_s, new_s = t[BASE].median_s / steps, t[NEW].median_s / steps
  table.add(name, label, h.fmt_ms(base_s), h.fmt_ms(new_s), h.fmt_ratio(r),
            f"{min(ratios):.2f}-{max(ratios):.2f}", h.fmt_s(cb.total_s), h.fmt_s(cn.total_s),
            case=name, variant=label, base_s=base_s, new_s=new_s, paired_ratio=r,
            round_ratios=ratios, base_block_s=block_s[BASE], new_block_s=block_s[NEW],
            base_lower_s=cb.lower_s, base_compile_s=cb.compile_s, new_lower_s=cn.lower_s,
            new_compile_s=cn.compile_s)
  return block_s


def run(opts: Any, report: h.Report) -> None:
  with tempfile.TemporaryDirectory(prefix="jpack_compare_") as folder:
    base, commit = extract_baseline(opts.baseline, pathlib.Path(folder))
    modules = {BASE: base, NEW: jpack}
    table = h.Table(["case", "variant", "base ms", "new ms", "new/base", "round range",
                     "base compile s", "new compile s"],
                    title=f"{opts.baseline} ({commit[:10]}) -> working tree: median time per "
                          "call; new/base paired by rounds (lower is better)")
    chain = h.Table(["model", "base", "new", "goal", "result"],
                    title="optax.chain(jpack.optax.allreduce, adam) / "
                          "data_parallel(mode='allreduce'), paired by rounds")
    mesh = h.mesh(DEVICES)
    rows = NamedSharding(mesh, P(AXIS))  # split over the devices
    for name in opts.models:
      model = st.MODELS[name]()
      batch = jax.device_put(model.batch(st.PER_DEVICE_BATCH * DEVICES), rows)
      times = {}
      for key in [*(opts.variants or VARIANTS), CHAIN]:
        label = "optax.chain(allreduce, adam)" if key == CHAIN else f"data_parallel({key})"
        sides = {k: step_side(m, key, model, mesh, batch) for k, m in modules.items()}
        times[key] = add_rows(table, name, label, sides, opts.rounds, opts.steps)
      if "allreduce" in times:
        r = {k: statistics.median(a / b for a, b in zip(times[CHAIN][k], times["allreduce"][k]))
             for k in (BASE, NEW)}
        chain.add(name, h.fmt_ratio(r[BASE]), h.fmt_ratio(r[NEW]), f"<={CHAIN_GOAL:g}x",
                  h.verdict(r[NEW] <= CHAIN_GOAL), model=name, base_ratio=r[BASE],
                  new_ratio=r[NEW], goal=CHAIN_GOAL, ok=r[NEW] <= CHAIN_GOAL)
      h.release_host_memory()
    w = h.synthetic_small_leaves(200 if opts.quick else 1000)
    tree = h.random_tree(w.shapes, seed=0, lead=DEVICES, sharding=rows)
    sides = {k: pmean_side(m, mesh, w, tree) for k, m in modules.items()}
    add_rows(table, f"{w.num_leaves} small f32 leaves", "pmean (tree in, tree out)", sides,
             opts.rounds, opts.steps)
    report.table(table)
    if chain.rows:
      report.table(chain)
    report.text("round range: the smallest and largest per-round new/base ratio. Compile = "
                "lower + compile of the jitted step (or pmean).")
