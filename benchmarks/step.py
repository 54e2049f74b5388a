"""A whole data-parallel adam step on 8 forced CPU devices: jpack against plain steps.

Every variant trains the same model from the same parameters on the same batch, split
over the mesh axis ``"batch"`` by ``NamedSharding``, with the state donated. The models:
real architectures from `benchmarks.models` with their real leaf counts, narrowed (a
GPT-2 decoder of 12 blocks, width 64, tied embedding, 148 leaves; a ViT encoder of 12
blocks, 152 leaves; a ResNet-18 of basic blocks, width 16, 62 leaves, whose BatchNorm
running statistics are model state, ``dp.init(params, model_state)``), per-device
batch 4; and MLPs of equal-sized leaves, per-device batch 16. The baselines are written
here without jpack; all but the jit ones are shard_map steps:

  per-leaf      per-leaf ``lax.pmean`` of the gradients + optax.adam (the baseline)
  ravel         ``ravel_pytree`` + one pmean + unravel, optax.adam
  optax.flatten per-leaf pmean + ``optax.flatten(optax.adam)``
  jit           plain ``jax.jit`` over global arrays: params replicated, batch split,
                loss = mean over the global batch; XLA inserts (and combines) the
                gradient all-reduces
  jit ZeRO-1    the same with the adam state split over the axis by its shardings (each
                leaf's largest evenly divisible dimension), so XLA partitions the update
                and all-gathers the new params
  hand ZeRO-1   ZeRO-1 with plain jax + optax: <= 4 MiB f32 buckets, a custom-VJP
                unpack, psum_scatter / all_gather per bucket

The jit steps run on the mesh with Auto axes (XLA picks the shardings inside the step);
they carry no model state, so they are left out on the ResNet.

The jpack variants:

  allreduce     ``jpack.data_parallel(mode="allreduce")``: params a tree, gradients
                packed into buckets, one collective per bucket, unpacked
  optax.chain   ``optax.chain(jpack.optax.allreduce(AXIS, grad_norm=True), optax.adam)``
                in a plain shard_map step (not on big models); it reports the norm
                allreduce keeps, as data_parallel does
  hand pmean    the README's hand-written step: per-leaf's, with ``jpack.pmean(grads)``
  packed        ``mode="packed"``: persistent packed params; the loss unpacks them,
                gradients arrive packed, adam updates the buckets (no per-step pack)
  packed bf16   the same with a bf16 wire (``Precision(comm_dtype=jnp.bfloat16)``)
  sharded       ``mode="sharded"``: ZeRO-1, ``jpack.optax.sharded(adam)`` on packed params

Mixed precision, ``precision=jpack.Precision(param_dtype=jnp.bfloat16)``: bf16 params for
the loss, f32 masters in
the optimizer state (replicated in packed, split 1/N like the moments in sharded), the
new params all-gathered in bf16 in sharded. Their parameter difference from per-leaf is
bf16 rounding, not a check:

  packed, bf16 params    ``mode="packed", precision=Precision(param_dtype=jnp.bfloat16)``
  sharded, bf16 params   ``mode="sharded", precision=Precision(param_dtype=jnp.bfloat16)``

Gradient accumulation over 4 micro-batches (each device's rows of the batch, split in
4), one adam update per step, against the usual way to write it:

  per-leaf + MultiSteps  the per-leaf step with ``optax.MultiSteps(adam, 4)``, called
                         4 times per measured step on micro-batches of 1/4 of the batch:
                         an all-reduce of every gradient leaf on every micro-step
  packed, accumulate=4   ``mode="packed", accumulate=4``: micro-batches under lax.scan,
                         gradients summed in f32 buckets, reduced once per step
  sharded, accumulate=4  the same in ``mode="sharded"``
  sharded, acc=4 ZeRO-2  ``mode=jpack.Mode("sharded", shard_accumulator=True),
                         accumulate=4``: every micro-step's gradients reduce-scattered
                         into a 1/N accumulator

Checkpoints: the packed and the sharded step with an asynchronous Orbax checkpoint
every 10 steps (``jpack.checkpoint.save`` after every step, a ``CheckpointManager``
saving every 10th; benchmarks/checkpoint.py's loop), timed in the same run as the rows
without saves; "vs no saves" is the row's step time over the same mode's without saves
(median over blocks of the block-by-block ratio):

  packed, async save every 10    ``mode="packed"``
  sharded, async save every 10   ``mode="sharded"``

Every block of these rows saves after its first step and waits for the write at its end
(inside the block's time: the write runs beside the block's other 9 steps, or holds the
loop up); with them, blocks are rounded up to a multiple of 10 steps for every variant.
On CPU devices the background write shares the host's cores with the steps.

GPT-2's optimizers (on ``gpt2_12x64`` by default), each against per-leaf optax with the
same optimizer (speed-up and max |Δp| are against that row):

  adamw(mask=)  ``optax.adamw(lr, weight_decay=0.1, mask=<matrices and embeddings>)``:
                per-leaf; ``mode="packed"`` and ``mode="sharded"`` (the mask computed
                leaf by leaf on the buckets and slices); and ``mode="sharded"`` with
                ``jpack.optax.partition({decay: adamw, no_decay: adam}, labels)``
  lamb, muon    ``optax.lamb``, ``optax.contrib.muon``: per-leaf, ``mode="packed"``
                and ``mode="sharded"``: lamb's trust ratio computed leaf by leaf on the
                buckets and slices, muon on the leaves (packed) or on each device's own
                whole leaves (sharded). A variant that data_parallel refuses (a
                TypeError) is shown as a "refused" row

And bounds, which are not adam steps:

  grads only    loss + gradients, no collective, no update. Every step does at least
                this: it is the floor of the step time
  packed grads  the same with persistent packed params (the loss unpacks them, gradients
    only        come out packed): its distance from grads only is what pack + unpack cost
  ZeRO-1 sgd    ``mode="sharded"`` with plain SGD: the collectives every ZeRO-1 step
                pays, almost no update, so it bounds what ZeRO-1 with any optimizer reaches

Reported per variant: compile time (lower + compile of the step); median step time over
several timed blocks of steps (variants interleaved, block by block); speed-up over
per-leaf (the ratio of the medians) and its spread, the lowest and highest of the
block-by-block ratios (the same round's times); "gap closed", the share of per-leaf's
time above the grads-only floor that the variant removes, (t_per_leaf - t_variant) /
(t_per_leaf - t_grads_only), all from the same run; for the accumulation rows, the speed-up over per-leaf + MultiSteps; the collectives
in the compiled step (AR all-reduce, RS reduce-scatter, AG all-gather, A2A all-to-all)
and their bytes, counted once per program (ops inside a loop body are marked, and run
once per iteration); optimizer-state bytes per device; the bytes of params + optimizer
state (masters and moments) per device, also in units of Ψ = the parameter count; and
the largest parameter difference from the per-leaf variant after the same steps (a
sanity check: every adam variant is the same optimizer, with the same updates).

    python -m benchmarks step                  # GPT-2, ViT, ResNet-18, the two MLPs
    python -m benchmarks step --quick          # mlp_40x256 only, fewer steps
    python -m benchmarks step --models mlp_400x32 --markdown step.md
    python -m benchmarks step --models resnet50   # ResNet-50 shapes, no compute to hide copies
    python -m benchmarks step --quick --variants packed,sharded,packed_save10,sharded_save10
                                               # the checkpoint rows and theirs without saves
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack
from jpack import _reference
from benchmarks import _common as c
from benchmarks import checkpoint as ckpt
from benchmarks import models
from benchmarks.models import Model

NUM_DEVICES = 8
AXIS = "batch"
PER_DEVICE_BATCH = 16
REAL_MODEL_BATCH = 4  # per device, on the real architectures (their compute is larger)
LEARNING_RATE = 1e-3

# Targets: step-time speed-up over the per-leaf step, same run. mlp_24x1024 has about
# ResNet-50's parameter count (25.2 M).
# On the real architectures: the default mode 1.3x, ZeRO-1 1.5x, the hand-written
# jpack.pmean step 1.0x; ZeRO-1 with GPT-2's other optimizers 1.2x over per-leaf optax
# with the same optimizer.
REAL_MODELS = ("gpt2_12x64", "vit_12x64", "resnet18_narrow")
GOALS = {("mlp_40x256", "allreduce"): 1.0, ("mlp_40x256", "optax_chain"): 1.0,
         ("mlp_40x256", "packed"): 1.0,
         ("mlp_40x256", "sharded"): 2.5, ("mlp_24x1024", "allreduce"): 1.0,
         ("mlp_24x1024", "packed"): 1.0, ("mlp_24x1024", "sharded"): 1.5,
         **{(m, k): g for m in REAL_MODELS
            for k, g in (("packed", 1.3), ("sharded", 1.5), ("hand_pmean", 1.0))},
         **{("gpt2_12x64", f"sharded_{o}"): 1.2 for o in ("adamw_mask", "lamb", "muon")}}

VARIANTS = {
    "per_leaf": "per-leaf pmean",
    "ravel": "ravel_pytree",
    "flatten": "optax.flatten",
    "jit": "jit + NamedSharding",
    "jit_zero1": "jit, ZeRO-1 by sharding",
    "jit_fsdp": "jit, FSDP by sharding",
    "allreduce": "jpack allreduce",
    "optax_chain": "optax.chain(jpack.optax.allreduce, adam)",
    "hand_pmean": "hand-written jpack.pmean step",
    "packed": "jpack packed",
    "packed_bf16": "jpack packed bf16",
    "sharded": "jpack sharded",
    "fsdp": "jpack fsdp (ZeRO-3)",
    "hand_zero1": "hand-written ZeRO-1",
    "packed_bf16_params": "jpack packed, bf16 params",
    "sharded_bf16": "jpack sharded, bf16 params",
    "per_leaf_multisteps4": "per-leaf + MultiSteps k=4",
    "packed_acc4": "jpack packed, accumulate=4",
    "sharded_acc4": "jpack sharded, accumulate=4",
    "sharded_acc4_zero2": "jpack sharded, acc=4 ZeRO-2",
    "grad_only": "bound: grads only",
    "packed_grad_only": "bound: packed grads only",
    "sharded_sgd": "bound: ZeRO-1 with sgd",
    "packed_save10": f"jpack packed, async save every {ckpt.EVERY}",
    "sharded_save10": f"jpack sharded, async save every {ckpt.EVERY}",
    # GPT-2's optimizers, each against per-leaf optax with the same optimizer.
    "per_leaf_adamw_mask": "per-leaf, adamw(mask=no decay on biases, norms)",
    "packed_adamw_mask": "jpack packed, adamw(mask=...)",
    "sharded_adamw_mask": "jpack sharded, adamw(mask=...)",
    "sharded_adamw_labels": "jpack sharded, adamw/adam by optax.partition",
    "per_leaf_lamb": "per-leaf, lamb",
    "packed_lamb": "jpack packed, lamb",
    "sharded_lamb": "jpack sharded, lamb",
    "per_leaf_muon": "per-leaf, contrib.muon",
    "packed_muon": "jpack packed, contrib.muon",
    "sharded_muon": "jpack sharded, contrib.muon",
}
ACCUMULATE = 4  # micro-batches per step of the accumulation rows
MULTISTEPS = "per_leaf_multisteps4"  # their baseline


WEIGHT_DECAY = 0.1  # GPT-2's adamw


def decays(params: Any) -> Any:
  """GPT-2's weight-decay mask: decay on matrices and embeddings, not on biases and norms."""
  return jax.tree.map(lambda x: np.ndim(x) >= 2, params)


