"""A whole data-parallel step on 8 CPU devices: jpack's modes (`VARIANTS`, built by
`build`) against the steps written without it, on the same model (`MODELS`), params and
batch, timed in interleaved rounds of ``--steps`` steps. Columns: docs/performance.md.
"""

import dataclasses
import functools
import pathlib
import statistics
import tempfile
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from benchmarks import checkpoint as ckpt
from benchmarks import harness as h
from benchmarks import models
from benchmarks.models import Model
from jpack import _reference

TITLE = "jpack data-parallel step benchmark"
DEVICES = 8
AXIS = h.AXIS
MERGE_KEY = "model"
LEARNING_RATE = 1e-3
ACCUMULATE = 4  # micro-batches per step of the accumulation rows
DEFAULTS = dict(steps=10, rounds=5)
QUICK = dict(steps=5, rounds=3, models=["mlp_40x256"])
WEIGHT_DECAY = 0.1  # GPT-2's adamw


def decays(params: Any) -> Any:  # GPT-2's weight-decay mask: not biases and norms
  return jax.tree.map(lambda x: np.ndim(x) >= 2, params)


OPTIMIZERS: dict[str, Callable[[float], Any]] = {
    "adam": optax.adam, "adamw": optax.adamw, "sgd": optax.sgd, "lamb": optax.lamb,
    "muon": optax.contrib.muon, "adafactor": optax.adafactor,
    "adamw_mask": lambda lr: optax.adamw(lr, weight_decay=WEIGHT_DECAY, mask=decays),
    # jpack.optax.partition's form of adamw_mask: adamw where it decays, adam elsewhere.
    "adamw_labels": lambda lr: {"decay": optax.adamw(lr, weight_decay=WEIGHT_DECAY),
                                "no_decay": optax.adam(lr)},
}


@dataclasses.dataclass(frozen=True)
class Variant:
  """One step: how `build` makes it (``kind``), optimizer and options."""
  label: str
  kind: str = "jpack"           # "jpack": jpack.data_parallel(mode=mode, ...)
  mode: str = ""
  optimizer: str = "adam"
  param_dtype: Any = None       # jpack.Precision(param_dtype=); the others cast for the loss
  comm_dtype: Any = None        # jpack.Precision(comm_dtype=)
  accumulate: int = 1
  shard_accumulator: bool = False  # jpack.Mode(mode, shard_accumulator=): ZeRO-2
  keep_gathered: bool = False      # jpack.Mode("fsdp", keep_gathered=)
  saves: bool = False           # a checkpoint every ckpt.EVERY steps
  baseline: str = "per_leaf"    # speed-up and max |Δp| are against it
  compared: bool = True         # max |Δp| against the baseline means something

  # optax.MultiSteps as users write it: the step called k times per step.
  calls = property(lambda self: self.accumulate if self.kind == "multisteps" else 1)
  jit_mesh = property(lambda self: self.kind.startswith("jit"))  # on Auto axes (`auto`)


def _optimizer_rows(o: str, name: str, per_leaf_name: str = "") -> dict[str, Variant]:
  """Optimizer ``o`` in a per-leaf step, and in jpack's packed and sharded modes against it."""
  return {f"per_leaf_{o}": Variant(f"per-leaf, {per_leaf_name or name}", kind="per_leaf",
                                   optimizer=o, compared=False),
          **{f"{m}_{o}": Variant(f"jpack {m}, {name}", mode=m, optimizer=o,
                                 baseline=f"per_leaf_{o}") for m in ("packed", "sharded")}}


