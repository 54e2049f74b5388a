"""Step time with an Orbax checkpoint every 10 steps against none, on 8 CPU devices.

The step benchmark's main model (MLP 40x256, adam) in each mode, the same loop of
steps run three ways (`VARIANTS`): no saves; ``jpack.checkpoint.save`` after every step
with a ``CheckpointManager`` saving every 10th asynchronously (Orbax's default: the
files are written while the next steps run); the same synchronously. "step ms" is the
loop's time over its steps, the wait for the last asynchronous write shown apart; "vs no
saves" the median over rounds of the loop's time over the no-save loop's in the same
round; "save call ms" how long a saving call holds the loop up once the steps queued
before it are done.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import statistics
import tempfile
from typing import Any

import jax
import optax

import jpack
from benchmarks import harness as h

TITLE = "jpack checkpoint benchmark"
DEVICES = 8
MERGE_KEY = "mode"
EVERY = 10
MODELS = {"mlp_40x256": (40, 256)}
VARIANTS = {"packed": "jpack packed", "sharded": "jpack sharded"}  # the modes
LOOPS = {"none": "no saves", "async": f"async save every {EVERY}",
         "sync": f"sync save every {EVERY}"}
DEFAULTS = dict(steps=100, rounds=5)
QUICK = dict(steps=40, rounds=3)


@dataclasses.dataclass(frozen=True)
class EveryFrom:
  """An Orbax save decision policy: save at step ``start`` and every `EVERY` steps after
  it. The step benchmark saves on the first step of each round with it, so that the
  write runs beside the round's next steps, as it would in a training loop."""
  start: int

  def should_save(self, step: Any, previous_steps: Any = (), *, context: Any = None) -> bool:
    del previous_steps, context
    return step.step >= self.start and (step.step - self.start) % EVERY == 0


def make_manager(directory: pathlib.Path, *, asynchronous: bool = True,
                 policy: Any = None) -> Any:
  """An Orbax ``CheckpointManager`` saving every `EVERY` steps (or by ``policy``),
  keeping the latest two checkpoints."""
  import orbax.checkpoint as ocp

  return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      save_decision_policy=policy or ocp.checkpoint_managers.FixedIntervalPolicy(EVERY),
      preservation_policy=ocp.checkpoint_managers.LatestN(2),
      enable_async_checkpointing=asynchronous))


def run_steps(step_fn: Any, state: Any, batch: Any, start: int, steps: int,
              manager: Any = None) -> tuple[Any, Any, list[float]]:
  """``steps`` calls of ``step_fn(state, batch)`` from step count ``start``, with
  ``jpack.checkpoint.save`` after every step that ``manager``'s policy saves.

  Returns the state, the last metrics, and how long each saving call held the loop up:
  the steps queued before it are waited for outside its time (a save copies the values,
  so it waits for them). Nothing waits for the last steps or the writes."""
  calls, metrics = [], None
  for step in range(start, start + steps):
    state, metrics = step_fn(state, batch)
    if manager is not None and manager.should_save(step + 1):
      jax.block_until_ready(state)
      ok, seconds = h.timed(lambda: jpack.checkpoint.save(manager, step + 1, state))
      assert ok
      calls.append(seconds)
  return state, metrics, calls


def checkpoint_bytes(manager: Any) -> int:
  """The size on disk of ``manager``'s latest checkpoint (0: none)."""
  step = manager.latest_step()
  if step is None:
    return 0
  latest = pathlib.Path(manager.directory) / str(step)
  return sum(p.stat().st_size for p in latest.rglob("*") if p.is_file())


