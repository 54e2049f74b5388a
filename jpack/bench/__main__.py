"""``python -m jpack.bench <name> [options]``: run benchmark module ``jpack.bench.<name>``.

``python -m jpack.bench all [--quick] [--markdown-dir DIR]`` runs pack, collectives and (if
importable) step, each in a fresh process: a benchmark that needs 8 CPU devices must set
``jax_num_cpu_devices`` before JAX's backend starts, which one shared process cannot do.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import time

from jpack.bench import BENCHMARKS

USAGE = """usage: python -m jpack.bench <name> [options]     (python -m jpack.bench <name> --help)
       python -m jpack.bench all [--quick] [--markdown-dir DIR]

benchmarks: {names}"""


def _available() -> list[str]:
  return [n for n in BENCHMARKS if importlib.util.find_spec(f"jpack.bench.{n}") is not None]


def _run_all(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="python -m jpack.bench all")
  parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
  parser.add_argument("--markdown-dir", metavar="DIR",
                      help="write DIR/<name>.md for every benchmark")
  args = parser.parse_args(argv)
  status = 0
  summary = []
  for name in BENCHMARKS:
    if importlib.util.find_spec(f"jpack.bench.{name}") is None:
      print(f"\n### {name}: not available (no module jpack.bench.{name}), skipped", flush=True)
      summary.append((name, "skipped", 0.0))
      continue
    cmd = [sys.executable, "-m", "jpack.bench", name]
    if args.quick:
      cmd.append("--quick")
    if args.markdown_dir:
      os.makedirs(args.markdown_dir, exist_ok=True)
      cmd += ["--markdown", os.path.join(args.markdown_dir, f"{name}.md")]
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
  if not argv or argv[0] in ("-h", "--help", "help", "list"):
    print(USAGE.format(names=", ".join(_available() + ["all"])))
    return 0 if argv else 2
  name, rest = argv[0], argv[1:]
  if name == "all":
    return _run_all(rest)
  if not name.isidentifier() or name.startswith("_"):
    print(f"Unknown benchmark {name!r}.\n" + USAGE.format(names=", ".join(_available())))
    return 2
  if importlib.util.find_spec(f"jpack.bench.{name}") is None:
    print(f"Unknown benchmark {name!r} (no module jpack.bench.{name}).\n"
          + USAGE.format(names=", ".join(_available() + ["all"])))
    return 2
  module = importlib.import_module(f"jpack.bench.{name}")
  if not hasattr(module, "main"):
    print(f"jpack.bench.{name} has no main(argv) function.")
    return 2
  return int(module.main(rest) or 0)


if __name__ == "__main__":
  raise SystemExit(main())
