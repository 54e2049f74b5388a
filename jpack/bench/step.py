"""A whole data-parallel adam step on 8 forced CPU devices: jpack vs per-leaf, in one run.

Every variant is `jpack.data_parallel` (shard_map over ``("batch",)``, inputs placed with
``NamedSharding``, state donated) on the same model, batch and initial parameters:

  per-leaf      per-leaf ``lax.pmean`` of the gradients + optax.adam (the baseline)
  ravel         ``ravel_pytree`` + one pmean + unravel, optax.adam
  optax.flatten per-leaf pmean + ``optax.flatten(optax.adam)``
  allreduce     ``optax.chain(jpack.optax.allreduce, adam)`` semantics: params a tree,
                gradients packed into buckets, one collective per bucket, unpacked
                (``data_parallel(mode="allreduce")``)
  optax.chain   the same written by hand: ``optax.chain(jpack.optax.allreduce, adam)``
                in a plain shard_map step (not on big models)
  packed        persistent packed params: the loss unpacks them, gradients arrive packed,
                adam updates the buckets (no per-step pack)
  packed bf16   the same with a bf16 wire (``comm_dtype=jnp.bfloat16``)
  sharded       ZeRO-1: ``jpack.optax.sharded(adam)`` on packed params
  hand ZeRO-1   the feasibility study's ZeRO-1 written by hand with plain jax + optax (no
                jpack): <= 4 MiB buckets, custom-VJP unpack, psum_scatter/all_gather
  grads only    not a step: loss + gradients, no collective, no update. Every step does
                at least this, so per-leaf time / this time bounds any variant's speed-up
  packed grads  the same with persistent packed params (the loss unpacks them, gradients
    only        come out packed): its distance from grads only is what pack + unpack cost
  ZeRO-1 sgd    ZeRO-1 with plain SGD: the collectives every ZeRO-1 step pays, almost no
                update, so it bounds what ZeRO-1 with any optimizer can reach

Reported per variant: compile time (lower + compile of the step), median step time over
several timed blocks of steps (variants interleaved, block by block), speed-up over per-leaf (the issue's ratio), collectives in
the compiled step (AR all-reduce, RS reduce-scatter, AG all-gather, A2A all-to-all) and their bytes,
optimizer-state bytes per device, and the largest parameter difference from the per-leaf
variant after the same steps (a sanity check: every variant is the same optimizer).

    python -m jpack.bench step                  # mlp_40x256 and mlp_24x1024 (~10 min)
    python -m jpack.bench step --quick          # mlp_40x256 only, fewer steps (~2 min)
    python -m jpack.bench step --models mlp_400x32 --markdown step.md
    python -m jpack.bench step --models resnet50   # ResNet-50 shapes, no compute to hide copies
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from jpack.bench import _common as c

NUM_DEVICES = 8
AXIS = "batch"
PER_DEVICE_BATCH = 16

# Goals from the issues (step-time speed-up over the per-leaf step, same run).
# mlp_24x1024 is the "ResNet-50-sized" model (25.2 M params, as in the feasibility study).
GOALS = {("mlp_40x256", "allreduce"): 1.0, ("mlp_40x256", "optax_chain"): 1.0,
         ("mlp_40x256", "packed"): 1.0,
         ("mlp_40x256", "sharded"): 2.5, ("mlp_24x1024", "allreduce"): 1.0,
         ("mlp_24x1024", "packed"): 1.0, ("mlp_24x1024", "sharded"): 1.5}

VARIANTS = {
    # key: (label, data_parallel mode, wrap the optimizer in optax.flatten, comm dtype)
    "per_leaf": ("per-leaf pmean", "per_leaf", False, None),
    "ravel": ("ravel_pytree", "ravel", False, None),
    "flatten": ("optax.flatten", "per_leaf", True, None),
    "allreduce": ("jpack allreduce", "allreduce", False, None),
    # The step users write in their own shard_map, exactly as the issue names it:
    # optax.chain(jpack.optax.allreduce, adam), params a tree (no data_parallel).
    "optax_chain": ("optax.chain(jpack.optax.allreduce, adam)", None, False, None),
    "packed": ("jpack packed", "packed", False, None),
    "packed_bf16": ("jpack packed bf16", "packed", False, jnp.bfloat16),
    "sharded": ("jpack sharded", "sharded", False, None),
    # The feasibility study's ZeRO-1, written by hand without jpack (an independent check
    # of how close jpack's sharded step is to the best known recipe).
    "study_zero1": ("hand-written ZeRO-1", None, False, None),
    # Not a training step: loss and gradients only, no communication and no update. No
    # data-parallel step can beat it, so per-leaf / this bounds the attainable speed-up.
    "grad_only": ("bound: grads only", None, False, None),
    # The same with jpack's persistent packed params: the loss unpacks them, gradients come
    # out packed. Its distance from grad_only is what pack + unpack cost inside a step.
    "packed_grad_only": ("bound: packed grads only", None, False, None),
    # ZeRO-1 with the cheapest optimizer there is (plain SGD on the slices): the
    # reduce-scatter and all-gather that any ZeRO-1 step pays, with almost no update.
    "sharded_sgd": ("bound: ZeRO-1 with sgd", "sharded", False, None),
}
# Variants that are not adam, or not a step: no parameter comparison with per-leaf.
NOT_COMPARABLE = ("per_leaf", "grad_only", "packed_grad_only", "sharded_sgd")


# -- models ----------------------------------------------------------------------------


@dataclasses.dataclass
class Model:
  name: str
  describe: str
  params: Any                       # numpy tree (host), initial parameters
  loss: Callable[[Any, Any], jax.Array]
  batch: Callable[[int], Any]       # global batch size -> numpy batch

  @property
  def num_leaves(self) -> int:
    return len(jax.tree.leaves(self.params))

  @property
  def num_params(self) -> int:
    return sum(np.size(x) for x in jax.tree.leaves(self.params))


def mlp(depth: int, width: int, seed: int = 0) -> Model:
  """``depth`` layers of ``tanh((h @ w + b) * scale + shift)``: 4 leaves per layer."""
  rng = np.random.default_rng(seed)
  layers = [{"w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
             "b": np.zeros(width, np.float32), "scale": np.ones(width, np.float32),
             "shift": np.zeros(width, np.float32)} for _ in range(depth)]

  def loss(params, batch):
    x, y = batch
    h = x
    for layer in params["layers"]:
      h = jnp.tanh((h @ layer["w"] + layer["b"]) * layer["scale"] + layer["shift"])
    return jnp.mean((h - y) ** 2)

  def batch(n):
    r = np.random.default_rng(seed + 1)
    return (r.standard_normal((n, width)).astype(np.float32),
            r.standard_normal((n, width)).astype(np.float32))

  return Model(f"mlp_{depth}x{width}", f"MLP {depth}x{width}", {"layers": layers}, loss, batch)


def shape_table(name: str, seed: int = 0) -> Model:
  """A packaged workload's parameter table with a cheap per-leaf quadratic loss.

  The loss touches every parameter once (``mean((p - c)^2)`` per leaf, ``c`` from the
  batch), so the step is dominated by what jpack changes: gradient communication and the
  optimizer update over the real leaf sizes.
  """
  w = c.load_workload(name)
  rng = np.random.default_rng(seed)
  params = {k: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype)
            for k, s in w.shapes.items()}

  def loss(params, batch):
    target = jnp.mean(batch)
    return sum(jnp.mean((p.astype(jnp.float32) - target) ** 2) for p in jax.tree.leaves(params))

  def batch(n):
    return np.random.default_rng(seed + 1).standard_normal((n, 4)).astype(np.float32)

  return Model(name, f"{name} shapes, quadratic loss", params, loss, batch)


MODELS = {
    "mlp_40x256": lambda: mlp(40, 256),
    "resnet50": lambda: shape_table("resnet50"),
    "mlp_24x1024": lambda: mlp(24, 1024),
    "mlp_400x32": lambda: mlp(400, 32),
    "mlp_4x32": lambda: mlp(4, 32),  # a smoke test of the benchmark itself
}
DEFAULT_MODELS = ("mlp_40x256", "mlp_24x1024")
# Every variant keeps its state alive while they are timed round-robin: on big models,
# drop the two extra rows (ResNet-50: ~2.5 GB of replicated state per variant).
BIG_MODEL_VARIANTS = ("per_leaf", "ravel", "allreduce", "packed", "sharded", "study_zero1",
                      "grad_only", "packed_grad_only")
BIG_MODEL_PARAMS = 10_000_000


# -- measuring -------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
  key: str
  compiled: c.Compiled
  step_s: float
  colls: c.Collectives
  opt_bytes: int
  params: Any  # final params, host numpy tree
  loss: float


def _bytes_per_device(tree: Any) -> int:
  """Bytes that device 0 holds for ``tree`` (a replicated leaf counts fully)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shards = getattr(x, "addressable_shards", None)
    total += shards[0].data.nbytes if shards else np.asarray(x).nbytes
  return total