def adamw_mask(lr: float) -> optax.GradientTransformation:
  """GPT-2's recipe, as users write it."""
  return optax.adamw(lr, weight_decay=WEIGHT_DECAY, mask=decays)


def adamw_by_label(lr: float) -> dict[str, optax.GradientTransformation]:
  """The same as `jpack.optax.partition` takes it (with `decay_labels`): adamw where
  `decays`, adam (adamw without its decay) elsewhere, each label in its own buckets."""
  return {"decay": optax.adamw(lr, weight_decay=WEIGHT_DECAY), "no_decay": optax.adam(lr)}


def decay_labels(params: Any) -> Any:
  return jax.tree.map(lambda d: "decay" if d else "no_decay", decays(params))


# GPT-2's other optimizers (`--models gpt2_12x64`): per-leaf optax, packed, sharded.
OPTIMIZERS = {"adamw_mask": adamw_mask, "lamb": optax.lamb, "muon": optax.contrib.muon}


class JpackVariant(NamedTuple):
  """The `jpack.data_parallel` arguments of a variant."""
  mode: str
  optimizer: Callable[[float], Any] = optax.adam
  comm_dtype: Any = None   # jpack.Precision(comm_dtype=)
  param_dtype: Any = None  # jpack.Precision(param_dtype=)
  accumulate: int = 1
  shard_accumulator: bool = False  # jpack.Mode(mode, shard_accumulator=)
  # params -> labels: the optimizer (a dict by label) runs as jpack.optax.partition
  labels: Callable[[Any], Any] | None = None


DATA_PARALLEL = {
    "allreduce": JpackVariant("allreduce"),
    "packed": JpackVariant("packed"),
    "packed_bf16": JpackVariant("packed", comm_dtype=jnp.bfloat16),
    "sharded": JpackVariant("sharded"),
    "fsdp": JpackVariant("fsdp"),
    "packed_bf16_params": JpackVariant("packed", param_dtype=jnp.bfloat16),
    "sharded_bf16": JpackVariant("sharded", param_dtype=jnp.bfloat16),
    "packed_acc4": JpackVariant("packed", accumulate=ACCUMULATE),
    "sharded_acc4": JpackVariant("sharded", accumulate=ACCUMULATE),
    "sharded_acc4_zero2": JpackVariant("sharded", accumulate=ACCUMULATE,
                                       shard_accumulator=True),
    "sharded_sgd": JpackVariant("sharded", optimizer=optax.sgd),
    "packed_save10": JpackVariant("packed"),
    "sharded_save10": JpackVariant("sharded"),
    "packed_adamw_mask": JpackVariant("packed", optimizer=adamw_mask),
    "sharded_adamw_mask": JpackVariant("sharded", optimizer=adamw_mask),
    "sharded_adamw_labels": JpackVariant("sharded", optimizer=adamw_by_label,
                                         labels=decay_labels),
    "packed_lamb": JpackVariant("packed", optimizer=optax.lamb),
    "sharded_lamb": JpackVariant("sharded", optimizer=optax.lamb),
    "packed_muon": JpackVariant("packed", optimizer=optax.contrib.muon),
    "sharded_muon": JpackVariant("sharded", optimizer=optax.contrib.muon),
}
# Each variant's per-leaf baseline (the same optimizer): speed-up and max |Δp| are
# against it. The others' is "per_leaf" (adam).
BASELINES = {**{f"{mode}_{o}": f"per_leaf_{o}" for o in OPTIMIZERS
                for mode in ("packed", "sharded")},
             "sharded_adamw_labels": "per_leaf_adamw_mask"}
