"""Startup: building a data-parallel step and its ``init``, before any step compiles.

What a user waits for before the first step starts compiling: ``jpack.data_parallel(...)``
(planning the layout, the optimizer check of ``jpack._probe`` on a miniature of the
params, the state's shapes) and ``dp.init(params)`` (packing the params on the host, the
small program that broadcasts them and initialises the optimizer). The step's own
compilation is not part of it (the step benchmark reports it).

Per model and mode, on 8 CPU devices, ``optax.adamw``, and on the GPT-2-like model also
optimizers that need whole leaves (their check probes which parts need them):

  first   a new optimizer object on params this process has not built a step for: the
          optimizer check probes, init compiles its program
  again   the same optimizer and params built again (a notebook cell run twice, a
          second mesh): the check's verdict is cached; init compiles again (a new step)

Models: MLPs of 25, 200, 1000 and 4000 leaves (matrices and biases, 32 wide), GPT-2
small's 148 leaves narrowed as in the step benchmark, and the 4000 tiny leaves of
``many_small_4000`` at full size. A build and init of a tiny model runs first, so that
JAX's own start (the backend, its first compilation) is not counted: it is shown apart.
Times are wall times of one call ("again": the median over ``--rounds``).

Goals (issue 38): build + init at most 0.5 s up to 200 leaves, and growing at most
linearly to 4000 leaves (the time per leaf at 4000 leaves at most the one at 200).

    python -m benchmarks startup              # every model, packed and sharded
    python -m benchmarks startup --quick      # 25 and 200 leaves, GPT-2, packed
    python -m benchmarks startup --modes packed,sharded,allreduce --sizes 25,200
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
import optax

import jpack
from benchmarks import _common as c
from benchmarks import models

DEVICES = 8
WIDTH = 32  # of the MLPs' matrices
DEFAULT_SIZES = (25, 200, 1000, 4000)
QUICK_SIZES = (25, 200)
REAL_MODELS = ("gpt2_12x64", "many_small_4000")
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": lambda: optax.adamw(1e-3),
    "lamb": lambda: optax.lamb(1e-3),
    "muon": lambda: optax.contrib.muon(1e-3),
}
MORE_OPTIMIZERS = {"gpt2_12x64": ("lamb", "muon")}  # beside adamw
QUICK_REAL_MODELS = ("gpt2_12x64",)
MODES = ("packed", "sharded", "allreduce")
DEFAULT_MODES = ("packed", "sharded")  # allreduce's init takes a program per leaf
DEFAULT_ROUNDS = 3
GOAL_S = 0.5  # build + init, up to GOAL_LEAVES leaves
GOAL_LEAVES = 200


def mlp(num_leaves: int) -> models.Model:
  """``num_leaves`` leaves: (WIDTH, WIDTH) matrices and (WIDTH,) biases, alternating."""
  rng = np.random.default_rng(0)
  params = {f"l{i:05d}": (rng.standard_normal((WIDTH, WIDTH) if i % 2 == 0 else (WIDTH,))
                          / np.sqrt(WIDTH)).astype(np.float32) for i in range(num_leaves)}

  def loss(params, batch):  # never traced here: only building and init are timed
    return sum(jax.numpy.sum(p * p) for p in jax.tree.leaves(params)) * batch.mean()

  return models.Model(f"mlp_{num_leaves}", f"MLP, {num_leaves} leaves", params, loss,
                      lambda n: np.ones((n, WIDTH), np.float32))


REAL = {
    "gpt2_12x64": lambda: models.gpt2(layers=12, width=64, vocab=1024, positions=32,
                                      heads=4, seq=16, name="gpt2_12x64"),
    "many_small_4000": lambda: models.full_size("many_small_4000", abstract=False),
}


@dataclasses.dataclass
class Startup:
  """The startup of one model in one mode."""
  model: str
  leaves: int
  mode: str
  optimizer: str
  first_build_s: float
  first_init_s: float
  again_build_s: float
  again_init_s: float

  @property
  def first_s(self) -> float:
    return self.first_build_s + self.first_init_s

  @property
  def again_s(self) -> float:
    return self.again_build_s + self.again_init_s


def build_and_init(model: models.Model, optimizer: optax.GradientTransformation,
                   mode: str) -> tuple[float, float]:
  """Seconds to build the step and to run ``init`` (until its state is ready)."""
  t0 = time.perf_counter()
  dp = jpack.data_parallel(model.loss, optimizer, model.params, mode=mode)
  t1 = time.perf_counter()
  jax.block_until_ready(dp.init(model.params))
  return t1 - t0, time.perf_counter() - t1


def measure(model: models.Model, mode: str, rounds: int, name: str = "adamw") -> Startup:
  optimizer = OPTIMIZERS[name]()  # a new object: no verdict of the check is cached for it
  first = build_and_init(model, optimizer, mode)
  again = [build_and_init(model, optimizer, mode) for _ in range(rounds)]
  return Startup(model.name, model.num_leaves, mode, name, *first,
                 statistics.median(b for b, _ in again), statistics.median(i for _, i in again))


def _goals(results: list[Startup], modes: list[str]) -> list[str]:
  """The goal lines: at most GOAL_S up to GOAL_LEAVES leaves; linear growth of the MLPs'
  time per leaf from GOAL_LEAVES leaves to the largest."""
  lines = []
  for mode in modes:
    rows = [r for r in results if r.mode == mode and r.optimizer == "adamw"]
    small = [r for r in rows if r.leaves <= GOAL_LEAVES]
    for which in ("first", "again"):
      worst = max(small, key=lambda r: getattr(r, f"{which}_s"), default=None)
      if worst is not None:
        t = getattr(worst, f"{which}_s")
        lines.append(f"{c.verdict(t <= GOAL_S)} {mode}, {which}: build + init <= "
                     f"{GOAL_S} s up to {GOAL_LEAVES} leaves (slowest: {worst.model}, "
                     f"{t:.2f} s)")
    mlps = {r.leaves: r for r in rows if r.model.startswith("mlp_")}
    base, top = mlps.get(GOAL_LEAVES), mlps.get(max(mlps, default=0))
    if base is not None and top is not None and top.leaves > base.leaves:
      for which in ("first", "again"):
        growth = (getattr(top, f"{which}_s") / top.leaves) / (getattr(base, f"{which}_s")
                                                            / base.leaves)
        lines.append(f"{c.verdict(growth <= 1)} {mode}, {which}: at most linear from "
                     f"{base.leaves} to {top.leaves} leaves (time per leaf "
                     f"{growth:.2f}x the one at {base.leaves})")
  return lines


def _report(argv: list[str], warmup_s: float, results: list[Startup],
            modes: list[str]) -> c.Report:
  report = c.Report("Startup: data_parallel + init, 8 CPU devices", "startup", argv)
  table = c.Table(["model", "leaves", "mode", "optimizer", "build s", "init s", "first s",
                   "again: build s", "init s ", "again s", "first per leaf ms"],
                  "build and init (first: the optimizer check probes; again: its verdict "
                  "cached)")
  for r in results:
    table.add(r.model, r.leaves, r.mode, r.optimizer, c.fmt_s(r.first_build_s), c.fmt_s(r.first_init_s),
              c.fmt_s(r.first_s), c.fmt_s(r.again_build_s), c.fmt_s(r.again_init_s),
              c.fmt_s(r.again_s), f"{1e3 * r.first_s / r.leaves:.3g}",
              **{**dataclasses.asdict(r), "first_s": r.first_s, "again_s": r.again_s})
  report.table(table)
  report.text(f"JAX's own start (a tiny model's build and init, first in the process, in "
              f"{', '.join(modes)}): {warmup_s:.2f} s, not counted above.")
  report.text("\n".join(_goals(results, modes)))
  return report


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks startup", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", type=_sizes, default=None,
                      help=f"MLP leaf counts (default {','.join(map(str, DEFAULT_SIZES))})")
  parser.add_argument("--models", default=None,
                      help=f"real models, comma-separated, from {', '.join(REAL)}, or "
                           f"'none' (default {','.join(REAL_MODELS)})")
  parser.add_argument("--modes", default=None,
                      help=f"comma-separated, from {', '.join(MODES)} (default "
                           f"{','.join(DEFAULT_MODES)})")
  parser.add_argument("--rounds", type=c.positive_int, default=DEFAULT_ROUNDS,
                      help="builds of 'again' (median; default %(default)s)")
  parser.add_argument("--quick", action="store_true",
                      help=f"--sizes {','.join(map(str, QUICK_SIZES))} --models "
                           f"{','.join(QUICK_REAL_MODELS)} --modes packed unless given")
  c.add_output_args(parser, "startup")
  return parser


def _sizes(text: str) -> tuple[int, ...]:
  """argparse type: comma-separated leaf counts >= 1 (or empty: none)."""
  return tuple(c.positive_int(t) for t in text.split(",") if t)


def _names(text: str | None, default: tuple[str, ...], known: Any, flag: str) -> list[str]:
  if text is None:
    return list(default)
  names = [n for n in text.split(",") if n and n != "none"]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise SystemExit(f"{flag}: unknown {', '.join(map(repr, unknown))}; choose from "
                     f"{', '.join(known)}")
  return names


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parser().parse_args(argv)
  sizes = args.sizes if args.sizes is not None else (QUICK_SIZES if args.quick
                                                      else DEFAULT_SIZES)
  real = _names(args.models, QUICK_REAL_MODELS if args.quick else REAL_MODELS, REAL,
                "--models")
  modes = _names(args.modes, ("packed",) if args.quick else DEFAULT_MODES, MODES, "--modes")
  c.set_cpu_devices(DEVICES)  # before anything creates an array
  c.require_devices(DEVICES)
  more = "; ".join(f"on {m} {', '.join(o)}" for m, o in MORE_OPTIMIZERS.items())
  c.banner("benchmarks.startup", [
      f"MLPs of {', '.join(map(str, sizes)) or 'no'} leaves; {', '.join(real) or 'no'} real "
      f"models; modes {', '.join(modes)}; optax.adamw (and {more}); "
      f"again: median of {args.rounds}"])
  makers: list[Callable[[], models.Model]] = [lambda n=n: mlp(n) for n in sizes]
  makers += [REAL[name] for name in real]
  t0 = time.perf_counter()
  tiny = mlp(4)
  for mode in modes:  # JAX's own start, and the first compilations of every mode
    build_and_init(tiny, optax.adamw(1e-3), mode)
  warmup_s = time.perf_counter() - t0
  results = []
  for make in makers:
    model = make()
    for name in ("adamw", *MORE_OPTIMIZERS.get(model.name, ())):
      for mode in modes:
        results.append(measure(model, mode, args.rounds, name))
        r = results[-1]
        print(f"{r.model} ({r.leaves} leaves), {mode}, {name}: first {r.first_s:.2f} s, "
              f"again {r.again_s:.2f} s", flush=True)
    c.release_host_memory()
  report = _report(argv, warmup_s, results, modes)
  report.write(args)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
