"""``python -m benchmarks <name> [options]``: run benchmark module ``benchmarks.<name>``.

``python -m benchmarks all [--quick] [--markdown-dir DIR] [--json-dir DIR]`` runs every
benchmark, each in a fresh process: a benchmark that needs 8 CPU devices must set
``jax_num_cpu_devices`` before JAX's backend starts, which one shared process cannot do.
Run from the repository root (``benchmarks`` is not installed with jpack).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import time

from benchmarks import BENCHMARKS

USAGE = """usage: python -m benchmarks <name> [options]     (python -m benchmarks <name> --help)
       python -m benchmarks all [--quick] [--markdown-dir DIR] [--json-dir DIR]

benchmarks: {names}"""


def _exists(name: str) -> bool:
  return importlib.util.find_spec(f"benchmarks.{name}") is not None


def _available() -> list[str]:
  return [n for n in BENCHMARKS if _exists(n)]


def _run_all(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks all")
  parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
  parser.add_argument("--markdown-dir", metavar="DIR",
                      help="write DIR/<name>.md for every benchmark")
  parser.add_argument("--json-dir", metavar="DIR",
                      help="write DIR/<name>.json for every benchmark (default: each "
                           "benchmark's own default, benchmarks/results/<name>.json)")
  args = parser.parse_args(argv)
  status = 0
  summary = []
  for name in BENCHMARKS:
    if not _exists(name):
      print(f"\n### {name}: not available (no module benchmarks.{name}), skipped", flush=True)
      summary.append((name, "skipped", 0.0))
      continue
    cmd = [sys.executable, "-m", "benchmarks", name]
    if args.quick:
      cmd.append("--quick")
    for flag, folder, ext in (("--markdown", args.markdown_dir, "md"),
                              ("--json", args.json_dir, "json")):
      if folder:
        os.makedirs(folder, exist_ok=True)
        cmd += [flag, os.path.join(folder, f"{name}.{ext}")]
    print(f"\n### {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    summary.append((name, "ok" if rc == 0 else f"exit {rc}", time.perf_counter() - t0))
    status = status or rc
  print("\n### summary")
  for name, result, seconds in summary:
    print(f"  {name:<12} {result:<8} {seconds:7.1f} s")
  return status


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  names = ", ".join(_available() + ["all"])
  if not argv or argv[0] in ("-h", "--help", "help", "list"):
    print(USAGE.format(names=names))
    return 0 if argv else 2
  name, rest = argv[0], argv[1:]
  if name == "all":
    return _run_all(rest)
  if name not in BENCHMARKS or not _exists(name):
    print(f"Unknown benchmark {name!r}.\n" + USAGE.format(names=names))
    return 2
  return int(importlib.import_module(f"benchmarks.{name}").main(rest) or 0)


if __name__ == "__main__":
  raise SystemExit(main())