OPTIMIZER_VARIANTS = (*(k for o in OPTIMIZERS
                        for k in (f"per_leaf_{o}", f"packed_{o}", f"sharded_{o}")),
                      "sharded_adamw_labels")
# Variants that save a checkpoint every ckpt.EVERY steps, and the variant each is timed
# against: the same step without saves.
SAVING = {"packed_save10": "packed", "sharded_save10": "sharded"}
# Variants that are not adam, or not a step: no parameter comparison with per-leaf.
NOT_COMPARABLE = ("per_leaf", "grad_only", "packed_grad_only", "sharded_sgd",
                  *(f"per_leaf_{o}" for o in OPTIMIZERS))
# Variants that carry a model's state (`Model.has_state`: the ResNet's BatchNorm
# running statistics); the others are skipped on such a model.
WITH_STATE = ("per_leaf", "hand_pmean", "optax_chain", "ravel", "flatten", "allreduce",
              "packed", "sharded", "fsdp", "grad_only", "packed_grad_only")
# Variants whose params are bf16: their difference from per-leaf is the rounding's.
BF16_PARAMS = tuple(k for k, v in DATA_PARALLEL.items() if v.param_dtype is not None)
# Variants that accumulate micro-batches, compared with per-leaf + MultiSteps.
ACCUMULATING = (MULTISTEPS,) + tuple(k for k, v in DATA_PARALLEL.items() if v.accumulate > 1)
FLOOR = "grad_only"


# -- models ----------------------------------------------------------------------------


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
  """A workload's parameter table with a cheap per-leaf quadratic loss.

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


# The real architectures (`benchmarks.models`) with their real models' leaf counts,
# narrowed to what 8 simulated CPU devices time in seconds: GPT-2 small's 148 leaves
# (tied embedding), ViT-B/16's 152, ResNet-18's 62 (basic blocks) with 40 BatchNorm
# running statistics as model state. The tiny ones are smoke tests of the benchmark.
MODELS = {
    "gpt2_12x64": lambda: models.gpt2(layers=12, width=64, vocab=1024, positions=32,
                                      heads=4, seq=16, name="gpt2_12x64"),
    "vit_12x64": lambda: models.vit(layers=12, width=64, patch=8, image=32, classes=100,
                                    heads=4, name="vit_12x64"),
    "resnet18_narrow": lambda: models.resnet(models.RESNET18_BLOCKS, width=16, image=32,
                                             classes=100, block="basic", bn_state=True,
                                             name="resnet18_narrow"),
    "gpt2_2x16": lambda: models.gpt2(layers=2, width=16, vocab=64, positions=8, heads=2,
                                     seq=4, name="gpt2_2x16"),
    "vit_2x16": lambda: models.vit(layers=2, width=16, patch=4, image=8, classes=10,
                                   heads=2, name="vit_2x16"),
    "resnet18_tiny": lambda: models.resnet(models.RESNET18_BLOCKS, width=4, image=8,
                                           classes=10, block="basic", bn_state=True,
                                           name="resnet18_tiny"),
    "mlp_40x256": lambda: mlp(40, 256),
    "resnet50": lambda: shape_table("resnet50"),
    "mlp_24x1024": lambda: mlp(24, 1024),
    "mlp_400x32": lambda: mlp(400, 32),
    "mlp_4x32": lambda: mlp(4, 32),  # a smoke test of the benchmark itself
    # A smoke test whose buckets need no padding in bf16 or f32 on 8 devices: its bf16
    # and f32 bytes compare exactly 1:2.
    "mlp_4x256": lambda: mlp(4, 256),
}
DEFAULT_MODELS = ("gpt2_12x64", "vit_12x64", "resnet18_narrow", "mlp_40x256", "mlp_24x1024")
# What runs on the real architectures by default: the modes, the steps users write by
# hand, the jit baselines and the floor; on GPT-2 also its optimizers.
# (Each costs a compilation of a 12-block model: about a minute on a busy 2-core host.)
REAL_MODEL_VARIANTS = ("per_leaf", "jit", "jit_zero1", "hand_pmean", "packed", "sharded")
MODEL_VARIANTS = {"gpt2_12x64": REAL_MODEL_VARIANTS + OPTIMIZER_VARIANTS,
                  "vit_12x64": REAL_MODEL_VARIANTS,
                  "resnet18_narrow": REAL_MODEL_VARIANTS}
# Every variant keeps its state alive while they are timed round-robin: on big models
# only these run by default (ResNet-50 holds gigabytes of replicated state per variant;
# the sharded ones added to the list hold little).
# Eight fit in 24 GiB on MLP 24x1024 (25 M params, 8 simulated devices); twelve did not.
BIG_MODEL_VARIANTS = ("per_leaf", "jit", "jit_zero1", "allreduce", "packed", "sharded",
                      "sharded_bf16", "grad_only")
BIG_MODEL_PARAMS = 10_000_000


# -- the steps -------------------------------------------------------------------------


class State(NamedTuple):
  """What the steps written here carry from one step to the next."""
  params: Any     # a tree, or buckets
  opt_state: Any  # the optimizer state (per-device slices for ZeRO-1)
  model_state: Any = None  # the model's state (`Model.has_state`), replicated


class Step(NamedTuple):
  """A variant's functions, the three that `jpack.DataParallel` also has, and how many
  calls of ``step`` make one measured step (each on that share of every device's rows)."""
  init: Callable[..., Any]  # host params (and model state, if any) -> placed state
  step: Callable[[Any, Any], tuple[Any, dict]]  # (state, batch) -> (new state, metrics)
  unpack: Callable[[Any], Any]                  # state -> params as the original tree
  calls: int = 1


def _per_device(tree: Any) -> Any:
  """This device's copy of replicated values: differentiating w.r.t. it keeps the
  gradients local, where shard_map's autodiff would psum each leaf's gradient itself."""
  return jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), tree)


def _per_leaf_pmean(grads: Any, params: Any = None) -> Any:
  del params
  return jax.tree.map(lambda g: jax.lax.pmean(g, AXIS), grads)


def _ravel_pmean(grads: Any, params: Any = None) -> Any:
  del params
  flat, unravel = ravel_pytree(grads)
  return unravel(jax.lax.pmean(flat, AXIS))


def _record_norm() -> optax.GradientTransformation:
  """Keeps the global norm of the updates it sees as its state: like every
  `jpack.data_parallel` step, the plain steps report the reduced gradients' norm."""
  return optax.GradientTransformation(
      lambda params: jnp.zeros((), jnp.float32),
      lambda updates, state, params=None: (updates, optax.tree.norm(updates)))