@dataclasses.dataclass
class _Prepared:
  key: str
  dp: jpack.DataParallel
  compiled: c.Compiled
  state: Any
  times: list[float]


def _grads_only(model: Model, mesh, layout: jpack.Layout | None = None) -> jpack.DataParallel:
  """The compute every data-parallel step shares: per-device loss and gradients (with a
  ``layout``: of params kept packed, the loss unpacking them)."""
  loss_fn = model.loss if layout is None else lambda p, b: model.loss(jpack.unpack(p), b)

  def local_step(state, batch):
    params = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), state.params)
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    # Gradients are outputs (per device), so XLA cannot drop their computation.
    return state, {"loss": jax.lax.pmean(loss, AXIS),
                   "grads": jax.tree.map(lambda g: g[None], grads)}

  specs = jpack.TrainState(P(), P(), P())
  # Donated like every real step's state: returned unchanged, it is then aliased, not
  # copied (a copy of the replicated params would cost ~1/3 of this step on MLP 40x256).
  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(specs, P(AXIS)),
                               out_specs=(specs, {"loss": P(), "grads": P(AXIS)})),
                 donate_argnums=0)
  replicated = NamedSharding(mesh, P())
  prepare = (lambda params: params) if layout is None else (
      lambda params: jpack.pack(params, layout))
  init = lambda params: jpack.TrainState(jax.device_put(prepare(params), replicated), (),
                                         jax.device_put(jnp.zeros((), jnp.int32), replicated))
  return jpack.DataParallel(init, step, lambda state: state.params, None)


