"""Step time with an Orbax checkpoint every 10 steps (asynchronous or not) against none:
MLP 40x256, adam, 8 CPU devices, each mode of `VARIANTS`, loops interleaved in rounds.
"""

import dataclasses
import functools
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
  """An Orbax save decision policy: save at step ``start`` and every `EVERY` after."""
  start: int

  def should_save(self, step: Any, previous_steps: Any = (), *, context: Any = None) -> bool:
    del previous_steps, context
    return step.step >= self.start and (step.step - self.start) % EVERY == 0


def make_manager(directory: pathlib.Path, *, asynchronous: bool = True,
                 policy: Any = None) -> Any:
  """An Orbax ``CheckpointManager`` saving every `EVERY` steps (or by ``policy``)."""
  import orbax.checkpoint as ocp

  return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      save_decision_policy=policy or ocp.checkpoint_managers.FixedIntervalPolicy(EVERY),
      preservation_policy=ocp.checkpoint_managers.LatestN(2),
      enable_async_checkpointing=asynchronous))


def checkpoint_bytes(manager: Any) -> int:
  """The size on disk of ``manager``'s latest checkpoint (0: none)."""
  latest = pathlib.Path(manager.directory) / str(manager.latest_step())
  return sum(p.stat().st_size for p in latest.rglob("*") if p.is_file())


@dataclasses.dataclass
class Saves:
  """Steps saved by an Orbax ``manager`` (none without one), and what saving took: each
  saving call, each wait for the writes at the end of a loop, the last checkpoint's size."""
  manager: Any = None
  calls: list[float] = dataclasses.field(default_factory=list)
  waits: list[float] = dataclasses.field(default_factory=list)
  bytes: int = 0

  def run(self, step_fn: Any, state: Any, batch: Any, steps: int) -> tuple[Any, Any]:
    """``steps`` steps from the state's count, saving where the manager does: the state
    and the last metrics. A saving call is timed once the queued steps are done."""
    metrics, start = None, int(state.step)
    for step in range(start + 1, start + steps + 1):
      state, metrics = step_fn(state, batch)
      if self.manager is not None and self.manager.should_save(step):
        jax.block_until_ready(state)
        ok, seconds = h.timed(lambda: jpack.checkpoint.save(self.manager, step, state))
        assert ok
        self.calls.append(seconds)
    return state, metrics

  def wait(self, state: Any = None) -> None:
    """Wait for ``state`` and the manager's writes under way, timed."""
    _, seconds = h.timed(lambda: (jax.block_until_ready(state),
                                  self.manager.wait_until_finished()))
    self.waits.append(seconds)

  def close(self) -> None:
    """Keep the last checkpoint's size; close the manager, delete its folder."""
    self.bytes = checkpoint_bytes(self.manager)
    self.manager.close()
    shutil.rmtree(self.manager.directory, ignore_errors=True)
    self.manager = None

  def medians(self) -> tuple[float | None, float | None]:
    """The median saving call and wait (None where there were none)."""
    return tuple(statistics.median(x) if x else None for x in (self.calls, self.waits))


def bench_mode(mode: str, steps: int, rounds: int, root: pathlib.Path
               ) -> tuple[dict[str, h.Timing], dict[str, Saves]]:
  from benchmarks.step import PER_DEVICE_BATCH, mlp

  model = mlp(*MODELS["mlp_40x256"])
  dp = jpack.data_parallel(model.loss, optax.adam(1e-3), model.params, mode=mode)
  batch = jax.device_put(model.batch(PER_DEVICE_BATCH * DEVICES),
                         jax.sharding.NamedSharding(h.mesh(DEVICES), jax.P(h.AXIS)))
  box = [dp.init(model.params)]  # the loops take turns on one state: donated, passed on
  saves = {k: Saves() for k in ("warm-up", *LOOPS)}

  def loop(kind: str, n: int) -> Any:
    s = saves[kind]
    if kind != "none":  # a manager a round: `finish` waits for its writes, then closes it
      s.manager = make_manager(root / f"{mode}-{kind}" / str(len(s.waits)),
                               asynchronous=kind != "sync")
    box[0], metrics = s.run(dp.step, box[0], batch, n)
    return metrics["loss"]

  def finish(kind: str) -> None:
    if saves[kind].manager is not None:
      saves[kind].wait()
      saves[kind].close()

  loop("warm-up", EVERY)  # compiles the step and warms up a save (Orbax starts its threads)
  finish("warm-up")
  timings = h.time_rounds({k: functools.partial(loop, k, steps) for k in LOOPS}, rounds,
                          warmup=0, after=finish)
  return timings, {k: saves[k] for k in LOOPS}


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
        call_s, wait_s = loop.medians()
        table.add(f"jpack {mode}, {LOOPS[kind]}", h.fmt_ms(t.median_s / opts.steps),
                  h.fmt_ratio(ratio), h.fmt_ms(call_s), h.fmt_ms(wait_s),
                  f"{loop.bytes / 2**20:.1f}" if loop.bytes else "-",
                  key=f"{mode}_{kind}", mode=mode, variant=kind,
                  step_s=t.median_s / opts.steps, vs_no_saves=ratio, save_call_s=call_s,
                  wait_s=wait_s, checkpoint_bytes=loop.bytes, loop_s=list(t.samples),
                  saves_per_loop=opts.steps // EVERY)
      h.release_host_memory()
  report.table(table)
  report.text("Columns: docs/performance.md#checkpoints.")