def _loss_and_grads(model: Model, params: Any, model_state: Any, batch: Any,
                    to_tree: Callable[[Any], Any] = lambda p: p
                    ) -> tuple[jax.Array, Any, Any]:
  """Loss, gradients w.r.t. ``params`` (``to_tree`` makes the model's params of them)
  and the new model state (averaged over the axis leaf by leaf, as `jpack.data_parallel`
  averages it; None without state) of this device's batch."""
  if not model.has_state:
    loss, grads = jax.value_and_grad(lambda p: model.loss(to_tree(p), batch))(params)
    return loss, grads, None
  (loss, new), grads = jax.value_and_grad(
      lambda p: model.loss(to_tree(p), model_state, batch), has_aux=True)(params)
  return loss, grads, jax.tree.map(lambda x: jax.lax.pmean(x, AXIS), new)


def _plain_step(model: Model, mesh, reduce: optax.GradientTransformation,
                optimizer: optax.GradientTransformation, record_norm: bool = True) -> Step:
  """A data-parallel step as written without `jpack.data_parallel`: a shard_map step on
  replicated params whose optimizer is ``optax.chain(reduce, <record the norm>,
  optimizer)``, ``reduce`` averaging the per-device gradients over the axis. Without
  ``record_norm`` the chain is ``optax.chain(reduce, optimizer)``, and the norm is the
  one ``reduce`` keeps in its state, if it keeps one (`jpack.optax.allreduce` does).
  A model's state is carried and averaged (`_loss_and_grads`)."""
  tx = optax.chain(reduce, *([_record_norm()] if record_norm else []), optimizer)

  def local_step(state, batch):
    loss, grads, model_state = _loss_and_grads(model, _per_device(state.params),
                                               state.model_state, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    norm = opt_state[1] if record_norm else getattr(opt_state[0], "grad_norm", None)
    return (State(optax.apply_updates(state.params, updates), opt_state, model_state),
            {"loss": jax.lax.pmean(loss, AXIS), "grad_norm": norm})

  init = jax.jit(jax.shard_map(lambda p, m: State(p, tx.init(p), m), mesh=mesh,
                               in_specs=P(), out_specs=P()))
  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(AXIS)),
                               out_specs=(P(), P())), donate_argnums=0)
  replicated = NamedSharding(mesh, P())
  return Step(lambda params, model_state=None: init(
      *jax.device_put((params, model_state), replicated)), step, lambda state: state.params)


def _zero1_sharding(x: jax.ShapeDtypeStruct, mesh) -> NamedSharding:
  """``x`` split over the axis along its largest dimension that splits evenly (the first
  of equal ones); replicated when none does, as adam's step count."""
  n = mesh.shape[AXIS]
  for d in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
    if x.shape[d] and x.shape[d] % n == 0:
      return NamedSharding(mesh, P(*(AXIS if i == d else None for i in range(x.ndim))))
  return NamedSharding(mesh, P())


def _jit_step(model: Model, mesh, zero1: bool = False,
              optimizer: optax.GradientTransformation | None = None,
              fsdp: bool = False) -> Step:
  """Data parallelism as plain ``jax.jit`` gives it, without shard_map: a step over
  global arrays, params replicated and the batch split by their shardings, so XLA
  partitions it and inserts the gradient all-reduces itself. With ``zero1`` the
  optimizer state is split too (`_zero1_sharding`): XLA updates each device's slice and
  all-gathers the new params, which stay replicated. With ``fsdp`` the params are split
  the same way (FSDP as MaxText's axis rules give it): XLA gathers them for the loss.

  The shardings are given as ``in_shardings`` / ``out_shardings``, which the
  benchmark's Explicit-axes mesh and an Auto-axes one both take. The two compile the
  same collectives and update; under ZeRO-1 they differ only in how the reported
  gradient norm is summed (an Auto mesh adds a small all-reduce for it).
  """
  tx = optax.chain(_record_norm(), optimizer or optax.adam(LEARNING_RATE))
  replicated = NamedSharding(mesh, P())
  params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                             model.params)
  split = (lambda x: _zero1_sharding(x, mesh)) if zero1 else (lambda _: replicated)
  shardings = State(jax.tree.map(split if fsdp else (lambda _: replicated), params_like),
                    jax.tree.map(split, jax.eval_shape(tx.init, params_like)))

  def global_step(state, batch):
    # The mean over the global batch: with equal slices, the mean of the per-device
    # means the shard_map steps average, so every variant takes the same gradient.
    loss, grads = jax.value_and_grad(model.loss)(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return (State(optax.apply_updates(state.params, updates), opt_state),
            {"loss": loss, "grad_norm": opt_state[0]})

  init = jax.jit(lambda p: State(p, tx.init(p)), out_shardings=shardings)
  step = jax.jit(global_step, in_shardings=(shardings, NamedSharding(mesh, P(AXIS))),
                 out_shardings=(shardings, replicated), donate_argnums=0)
  return Step(lambda params: init(jax.device_put(params, replicated)) if not fsdp else
              init(params), step, lambda state: state.params)


def _grads_only(model: Model, mesh, layout: jpack.Layout | None = None) -> Step:
  """The compute every data-parallel step shares: per-device loss and gradients (with a
  ``layout``: of params kept packed, the loss unpacking them)."""
  def local_step(state, batch):
    loss, grads, _ = _loss_and_grads(model, _per_device(state.params), state.model_state,
                                     batch, (lambda p: p) if layout is None else jpack.unpack)
    # Gradients are outputs (per device), so XLA cannot drop their computation.
    return state, {"loss": jax.lax.pmean(loss, AXIS),
                   "grads": jax.tree.map(lambda g: g[None], grads)}

  # Donated like every real step's state: returned unchanged, it is then aliased, not
  # copied (a copy of the replicated params would be a sizeable part of this step).
  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(P(), P(AXIS)),
                               out_specs=(P(), {"loss": P(), "grads": P(AXIS)})),
                 donate_argnums=0)
  replicated = NamedSharding(mesh, P())
  prepare = (lambda params: params) if layout is None else (
      lambda params: jpack.pack(params, layout))
  to_tree = (lambda state: state.params) if layout is None else (
      lambda state: jpack.unpack(state.params))
  return Step(lambda params, model_state=None: State(
      *jax.device_put((prepare(params), (), model_state), replicated)), step, to_tree)


