"""Command line: ``python -m jpack demo`` / ``python -m jpack layout WORKLOAD.json``."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any, Callable, Sequence

DEFAULT_STEPS = 200
QUICK_STEPS = 40


def _positive(kind: Callable[[str], Any], noun: str, least: str) -> Callable[[str], Any]:
  """An argparse type: ``kind(text)``, refused unless finite and above 0 (NaN too)."""
  def parse(text: str) -> Any:
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected a positive {noun}, got {text!r}") from None
    if not 0 < value < math.inf:
      raise argparse.ArgumentTypeError(f"must be {least}, got {text}")
    return value

  return parse


_positive_int = _positive(int, "integer", ">= 1")
_positive_float = _positive(float, "number", "a positive number")


def _modes(text: str) -> list[str]:
  from jpack._demo import ALL_MODES

  modes = [m.strip() for m in text.split(",") if m.strip()]
  if not modes:
    raise argparse.ArgumentTypeError("give at least one mode")
  unknown = [m for m in modes if m not in ALL_MODES]
  if unknown:
    raise argparse.ArgumentTypeError(
        f"unknown mode(s) {', '.join(map(repr, unknown))}; choose from {', '.join(ALL_MODES)}")
  if len(set(modes)) != len(modes):
    raise argparse.ArgumentTypeError(f"mode listed twice in {text!r}")
  return modes


def build_parser() -> argparse.ArgumentParser:
  from jpack._demo import ALL_MODES, COMM_DTYPES, DEMO_MODES, PARAM_DTYPES

  parser = argparse.ArgumentParser(
      prog="jpack", description="jpack: pack JAX pytrees into per-dtype flat buckets.")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")

  demo = sub.add_parser(
      "demo", help="train a small MLP data-parallel in each mode and compare them",
      description=(
          "Train an MLP on scikit-learn's bundled digits data set (no download), "
          "data-parallel over simulated CPU devices, once per gradient-reduction mode, "
          "and compare step time, collectives, bytes, memory and accuracy. "
          "Needs: pip install 'jpack[demo]'."),
  )
  demo.add_argument("--devices", type=_positive_int, default=8,
                    help="number of simulated CPU devices (data-parallel replicas); "
                         "default %(default)s")
  demo.add_argument("--steps", type=_positive_int, default=None,
                    help=f"training steps per mode, at least 2 (default {DEFAULT_STEPS}, "
                         f"{QUICK_STEPS} with --quick)")
  demo.add_argument("--batch-size", type=_positive_int, default=256,
                    help="global batch size, split over the devices (must divide evenly); "
                         "default %(default)s")
  demo.add_argument("--modes", type=_modes, default=",".join(DEMO_MODES),
                    help=f"comma-separated modes, from: {', '.join(ALL_MODES)} (per_leaf: a "
                         "shard_map step with a pmean per gradient leaf; jit: plain jax.jit "
                         "on sharded arrays, XLA inserting the all-reduces; the others: "
                         "jpack.data_parallel's modes); default %(default)s")
  demo.add_argument("--comm-dtype", choices=COMM_DTYPES, default="none",
                    help="wire dtype of jpack's gradient collectives (none: the "
                         "gradients' own dtype); the per_leaf and jit steps ignore it; "
                         "default %(default)s")
  demo.add_argument("--param-dtype", choices=PARAM_DTYPES, default="float32",
                    help="dtype the loss sees the params in. bfloat16: the packed and "
                         "sharded modes keep bf16 params with float32 master copies in the "
                         "optimizer state (data_parallel's precision=jpack.Precision("
                         "param_dtype=)); per_leaf, jit and "
                         "allreduce keep float32 params and cast them to bf16 for the loss; "
                         "default %(default)s")
  demo.add_argument("--accumulate", type=_positive_int, default=1, metavar="K",
                    help="micro-batches per step, one update of the whole batch: "
                         "data_parallel's accumulate= in the jpack modes, optax.MultiSteps "
                         "(a gradient reduction per micro-batch) in per_leaf and jit; must "
                         "divide the per-device batch; default %(default)s")
  demo.add_argument("--width", type=_positive_int, default=128,
                    help="MLP hidden width; default %(default)s")
  demo.add_argument("--depth", type=_positive_int, default=12,
                    help="residual blocks (4 parameter leaves each); default %(default)s")
  demo.add_argument("--lr", type=_positive_float, default=1e-3,
                    help="adamw learning rate; default %(default)s")
  demo.add_argument("--out", default="jpack-demo-out",
                    help="directory for the plot (jpack-demo.png) and results.json; "
                         "default ./%(default)s")
  demo.add_argument("--seed", type=int, default=0,
                    help="seed of the data split, init and batches; default %(default)s")
  demo.add_argument("--quick", action="store_true",
                    help=f"a fast run ({QUICK_STEPS} steps unless --steps is given)")
  demo.add_argument("--no-progress", action="store_true", help="no progress bars")
  demo.set_defaults(handler=_cmd_demo, subparser=demo)

  layout = sub.add_parser(
      "layout", help="print jpack.plan's bucket layout for a workload file",
      description="Print the bucket table jpack.plan builds for a workload: a JSON file "
                  "{'leaves': [{'path', 'shape', 'dtype'}, ...]}, such as those in "
                  "benchmarks/workloads/ of the jpack repository.")
  layout.add_argument("workload", metavar="WORKLOAD.json", help="path of the workload file")
  layout.add_argument("--bucket-mib", type=_positive_float, default=None,
                      help="bucket size cap in MiB (default: jpack's own, 4 MiB)")
  layout.add_argument("--num-shards", type=_positive_int, default=1,
                      help="pad buckets to split evenly over this many devices; "
                           "default %(default)s")
  layout.add_argument("--leaves", action="store_true", help="also list every leaf")
  layout.set_defaults(handler=_cmd_layout, subparser=layout)
  return parser


def _cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
  if args.batch_size % args.devices:
    parser.error(f"--batch-size {args.batch_size} must be divisible by --devices "
                 f"{args.devices}")
  per_device = args.batch_size // args.devices
  if per_device % args.accumulate:
    parser.error(f"--accumulate {args.accumulate} must divide the per-device batch "
                 f"{per_device} (--batch-size / --devices) into equal micro-batches")
  steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick
                                                      else DEFAULT_STEPS)
  if steps < 2:
    parser.error(f"--steps {steps}: give at least 2 (the first step compiles and is not "
                 "timed)")
  out = pathlib.Path(args.out)
  if out.exists() and not out.is_dir():
    parser.error(f"--out {args.out!r} exists and is not a directory")
  from jpack import _demo

  try:
    _demo.run(devices=args.devices, steps=steps, batch_size=args.batch_size,
              modes=args.modes, comm_dtype=args.comm_dtype,
              param_dtype=args.param_dtype, accumulate=args.accumulate, out=args.out,
              seed=args.seed, width=args.width, depth=args.depth, lr=args.lr,
              progress=not args.no_progress)
  except ImportError as e:
    print(f"jpack demo: {e}", file=sys.stderr)
    return 1
  return 0


def _cmd_layout(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
  path = pathlib.Path(args.workload)
  if not path.is_file():
    parser.error(f"no workload file {args.workload!r}: give the path of a .json file, e.g. "
                 "benchmarks/workloads/resnet50.json in a checkout of the jpack repository")
  try:
    doc = json.loads(path.read_text())
    import jax

    shapes = {}
    for leaf in doc["leaves"]:
      key = leaf["path"]
      if not isinstance(key, str) or key in shapes:
        why = "repeated" if key in shapes else "not a string"
        raise ValueError(f"leaf path {key!r} is {why}")
      shapes[key] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), leaf["dtype"])
  except (ValueError, KeyError, TypeError) as e:
    parser.error(f"{path} is not a workload file ({{'leaves': [{{'path', 'shape', "
                 f"'dtype'}}, ...]}}): {e}")
  import jpack

  options = {"num_shards": args.num_shards}
  if args.bucket_mib is not None:
    options["bucket_bytes"] = max(1, int(args.bucket_mib * 2**20))
  try:
    layout = jpack.plan(shapes, **options)
  except (ValueError, TypeError) as e:  # a shape or dtype jpack refuses, with its path
    parser.error(f"{path}: {e}")
  print(f"{doc.get('name', path.stem)}:")
  print(layout.summary(leaves=args.leaves))
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command is None:
    parser.print_help()
    return 2
  return args.handler(args, args.subparser)


if __name__ == "__main__":
  sys.exit(main())