def _optax_chain(model: Model, mesh, plan_options: dict) -> jpack.DataParallel:
  """A user's own shard_map step with ``optax.chain(jpack.optax.allreduce, adam)``.

  Like every data_parallel step (per-leaf included), it reports the global norm of the
  reduced gradients, recorded by a transform between the all-reduce and adam.
  """
  def record_norm():
    return optax.GradientTransformation(
        lambda params: jnp.zeros((), jnp.float32),
        lambda updates, state, params=None: (updates, optax.tree.norm(updates)))

  tx = optax.chain(jpack.optax.allreduce(AXIS, **plan_options), record_norm(),
                   optax.adam(1e-3))

  def local_init(params):
    return jpack.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))

  def local_step(state, batch):
    # Per-device gradients: without vary, shard_map's autodiff would all-reduce each leaf.
    loss, grads = jax.value_and_grad(model.loss)(jpack.vary(state.params, AXIS), batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = jpack.TrainState(optax.apply_updates(state.params, updates), opt_state,
                           state.step + 1)
    return new, {"loss": jax.lax.pmean(loss, AXIS), "grad_norm": opt_state[1]}

  specs = jpack.TrainState(P(), P(), P())
  init_sm = jax.jit(jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=specs))
  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(specs, P(AXIS)),
                               out_specs=(specs, {"loss": P(), "grad_norm": P()})),
                 donate_argnums=0)
  replicated = NamedSharding(mesh, P())
  return jpack.DataParallel(lambda params: init_sm(jax.device_put(params, replicated)), step,
                            lambda state: state.params, None)