def _buckets_of(params: Any, n: int, bucket_bytes: int) -> tuple[list[list[int]], list[int]]:
  """The hand-written ZeRO-1's buckets: leaf indices filled from the last leaf, <=
  ``bucket_bytes`` of f32 each, and each bucket's length padded to a multiple of ``n``."""
  sizes = [int(np.size(x)) for x in jax.tree.leaves(params)]
  groups, current, nbytes = [], [], 0
  for i in reversed(range(len(sizes))):
    if current and nbytes + 4 * sizes[i] > bucket_bytes:
      groups.append(current)
      current, nbytes = [], 0
    current.append(i)
    nbytes += 4 * sizes[i]
  groups.append(current)
  return groups, [-(-sum(sizes[i] for i in g) // n) * n for g in groups]


def _hand_zero1(model: Model, mesh, bucket_bytes: int = 4 * 2**20) -> Step:
  """ZeRO-1 written by hand with plain jax + optax, as an independent reference for
  jpack's sharded step.

  Parameters live as f32 buckets (`_buckets_of`); the loss unpacks them through a
  custom VJP whose backward is one concatenate; gradients are ``psum_scatter``-ed per
  bucket, adam runs on this device's slice, and the new slices are ``all_gather``-ed.
  """
  n = mesh.shape[AXIS]
  leaves, treedef = jax.tree.flatten(model.params)
  shapes = [np.shape(x) for x in leaves]
  sizes = [int(np.size(x)) for x in leaves]
  groups, lengths = _buckets_of(model.params, n, bucket_bytes)

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
  tx = optax.adam(LEARNING_RATE)

  def local_slice(buckets):
    k = jax.lax.axis_index(AXIS)
    return [jax.lax.dynamic_slice_in_dim(b, k * (b.shape[0] // n), b.shape[0] // n)
            for b in buckets]

  def local_init(params):
    buckets = pack(jax.tree.leaves(params))
    return State(buckets, tx.init(local_slice(buckets)))

  def local_step(state, batch):
    def loss(buckets):
      return model.loss(jax.tree.unflatten(treedef, unpack(buckets)), batch)

    value, grads = jax.value_and_grad(loss)(_per_device(state.params))
    grads = [jax.lax.psum_scatter(g, AXIS, tiled=True) / n for g in grads]
    mine = local_slice(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, mine)
    new = [jax.lax.all_gather(x, AXIS, tiled=True) for x in optax.apply_updates(mine, updates)]
    return State(new, opt_state), {"loss": jax.lax.pmean(value, AXIS)}

  return _sharded_state_step(local_init, local_step, mesh, model.params,
                             lambda state: jax.tree.unflatten(treedef, unpack(state.params)))


def _sharded_state_step(local_init: Callable, local_step: Callable, mesh, params: Any,
                        to_tree: Callable) -> Step:
  """Jit a shard_map step whose params are replicated and whose optimizer state is split
  over the axis (every array of rank >= 1 in it)."""
  params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
  shapes = jax.eval_shape(jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=P(),
                                        check_vma=False), params_like)
  specs = State(jax.tree.map(lambda _: P(), shapes.params),
                jax.tree.map(lambda x: P(AXIS) if x.ndim else P(), shapes.opt_state))
  init = jax.jit(jax.shard_map(local_init, mesh=mesh, in_specs=P(), out_specs=specs,
                               check_vma=False))
  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(specs, P(AXIS)),
                               out_specs=(specs, {"loss": P()}), check_vma=False),
                 donate_argnums=0)
  replicated = NamedSharding(mesh, P())
  return Step(lambda p: init(jax.device_put(p, replicated)), step, jax.jit(to_tree))


def _multi_steps(model: Model, mesh, k: int) -> Step:
  """Accumulation as optax offers it: the per-leaf step with ``optax.MultiSteps(adam, k)``,
  called ``k`` times per step. Every call all-reduces its micro-batch's gradients, and
  MultiSteps applies adam to their mean on the k-th."""
  adam = optax.MultiSteps(optax.adam(LEARNING_RATE), every_k_schedule=k)
  step = _plain_step(model, mesh, optax.stateless(_per_leaf_pmean),
                     adam.gradient_transformation())
  return step._replace(calls=k)


def _auto(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """``mesh`` with Auto axes, as a plain jit user has it: XLA chooses the shardings
  inside the step (under Explicit axes, an embedding lookup's would have to be spelled
  out)."""
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def build(key: str, model: Model, mesh, plan_options: dict) -> Any:
  """Variant ``key``'s step: a `Step`, or the `jpack.DataParallel` of a jpack mode.

  ``plan_options`` (``--bucket-bytes``, ``--solo-bytes``) go to the steps written here
  that plan buckets (hand pmean, optax.chain, packed grads only); `jpack.data_parallel`
  takes none: the platform decides (`jpack.step_options`). A model's state is given to
  the step's ``init`` (`_prepare`)."""
  if key in DATA_PARALLEL:
    v = DATA_PARALLEL[key]
    optimizer = v.optimizer(LEARNING_RATE)
    if v.labels is not None:
      optimizer = jpack.optax.partition(optimizer, v.labels(model.params))
    return jpack.data_parallel(
        model.loss, optimizer, model.params, mesh,
        mode=jpack.Mode(v.mode, shard_accumulator=v.shard_accumulator),
        precision=jpack.Precision(param_dtype=v.param_dtype, comm_dtype=v.comm_dtype),
        accumulate=v.accumulate)
  adam = optax.adam(LEARNING_RATE)
  per_leaf = optax.stateless(_per_leaf_pmean)
  if key in OPTIMIZER_VARIANTS:  # per_leaf_<optimizer>
    return _plain_step(model, mesh, per_leaf, OPTIMIZERS[key[len("per_leaf_"):]](LEARNING_RATE))
  builders = {
      "per_leaf": lambda: _plain_step(model, mesh, per_leaf, adam),
      "hand_pmean": lambda: _plain_step(
          model, mesh, optax.stateless(lambda g, p=None: jpack.pmean(g, AXIS, **plan_options)),
          adam),
      MULTISTEPS: lambda: _multi_steps(model, mesh, ACCUMULATE),
      "ravel": lambda: _plain_step(model, mesh, optax.stateless(_ravel_pmean), adam),
      "flatten": lambda: _plain_step(model, mesh, per_leaf, optax.flatten(adam)),
      "jit": lambda: _jit_step(model, _auto(mesh)),
      "jit_zero1": lambda: _jit_step(model, _auto(mesh), zero1=True),
      "jit_fsdp": lambda: _jit_step(model, _auto(mesh), zero1=True, fsdp=True),
      "optax_chain": lambda: _plain_step(
          model, mesh, jpack.optax.allreduce(AXIS, grad_norm=True, **plan_options), adam,
          record_norm=False),
      "hand_zero1": lambda: _hand_zero1(model, mesh),
      "grad_only": lambda: _grads_only(model, mesh),
      "packed_grad_only": lambda: _grads_only(model, mesh,
                                              jpack.plan(model.params, **plan_options)),
  }
  return builders[key]()


# -- measuring -------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
  key: str
  compiled: c.Compiled
  step_s: float
  block_s: list[float]  # mean step time of every timed block
  colls: c.Collectives
  loop_colls: c.Collectives  # those of `colls` in a loop body: they run every iteration
  calls: int            # compiled calls per step
  opt_bytes: int
  state_bytes: int      # params + optimizer state (masters included), per device
  params: Any  # final params, host numpy tree
  loss: float
  saves: _Saves | None = None  # the checkpoint rows'


def _bytes_per_device(tree: Any) -> int:
  """Bytes that device 0 holds for ``tree`` (a replicated leaf counts fully)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shards = getattr(x, "addressable_shards", None)
    total += shards[0].data.nbytes if shards else np.asarray(x).nbytes
  return total


def _micro_batches(batch: Any, k: int, devices: int) -> list[Any]:
  """``batch`` as ``k`` batches placed like it, the j-th holding micro-batch j of every
  device's rows: the split ``data_parallel(accumulate=k)`` makes on each device."""
  if k == 1:
    return [batch]

  def part(x, j):
    rows = np.asarray(x).reshape((devices, k, -1) + x.shape[1:])[:, j]
    return jax.device_put(rows.reshape((-1,) + x.shape[1:]), x.sharding)

  return [jax.tree.map(lambda x: part(x, j), batch) for j in range(k)]


@dataclasses.dataclass
class _Prepared:
  key: str
  step: Any  # a Step or a jpack.DataParallel
  compiled: c.Compiled
  state: Any
  batches: list[Any]  # what one step calls the compiled step on, in order
  times: list[float]
  saves: _Saves | None = None  # the checkpoint rows' (`SAVING`)


@dataclasses.dataclass
class _Saves:
  """A checkpoint row's Orbax manager and what its saves took."""
  manager: Any
  count: int  # the state's step count
  calls: list[float] = dataclasses.field(default_factory=list)  # each saving call's block
  waits: list[float] = dataclasses.field(default_factory=list)  # each block's final wait
  bytes: int = 0  # the latest checkpoint's size on disk


def _prepare(model: Model, key: str, mesh, batch, plan_options: dict,
             directory: Any = None) -> _Prepared:
  step = build(key, model, mesh, plan_options)
  if key in ("jit", "jit_zero1", "jit_fsdp"):  # on their mesh with Auto axes (`_auto`)
    batch = jax.device_put(batch, NamedSharding(_auto(mesh), P(AXIS)))
  batches = _micro_batches(batch, getattr(step, "calls", 1), mesh.shape[AXIS])
  state = jax.block_until_ready(step.init(model.params, model.state) if model.has_state
                                else step.init(model.params))
  compiled = c.compile_fn(step.step, state, batches[0], jit_kwargs={"donate_argnums": 0})
  for b in batches:  # warm-up: one whole step, so every variant takes as many updates
    state, _ = compiled.fn(state, b)
  state = jax.block_until_ready(state)
  saves = None
  if key in SAVING:
    count = int(state.step)
    # Saves after the first step of every block (`_time_block`), and one now to warm up
    # Orbax (its threads, the directory) outside the timed blocks.
    manager = ckpt.make_manager(directory / key, policy=ckpt.EveryFrom(count + 1))
    assert jpack.checkpoint.save(manager, count, state, force=True)
    manager.wait_until_finished()
    saves = _Saves(manager, count)
  return _Prepared(key, step, compiled, state, batches, [], saves)


def _time_block(p: _Prepared, steps: int) -> Any:
  state = p.state
  t0 = time.perf_counter()
  if p.saves is None:
    for _ in range(steps):
      for b in p.batches:
        state, metrics = p.compiled.fn(state, b)
    jax.block_until_ready(state)
  else:  # benchmarks/checkpoint.py's loop, and the wait for the block's last write
    state, metrics, calls = ckpt.run_steps(p.compiled.fn, state, p.batches[0],
                                           p.saves.count, steps, p.saves.manager)
    jax.block_until_ready(state)
    t = time.perf_counter()
    p.saves.manager.wait_until_finished()
    p.saves.waits.append(time.perf_counter() - t)
    p.saves.calls += calls
    p.saves.count += steps
  p.times.append((time.perf_counter() - t0) / steps)
  p.state = state
  return metrics


def _result(p: _Prepared, metrics: dict) -> Result:
  text = p.compiled.text()
  if p.saves is not None:
    p.saves.bytes = ckpt.checkpoint_bytes(p.saves.manager)
    p.saves.manager.close()
  return Result(p.key, p.compiled, statistics.median(p.times), p.times,
                c.count_collectives(text), _reference.loop_collectives(text), len(p.batches),
                _bytes_per_device(p.state.opt_state),
                _bytes_per_device((p.state.params, p.state.opt_state)),
                jax.tree.map(np.asarray, p.step.unpack(p.state)), float(metrics["loss"]),
                p.saves)


def _measure(model: Model, keys: list[str], mesh, batch, *, steps: int, blocks: int,
             plan_options: dict) -> dict[str, Result | str]:
  """Compile every variant, then time them round-robin, block by block.

  Interleaving spreads slow phases of a shared machine over all variants instead of
  charging them to whichever happened to run then: the ratios are what matters. The
  checkpoint rows write into a temporary directory, removed at the end. A jpack variant
  that `jpack.data_parallel` refuses (a TypeError: ZeRO-1 with an optimizer that needs
  whole leaves) is the refusal's message instead of a `Result`.
  """
  with tempfile.TemporaryDirectory(prefix="jpack-step-bench-") as tmp:
    prepared: dict[str, _Prepared | str] = {}
    for key in keys:
      print(f"   {VARIANTS[key]} ...", end="", flush=True)
      try:
        prepared[key] = p = _prepare(model, key, mesh, batch, plan_options,
                                     pathlib.Path(tmp))
      except TypeError as e:
        if key not in DATA_PARALLEL:
          raise
        prepared[key] = f"refused: {e}"
        print(f" refused (TypeError: {str(e).splitlines()[0][:100]}...)", flush=True)
        continue
      c.release_host_memory()
      print(f" compile {c.fmt_s(p.compiled.total_s)} s", flush=True)
    timed = {key: p for key, p in prepared.items() if not isinstance(p, str)}
    metrics = {}
    for _ in range(blocks):
      for key, p in timed.items():
        metrics[key] = _time_block(p, steps)
    return {key: p if isinstance(p, str) else _result(p, metrics[key])
            for key, p in prepared.items()}


def _max_diff(a: Any, b: Any) -> float:
  return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
              for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)) if np.size(x)),
             default=0.0)


