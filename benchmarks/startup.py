"""Startup: ``jpack.data_parallel(...)`` and ``dp.init(params)``, before any step
compiles, per model and mode on 8 CPU devices: "first" with a new optimizer object (the
check reads it), "again" the same object (its verdict cached).
"""

import dataclasses
import statistics
from typing import Any, Callable

import jax
import numpy as np
import optax

import jpack
from benchmarks import harness as h
from benchmarks import models, step

TITLE = "Startup: data_parallel + init, 8 CPU devices"
DEVICES = 8
MERGE_KEY = "model"
WIDTH = 32  # of the MLPs' matrices
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": lambda: optax.adamw(1e-3), "lamb": lambda: optax.lamb(1e-3),
    "muon": lambda: optax.contrib.muon(1e-3), "adafactor": lambda: optax.adafactor(1e-3),
    "clip_adamw_mask": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))}
MORE_OPTIMIZERS = {"gpt2_12x64": ("lamb", "muon", "adafactor", "clip_adamw_mask")}
VARIANTS = ("packed", "sharded", "allreduce")  # the modes; allreduce's init: a program per leaf
DEFAULTS = dict(rounds=3, variants=["packed", "sharded"],
                models=["mlp_25", "mlp_200", "mlp_1000", "mlp_4000", "gpt2_12x64",
                        "many_small_4000"])
QUICK = dict(variants=["packed"], models=["mlp_25", "mlp_200", "gpt2_12x64"])
GOAL_S, GOAL_LEAVES = 0.5, 200  # build + init up to 200 leaves; linear beyond


def mlp(num_leaves: int) -> models.Model:
  """``num_leaves`` leaves: (WIDTH, WIDTH) matrices and (WIDTH,) biases, alternating."""
  rng = np.random.default_rng(0)
  params = {f"l{i:05d}": (rng.standard_normal((WIDTH, WIDTH) if i % 2 == 0 else (WIDTH,))
                          / np.sqrt(WIDTH)).astype(np.float32) for i in range(num_leaves)}

  def loss(params, batch):  # never traced here: only building and init are timed
    return sum(jax.numpy.sum(p * p) for p in jax.tree.leaves(params)) * batch.mean()

  return models.Model(f"mlp_{num_leaves}", f"MLP, {num_leaves} leaves", params, loss,
                      lambda n: np.ones((n, WIDTH), np.float32))


MODELS: dict[str, Callable[[], models.Model]] = {
    **{f"mlp_{n}": (lambda n=n: mlp(n)) for n in (25, 200, 1000, 4000)},
    "gpt2_12x64": lambda: step.MODELS["gpt2_12x64"](),
    "many_small_4000": lambda: models.full_size("many_small_4000", abstract=False),
}


@dataclasses.dataclass
class Startup:
  model: str
  leaves: int
  mode: str
  optimizer: str
  first_build_s: float
  first_init_s: float
  again_build_s: float
  again_init_s: float

  first_s = property(lambda self: self.first_build_s + self.first_init_s)
  again_s = property(lambda self: self.again_build_s + self.again_init_s)


def build_and_init(model: models.Model, optimizer: Any, mode: str) -> tuple[float, float]:
  """Seconds to build the step and to run ``init`` (until its state is ready)."""
  dp, build_s = h.timed(lambda: jpack.data_parallel(model.loss, optimizer, model.params,
                                                    mode=mode))
  return build_s, h.timed(lambda: dp.init(model.params))[1]


def measure(model: models.Model, mode: str, rounds: int, name: str) -> Startup:
  optimizer = OPTIMIZERS[name]()  # a new object: no verdict of the check is cached for it
  first = build_and_init(model, optimizer, mode)
  again = [build_and_init(model, optimizer, mode) for _ in range(rounds)]
  return Startup(model.name, model.num_leaves, mode, name, *first,
                 statistics.median(b for b, _ in again), statistics.median(i for _, i in again))


def goals(results: list[Startup], modes: list[str]) -> list[str]:
  """At most GOAL_S up to GOAL_LEAVES leaves, whatever the optimizer; at most linear in
  leaves beyond (adamw's MLPs)."""
  lines = []
  for mode in modes:
    rows = [r for r in results if r.mode == mode]
    mlps = {r.leaves: r for r in rows if r.model.startswith("mlp_") and r.optimizer == "adamw"}
    base, top = mlps.get(GOAL_LEAVES), mlps.get(max(mlps, default=0))
    for which in ("first", "again"):
      get = lambda r: getattr(r, f"{which}_s")
      worst = max((r for r in rows if r.leaves <= GOAL_LEAVES), key=get, default=None)
      if worst is not None:
        lines.append(f"{h.verdict(get(worst) <= GOAL_S)} {mode}, {which}: build + init <= "
                     f"{GOAL_S} s up to {GOAL_LEAVES} leaves (slowest: {worst.model} with "
                     f"{worst.optimizer}, {get(worst):.2f} s)")
      if base is not None and top is not None and top.leaves > base.leaves:
        growth = (get(top) / top.leaves) / (get(base) / base.leaves)
        lines.append(f"{h.verdict(growth <= 1)} {mode}, {which}: at most linear from "
                     f"{base.leaves} to {top.leaves} leaves (time per leaf {growth:.2f}x "
                     f"the one at {base.leaves})")
  return lines


def run(opts: Any, report: h.Report) -> None:
  modes = opts.variants
  _, warmup_s = h.timed(lambda: [build_and_init(mlp(4), optax.adamw(1e-3), m) for m in modes])
  results = []
  for name in opts.models:
    model = MODELS[name]()
    for optimizer in ("adamw", *MORE_OPTIMIZERS.get(name, ())):
      for mode in modes:
        results.append(r := measure(model, mode, opts.rounds, optimizer))
        print(f"{r.model} ({r.leaves} leaves), {mode}, {optimizer}: first {r.first_s:.2f} s, "
              f"again {r.again_s:.2f} s", flush=True)
    h.release_host_memory()
  table = h.Table(["model", "leaves", "mode", "optimizer", "build s", "init s", "first s",
                   "again: build s", "init s ", "again s", "first per leaf ms"],
                  "build and init (first: the optimizer check reads it; again: its verdict "
                  "cached)")
  for r in results:
    table.add(r.model, r.leaves, r.mode, r.optimizer,
              *map(h.fmt_s, (r.first_build_s, r.first_init_s, r.first_s, r.again_build_s,
                             r.again_init_s, r.again_s)), f"{1e3 * r.first_s / r.leaves:.3g}",
              **dataclasses.asdict(r), first_s=r.first_s, again_s=r.again_s)
  report.table(table)
  report.text(f"JAX's own start (a tiny model's build and init, first in the process, in "
              f"{', '.join(modes)}): {warmup_s:.2f} s, not counted above.")
  report.text("\n".join(goals(results, modes)))