def _study_zero1(model: Model, mesh, bucket_bytes: int = 4 * 2**20) -> jpack.DataParallel:
  """ZeRO-1 as the feasibility study wrote it, with plain jax + optax (no jpack).

  Parameters live as f32 buckets of <= ``bucket_bytes`` (filled from the last leaf, padded
  to a multiple of the device count); the loss unpacks them through a custom VJP whose
  backward is one concatenate; gradients are ``psum_scatter``-ed per bucket, adam runs on
  this device's slice, and the new slices are ``all_gather``-ed.
  """
  n = mesh.shape[AXIS]
  leaves, treedef = jax.tree.flatten(model.params)
  shapes = [np.shape(x) for x in leaves]
  sizes = [int(np.size(x)) for x in leaves]
  groups, current, nbytes = [], [], 0
  for i in reversed(range(len(leaves))):
    if current and nbytes + 4 * sizes[i] > bucket_bytes:
      groups.append(current)
      current, nbytes = [], 0
    current.append(i)
    nbytes += 4 * sizes[i]
  groups.append(current)
  lengths = [-(-sum(sizes[i] for i in g) // n) * n for g in groups]

  def pack(ls):
    out = []
    for g, length in zip(groups, lengths):
      parts = [jnp.reshape(ls[i], (-1,)) for i in g]
      pad = length - sum(sizes[i] for i in g)
      out.append(jnp.concatenate(parts + ([jnp.zeros((pad,), jnp.float32)] if pad else [])))
    return out

  @jax.custom_vjp
  def unpack(buckets):
    ls = [None] * len(leaves)
    for g, b in zip(groups, buckets):
      offset = 0
      for i in g:
        ls[i] = jax.lax.slice(b, (offset,), (offset + sizes[i],)).reshape(shapes[i])
        offset += sizes[i]
    return ls

  unpack.defvjp(lambda b: (unpack(b), None), lambda _, ct: (pack(ct),))
  tx = optax.adam(1e-3)

  def local_slice(buckets):
    k = jax.lax.axis_index(AXIS)
    return [jax.lax.dynamic_slice_in_dim(b, k * (b.shape[0] // n), b.shape[0] // n)
            for b in buckets]

  def local_init(params):
    buckets = pack(jax.tree.leaves(params))
    return jpack.TrainState(buckets, tx.init(local_slice(buckets)), jnp.zeros((), jnp.int32))

  def local_step(state, batch):
    def loss(buckets):
      return model.loss(jax.tree.unflatten(treedef, unpack(buckets)), batch)

    varying = [jax.lax.pcast(b, AXIS, to="varying") for b in state.params]
    value, grads = jax.value_and_grad(loss)(varying)
    grads = [jax.lax.psum_scatter(g, AXIS, tiled=True) / n for g in grads]
    mine = local_slice(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, mine)
    new = [jax.lax.all_gather(x, AXIS, tiled=True) for x in optax.apply_updates(mine, updates)]
    return jpack.TrainState(new, opt_state, state.step + 1), {"loss": jax.lax.pmean(value, AXIS)}

  params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), model.params)
  shapes_out = jax.eval_shape(jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=P(),
                                            check_vma=False), params_like)
  specs = jpack.TrainState(jax.tree.map(lambda _: P(), shapes_out.params),
                           jax.tree.map(lambda x: P(AXIS) if x.ndim else P(),
                                        shapes_out.opt_state), P())
  init_sm = jax.jit(jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=specs,
                                  check_vma=False))
  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(specs, P(AXIS)),
                               out_specs=(specs, {"loss": P()}), check_vma=False),
                 donate_argnums=0)
  replicated = NamedSharding(mesh, P())
  to_tree = jax.jit(lambda state: jax.tree.unflatten(treedef, unpack(state.params)))
  return jpack.DataParallel(lambda params: init_sm(jax.device_put(params, replicated)), step,
                            to_tree, None)