_v = Variant
VARIANTS = {
    "per_leaf": _v("per-leaf pmean", kind="per_leaf", compared=False),
    "ravel": _v("ravel_pytree", kind="ravel"),
    "flatten": _v("optax.flatten", kind="flatten"),
    "jit": _v("jit + NamedSharding", kind="jit"),
    "jit_zero1": _v("jit, ZeRO-1 by sharding", kind="jit_zero1"),
    "jit_fsdp": _v("jit, FSDP by sharding", kind="jit_fsdp"),
    "allreduce": _v("jpack allreduce", mode="allreduce"),
    "optax_chain": _v("optax.chain(jpack.optax.allreduce, adam)", kind="optax_chain"),
    "hand_pmean": _v("hand-written jpack.pmean step", kind="hand_pmean"),
    "packed": _v("jpack packed", mode="packed"),
    "packed_bf16": _v("jpack packed bf16", mode="packed", comm_dtype=jnp.bfloat16),
    "sharded": _v("jpack sharded", mode="sharded"),
    "fsdp": _v("jpack fsdp (ZeRO-3)", mode="fsdp"),
    "hand_zero1": _v("hand-written ZeRO-1", kind="hand_zero1"),
    "packed_bf16_params": _v("jpack packed, bf16 params", mode="packed",
                             param_dtype=jnp.bfloat16),
    "sharded_bf16": _v("jpack sharded, bf16 params", mode="sharded", param_dtype=jnp.bfloat16),
    "per_leaf_multisteps4": _v("per-leaf + MultiSteps k=4", kind="multisteps",
                               accumulate=ACCUMULATE),
    "packed_acc4": _v("jpack packed, accumulate=4", mode="packed", accumulate=ACCUMULATE),
    "sharded_acc4": _v("jpack sharded, accumulate=4", mode="sharded", accumulate=ACCUMULATE),
    "sharded_acc4_zero2": _v("jpack sharded, acc=4 ZeRO-2", mode="sharded",
                             accumulate=ACCUMULATE, shard_accumulator=True),
    "grad_only": _v("bound: grads only", kind="grad_only", compared=False),
    "packed_grad_only": _v("bound: packed grads only", kind="packed_grad_only", compared=False),
    "sharded_sgd": _v("bound: ZeRO-1 with sgd", mode="sharded", optimizer="sgd",
                      compared=False),
    "packed_save10": _v(f"jpack packed, async save every {ckpt.EVERY}", mode="packed",
                        saves=True),
    "sharded_save10": _v(f"jpack sharded, async save every {ckpt.EVERY}", mode="sharded",
                         saves=True),
    # GPT-2's optimizers, each against per-leaf optax with the same optimizer.
    **_optimizer_rows("adamw_mask", "adamw(mask=...)", "adamw(mask=no decay on biases, norms)"),
    "sharded_adamw_labels": _v("jpack sharded, adamw/adam by optax.partition", mode="sharded",
                               optimizer="adamw_labels", baseline="per_leaf_adamw_mask"),
    **_optimizer_rows("lamb", "lamb"), **_optimizer_rows("muon", "contrib.muon"),
    **_optimizer_rows("adafactor", "adafactor"),
}
OPTIMIZER_VARIANTS = tuple(k for k, v in VARIANTS.items()
                           if v.optimizer not in ("adam", "sgd"))
ACCUMULATING = tuple(k for k, v in VARIANTS.items() if v.accumulate > 1)
MULTISTEPS, FLOOR = "per_leaf_multisteps4", "grad_only"
# The steps that carry a model's state (the ResNet's BatchNorm statistics).
WITH_STATE = ("per_leaf", "hand_pmean", "optax_chain", "ravel", "flatten", "allreduce",
              "packed", "sharded", "fsdp", "grad_only", "packed_grad_only")
# Step-time goals over the baseline, same run; mlp_24x1024 has about ResNet-50's size.
REAL_MODELS = ("gpt2_12x64", "vit_12x64", "resnet18_narrow")
GOALS = {("mlp_40x256", "allreduce"): 1.0, ("mlp_40x256", "optax_chain"): 1.0,
         ("mlp_40x256", "packed"): 1.0, ("mlp_40x256", "sharded"): 2.5,
         ("mlp_24x1024", "allreduce"): 1.0, ("mlp_24x1024", "packed"): 1.0,
         ("mlp_24x1024", "sharded"): 1.5,
         **{(m, k): g for m in REAL_MODELS
            for k, g in (("packed", 1.3), ("sharded", 1.5), ("hand_pmean", 1.0))},
         **{("gpt2_12x64", f"sharded_{o}"): 1.2 for o in ("adamw_mask", "lamb", "muon")}}