def gap_closed(t_per_leaf: float | None, t_variant: float, t_floor: float | None
               ) -> float | None:
  """The share of per-leaf's time above the floor that the variant removes: 1 at the
  floor, 0 at per-leaf's time, negative when slower than per-leaf."""
  if t_per_leaf is None or t_floor is None or t_per_leaf <= t_floor:
    return None
  return (t_per_leaf - t_variant) / (t_per_leaf - t_floor)


def _fmt_share(x: float | None) -> str:
  return "-" if x is None else f"{100 * x:.0f}%"


def _collectives_cell(r: Result) -> str:
  """E.g. ``AR1 RS3 AG3``, ``... (RS3 in loop)`` where some run once per loop iteration,
  ``... x4 calls`` where a step calls the compiled program several times."""
  cell = r.colls.short()
  if any(r.loop_colls.count.values()):
    cell += f" ({r.loop_colls.short()} in loop)"
  return cell + (f" x{r.calls} calls" if r.calls > 1 else "")


def _state_cell(nbytes: int, num_params: int) -> str:
  """Bytes per device, and in units of Ψ (the parameter count): 12.0Ψ is f32 params and
  adam's two f32 moments, replicated."""
  return f"{c.human_bytes(nbytes)} ({nbytes / num_params:.1f}Ψ)"


def _diff_cell(key: str, diff: float | None) -> str:
  if diff is None:
    return "-"
  return f"{diff:.1e} (bf16)" if key in BF16_PARAMS else f"{diff:.1e}"


def _param_dtype(key: str) -> str:
  v = DATA_PARALLEL.get(key)
  return np.dtype(v.param_dtype).name if v and v.param_dtype is not None else "float32"


def _accumulate(key: str) -> int:
  return ACCUMULATE if key == MULTISTEPS else (
      DATA_PARALLEL[key].accumulate if key in DATA_PARALLEL else 1)


def _saving_values(r: Result, plain: Result | None) -> dict[str, Any]:
  """A checkpoint row's figures (None for the other rows): its step time over the same
  mode's without saves, the median over blocks of the ratio in the same round."""
  if r.saves is None:
    return {"vs_no_saves": None, "save_call_s": None, "save_wait_s": None,
            "saves": 0, "checkpoint_bytes": None, "no_saves_key": None}
  ratio = None
  if plain is not None and len(plain.block_s) == len(r.block_s):
    ratio = statistics.median(a / b for a, b in zip(r.block_s, plain.block_s))
  return {"vs_no_saves": ratio,
          "save_call_s": statistics.median(r.saves.calls) if r.saves.calls else None,
          "save_wait_s": statistics.median(r.saves.waits) if r.saves.waits else None,
          "saves": len(r.saves.calls), "checkpoint_bytes": r.saves.bytes,
          "no_saves_key": plain and plain.key}