@dataclasses.dataclass
class Loop:
  """The running state of one way of looping, and what its rounds took."""
  dp: Any
  state: Any
  batch: Any
  kind: str
  root: pathlib.Path
  calls: list[float] = dataclasses.field(default_factory=list)
  waits: list[float] = dataclasses.field(default_factory=list)
  bytes: int = 0
  manager: Any = None

  def __call__(self, steps: int) -> Any:
    if self.kind != "none":
      self.manager = make_manager(self.root / f"{self.kind}-{len(self.waits)}",
                                  asynchronous=self.kind == "async")
    self.state, metrics, calls = run_steps(self.dp.step, self.state, self.batch,
                                           int(self.state.step), steps, self.manager)
    self.calls += calls
    return metrics["loss"]

  def finish(self) -> None:
    """After a timed loop: wait for its writes (shown apart), then drop them."""
    if self.manager is not None:
      _, wait = h.timed(self.manager.wait_until_finished)
      self.waits.append(wait)
      self.bytes = checkpoint_bytes(self.manager)
      self.manager.close()
      shutil.rmtree(self.manager.directory, ignore_errors=True)
      self.manager = None


def bench_mode(mode: str, steps: int, rounds: int, root: pathlib.Path) -> tuple[dict, dict]:
  from benchmarks.step import PER_DEVICE_BATCH, mlp

  model = mlp(*MODELS["mlp_40x256"])
  dp = jpack.data_parallel(model.loss, optax.adam(1e-3), model.params, mode=mode)
  batch = jax.device_put(model.batch(PER_DEVICE_BATCH * DEVICES),
                         jax.sharding.NamedSharding(h.mesh(DEVICES), jax.P(h.AXIS)))
  state = dp.init(model.params)
  # Compile the step and warm up a save (Orbax starts its threads on the first one).
  warm = Loop(dp, state, batch, "async", root / f"{mode}-warm-up")
  warm(EVERY)
  warm.finish()
  loops = {k: Loop(dp, None, batch, k, root / f"{mode}-{k}") for k in LOOPS}

  def call(kind: str) -> Any:
    loop = loops[kind]
    loop.state = warm.state  # the loops take turns on one state: donated, passed on
    out = loop(steps)
    warm.state = loop.state
    return out

  timings = h.time_rounds({k: lambda k=k: call(k) for k in LOOPS}, rounds, warmup=0,
                          after=lambda k: loops[k].finish())
  return timings, loops


def run(opts: Any, report: h.Report) -> None:
  if opts.steps % EVERY:
    raise SystemExit(f"--steps must be a multiple of {EVERY} (a save every {EVERY} steps)")
  depth, width = MODELS["mlp_40x256"]
  table = h.Table(["variant", "step ms", "vs no saves", "save call ms", "wait at end ms",
                   "checkpoint MiB"],
                  title=f"MLP {depth}x{width} (160 leaves, 2.65 M params), adam, "
                        f"{DEVICES} devices, {opts.steps} steps per loop")
  with tempfile.TemporaryDirectory(prefix="jpack-checkpoint-bench-") as tmp:
    for mode in opts.variants or VARIANTS:
      timings, loops = bench_mode(mode, opts.steps, opts.rounds, pathlib.Path(tmp))
      for kind, loop in loops.items():
        t = timings[kind]
        ratio = t.over(timings["none"])
        call_s = statistics.median(loop.calls) if loop.calls else None
        wait_s = statistics.median(loop.waits) if loop.waits else None
        table.add(f"jpack {mode}, {LOOPS[kind]}", h.fmt_ms(t.median_s / opts.steps),
                  h.fmt_ratio(ratio), h.fmt_ms(call_s), h.fmt_ms(wait_s),
                  f"{loop.bytes / 2**20:.1f}" if loop.bytes else "-",
                  key=f"{mode}_{kind}", mode=mode, variant=kind,
                  step_s=t.median_s / opts.steps, vs_no_saves=ratio, save_call_s=call_s,
                  wait_s=wait_s, checkpoint_bytes=loop.bytes, loop_s=list(t.samples),
                  saves_per_loop=opts.steps // EVERY)
      h.release_host_memory()
  report.table(table)
  report.text("step ms: the loop's wall time over its steps, median of rounds. vs no "
              "saves: over the no-save loop's in the same round (median). save call ms: "
              "how long one saving call of jpack.checkpoint.save blocks the loop once the "
              "queued steps are done. wait at end: manager.wait_until_finished().")