def mlp(depth: int, width: int, seed: int = 0) -> Model:
  """``depth`` layers of ``tanh((h @ w + b) * scale + shift)``: 4 leaves per layer."""
  rng = np.random.default_rng(seed)
  layers = [{"w": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
             "b": np.zeros(width, np.float32), "scale": np.ones(width, np.float32),
             "shift": np.zeros(width, np.float32)} for _ in range(depth)]

  def loss(params, batch):
    x, y = batch
    for layer in params["layers"]:
      x = jnp.tanh((x @ layer["w"] + layer["b"]) * layer["scale"] + layer["shift"])
    return jnp.mean((x - y) ** 2)

  batch, _ = models._data(lambda n: (jax.ShapeDtypeStruct((n, width), np.float32),) * 2, seed)
  return Model(f"mlp_{depth}x{width}", f"MLP {depth}x{width}", {"layers": layers}, loss, batch)


def shape_table(name: str, seed: int = 0) -> Model:
  """A workload's parameter table with a loss touching every parameter once."""
  rng = np.random.default_rng(seed)
  params = {k: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype)
            for k, s in h.load_workload(name).shapes.items()}

  def loss(params, batch):
    return sum(jnp.mean((p.astype(jnp.float32) - jnp.mean(batch)) ** 2)
               for p in jax.tree.leaves(params))

  return Model(name, f"{name} shapes, quadratic loss", params, loss,
               *models._data(lambda n: jax.ShapeDtypeStruct((n, 4), np.float32), seed))


# Real architectures with their real leaf counts, narrowed; the tiny ones are smoke tests.
_resnet18 = functools.partial(models.resnet, models.RESNET18_BLOCKS, block="basic", bn_state=True)
MODELS: dict[str, Callable[[], Model]] = {
    "gpt2_12x64": lambda: models.gpt2(layers=12, width=64, vocab=1024, positions=32,
                                      heads=4, seq=16, name="gpt2_12x64"),
    "vit_12x64": lambda: models.vit(layers=12, width=64, patch=8, image=32, classes=100,
                                    heads=4, name="vit_12x64"),
    "resnet18_narrow": lambda: _resnet18(width=16, image=32, classes=100, name="resnet18_narrow"),
    "mlp_40x256": lambda: mlp(40, 256),
    "mlp_24x1024": lambda: mlp(24, 1024),
    "gpt2_2x16": lambda: models.gpt2(layers=2, width=16, vocab=64, positions=8, heads=2,
                                     seq=4, name="gpt2_2x16"),
    "vit_2x16": lambda: models.vit(layers=2, width=16, patch=4, image=8, classes=10,
                                   heads=2, name="vit_2x16"),
    "resnet18_tiny": lambda: _resnet18(width=4, image=8, classes=10, name="resnet18_tiny"),
    "resnet50": lambda: shape_table("resnet50"),
    "mlp_400x32": lambda: mlp(400, 32),
    "mlp_4x32": lambda: mlp(4, 32),
    "mlp_4x256": lambda: mlp(4, 256),  # buckets without padding: bf16 and f32 bytes 1:2
}
DEFAULT_MODELS = ("gpt2_12x64", "vit_12x64", "resnet18_narrow", "mlp_40x256", "mlp_24x1024")
REAL_MODEL_BATCH, PER_DEVICE_BATCH = 4, 16  # rows per device
# The default variants of the real architectures and of big models.
REAL_MODEL_VARIANTS = ("per_leaf", "jit", "jit_zero1", "hand_pmean", "packed", "sharded")
MODEL_VARIANTS = {"gpt2_12x64": REAL_MODEL_VARIANTS + OPTIMIZER_VARIANTS,
                  "vit_12x64": REAL_MODEL_VARIANTS, "resnet18_narrow": REAL_MODEL_VARIANTS}
BIG_MODEL_VARIANTS = ("per_leaf", "jit", "jit_zero1", "allreduce", "packed", "sharded",
                      "sharded_bf16", "grad_only")
BIG_MODEL_PARAMS = 10_000_000