def spread(base: Result | None, r: Result) -> tuple[float, float] | None:
  """The lowest and highest of the block-by-block speed-ups (``base``'s block time over
  ``r``'s in the same round): how far the ratio moved over the interleaved rounds."""
  if base is None or len(base.block_s) != len(r.block_s):
    return None
  ratios = [a / b for a, b in zip(base.block_s, r.block_s)]
  return min(ratios), max(ratios)


def _fmt_spread(x: tuple[float, float] | None) -> str:
  return "-" if x is None else f"{x[0]:.2f}–{x[1]:.2f}"


def bench_model(model: Model, variants: list[str], report: c.Report, *, steps: int,
                blocks: int, per_device_batch: int = PER_DEVICE_BATCH,
                plan_options: dict | None = None,
                num_devices: int = NUM_DEVICES) -> dict[str, Result | str]:
  plan_options = plan_options or {}
  mesh = jax.make_mesh((num_devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:num_devices])
  batch = jax.device_put(model.batch(per_device_batch * num_devices),
                         NamedSharding(mesh, P(AXIS)))
  layout = jpack.plan(model.params, **{"num_shards": num_devices, **plan_options})
  print(f"\n-- {model.describe}: {model.num_leaves} leaves, {model.num_params / 1e6:.2f} M "
        f"params, {len(layout.buckets)} buckets; global batch "
        f"{per_device_batch * num_devices}; {blocks} x {steps} timed steps", flush=True)
  results = _measure(model, variants, mesh, batch, steps=steps, blocks=blocks,
                     plan_options=plan_options)

  timed = {k: r for k, r in results.items() if not isinstance(r, str)}
  floor, multi = timed.get(FLOOR), timed.get(MULTISTEPS)
  table = c.Table(["variant", "compile s", "step ms", "speed-up", "spread", "vs MultiSteps",
                   "gap closed", "vs no saves", "save call ms", "goal", "collectives",
                   "coll. bytes", "opt state/dev", "params+opt/dev", "max |Δp| vs per-leaf"],
                  title=f"{model.describe} ({model.num_leaves} leaves, "
                        f"{model.num_params / 1e6:.2f} M params), adam, {num_devices} devices")
  for key, r in results.items():
    base = timed.get(BASELINES.get(key, "per_leaf"))
    goal = GOALS.get((model.name, key))
    common = dict(model=model.name, key=key, leaves=model.num_leaves,
                  params=model.num_params, psi=model.num_params,
                  baseline=BASELINES.get(key, "per_leaf"), goal_speedup=goal)
    if isinstance(r, str):  # refused by data_parallel
      table.add(VARIANTS[key], "-", "refused", "-", "-", "-", "-", "-", "-",
                "" if goal is None else f">={goal:g}x {c.verdict(False)}", "-", "-", "-",
                "-", "-", refused=r, **common)
      continue
    speedup = c.ratio(base.step_s, r.step_s) if base else None
    low_high = spread(base, r)
    vs_multi = c.ratio(multi.step_s, r.step_s) if multi and key in ACCUMULATING else None
    closed = (None if key in SAVING else
              gap_closed(base and base.step_s, r.step_s, floor and floor.step_s))
    saving = _saving_values(r, timed.get(SAVING.get(key)))
    verdict = "" if goal is None or speedup is None else (
        f">={goal:g}x {c.verdict(speedup >= goal)}")
    diff = (None if key in NOT_COMPARABLE or base is None
            else _max_diff(r.params, base.params))
    diff_multi = (_max_diff(r.params, multi.params)
                  if multi and key in ACCUMULATING and key != MULTISTEPS else None)
    coll_bytes = sum(r.colls.result_bytes.values())
    table.add(VARIANTS[key], c.fmt_s(r.compiled.total_s), c.fmt_ms(r.step_s),
              c.fmt_ratio(speedup), _fmt_spread(low_high), c.fmt_ratio(vs_multi),
              _fmt_share(closed), c.fmt_ratio(saving["vs_no_saves"]),
              c.fmt_ms(saving["save_call_s"]), verdict,
              _collectives_cell(r), c.human_bytes(coll_bytes) if coll_bytes else "-",
              c.human_bytes(r.opt_bytes), _state_cell(r.state_bytes, model.num_params),
              _diff_cell(key, diff), **common, param_dtype=_param_dtype(key),
              accumulate=_accumulate(key), calls_per_step=r.calls,
              lower_s=r.compiled.lower_s, compile_s=r.compiled.compile_s, step_s=r.step_s,
              block_step_s=r.block_s, speedup_vs_per_leaf=speedup,
              speedup_min=low_high and low_high[0], speedup_max=low_high and low_high[1],
              speedup_vs_multisteps=vs_multi, gap_closed=closed,
              **c.collective_values(r.colls),
              collectives_in_loop=r.loop_colls.count,
              collective_bytes_in_loop=r.loop_colls.result_bytes,
              opt_state_bytes=r.opt_bytes, state_bytes_per_device=r.state_bytes,
              state_bytes_per_param=r.state_bytes / model.num_params,
              max_param_diff_vs_per_leaf=diff, max_param_diff_vs_multisteps=diff_multi,
              final_loss=r.loss, **saving)
  report.table(table)
  return results


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m benchmarks step", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--models", default="",
                      help=f"comma-separated subset of {', '.join(MODELS)} "
                           f"(default: {', '.join(DEFAULT_MODELS)})")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help=f"comma-separated subset of {', '.join(VARIANTS)}")
  parser.add_argument("--quick", action="store_true",
                      help="mlp_40x256 only, 3 x 5 steps (3 x 10 with the checkpoint rows)")
  parser.add_argument("--devices", type=c.positive_int, default=NUM_DEVICES,
                      help=f"devices on the data-parallel axis (default {NUM_DEVICES}; CPU "
                           "devices are simulated, other platforms use the first N)")
  parser.add_argument("--steps", type=c.positive_int, default=None,
                      help="steps per timed block (default 10; rounded up to a multiple of "
                           f"{ckpt.EVERY} with the checkpoint rows)")
  parser.add_argument("--blocks", type=c.positive_int, default=None,
                      help="timed blocks (median; default 5)")
  parser.add_argument("--batch", type=c.positive_int, default=None,
                      help=f"per-device batch (default {PER_DEVICE_BATCH}; "
                           f"{REAL_MODEL_BATCH} on {', '.join(REAL_MODELS)})")
  parser.add_argument("--bucket-bytes", type=c.positive_int, default=None,
                      help="jpack.plan bucket_bytes of the hand-written steps that plan "
                           "buckets (default: jpack's, 4 MiB); jpack.data_parallel's "
                           "are the platform's (jpack.step_options)")
  parser.add_argument("--solo-bytes", type=int, default=None,
                      help="jpack.plan solo_bytes of the same steps (default: jpack's, "
                           "1 MiB; 0 = None)")
  c.add_output_args(parser, "step")
  c.add_update_arg(parser)
  return parser


