"""ZeRO-1 as an optax transform: each device keeps and updates 1/N of every bucket.

``update`` reduce-scatters the packed gradients (mean), runs ``inner`` on this device's
slice of each bucket, and all-gathers the updates. Optimizer state lives only for the
local slices, so per-device optimizer memory is ~1/N of the replicated state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jpack import _cpu as cpu
from jpack._collectives import (Shards, axis_size, check_shardable, all_gather,
                                mean_to_slices, shard, slice_axes)
from jpack._internal import sum_of_squares
from jpack._labels import Inner, check_inner, group_fn_for, placed, split_partition
from jpack._layout import (DEFAULT_BUCKET_BYTES, DEFAULT_MAX_LEAVES, Layout,
                           check_plan_options, plan, shard_of, whole_leaf_shards)
from jpack._leafwise import on_buckets
from jpack._owned import on_owned
from jpack._pack import Packed, pack
from jpack._probe import checker, described
from jpack._precision import (ParamDtype, as_layout, cast_params, check_masters,
                              pack_masters)
from jpack._transforms import (after, after_neighbours, layout_of_masters, layout_state_repr,
                               named_errors,
                               pack_like, unpack_as_returned, update_buckets,
                               value_scalars)

logger = logging.getLogger("jpack")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class ShardedState:
  """State of `sharded`.

  A pytree whose static field is the `Layout` of the buckets, which `gather_state` /
  `scatter_state` need to convert checkpoints.

  Attributes:
    inner_state: ``inner``'s state for this device's slices of the buckets. Seen from
      outside ``shard_map`` (as global arrays), each slice-shaped leaf is the full
      bucket, sharded over the devices.
    layout: the static bucket `Layout` (planned with ``num_shards`` = axis size).
    grad_norm: the global norm of the reduced gradient of the last update (for logging).
    master: with ``param_dtype``, this device's slices of the master buckets, in the
      dtype the params had at ``init``; otherwise None.
  """

  inner_state: optax.OptState
  layout: Layout = dataclasses.field(metadata=dict(static=True))
  grad_norm: jax.Array = dataclasses.field(
      default_factory=lambda: jnp.zeros((), jnp.float32))
  master: Any = None

  def __repr__(self) -> str:
    return layout_state_repr(self)


def sharded(inner: optax.GradientTransformation, axis_name: Any, *, comm_dtype: Any = None,
            param_dtype: ParamDtype = None,
            plan_options: Mapping[str, Any] | None = None) -> optax.GradientTransformation:
  """ZeRO-1: run ``inner`` on this device's 1/N slice of every gradient bucket.

  Use inside `jax.shard_map` / `jax.pmap` on per-device (not yet averaged) gradients.
  ``update`` takes a tree, a `jpack.Packed` or reduced `jpack.Shards`, and returns the
  same kind. With `Shards` params (`jpack.shard`), the updates are `Shards` too: apply
  them to the slices and `jpack.all_gather` the new params (one pass fewer)::

    local = jpack.shard(params, "batch")                 # params: a jpack.Packed
    updates, opt_state = tx.update(grads, opt_state, local)
    params = jpack.all_gather(optax.apply_updates(local, updates), "batch")

  Global-norm clipping, trust ratios and masks static per leaf are computed on the
  slices (one small psum); what reads leaves' shapes (adafactor, muon, sm3) runs on
  each device's own whole leaves, in a layout ``init`` plans and logs; what needs more
  (``apply_if_finite``) is refused (docs/zero.md).

  Args:
    inner: an optax transformation, or a `jpack.optax.partition` (buckets per label).
    axis_name: the data-parallel axis, or ``(outer, inner)``: slices over ``inner`` (a
      node's devices), replicated over ``outer``, across which only slices travel.
    comm_dtype: wire dtype of the gradient reduce-scatter (see `jpack.psum`).
    param_dtype: as in `jpack.optax.flat`, with the masters sliced like the moments.
    plan_options: keyword arguments for `jpack.plan`, as one dict (``num_shards``: the
      axis size).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `ShardedState`; extra
    update arguments (``value=``) are passed on to ``inner``.

  Raises:
    TypeError: ``inner`` cannot run on slices or on owned leaves.
    ValueError: packed params whose layout splits leaves ``inner`` needs whole, or
      updates or params packed with another layout than ``state.layout``.

  Examples:
    >>> import optax, jpack
    >>> tx = jpack.optax.sharded(optax.adamw(1e-3), "batch")
  """
  inner, labels = split_partition(inner)
  check_inner(inner, labels)
  plan_options = check_plan_options(plan_options, "jpack.optax.sharded", num_shards=1)
  data_axes = axis_name  # gradients are averaged over all of them, sliced over the last
  axis_name = slice_axes(axis_name)[1]
  where = "inside jpack.optax.sharded"
  arrange = ownership(inner, axis_name, where, plan_options)

  def layout_for(tree, n):
    if isinstance(tree, (Packed, Shards)):
      layout = arrange(tree.layout)[0]
      if layout != tree.layout:
        raise ValueError(
            f"The params are a {type(tree).__name__} with layout {tree.layout.fingerprint}, "
            f"but {described(inner)} needs whole leaves on each device, and that layout "
            "splits some leaves between devices. Pass the params as a tree: init then "
            "plans a layout whose shards hold whole leaves (state.layout; pack with it).")
      return layout
    return arrange(plan(tree, group_fn=group_fn_for(tree, labels),
                        **{**plan_options, "num_shards": n}))[0]

  def init_fn(params):
    n = axis_size(axis_name)
    master = None
    if param_dtype is None:
      layout = layout_for(params, n)
    else:
      check_masters(params, "jpack.optax.sharded")
      layout = layout_for(cast_params(params, param_dtype), n)
      master = shard(pack_masters(params, layout), axis_name)
    check_shardable(layout, n)
    if master is not None:
      local = master
    elif isinstance(params, Shards):  # already this device's slices
      local = params
    else:
      local = shard(params if isinstance(params, Packed) else pack(params, layout), axis_name)
    with named_errors(inner, where, "init"):
      inner_state = arrange(layout)[1].init(local.buckets)
    return ShardedState(inner_state, layout,
                        master=None if master is None else master.buckets)

  def update_fn(updates, state, params=None, **extra_args):
    layout = state.layout
    masters = None if state.master is None else layout_of_masters(state)
    packed = pack_like(updates, layout, "updates", masters=masters)
    if masters is not None:  # reduced in the masters' dtype (or comm_dtype on the wire)
      packed = as_layout(packed, masters)
    if isinstance(packed, Shards):
      grads = packed
    else:
      grads = mean_to_slices(packed, data_axes, comm_dtype=comm_dtype)
    norm = jnp.sqrt(lax.psum(sum_of_squares(grads.buckets), axis_name))
    values = value_scalars(extra_args.get("value"))
    # Each update must come after the backward pass's last read of its params (else XLA
    # guards the donated bucket with a copy). On CPU it waits for the global norm. On
    # GPUs that would hold every update and all-gather back until the last bucket's
    # reduce-scatter, and split the norm into kernels of its own; there each bucket
    # waits for its neighbours' gradients instead, as in `flat`, and the norm fuses
    # into the updates.
    grads = Shards(tuple(cpu.choose(lambda b: list(after(b, norm, *values)),
                                    lambda b: after_neighbours(b, *values),
                                    grads.buckets)), grads.layout)
    local_params = None
    if params is not None:
      local_params = pack_like(params, layout, "params")
      if not isinstance(local_params, Shards):
        local_params = shard(local_params, axis_name)
      local_params = local_params.buckets
    with named_errors(inner, where, "update"):
      new, inner_state, master = update_buckets(arrange(layout)[1], grads.buckets,
                                                state, local_params, extra_args)
    new_state = ShardedState(inner_state, layout, norm, master)
    if isinstance(params, Shards):
      # The caller applies the updates to its slice and all-gathers the new params:
      # one full-size pass fewer than gathering updates and adding them everywhere.
      return Shards(tuple(new), layout), new_state
    full = all_gather(Shards(tuple(new), layout), axis_name)
    if isinstance(updates, (Packed, Shards)):
      return full, new_state
    return unpack_as_returned(full), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def pads_much(layout: Layout) -> bool:
  """Whether ``layout``'s buckets hold more than `_MAX_PADDING` times its leaves' bytes
  (owned whole leaves, padded to the largest on every device)."""
  return layout.nbytes > _MAX_PADDING * layout.leaf_nbytes


def params_or_masters(params: Any, state: Any) -> Any:
  """``params``; where ZeRO-3 keeps none (``param_dtype``: the masters in ``state``, a
  `ShardedState`, are the only copy), this device's slices of them as the loss takes
  them: the masters rounded to the layout's dtypes (abstract masters, their shapes)."""
  if params is not None:
    return params
  dtypes = [b.dtype for b in state.layout.buckets]
  return Shards(tuple(jax.ShapeDtypeStruct(m.shape, d) if isinstance(m, jax.ShapeDtypeStruct)
                      else m.astype(d) for m, d in zip(state.master, dtypes)), state.layout)


_MAX_PADDING = 2.0  # bucket bytes over leaf bytes above which init warns


def ownership(inner: Inner, axis_name: Any, where: str, plan_options: dict[str, Any],
              log: bool = True
              ) -> Callable[[Layout], tuple[Layout, optax.GradientTransformationExtraArgs]]:
  """``arrange(layout)``: the layout ZeRO-1 runs ``inner`` on, and ``inner`` over its
  slices. Parts of ``inner`` that slices would change (per the probe) run on each
  device's own leaves (`jpack._owned.on_owned`), if the probe finds that they compute
  optax's result there; the layout is then re-planned so that each shard holds whole
  leaves (`jpack._layout.whole_leaf_shards`). Anything else is refused with a
  `TypeError`. Said once per layout (INFO on the ``"jpack"`` logger), with ``log``."""
  checks: dict[Any, Callable[[Layout], str | None]] = {}
  arranged: dict[Layout, tuple[Layout, optax.GradientTransformationExtraArgs]] = {}

  def key(tx: Any) -> Any:
    return id(tx) if tx is inner else (tx.init, tx.update)

  def check(tx: Any, on: str, layout: Layout, name: str | None = None) -> str | None:
    if (key(tx), on) not in checks:
      checks[key(tx), on] = checker(tx, on=on, axis_name=axis_name, where=where)
    return checks[key(tx), on](layout, name)

  def place(layout: Layout):
    culprits: dict[Any, str | None] = {}  # by part: what its probe on slices named

    def needs_leaves(tx):
      culprits[key(tx)] = check(tx, "slices", layout)
      return culprits[key(tx)]

    def leaves(tx, lay):
      # What slices would change runs on owned leaves if the probe finds it right there
      # (with empty stand-ins for the other leaves, else one-element ones); a dict's
      # multi_transform is made by `placed`: the dict is probed.
      probed = tx if key(tx) in culprits or not isinstance(inner, Mapping) else inner
      name = culprits.get(key(probed))
      try:
        check(probed, "owned", layout, name)
        unit = False
      except TypeError as empty:  # a dim divided by, a max: maybe with stand-ins
        try:
          check(probed, "owned_unit", layout, name)
        except TypeError:
          raise empty from None
        unit = True
      return on_owned(tx, lay, axis_name, unit)

    return placed(inner, layout, needs_leaves, leaves=leaves,
                  by_leaf=lambda tx: on_buckets(tx, layout, axis_name, needs_leaves))

  def arrange(layout: Layout) -> tuple[Layout, optax.GradientTransformationExtraArgs]:
    if layout in arranged:
      return arranged[layout]
    tx, on_leaves, whole, computed = place(layout)
    if computed and log:
      logger.info("jpack.optax.sharded (layout %s): %s on each device's slices, leaf by "
                  "leaf", layout.fingerprint, ", ".join(dict.fromkeys(computed)))
    final = layout
    if on_leaves and any(shard_of(layout, s) is None for s in layout.slots):
      final = whole_leaf_shards(
          layout, plan_options.get("bucket_bytes", DEFAULT_BUCKET_BYTES),
          plan_options.get("max_leaves", DEFAULT_MAX_LEAVES))
      tx = place(final)[0]
    if on_leaves and log:
      differ = ", ".join(dict.fromkeys(on_leaves))
      # Padded to more than twice the leaves (a leaf far larger than the rest): the
      # collectives and the buffers then cost more than ZeRO-1 saves.
      padded = pads_much(final)
      logger.log(logging.WARNING if padded else logging.INFO,
                 "jpack.optax.sharded (layout %s): %s on each device's own whole leaves "
                 "(on slices %s would differ)%s; the buckets hold %.3g MB for %.3g MB of "
                 "leaves%s", final.fingerprint, described(inner) if whole else differ,
                 "it" if whole or len(set(on_leaves)) == 1 else "they",
                 "" if whole else ", the rest on slices",
                 final.nbytes / 1e6, final.leaf_nbytes / 1e6,
                 " (padded to the largest leaf on every device: mode='packed', which "
                 "keeps a replicated state, moves and holds less here)" if padded else "")
    arranged[layout] = arranged[final] = (final, tx)
    return final, tx

  return arrange


def sharded_layout(inner: Inner, layout: Layout, axis_name: Any, where: str,
                   **plan_options: Any) -> Layout:
  """The layout `sharded` runs ``inner`` on, for params planned as ``layout`` (with
  ``num_shards``): ``layout`` itself, or re-planned so that each device owns whole
  leaves where ``inner`` needs them. Raises `TypeError` where ``inner`` cannot run on
  ZeRO-1 at all (see `ownership`). Silent: `sharded`'s ``init`` says what runs where."""
  return ownership(inner, axis_name, where, plan_options, log=False)(layout)[0]


def state_bytes_per_device(state: ShardedState, num_devices: int) -> int:
  """Bytes of optimizer state each device holds.

  Args:
    state: the global `ShardedState` (as returned from ``shard_map``, or its
      ``jax.eval_shape``): each slice-shaped leaf is the full bucket, split over devices.
    num_devices: the number of devices it is split over (the axis size it was planned
      for).

  Returns:
    Bytes per device: ``1/num_devices`` of every bucket-shaped leaf plus every scalar
    (step counts, the gradient norm), which each device holds whole.
  """
  total = 0
  for x in jax.tree.leaves(state):
    nbytes = math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
    total += nbytes // num_devices if x.ndim else nbytes
  return total