def auto(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """``mesh`` with Auto axes, as a plain jit user has it."""
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def optimizer(v: Variant, params: Any, lr: float = LEARNING_RATE) -> Any:
  tx = OPTIMIZERS[v.optimizer](lr)
  if isinstance(tx, dict):  # by label: adamw where decays, adam elsewhere
    labels = jax.tree.map(lambda d: "decay" if d else "no_decay", decays(params))
    return jpack.optax.partition(tx, labels)
  return tx


def _grads_only(model: Model, mesh, layout: jpack.Layout | None = None) -> Any:
  """Per-device loss and gradients (of packed params with a ``layout``), nothing else."""
  to_tree = (lambda p: p) if layout is None else jpack.unpack

  def local_step(state, batch):
    params = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), state.params)
    if state.model_state is None:
      loss, grads = jax.value_and_grad(lambda p: model.loss(to_tree(p), batch))(params)
    else:
      (loss, _), grads = jax.value_and_grad(
          lambda p: model.loss(to_tree(p), state.model_state, batch), has_aux=True)(params)
    # Gradients are outputs (per device), so XLA cannot drop their computation.
    return state, {"loss": jax.lax.pmean(loss, AXIS),
                   "grads": jax.tree.map(lambda g: g[None], grads)}

  # Donated like every real step's state: returned unchanged, it is aliased, not copied.
  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(AXIS)),
                               out_specs=(P(), {"loss": P(), "grads": P(AXIS)})),
                 donate_argnums=0)
  prepare = (lambda p: p) if layout is None else (lambda p: jpack.pack(p, layout))
  replicated = NamedSharding(mesh, P())
  return jpack.DataParallel(
      lambda p, m=None: jax.device_put(jpack.TrainState(prepare(p), (), jnp.zeros(()), m),
                                       replicated), step,
      lambda state: to_tree(state.params), layout)


def _floor(model: Model, mesh) -> Any:
  """Loss, gradients and an SGD update on each device's own gradients: no reduction."""

  def local(params, batch):
    mine = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), params)
    grads = jax.grad(model.loss)(mine, batch)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g.astype(p.dtype), params, grads)

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(),
                               check_vma=False), donate_argnums=0)
  return jpack.DataParallel(lambda p: jax.device_put(p, NamedSharding(mesh, P())), step,
                            lambda p: p, None)


