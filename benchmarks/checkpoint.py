"""Step time with a checkpoint every 10 steps against no checkpoints, on 8 CPU devices.

The step benchmark's main model (MLP 40x256, 160 leaves, 2.65 M params, adam), trained
by ``jpack.data_parallel`` in the packed and the sharded (ZeRO-1) mode. Per mode, the
same loop of steps runs three ways:

  no saves   ``dp.step`` only
  async      ``jpack.checkpoint.save`` after every step, an Orbax
             ``CheckpointManager`` saving every 10th (asynchronous, Orbax's default):
             the state is copied to the host, the files are written in the background
             while the next steps run
  sync       the same with ``enable_async_checkpointing=False``: the loop waits for the
             files

"step ms" is the loop's wall time over its steps (the wait for the last async save is
left out and shown apart); "vs no saves" is the median over rounds of the loop's time
over the no-save loop's in the same round; "save call ms" the median time one saving
call blocks the loop once the steps queued before it are done (the host copy and
Orbax's synchronous part; with "sync", the whole write). The variants run interleaved,
round by round, each into a fresh checkpoint directory. On CPU devices the background
write shares the cores with the steps; with an accelerator it runs beside them.

    python -m benchmarks checkpoint             # 100 steps x 5 rounds
    python -m benchmarks checkpoint --quick     # 40 steps x 3 rounds
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

DEVICES = 8
EVERY = 10
MODEL = (40, 256)  # the step benchmark's main model: MLP 40x256
MODES = ("packed", "sharded")
VARIANTS = ("none", "async", "sync")
LABELS = {"none": "no saves", "async": f"async save every {EVERY}",
          "sync": f"sync save every {EVERY}"}
DEFAULT_STEPS, DEFAULT_ROUNDS = 100, 5
QUICK_STEPS, QUICK_ROUNDS = 40, 3


@dataclasses.dataclass
class Loop:
  """One timed loop of one variant."""
  seconds: float
  save_calls: list[float]  # how long each call that started a save blocked the loop
  wait_s: float            # wait_until_finished after the loop (async: the last write)
  bytes: int               # the size of the last checkpoint on disk (0: none)


@dataclasses.dataclass(frozen=True)
class EveryFrom:
  """An Orbax save decision policy: save at step ``start`` and every `EVERY` steps after
  it (``FixedIntervalPolicy(EVERY)`` saves at the multiples of `EVERY`). The step
  benchmark saves on the first step of each timed block with it, so that the write runs
  beside the block's next steps, as it would beside the next steps of a training loop."""
  start: int

  def should_save(self, step: Any, previous_steps: Any = (), *, context: Any = None) -> bool:
    del previous_steps, context
    return step.step >= self.start and (step.step - self.start) % EVERY == 0


def make_manager(directory: pathlib.Path, *, asynchronous: bool = True,
                 policy: Any = None) -> Any:
  """An Orbax ``CheckpointManager`` saving every `EVERY` steps (or by ``policy``), keeping
  the latest two checkpoints."""
  import orbax.checkpoint as ocp

  options = ocp.CheckpointManagerOptions(
      save_decision_policy=policy or ocp.checkpoint_managers.FixedIntervalPolicy(EVERY),
      preservation_policy=ocp.checkpoint_managers.LatestN(2),
      enable_async_checkpointing=asynchronous)
  return ocp.CheckpointManager(directory, options=options)


def run_steps(step_fn: Any, state: Any, batch: Any, start: int, steps: int,
              manager: Any = None) -> tuple[Any, Any, list[float]]:
  """``steps`` calls of ``step_fn(state, batch)`` from step count ``start``; with a
  ``manager``, ``jpack.checkpoint.save`` after every step its policy saves.

  Returns the state, the last step's metrics, and how long each call that saved blocked
  the loop. A save copies the values: it waits for the steps still queued. That wait is
  the loop's (in its time), not the call's: the steps are waited for before the call is
  timed. Nothing waits for the last steps or for the writes: the caller decides."""
  import jax

  import jpack

  calls = []
  metrics = None
  for step in range(start, start + steps):
    state, metrics = step_fn(state, batch)
    if manager is not None and manager.should_save(step + 1):
      jax.block_until_ready(state)
      t = time.perf_counter()
      assert jpack.checkpoint.save(manager, step + 1, state)
      calls.append(time.perf_counter() - t)
  return state, metrics, calls


def checkpoint_bytes(manager: Any) -> int:
  """The size on disk of ``manager``'s latest checkpoint (0: none)."""
  step = manager.latest_step()
  if step is None:
    return 0
  latest = pathlib.Path(manager.directory) / str(step)
  return sum(p.stat().st_size for p in latest.rglob("*") if p.is_file())


def _run_loop(dp: Any, state: Any, batch: Any, steps: int, variant: str,
              directory: pathlib.Path) -> tuple[Any, Loop]:
  import jax

  manager = (None if variant == "none"
             else make_manager(directory, asynchronous=variant == "async"))
  t0 = time.perf_counter()
  state, metrics, calls = run_steps(dp.step, state, batch, int(state.step), steps, manager)
  jax.block_until_ready(metrics["loss"])
  seconds = time.perf_counter() - t0
  t = time.perf_counter()
  size = 0
  if manager is not None:
    manager.wait_until_finished()
    size = checkpoint_bytes(manager)
    manager.close()
  return state, Loop(seconds, calls, time.perf_counter() - t, size)


