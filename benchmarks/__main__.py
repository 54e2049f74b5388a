"""``python -m benchmarks <name> [options]``: the one command line of the benchmarks.

Each benchmark is a module ``benchmarks.<name>`` of data (its models and variants) and a
``run(opts, report)``; this checks the options against that data, sets up the devices,
and writes ``benchmarks/results/<name>.json``, from which ``render`` fills the docs.
"""

import argparse
import importlib
import json
import os
import pathlib
import sys
from typing import Any

from benchmarks import BENCHMARKS, render  # render imports no JAX


def _positive(kind: type, most: float = float("inf")) -> Any:
  """An argparse type: ``kind(text)`` in (0, ``most``]."""
  def parse(text: str) -> Any:
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value <= most:
      bound = ">= 1" if kind is int else "> 0" if most == float("inf") else f"in (0, {most:g}]"
      raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
    return value
  return parse


def _names(text: str) -> list[str]:
  return [n for n in text.split(",") if n and n != "none"]


def _output(text: str) -> str:
  """A file path whose folder exists (checked before a long run fails at its end)."""
  path = pathlib.Path(text)
  if path.is_dir() or not path.parent.is_dir():
    raise argparse.ArgumentTypeError(f"{text!r}: not a file in a folder that exists "
                                     f"(folder {str(path.parent)!r} does not exist)")
  return text


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
      epilog="names are comma-separated; each benchmark's models and variants: --list")
  p.add_argument("name", choices=[*BENCHMARKS, "render"], metavar="NAME",
                 help=f"one of {', '.join(BENCHMARKS)}; render")
  p.add_argument("--list", action="store_true", help="list the models and variants")
  p.add_argument("--models", "--workloads", type=_names, help="models or workloads")
  p.add_argument("--variants", "--modes", type=_names, help="variants (or modes)")
  p.add_argument("--quick", action="store_true", help="small sizes, few rounds")
  p.add_argument("--rounds", "--blocks", "--runs", type=_positive(int),
                 help="timed rounds (median)")
  p.add_argument("--steps", type=_positive(int), help="calls per timed round")
  p.add_argument("--devices", type=_positive(int), help="devices on the data-parallel axis")
  p.add_argument("--batch", type=_positive(int), help="rows per device")
  p.add_argument("--scale", type=_positive(float, most=1),
                 help="optimizer: every leaf's largest dimension times this, in (0, 1]")
  p.add_argument("--max-leaves", type=_positive(int), help="leaves kept per workload")
  p.add_argument("--max-elements", type=_positive(int), help="elements kept per workload")
  p.add_argument("--baseline", metavar="REV", default="HEAD~1",
                 help="compare: the git revision whose jpack/ is the baseline")
  p.add_argument("--model", metavar="MODULE:FUNCTION",
                 help="gpu_compile: your model, FUNCTION() -> (params, loss_fn, batch)")
  p.add_argument("--json", metavar="PATH", type=_output,
                 help="the results file (default benchmarks/results/NAME.json)")
  p.add_argument("--markdown", metavar="PATH", type=_output, help="also write Markdown")
  p.add_argument("--update", action="store_true",
                 help="keep the results of the --json file that this run does not measure")
  p.add_argument("--check", action="store_true",
                 help="render: change nothing, exit 1 if a page is out of date")
  return p


def _check(p: argparse.ArgumentParser, module: Any, opts: argparse.Namespace) -> None:
  """Refuse unknown names and impossible options before anything runs."""
  for flag, chosen, known in (("--models", opts.models, module.MODELS),
                              ("--variants", opts.variants, module.VARIANTS)):
    unknown = [n for n in chosen or () if n not in known
               and not (n.startswith("small_") and "small_N" in known and n[6:].isdigit())]
    if unknown:
      p.error(f"{flag}: unknown {', '.join(map(repr, unknown))}; choose from "
              f"{', '.join(known)}")
  if error := getattr(module, "check", lambda opts: None)(opts):
    p.error(error)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  p = parser()
  opts = p.parse_args(argv)
  if opts.name == "render":
    return render.main(check=opts.check)
  os.environ.update(BENCHMARKS[opts.name])  # before JAX's backend starts
  module = importlib.import_module(f"benchmarks.{opts.name}")
  if opts.list:
    print(f"models: {', '.join(module.MODELS)}\nvariants: {', '.join(module.VARIANTS)}")
    return 0
  _check(p, module, opts)
  import jax

  from benchmarks import harness
  devices = opts.devices = opts.devices or getattr(module, "DEVICES", None)
  if devices:
    jax.config.update("jax_num_cpu_devices", devices)
  if devices and jax.device_count() < devices:
    p.error(f"needs {devices} devices, JAX has {jax.device_count()}")
  for key, value in {**module.DEFAULTS, **(module.QUICK if opts.quick else {})}.items():
    if getattr(opts, key, None) is None:
      setattr(opts, key, value)
  opts.json = opts.json or str(render.RESULTS_DIR / f"{opts.name}.json")
  earlier = (json.loads(pathlib.Path(opts.json).read_text())
             if opts.update and pathlib.Path(opts.json).is_file() else None)
  report = harness.Report(opts.name, module.TITLE, argv)
  print(f"== benchmarks {opts.name} ==\nmachine: {harness.machine()}", flush=True)

  def save() -> None:  # what the run has so far: a run stopped by a limit keeps it
    doc = report.json()
    if earlier is not None:
      doc = harness.merged(earlier, doc, module.MERGE_KEY, list(module.VARIANTS),
                           list(module.MODELS))
    report.write(getattr(module, "finish", lambda d: d)(doc), opts.json, opts.markdown)

  opts.save = save
  module.run(opts, report)
  save()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