def _with_accumulation(variants: list[str], per_device_batch: int, *, explicit: bool,
                       error: Callable[[str], Any]) -> list[str]:
  """``variants``, less the accumulation rows when the per-device batch does not split
  into their micro-batches (refused when they were asked for by name)."""
  if per_device_batch % ACCUMULATE == 0:
    return variants
  dropped = [v for v in variants if v in ACCUMULATING]
  if dropped and explicit:
    error(f"--batch {per_device_batch} does not split into {ACCUMULATE} micro-batches, "
          f"which {', '.join(dropped)} need")
  if dropped:
    print(f"(per-device batch {per_device_batch} does not split into {ACCUMULATE} "
          f"micro-batches: skipping {', '.join(dropped)})")
  return [v for v in variants if v not in ACCUMULATING]


def _with_saving(variants: list[str], steps: int) -> tuple[list[str], int]:
  """With checkpoint rows: each one's variant without saves (added if not chosen, to be
  compared with), and steps per block rounded up to whole save intervals."""
  saving = [v for v in variants if v in SAVING]
  if not saving:
    return variants, steps
  missing = list(dict.fromkeys(SAVING[v] for v in saving if SAVING[v] not in variants))
  if missing:
    print(f"(adding {', '.join(missing)}: the checkpoint rows are compared with them)")
    out: list[str] = []
    for v in variants:
      if v in SAVING and SAVING[v] not in variants and SAVING[v] not in out:
        out.append(SAVING[v])
      out.append(v)
    variants = out
  rounded = -(-steps // ckpt.EVERY) * ckpt.EVERY
  if rounded != steps:
    print(f"(blocks of {rounded} steps, not {steps}: the checkpoint rows save every "
          f"{ckpt.EVERY} steps)")
  return variants, rounded


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = _parser()
  args = parser.parse_args(argv)
  c.set_cpu_devices(args.devices)  # before anything creates an array
  if args.solo_bytes is not None and args.solo_bytes < 0:
    parser.error(f"--solo-bytes must be >= 0 (0 = no solo buckets), got {args.solo_bytes}")
  names = [n for n in args.models.split(",") if n] or (
      ["mlp_40x256"] if args.quick else list(DEFAULT_MODELS))
  unknown = set(names) - set(MODELS)
  if unknown:
    parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
  variants = [v for v in args.variants.split(",") if v]
  unknown = set(variants) - set(VARIANTS)
  if unknown:
    parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
  explicit = args.variants != parser.get_default("variants")
  variants = _with_accumulation(variants, args.batch or PER_DEVICE_BATCH, explicit=explicit,
                                error=parser.error)
  c.require_devices(args.devices)
  steps = args.steps or (5 if args.quick else 10)
  blocks = args.blocks or (3 if args.quick else 5)
  variants, steps = _with_saving(variants, steps)

  plan_options = {}
  if args.bucket_bytes is not None:
    plan_options["bucket_bytes"] = args.bucket_bytes
  if args.solo_bytes is not None:
    plan_options["solo_bytes"] = args.solo_bytes or None
  report = c.Report("jpack data-parallel step benchmark", "step", argv)
  default_batch = f"{PER_DEVICE_BATCH} ({REAL_MODEL_BATCH} on {', '.join(REAL_MODELS)})"
  c.banner("benchmarks.step", [
      f"{args.devices} {jax.devices()[0].platform.upper()} devices, mesh axis ('{AXIS}',) "
      f"(shard_map, or jit by NamedSharding), "
      f"optax.adam({LEARNING_RATE:g}), "
      f"per-device batch {args.batch or default_batch}, plan options of the hand-written "
      f"steps {plan_options or 'default'}; step time "
      f"= median of {blocks} blocks of {steps} steps, variants interleaved block by block"])
  for name in names:
    model = MODELS[name]()
    chosen = variants
    if not explicit and name in MODEL_VARIANTS:
      chosen = [v for v in variants if v in MODEL_VARIANTS[name]]
    elif not explicit and model.num_params > BIG_MODEL_PARAMS:
      chosen = [v for v in variants if v in BIG_MODEL_VARIANTS]
    elif not explicit:
      chosen = [v for v in variants if v not in OPTIMIZER_VARIANTS]
    if model.has_state:
      skipped = [v for v in chosen if v not in WITH_STATE]
      if skipped:
        print(f"({name} has model state, which {', '.join(skipped)} do not carry: skipped)")
      chosen = [v for v in chosen if v in WITH_STATE]
    bench_model(model, chosen, report, steps=steps, blocks=blocks,
                per_device_batch=args.batch or (
                    REAL_MODEL_BATCH if name in REAL_MODELS else PER_DEVICE_BATCH),
                plan_options=plan_options,
                num_devices=args.devices)
    del model
    c.release_host_memory()
  report.text("speed-up = per-leaf step time / variant step time (same run). gap closed = "
              "(per-leaf - variant) / (per-leaf - grads only) step times: the share of "
              "per-leaf's time above the grads-only floor that the variant removes. "
              "Collectives: AR all-reduce, RS reduce-scatter, AG all-gather, A2A all-to-all "
              "ops in the compiled step, bytes = their result bytes; ops in a loop body "
              "(lax.scan's micro-steps) are counted once and run once per iteration; "
              "\"xK calls\": one step calls the compiled program K times.")
  report.text("spread = the lowest and the highest of the block-by-block speed-ups (the "
              "baseline's block time over the variant's in the same round). The rows of "
              "GPT-2's optimizers (adamw(mask=...), lamb, contrib.muon) are compared with "
              "per-leaf optax with the same optimizer; the decay mask and lamb's trust "
              "ratio are computed leaf by leaf on the buckets (slices in mode='sharded'); "
              "in mode='sharded', muon runs on each device's own whole leaves, and opt "
              "state/dev shows what they keep; refused = jpack.data_parallel raised a "
              "TypeError naming the transformation.")
  report.text("bf16 params: params kept and used by the loss in bfloat16, f32 masters in "
              "the optimizer state; the difference from per-leaf's params is bf16 "
              "rounding. params+opt/dev: bytes of params + optimizer state (masters and "
              "moments) on one device, and in units of Ψ, the parameter count: f32 "
              "replicated adam is 12Ψ, ZeRO-1 with bf16 params about 2Ψ + 12Ψ/N.")
  report.text(f"Checkpoint rows: jpack.checkpoint.save after every step, an Orbax "
              f"CheckpointManager saving every {ckpt.EVERY}th asynchronously; each block "
              f"saves after its first step and waits for the write at its end (in its "
              f"time). vs no saves = the row's block time over the same mode's without "
              f"saves in the same round (median over blocks). save call ms = how long a "
              f"saving call holds the loop up once the queued steps are done. On CPU "
              f"devices the write shares the host's cores with the steps.")
  report.text(f"Accumulation: {ACCUMULATE} micro-batches per step, one adam update of the "
              f"whole batch. vs MultiSteps = per-leaf + optax.MultiSteps step time / variant "
              f"step time: MultiSteps all-reduces every gradient leaf on every micro-step, "
              f"jpack reduces the accumulated buckets once per step (ZeRO-2: reduce-scatters "
              f"them every micro-step into a 1/N accumulator).")
  report.write_markdown(args.markdown)
  earlier = c.earlier_results(args)
  report.write_json(args.json, None if earlier is None else c.merged(
      earlier, report.json(), "model", list(VARIANTS),
      list(dict.fromkeys([*DEFAULT_MODELS, *MODELS]))))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