def _hand_zero1(model: Model, mesh, bucket_bytes: int = 4 * 2**20) -> Any:
  """ZeRO-1 in plain jax + optax: f32 buckets filled from the last leaf, padded to a
  multiple of the devices, unpacked by a custom VJP; psum_scatter, adam, all_gather."""
  n = mesh.shape[AXIS]
  leaves, treedef = jax.tree.flatten(model.params)
  shapes, sizes = [np.shape(x) for x in leaves], [int(np.size(x)) for x in leaves]
  groups = [[]]
  for i in reversed(range(len(sizes))):
    if groups[-1] and 4 * (sum(sizes[j] for j in groups[-1]) + sizes[i]) > bucket_bytes:
      groups.append([])
    groups[-1].append(i)
  lengths = [-(-sum(sizes[i] for i in g) // n) * n for g in groups]

  def pack(ls):
    return [jnp.concatenate([jnp.reshape(ls[i], (-1,)) for i in g] + [
        jnp.zeros((length - sum(sizes[i] for i in g),), jnp.float32)])
            for g, length in zip(groups, lengths)]

  @jax.custom_vjp
  def unpack(buckets):
    ls = [None] * len(leaves)
    for g, b in zip(groups, buckets):
      offsets = np.cumsum([0] + [sizes[i] for i in g])
      for i, offset in zip(g, offsets):
        ls[i] = jax.lax.slice(b, (offset,), (offset + sizes[i],)).reshape(shapes[i])
    return ls

  unpack.defvjp(lambda b: (unpack(b), None), lambda _, ct: (pack(ct),))
  tx = optax.adam(LEARNING_RATE)

  def local_slice(buckets):
    k = jax.lax.axis_index(AXIS)
    return [jax.lax.dynamic_slice_in_dim(b, k * (b.shape[0] // n), b.shape[0] // n)
            for b in buckets]

  def local_init(params):
    buckets = pack(jax.tree.leaves(params))
    return jpack.TrainState(buckets, tx.init(local_slice(buckets)), jnp.zeros(()))

  def local_step(state, batch):
    mine = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), state.params)
    value, grads = jax.value_and_grad(
        lambda b: model.loss(jax.tree.unflatten(treedef, unpack(b)), batch))(mine)
    grads = [jax.lax.psum_scatter(g, AXIS, tiled=True) / n for g in grads]
    mine = local_slice(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, mine)
    new = [jax.lax.all_gather(x, AXIS, tiled=True) for x in optax.apply_updates(mine, updates)]
    return state._replace(params=new, opt_state=opt_state), {"loss": jax.lax.pmean(value, AXIS)}

  # Params whole on every device; the moments split over the axis, adam's count whole.
  opt = jax.eval_shape(tx.init, [jax.ShapeDtypeStruct((k,), jnp.float32) for k in lengths])
  specs = jpack.TrainState([P()] * len(groups), jax.tree.map(
      lambda x: P(AXIS) if x.ndim else P(), opt), P())
  smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
  init = jax.jit(smap(local_init, in_specs=P(), out_specs=specs))
  step = jax.jit(smap(local_step, in_specs=(specs, P(AXIS)), out_specs=(specs, {"loss": P()})),
                 donate_argnums=0)
  return jpack.DataParallel(lambda p: init(jax.device_put(p, NamedSharding(mesh, P()))), step,
                            jax.jit(lambda s: jax.tree.unflatten(treedef, unpack(s.params))),
                            None)


def build(v: Variant, model: Model, mesh) -> jpack.DataParallel:
  """Variant ``v``'s step on ``mesh``: by jpack, by `jax.jit`, by hand, or a per-leaf step."""
  # hand_pmean_options: the README's step, its layout planned with jpack.step_options.
  layout = (_reference._reported_layout(model.params, mesh) if v.kind == "hand_pmean_options"
            else jpack.plan(model.params, num_shards=mesh.shape[AXIS]))
  tx, loss, params = optimizer(v, model.params), model.loss, model.params
  if v.kind == "jpack":
    return jpack.data_parallel(
        loss, tx, params, mesh, accumulate=v.accumulate,
        mode=jpack.Mode(v.mode, shard_accumulator=v.shard_accumulator,
                        keep_gathered=v.keep_gathered),
        precision=jpack.Precision(param_dtype=v.param_dtype, comm_dtype=v.comm_dtype))
  if v.jit_mesh:
    return _reference.jit_step(loss, tx, params, auto(mesh), param_dtype=v.param_dtype,
                               shard_state=v.kind != "jit", shard_params=v.kind == "jit_fsdp")
  if v.kind == "hand_zero1":
    return _hand_zero1(model, mesh)
  if v.kind == "floor":
    return _floor(model, mesh)
  if v.kind in ("grad_only", "packed_grad_only"):
    return _grads_only(model, mesh, layout if v.kind == "packed_grad_only" else None)
  # The per-leaf steps: the optimizer and how the gradients are reduced.
  per_leaf = {
      "per_leaf": lambda: (tx, dict(param_dtype=v.param_dtype)),
      "ravel": lambda: (tx, dict(reduce=h.ravel_pmean)),
      "flatten": lambda: (optax.flatten(tx), {}),
      "hand_pmean": lambda: (tx, dict(reduce=lambda g: jpack.pmean(g, AXIS, layout=layout))),
      "optax_chain": lambda: (optax.chain(jpack.optax.allreduce(AXIS, grad_norm=True), tx),
                              dict(reduce=lambda g: g, norm=lambda s: s[0].grad_norm)),
      "multisteps": lambda: (_reference._multi_steps(tx, v.accumulate), {})}
  tx, options = per_leaf[v.kind.removesuffix("_options")]()
  return _reference.per_leaf_step(loss, tx, params, mesh, **options)


@dataclasses.dataclass
class Prepared:
  """A variant compiled, warmed up by one whole step, with what its rounds record."""
  key: str
  dp: jpack.DataParallel
  compiled: h.Compiled
  state: Any
  batches: list[Any]  # what one step calls the compiled step on, in order
  saves: ckpt.Saves | None = None  # the checkpoint rows' saves
  metrics: Any = None
  block_s: list[float] = dataclasses.field(default_factory=list)  # each timed block's step

  step_s = property(lambda self: statistics.median(self.block_s))
  params = property(lambda self: self.dp.unpack(self.state))


def micro_batches(batch: Any, k: int, devices: int) -> list[Any]:
  """``batch`` split into ``k`` as ``data_parallel(accumulate=k)`` splits each device's."""
  if k == 1:
    return [batch]

  def part(x, j):
    rows = np.asarray(x).reshape((devices, k, -1) + x.shape[1:])[:, j]
    return jax.device_put(rows.reshape((-1,) + x.shape[1:]), x.sharding)

  return [jax.tree.map(lambda x: part(x, j), batch) for j in range(k)]


def prepare(key: str, model: Model, mesh, batch: Any, directory: pathlib.Path) -> Prepared:
  v, dp = VARIANTS[key], build(VARIANTS[key], model, mesh)
  if v.jit_mesh:
    batch = jax.device_put(batch, NamedSharding(auto(mesh), P(AXIS)))
  batches = micro_batches(batch, v.calls, mesh.shape[AXIS])
  state = jax.block_until_ready(dp.init(model.params, model.state) if model.has_state
                                else dp.init(model.params))
  compiled = h.compile_fn(dp.step, state, batches[0], jit_kwargs={"donate_argnums": 0})
  for b in batches:  # warm-up: one whole step, so every variant takes as many updates
    state, _ = compiled.fn(state, b)
  p = Prepared(key, dp, compiled, jax.block_until_ready(state), batches)
  if v.saves:
    # Saves on the first step of every round, and once now to warm Orbax up.
    count = int(state.step)
    p.saves = ckpt.Saves(ckpt.make_manager(directory / key, policy=ckpt.EveryFrom(count + 1)))
    assert jpack.checkpoint.save(p.saves.manager, count, state, force=True)
    p.saves.manager.wait_until_finished()
  return p


def run_block(p: Prepared, steps: int) -> Any:
  """``steps`` steps of ``p``; a checkpoint row waits for its write inside the time."""
  if p.saves is None:
    for _ in range(steps):
      for b in p.batches:
        p.state, p.metrics = p.compiled.fn(p.state, b)
  else:
    p.state, p.metrics = p.saves.run(p.compiled.fn, p.state, p.batches[0], steps)
    p.saves.wait(p.state)
  return p.state


def measure(model: Model, keys: list[str], mesh, batch: Any, *, steps: int, rounds: int
            ) -> dict[str, Prepared | str]:
  """Compile every variant, then time them in interleaved rounds; a jpack variant that
  data_parallel refuses (TypeError) is the refusal's message instead."""
  with tempfile.TemporaryDirectory(prefix="jpack-step-bench-") as tmp:
    prepared: dict[str, Prepared | str] = {}
    for key in keys:
      print(f"   {VARIANTS[key].label} ...", end="", flush=True)
      try:
        prepared[key] = p = prepare(key, model, mesh, batch, pathlib.Path(tmp))
      except TypeError as e:
        if VARIANTS[key].kind != "jpack":
          raise
        prepared[key] = f"refused: {e}"
        print(f" refused (TypeError: {str(e).splitlines()[0][:100]}...)", flush=True)
        continue
      h.release_host_memory()
      print(f" compile {h.fmt_s(p.compiled.total_s)} s", flush=True)
    timed = {k: p for k, p in prepared.items() if not isinstance(p, str)}
    timings = h.time_rounds({k: functools.partial(run_block, p, steps) for k, p in timed.items()},
                            rounds, warmup=0)
    for key, p in timed.items():
      p.block_s = [t / steps for t in timings[key].samples]
      if p.saves is not None:
        p.saves.close()
    return prepared


def _saving_values(r: Prepared, plain: Prepared | None) -> dict[str, Any]:
  """A checkpoint row's figures against ``plain``, its mode's row (None for the others)."""
  s, paired = r.saves, plain and len(plain.block_s) == len(r.block_s)
  call_s, wait_s = s.medians() if s else (None, None)
  return {"vs_no_saves": statistics.median(a / b for a, b in zip(r.block_s, plain.block_s))
          if paired else None, "save_call_s": call_s, "save_wait_s": wait_s,
          "saves": len(s.calls) if s else 0, "checkpoint_bytes": s and s.bytes,
          "no_saves_key": plain and plain.key}


COLUMNS = ["variant", "compile s", "step ms", "speed-up", "spread", "vs MultiSteps",
           "gap closed", "vs no saves", "save call ms", "goal", "collectives", "coll. bytes",
           "opt state/dev", "params+opt/dev", "max |Δp| vs per-leaf"]


def table(model: Model, results: dict[str, Prepared | str], devices: int) -> h.Table:
  timed = {k: r for k, r in results.items() if not isinstance(r, str)}
  floor, multi = timed.get(FLOOR), timed.get(MULTISTEPS)
  t = h.Table(COLUMNS, title=f"{model.describe} ({model.num_leaves} leaves, "
                             f"{model.num_params / 1e6:.2f} M params), adam, {devices} devices")
  for key, r in results.items():
    v = VARIANTS[key]
    base, goal = timed.get(v.baseline), GOALS.get((model.name, key))
    common = dict(model=model.name, key=key, leaves=model.num_leaves, params=model.num_params,
                  psi=model.num_params, baseline=v.baseline, goal_speedup=goal)
    if isinstance(r, str):  # refused by data_parallel
      t.add(v.label, "-", "refused", *["-"] * 6, "" if goal is None else
            f">={goal:g}x {h.verdict(False)}", *["-"] * 5, refused=r, **common)
      continue
    speedup = h.ratio(base.step_s, r.step_s) if base else None
    ratios = [a / b for a, b in zip(base.block_s, r.block_s)] if base and len(
        base.block_s) == len(r.block_s) else None
    vs_multi = h.ratio(multi.step_s, r.step_s) if multi and key in ACCUMULATING else None
    closed = (None if v.saves or not (base and floor) or base.step_s <= floor.step_s
              else (base.step_s - r.step_s) / (base.step_s - floor.step_s))
    saving = _saving_values(r, timed.get(v.mode) if v.saves else None)
    diff = h.max_diff(r.params, base.params) if v.compared and base else None
    diff_multi = (h.max_diff(r.params, multi.params)
                  if multi and key in ACCUMULATING and key != MULTISTEPS else None)
    text, calls = r.compiled.text(), len(r.batches)
    # Collectives in a loop body run every iteration (the micro-steps' loop).
    every, in_loop = h.count_collectives(text), _reference.loop_collectives(text)
    coll_bytes = sum(every.result_bytes.values())
    colls = every.short() + (f" ({in_loop.short()} in loop)" if any(in_loop.count.values())
                             else "") + (f" x{calls} calls" if calls > 1 else "")
    opt_bytes = h.bytes_per_device(r.state.opt_state)
    state_bytes = h.bytes_per_device((r.state.params, r.state.opt_state))  # masters too
    t.add(v.label, h.fmt_s(r.compiled.total_s), h.fmt_ms(r.step_s), h.fmt_ratio(speedup),
          "-" if ratios is None else f"{min(ratios):.2f}–{max(ratios):.2f}",
          h.fmt_ratio(vs_multi), "-" if closed is None else f"{100 * closed:.0f}%",
          h.fmt_ratio(saving["vs_no_saves"]), h.fmt_ms(saving["save_call_s"]),
          "" if goal is None or speedup is None else f">={goal:g}x {h.verdict(speedup >= goal)}",
          colls, h.human_bytes(coll_bytes) if coll_bytes else "-", h.human_bytes(opt_bytes),
          f"{h.human_bytes(state_bytes)} ({state_bytes / model.num_params:.1f}Ψ)",
          "-" if diff is None else f"{diff:.1e}" + (" (bf16)" if v.param_dtype else ""),
          **common, param_dtype=np.dtype(v.param_dtype or np.float32).name,
          accumulate=v.accumulate, calls_per_step=calls, lower_s=r.compiled.lower_s,
          compile_s=r.compiled.compile_s, step_s=r.step_s, block_step_s=r.block_s,
          speedup_vs_per_leaf=speedup, speedup_min=ratios and min(ratios),
          speedup_max=ratios and max(ratios), speedup_vs_multisteps=vs_multi,
          gap_closed=closed, **h.collective_values(every), collectives_in_loop=in_loop.count,
          collective_bytes_in_loop=in_loop.result_bytes, opt_state_bytes=opt_bytes,
          state_bytes_per_device=state_bytes,
          state_bytes_per_param=state_bytes / model.num_params,
          max_param_diff_vs_per_leaf=diff, max_param_diff_vs_multisteps=diff_multi,
          final_loss=float(r.metrics["loss"]), **saving)
  return t


def chosen(name: str, model: Model, variants: list[str] | None) -> list[str]:
  """The variants asked for, or ``name``'s defaults; none that drop its model state."""
  keys = variants or MODEL_VARIANTS.get(name) or (
      BIG_MODEL_VARIANTS if model.num_params > BIG_MODEL_PARAMS
      else [k for k in VARIANTS if k not in OPTIMIZER_VARIANTS])
  dropped = [k for k in keys if model.has_state and k not in WITH_STATE]
  if dropped:
    print(f"({name} has model state, which {', '.join(sorted(dropped))} do not carry: skipped)")
  return [k for k in keys if k not in dropped]


def check(opts: Any) -> str | None:
  asked = [v for v in opts.variants or () if v in ACCUMULATING]
  if opts.batch and opts.batch % ACCUMULATE and asked:
    return (f"--batch {opts.batch} does not split into {ACCUMULATE} micro-batches, which "
            f"{', '.join(asked)} need")
  return None


def with_saving(keys: list[str], steps: int) -> tuple[list[str], int]:
  """Checkpoint rows' modes without saves added; steps rounded up to save intervals."""
  out: list[str] = []
  for k in keys:
    plain = VARIANTS[k].mode if VARIANTS[k].saves else None
    if plain and plain not in keys and plain not in out:
      print(f"(adding {plain}: {k} is compared with it)")
      out.append(plain)
    out.append(k)
  if any(VARIANTS[k].saves for k in out) and steps % ckpt.EVERY:
    rounded = -(-steps // ckpt.EVERY) * ckpt.EVERY
    print(f"(blocks of {rounded} steps, not {steps}: the checkpoint rows save every "
          f"{ckpt.EVERY} steps)")
    steps = rounded
  return out, steps


NOTES = ("speed-up, spread, collectives, max |Δp|: docs/performance.md#training-step. gap "
         "closed = (per-leaf - variant) / (per-leaf - grads only); vs MultiSteps = per-leaf + "
         "optax.MultiSteps time / variant time; vs no saves = a checkpoint row's time over the "
         "same mode's, same round; \"xK calls\": one step calls the program K times; refused = "
         "data_parallel raised a TypeError; params+opt/dev in Ψ, the parameter count.")


def run(opts: Any, report: h.Report) -> None:
  for name in opts.models or DEFAULT_MODELS:
    model = MODELS[name]()
    batch_rows = opts.batch or (REAL_MODEL_BATCH if name in REAL_MODELS else PER_DEVICE_BATCH)
    run_keys = chosen(name, model, opts.variants or None)
    if batch_rows % ACCUMULATE:
      run_keys = [k for k in run_keys if k not in ACCUMULATING]
    run_keys, steps = with_saving(run_keys, opts.steps)
    mesh = h.mesh(opts.devices)
    batch = jax.device_put(model.batch(batch_rows * opts.devices), NamedSharding(mesh, P(AXIS)))
    print(f"\n-- {model.describe}: {model.num_leaves} leaves, {model.num_params / 1e6:.2f} M "
          f"params; global batch {batch_rows * opts.devices}; {opts.rounds} x {steps} steps",
          flush=True)
    results = measure(model, run_keys, mesh, batch, steps=steps, rounds=opts.rounds)
    report.table(table(model, results, opts.devices))
    del model, results
    h.release_host_memory()
  report.text(NOTES)