def bench_mode(mode: str, steps: int, rounds: int, root: pathlib.Path) -> dict[str, list[Loop]]:
  """``rounds`` interleaved rounds of every variant in ``mode``."""
  import jax
  import optax

  import jpack
  from benchmarks.step import PER_DEVICE_BATCH, mlp

  model = mlp(*MODEL)
  dp = jpack.data_parallel(model.loss, optax.adam(1e-3), model.params, mode=mode)
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices(), ("batch",)),
                                        jax.P("batch"))
  batch = jax.device_put(model.batch(PER_DEVICE_BATCH * DEVICES), sharding)
  state = dp.init(model.params)
  # Compile the step and warm up a save (Orbax starts its threads on the first one).
  state, _ = _run_loop(dp, state, batch, EVERY, "async", root / f"{mode}-warm-up")
  shutil.rmtree(root / f"{mode}-warm-up", ignore_errors=True)
  loops: dict[str, list[Loop]] = {v: [] for v in VARIANTS}
  for r in range(rounds):
    # Each round starts one variant later: the one after a save loop meets its writes'
    # aftermath (page cache, freed buffers) in turn.
    for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
      directory = root / f"{mode}-{variant}-{r}"
      state, loop = _run_loop(dp, state, batch, steps, variant, directory)
      loops[variant].append(loop)
      shutil.rmtree(directory, ignore_errors=True)
      print(f"  {mode} {variant:<5} round {r + 1}: {1e3 * loop.seconds / steps:.1f} ms/step",
            flush=True)
  return loops


def _table(results: dict[str, dict[str, list[Loop]]], steps: int) -> Any:
  from benchmarks import _common as c

  depth, width = MODEL
  table = c.Table(["variant", "step ms", "vs no saves", "save call ms", "wait at end ms",
                   "checkpoint MiB"],
                  title=f"MLP {depth}x{width} (160 leaves, 2.65 M params), adam, "
                        f"{DEVICES} devices, {steps} steps per loop")
  for mode, loops in results.items():
    base = [x.seconds for x in loops["none"]]
    for variant in VARIANTS:
      runs = loops[variant]
      step_s = statistics.median(x.seconds for x in runs) / steps
      ratio = statistics.median(x.seconds / b for x, b in zip(runs, base))
      calls = [t for x in runs for t in x.save_calls]
      call_s = statistics.median(calls) if calls else None
      wait_s = statistics.median(x.wait_s for x in runs) if variant != "none" else None
      size = runs[-1].bytes
      table.add(f"jpack {mode}, {LABELS[variant]}", c.fmt_ms(step_s), c.fmt_ratio(ratio),
                c.fmt_ms(call_s), c.fmt_ms(wait_s),
                f"{size / 2**20:.1f}" if size else "-",
                key=f"{mode}_{variant}", mode=mode, variant=variant, step_s=step_s,
                vs_no_saves=ratio, save_call_s=call_s, wait_s=wait_s, checkpoint_bytes=size,
                loop_s=[x.seconds for x in runs], saves_per_loop=steps // EVERY)
  return table


def _parser() -> argparse.ArgumentParser:
  from benchmarks import _common as c

  parser = argparse.ArgumentParser(prog="python -m benchmarks checkpoint", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=c.positive_int, default=None,
                      help=f"steps per loop, a multiple of {EVERY} (default {DEFAULT_STEPS})")
  parser.add_argument("--rounds", type=c.positive_int, default=None,
                      help=f"interleaved rounds (median; default {DEFAULT_ROUNDS})")
  parser.add_argument("--modes", default=",".join(MODES),
                      help=f"comma-separated data_parallel modes (default {','.join(MODES)})")
  parser.add_argument("--quick", action="store_true",
                      help=f"--steps {QUICK_STEPS} --rounds {QUICK_ROUNDS} unless given")
  c.add_output_args(parser, "checkpoint")
  return parser


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = _parser()
  args = parser.parse_args(argv)
  steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
  rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
  modes = [m for m in args.modes.split(",") if m]
  if steps % EVERY:
    parser.error(f"--steps must be a multiple of {EVERY} (a save every {EVERY} steps), "
                 f"got {steps}")
  unknown = sorted(set(modes) - {"packed", "sharded", "allreduce"})
  if unknown or not modes:
    parser.error(f"--modes: unknown modes {unknown}; choose from packed, sharded, allreduce")

  from benchmarks import _common as c
  c.set_cpu_devices(DEVICES)
  c.require_devices(DEVICES)
  c.banner("benchmarks.checkpoint", [
      f"MLP {MODEL[0]}x{MODEL[1]}, modes {', '.join(modes)}; {steps} steps per loop, "
      f"{rounds} rounds; Orbax CheckpointManager saving every {EVERY} steps"])
  results = {}
  with tempfile.TemporaryDirectory(prefix="jpack-checkpoint-bench-") as tmp:
    for mode in modes:
      results[mode] = bench_mode(mode, steps, rounds, pathlib.Path(tmp))
      c.release_host_memory()
  report = c.Report("jpack checkpoint benchmark", "checkpoint", argv)
  report.table(_table(results, steps))
  report.text(
      "step ms: the loop's wall time over its steps, median of rounds. vs no saves: the "
      "loop's time over the no-save loop's in the same round (median). save call ms: "
      "how long one call of jpack.checkpoint.save that saves blocks the loop once "
      "the queued steps are done (host copy and Orbax's synchronous part; sync: the whole "
      "write). wait at end: manager.wait_until_finished() after the loop.")
  report.write(args)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
