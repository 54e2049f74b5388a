"""A training script killed with SIGKILL and restarted ends bit-identical to one never
interrupted.

The script is docs/examples/train_resume.py (the how-to's): the digits MLP with dropout,
trained by `jpack.data_parallel` on 8 simulated CPU devices, saving every 10 steps with
Orbax (asynchronously) and resuming from the last finished checkpoint. Its batches and
dropout keys are functions of the step, so a resumed run must compute exactly what the
uninterrupted one did. Each run is a subprocess: one runs to the end; another is killed
mid-run, restarted and killed again while a save is in flight (held open by the script's
test hook, so the kill always lands inside it), then restarted to the end.
"""

import os
import pathlib
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "examples" / "train_resume.py"
STEPS, EVERY = 40, 10
DEADLINE = 150  # seconds for one run; each takes a few seconds alone


def _command(mode: str, directory: pathlib.Path, *extra: str) -> list[str]:
  return [sys.executable, str(SCRIPT), "--mode", mode, "--steps", str(STEPS),
          "--save-every", str(EVERY), "--dir", str(directory), "--log-every", "1", *extra]


def _env() -> dict:
  return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _run_to_end(command: list[str], log: pathlib.Path) -> list[str]:
  with open(log, "w") as err:
    result = subprocess.run(command, env=_env(), stdout=subprocess.PIPE, stderr=err,
                            text=True, timeout=DEADLINE)
  assert result.returncode == 0, f"{command} failed:\n{log.read_text()[-4000:]}"
  return result.stdout.splitlines()


def _kill_at(command: list[str], marker: str, log: pathlib.Path) -> list[str]:
  """Start ``command``, read its output line by line and SIGKILL it on the first line
  that contains ``marker``; returns the lines it printed, up to that one.

  "Contains", not "starts with": the save hook prints from Orbax's thread, so its line
  can land inside one the training loop is printing. A run that never prints the marker
  is killed after ``DEADLINE`` seconds, so the test fails with its log instead of hanging.
  """
  lines = []
  with open(log, "w") as err:
    proc = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=err,
                            text=True, bufsize=1)
    deadline = threading.Timer(DEADLINE, proc.kill)
    deadline.start()
    try:
      for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if marker in line:
          proc.send_signal(signal.SIGKILL)
          break
    finally:
      deadline.cancel()
      proc.kill()  # if it ended before the marker, or the test was interrupted
      proc.wait(timeout=60)
      proc.stdout.close()
  assert lines and marker in lines[-1], (
      f"{command} ended before printing {marker!r}:\n" + "\n".join(lines)
      + "\n" + log.read_text()[-4000:])
  assert proc.returncode == -signal.SIGKILL
  return lines


def _resumed_from(lines: list[str]) -> int:
  return int(next(line for line in lines if " from step " in line).split()[-1])


def _finished(directory: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _assert_bit_identical(got_path: pathlib.Path, want_path: pathlib.Path) -> None:
  got, want = np.load(got_path), np.load(want_path)
  assert sorted(got.files) == sorted(want.files)
  assert any("opt_state" in k for k in want.files) and any("params" in k for k in want.files)
  for name in want.files:
    a, b = got[name], want[name]
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert a.tobytes() == b.tobytes(), f"{name} differs after the resumed run"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["packed", "sharded", "fsdp"])
def test_killed_and_resumed_run_is_bit_identical(mode, tmp_path):
  reference = tmp_path / "reference.npz"
  lines = _run_to_end(_command(mode, tmp_path / "uninterrupted", "--out", str(reference)),
                      tmp_path / "uninterrupted.log")
  assert lines[-1] == f"done at step {STEPS}"

  directory = tmp_path / "ckpt"
  # Killed mid-run, between two saves.
  first = _kill_at(_command(mode, directory), "step 15 ", tmp_path / "first.log")
  assert _resumed_from(first) == 0
  # Restarted (from step 10, unless the kill came before that save finished), then killed
  # while the save of step 30 is written but not finalized.
  second = _kill_at(_command(mode, directory, "--hold-save", "30"),
                    "save of step 30 in flight", tmp_path / "second.log")
  assert _resumed_from(second) in (0, 10)
  assert _finished(directory) == [10, 20]
  assert any(p.name.startswith("30.orbax-checkpoint-tmp") for p in directory.iterdir())
  # Restarted to the end: from the last finished save, step 20.
  final = tmp_path / "final.npz"
  third = _run_to_end(_command(mode, directory, "--out", str(final)), tmp_path / "third.log")
  assert _resumed_from(third) == 20 and third[-1] == f"done at step {STEPS}"
  assert _finished(directory) == [20, 30, 40]  # the last 3 kept; no unfinished left
  assert not any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir())
  _assert_bit_identical(final, reference)