def _prepare(model: Model, key: str, mesh, batch, plan_options: dict) -> _Prepared:
  _, mode, use_flatten, comm_dtype = VARIANTS[key]
  not_data_parallel = {  # variants that are not a jpack.data_parallel mode
      "grad_only": lambda: _grads_only(model, mesh),
      "packed_grad_only": lambda: _grads_only(model, mesh,
                                              jpack.plan(model.params, **plan_options)),
      "study_zero1": lambda: _study_zero1(model, mesh),
      "optax_chain": lambda: _optax_chain(model, mesh, plan_options)}
  if key in not_data_parallel:
    dp = not_data_parallel[key]()
    state = jax.block_until_ready(dp.init(model.params))
    compiled = c.compile_fn(dp.step, state, batch)
    state, _ = compiled.fn(state, batch)
    return _Prepared(key, dp, compiled, jax.block_until_ready(state), [])
  opt = optax.sgd(1e-3) if key == "sharded_sgd" else optax.adam(1e-3)
  if use_flatten:
    opt = optax.flatten(opt)
  dp = jpack.data_parallel(model.loss, opt, model.params, mesh, axis_name=AXIS, mode=mode,
                           comm_dtype=comm_dtype, **plan_options)
  state = jax.block_until_ready(dp.init(model.params))
  compiled = c.compile_fn(dp.step, state, batch, jit_kwargs={"donate_argnums": 0})
  state, _ = compiled.fn(state, batch)  # warm-up
  return _Prepared(key, dp, compiled, jax.block_until_ready(state), [])


def _time_block(p: _Prepared, batch, steps: int) -> Any:
  state = p.state
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = p.compiled.fn(state, batch)
  jax.block_until_ready(state)
  p.times.append((time.perf_counter() - t0) / steps)
  p.state = state
  return metrics


def _measure(model: Model, keys: list[str], mesh, batch, *, steps: int, blocks: int,
             plan_options: dict) -> dict[str, Result]:
  """Compile every variant, then time them round-robin, block by block.

  Interleaving spreads slow phases of a shared machine over all variants instead of
  charging them to whichever happened to run then: the ratios are what matters.
  """
  prepared = {}
  for key in keys:
    print(f"   {VARIANTS[key][0]} ...", end="", flush=True)
    prepared[key] = p = _prepare(model, key, mesh, batch, plan_options)
    c.release_host_memory()
    print(f" compile {c.fmt_s(p.compiled.total_s)} s", flush=True)
  metrics = {}
  for _ in range(blocks):
    for key, p in prepared.items():
      metrics[key] = _time_block(p, batch, steps)
  results = {}
  for key, p in prepared.items():
    results[key] = Result(key, p.compiled, statistics.median(p.times),
                          c.count_collectives(p.compiled.text()),
                          _bytes_per_device(p.state.opt_state),
                          jax.tree.map(np.asarray, p.dp.params(p.state)),
                          float(metrics[key]["loss"]))
  return results


def _max_diff(a: Any, b: Any) -> float:
  return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if np.size(x)),
             default=0.0)


def _coll_bytes(colls: c.Collectives) -> str:
  total = sum(colls.result_bytes.values())
  return c.human_bytes(total) if total else "-"


