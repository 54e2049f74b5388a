"""Step time with an Orbax checkpoint every 10 steps (asynchronous or not) against none:
MLP 40x256, adam, 8 CPU devices, each mode of `VARIANTS`, loops interleaved in rounds.
"""

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


def run_steps(step_fn: Any, state: Any, batch: Any, start: int, steps: int,
              manager: Any = None) -> tuple[Any, Any, list[float]]:
  """``steps`` steps from ``start``, saving where ``manager`` does: the state, the last
  metrics, and each saving call's time (the queued steps waited for outside it)."""
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
  latest = pathlib.Path(manager.directory) / str(manager.latest_step())
  return sum(p.stat().st_size for p in latest.rglob("*") if p.is_file())


@dataclasses.dataclass
class Loop:  # one way of looping, and what its rounds took
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
  # Compile the step and warm up a save (Orbax starts its threads).
  warm = Loop(dp, state, batch, "async", root / f"{mode}-warm-up")
  warm(EVERY)
  warm.finish()
  loops = {k: Loop(dp, None, batch, k, root / f"{mode}-{k}") for k in LOOPS}

  def call(kind: str) -> Any:
    loops[kind].state = warm.state  # the loops take turns on one state: donated, passed on
    out = loops[kind](steps)
    warm.state = loops[kind].state
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
  report.text("Columns: docs/performance.md#checkpoints.")