def bench_model(model: Model, variants: list[str], report: c.Report, *, steps: int,
                blocks: int, per_device_batch: int = PER_DEVICE_BATCH,
                plan_options: dict | None = None) -> dict[str, Result]:
  plan_options = plan_options or {}
  mesh = jax.make_mesh((NUM_DEVICES,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  batch = jax.device_put(model.batch(per_device_batch * NUM_DEVICES),
                         NamedSharding(mesh, P(AXIS)))
  layout = jpack.plan(model.params, **{"num_shards": NUM_DEVICES, **plan_options})
  print(f"\n-- {model.describe}: {model.num_leaves} leaves, {model.num_params / 1e6:.2f} M "
        f"params, {len(layout.buckets)} buckets; global batch "
        f"{per_device_batch * NUM_DEVICES}; {blocks} x {steps} timed steps", flush=True)
  results = _measure(model, variants, mesh, batch, steps=steps, blocks=blocks,
                     plan_options=plan_options)

  base = results.get("per_leaf")
  table = c.Table(["variant", "compile s", "step ms", "speed-up", "goal", "collectives",
                   "coll. bytes", "opt state/dev", "max |Δp| vs per-leaf"],
                  title=f"{model.describe} ({model.num_leaves} leaves, "
                        f"{model.num_params / 1e6:.2f} M params), adam, {NUM_DEVICES} devices")
  for key, r in results.items():
    speedup = c.ratio(base.step_s, r.step_s) if base else None
    goal = GOALS.get((model.name, key))
    verdict = "" if goal is None or speedup is None else (
        f">={goal:g}x {c.verdict(speedup >= goal)}")
    diff = ("-" if key in NOT_COMPARABLE or base is None
            else f"{_max_diff(r.params, base.params):.1e}")
    table.add(VARIANTS[key][0], c.fmt_s(r.compiled.total_s), c.fmt_ms(r.step_s),
              c.fmt_ratio(speedup), verdict, r.colls.short(), _coll_bytes(r.colls),
              c.human_bytes(r.opt_bytes), diff)
  report.table(table)
  return results


def main(argv: list[str] | None = None) -> int:
  c.set_cpu_devices(NUM_DEVICES)  # before anything creates an array
  parser = argparse.ArgumentParser(prog="python -m jpack.bench step", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="",
                      help=f"comma-separated subset of {', '.join(MODELS)} "
                           f"(default: {', '.join(DEFAULT_MODELS)})")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help=f"comma-separated subset of {', '.join(VARIANTS)}")
  parser.add_argument("--quick", action="store_true", help="mlp_40x256 only, 3 x 5 steps")
  parser.add_argument("--steps", type=c.positive_int, default=None, help="steps per timed block (default 10)")
  parser.add_argument("--blocks", type=c.positive_int, default=None, help="timed blocks (median; default 5)")
  parser.add_argument("--batch", type=c.positive_int, default=PER_DEVICE_BATCH,
                      help=f"per-device batch (default {PER_DEVICE_BATCH})")
  parser.add_argument("--bucket-bytes", type=c.positive_int, default=None,
                      help="jpack.plan bucket_bytes (default: jpack's, 4 MiB)")
  parser.add_argument("--solo-bytes", type=int, default=None,
                      help="jpack.plan solo_bytes (default: jpack's, 1 MiB; 0 = None)")
  parser.add_argument("--markdown", metavar="FILE", type=c.markdown_path,
                      help="also write the tables as Markdown")
  args = parser.parse_args(argv)
  if args.solo_bytes is not None and args.solo_bytes < 0:
    parser.error(f"--solo-bytes must be >= 0 (0 = no solo buckets), got {args.solo_bytes}")
  c.require_devices(NUM_DEVICES)

  names = [n for n in args.models.split(",") if n] or (
      ["mlp_40x256"] if args.quick else list(DEFAULT_MODELS))
  unknown = set(names) - set(MODELS)
  if unknown:
    raise SystemExit(f"Unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
  variants = [v for v in args.variants.split(",") if v]
  unknown = set(variants) - set(VARIANTS)
  if unknown:
    raise SystemExit(f"Unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
  steps = args.steps or (5 if args.quick else 10)
  blocks = args.blocks or (3 if args.quick else 5)

  plan_options = {}
  if args.bucket_bytes is not None:
    plan_options["bucket_bytes"] = args.bucket_bytes
  if args.solo_bytes is not None:
    plan_options["solo_bytes"] = args.solo_bytes or None
  report = c.Report("jpack data-parallel step benchmark")
  c.banner("jpack.bench step", [
      f"{NUM_DEVICES} CPU devices, jpack.data_parallel (shard_map over ('{AXIS}',)), "
      f"optax.adam(1e-3), per-device batch {args.batch}, plan options {plan_options or 'default'}; step time = median of "
      f"{blocks} blocks of {steps} steps, variants interleaved block by block"])
  for name in names:
    model = MODELS[name]()
    chosen = variants
    if args.variants == parser.get_default("variants") and model.num_params > BIG_MODEL_PARAMS:
      chosen = [v for v in variants if v in BIG_MODEL_VARIANTS]
    bench_model(model, chosen, report, steps=steps, blocks=blocks,
                per_device_batch=args.batch, plan_options=plan_options)
    del model
    c.release_host_memory()
  report.text("speed-up = per-leaf step time / variant step time (same run). Collectives: "
              "AR all-reduce, RS reduce-scatter, AG all-gather, A2A all-to-all ops in the compiled step, "
              "bytes = their result bytes.")
  report.write_markdown(args.markdown)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
