"""ZeRO-1 as an optax transform: each device keeps and updates 1/N of every bucket.

``update`` reduce-scatters the packed gradients (mean), runs ``inner`` on this device's
slice of each bucket, and all-gathers the updates. Optimizer state lives only for the
local slices, so per-device optimizer memory is ~1/N of the replicated state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jpack._collectives import (Shards, axis_size, check_shardable, all_gather,
                                reduce_scatter, shard)
from jpack._internal import sum_of_squares
from jpack._labels import Inner, Labels, check_inner, group_fn_for, labelled
from jpack._layout import Layout, check_plan_options, plan, retyped
from jpack._pack import Packed, pack
from jpack._probe import checker
from jpack._precision import (ParamDtype, as_layout, cast_params, check_masters,
                              pack_masters)
from jpack._transforms import (after, apply_to_masters, layout_of_masters, layout_state_repr,
                               pack_like, unpack_as_returned, value_scalars)


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


def sharded(inner: Inner, axis_name: Any, *, labels: Labels = None, comm_dtype: Any = None,
            param_dtype: ParamDtype = None,
            **plan_options: Any) -> optax.GradientTransformation:
  """ZeRO-1: run ``inner`` on this device's 1/N slice of every gradient bucket.

  Use inside `jax.shard_map` / `jax.pmap` over ``axis_name``, on per-device (not yet
  averaged) gradients: do not put `allreduce` before it. ``update`` takes a tree, a
  `jpack.Packed`, or already reduced `jpack.Shards` (skips the reduce-scatter), and
  returns updates of the same kind (`Shards` in -> full `Packed` out). If ``params`` are
  `Shards` (this device's slices, from `jpack.shard`), the updates come back as `Shards`
  without the all-gather: apply them to the slices and `jpack.all_gather` the new
  params, which saves one full-size pass per step (what
  ``jpack.data_parallel(mode="sharded")`` does)::

    local = jpack.shard(params, "batch")                 # params: a jpack.Packed
    updates, opt_state = tx.update(grads, opt_state, local)
    params = jpack.all_gather(optax.apply_updates(local, updates), "batch")

  The reduced gradients are computed after every bucket and after ``value`` (the loss,
  if given), so XLA need not copy donated parameters to protect the backward pass.

  Args:
    inner: an elementwise optax transformation (sgd, momentum, adam, adamw, lion, a
      chain with schedules, `jpack.optax.clip_by_global_norm(..., axis_name)`), or a dict
      ``{label: transformation}`` with ``labels``. Transformations that need the whole
      gradient or whole leaves (``optax.clip_by_global_norm``, lamb/lars, adafactor,
      ``optax.masked``...) are refused with a `TypeError`, because on slices they would
      silently compute something else.
    axis_name: the data-parallel mesh / pmap axis.
    labels: per-leaf labels (a tree like params or a prefix of it, or ``params ->
      tree``) selecting the
      transformation of each leaf from the dict ``inner``: masks (no weight decay on
      biases), frozen leaves (``optax.set_to_zero()``). Each label gets its own buckets.
    comm_dtype: wire dtype of the gradient reduce-scatter (see `jpack.psum`).
    param_dtype: mixed precision, as in `jpack.optax.flat`: the params are kept in this
      dtype, and the state keeps this device's slices of master copies in the dtype the
      params had at ``init`` (pass them in full precision), sharded like the moments.
      Gradients are cast to the masters' dtype before the reduce-scatter (``comm_dtype``
      can narrow the wire). With `Shards` params, the caller's all-gather of the new
      params moves ``param_dtype`` bytes: half of float32's for bfloat16.
    **plan_options: options for `jpack.plan` (``num_shards`` is set to the axis size).

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is a `ShardedState`; extra
    update arguments (``value=`` for ``optax.contrib.reduce_on_plateau``) are passed on
    to ``inner``.

  Raises:
    TypeError: ``inner`` cannot run on slices (see ``inner``).
    ValueError: from ``update``, when the updates or params are a `jpack.Packed` or
      `jpack.Shards` with another layout than ``state.layout``.

  Examples:
    >>> import optax, jpack
    >>> tx = jpack.optax.sharded(optax.adamw(1e-3), "batch")
  """
  check_inner(inner, labels)
  check_plan_options({**plan_options, "num_shards": 1}, "jpack.optax.sharded")
  check = checker(inner, on="slices", axis_name=axis_name,
                  where="inside jpack.optax.sharded")

  def layout_for(tree, n):
    if isinstance(tree, (Packed, Shards)):
      return tree.layout
    return plan(tree, group_fn=group_fn_for(tree, labels), **{**plan_options,
                                                               "num_shards": n})

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
    check(local.layout)  # on a miniature of the params: compares slices with the tree
    return ShardedState(labelled(inner, layout).init(local.buckets), layout,
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
      grads = reduce_scatter(packed, axis_name, mean=True, comm_dtype=comm_dtype)
    norm = jnp.sqrt(lax.psum(sum_of_squares(grads.buckets), axis_name))
    grads = after(grads, norm, *value_scalars(extra_args.get("value")))
    local_params = None
    if params is not None:
      local_params = pack_like(params, layout, "params")
      if not isinstance(local_params, Shards):
        local_params = shard(local_params, axis_name)
      local_params = local_params.buckets
    tx = labelled(inner, layout)
    if masters is None:
      new, inner_state = tx.update(grads.buckets, state.inner_state, local_params,
                                   **extra_args)
      master = None
    else:
      new, inner_state = tx.update(grads.buckets, state.inner_state, state.master,
                                   **extra_args)
      new, master = apply_to_masters(new, state.master, local_params, layout)
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


def clip_by_global_norm(max_norm: float, axis_name: Any = None) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` that also works on sharded slices.

  With ``axis_name``, the norm is ``sqrt(psum(local sum of squares))`` over the axis:
  the norm of the whole gradient when each device holds a disjoint slice (inside
  `sharded`). Without it, identical to `optax.clip_by_global_norm`: use that after
  `jpack.optax.allreduce` (or anywhere every device holds the whole gradient), where
  an ``axis_name`` would count each value N times and clip by sqrt(N) times the norm.

  Args:
    max_norm: the largest global norm allowed.
    axis_name: the axis the gradient is sharded over (inside `sharded`), or None for
      a gradient every device holds whole.

  Returns:
    A stateless `optax.GradientTransformation`.
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    squares = sum_of_squares(jax.tree.leaves(updates))
    if axis_name is not None:
      squares = lax.psum(squares, axis_name)
    norm = jnp.sqrt(squares)
    scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda x: (x * scale).astype(x.dtype), updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# -- checkpoints -----------------------------------------------------------------------


def gather_state(state: ShardedState) -> Any:
  """The state ``inner.init(params)`` would have on the full tree, from a `ShardedState`.

  Call outside ``shard_map`` on the global state (each slice-shaped leaf is then a full
  bucket, sharded over devices); the buckets are gathered to the host, and the result
  holds numpy arrays (no accelerator has to hold the whole state). Every tuple of
  buckets in the inner state becomes the params-shaped tree, in the buckets' dtype (the
  params' dtype, or e.g. ``mu_dtype``); scalars (step counts) are kept. The result is
  independent of the device count: save it with any checkpointer.

  Args:
    state: the global `ShardedState`.

  Returns:
    The full-tree optimizer state (for a dict ``inner``, the `optax.multi_transform`
    state over the buckets, with each bucket tuple turned into a tree). With
    ``param_dtype`` masters, ``{"inner_state": that, "master": the params tree in
    full precision}``.
  """
  layout = state.layout
  sizes = tuple(b.size for b in layout.buckets)
  is_buckets = functools.partial(_is_bucket_tuple, sizes=sizes)
  found = []

  def convert(x):
    if not is_buckets(x):
      return x
    found.append(x)
    # With labels, optax.multi_transform gives each label's state MaskedNode() in place
    # of the other labels' buckets; on the full tree it has MaskedNode() for their leaves.
    buckets = tuple(np.zeros(b.size, b.dtype) if _is_masked(a) else _to_host(a)
                    for a, b in zip(x, layout.buckets))
    # Moments may have another float dtype than the params (adam(mu_dtype=...)).
    leaves = layout.treedef.flatten_up_to(unpack_as_returned(Packed(buckets, layout)))
    return layout.treedef.unflatten(
        optax.MaskedNode() if _is_masked(x[slot.bucket]) else leaf
        for slot, leaf in zip(layout.slots, leaves))

  # Host arrays: a checkpoint should not need the whole state on one accelerator.
  out = jax.device_get(jax.tree.map(convert, state.inner_state,
                                    is_leaf=lambda x: is_buckets(x) or _is_masked(x)))
  leading = (set() if found or not sizes else
             {np.shape(x)[0] for x in jax.tree.leaves(state.inner_state) if np.ndim(x) == 2})
  if leading:
    raise ValueError(
        "gather_state found no bucket-shaped state: its leaves have a leading axis of "
        f"size {sorted(leading)}, as in a jax.pmap state (one row per device). It needs the "
        "global state of a shard_map step (data_parallel's default), whose leaves are "
        "whole buckets.")
  if state.master is None:
    return out
  return {"inner_state": out, "master": jax.device_get(convert(tuple(state.master)))}


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _is_bucket_tuple(x: Any, sizes: tuple[int, ...]) -> bool:
  """A node of a `ShardedState`'s inner state holding one array per bucket (with labels,
  `optax.MaskedNode` stands for other labels' buckets)."""
  return (isinstance(x, tuple) and len(x) == len(sizes) and len(sizes) > 0 and all(
      _is_masked(a) or (hasattr(a, "shape") and tuple(a.shape) == (s,))
      for a, s in zip(x, sizes)))


def _to_host(x: Any) -> np.ndarray:
  """The whole value of a (possibly sharded, possibly multi-process) array, on the host."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def scatter_state(tree_state: Any, like: ShardedState) -> ShardedState:
  """Inverse of `gather_state`, onto any device count.

  Args:
    tree_state: a full-tree state from `gather_state` (e.g. restored from a checkpoint
      saved on a different number of devices); with masters, the
      ``{"inner_state": ..., "master": ...}`` it returns.
    like: a `ShardedState` of the new run (e.g. ``jax.eval_shape`` of its init); gives
      the bucket layout for the new device count.

  Returns:
    A global `ShardedState` whose bucket tuples are full buckets; place it on devices
    with the sharding of the new run's state.

  Raises:
    ValueError: naming the key path, if the saved state's structure, shapes or dtypes
      do not match the new run's (another optimizer, other params, other labels).
  """
  layout = like.layout
  saved_masters = (isinstance(tree_state, dict)
                   and set(tree_state) == {"inner_state", "master"})
  if (like.master is not None) != saved_masters:
    has = "has" if saved_masters else "has no"
    wants = "keeps" if like.master is not None else "keeps no"
    raise ValueError(f"The saved optimizer state {has} master params (param_dtype=), and "
                     f"the new run {wants} masters: use the same param_dtype= for both.")
  if saved_masters:
    master = _saved_to_buckets((jax.tree_util.DictKey("master"),), tree_state["master"],
                               layout)
    for i, (got, want) in enumerate(zip(master, like.master)):
      if np.dtype(got.dtype) != np.dtype(want.dtype):
        raise ValueError(f"Saved master bucket {i} is {got.dtype}; the new run keeps its "
                         f"masters in {want.dtype}.")
    inner = scatter_state(tree_state["inner_state"], ShardedState(like.inner_state, layout))
    return ShardedState(inner.inner_state, layout, master=master)
  sizes = tuple(b.size for b in layout.buckets)
  # Where the new run's state holds a tuple of buckets, the saved one holds a params
  # tree: found by position, since shapes alone cannot tell a scalar param's moment
  # from a step count.
  is_buckets = functools.partial(_is_bucket_tuple, sizes=sizes)
  like_nodes, prefix = jax.tree_util.tree_flatten_with_path(like.inner_state,
                                                             is_leaf=is_buckets)
  try:
    saved = prefix.flatten_up_to(tree_state)
  except (ValueError, TypeError):
    converted = tree_state  # a structure mismatch: named below
  else:
    converted = prefix.unflatten(
        _saved_to_buckets(path, x, layout) if is_buckets(node) else x
        for (path, node), x in zip(like_nodes, saved))
  like_def = jax.tree.structure(like.inner_state)
  if jax.tree.structure(converted) != like_def:
    got = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(converted)]
    want = [jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_leaves_with_path(like.inner_state)]
    first = next((f"saved {g}, expected {w}" for g, w in zip(got, want) if g != w),
                 f"saved {len(got)} leaves, expected {len(want)}")
    raise ValueError("The saved optimizer state does not match the new optimizer's state "
                     f"structure (first difference: {first}): got "
                     f"{jax.tree.structure(converted)}, expected {like_def}. Was it saved "
                     "from the same inner transformation and labels=, for the same params?")
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(converted),
                               jax.tree.leaves(like.inner_state)):
    if np.shape(got) != tuple(want.shape) or jnp.result_type(got) != want.dtype:
      raise ValueError(
          f"Saved optimizer state at {jax.tree_util.keystr(path)} has shape "
          f"{np.shape(got)} and dtype {jnp.result_type(got)}; the new run expects "
          f"{tuple(want.shape)} {want.dtype}.")
  return ShardedState(converted, layout)


def _saved_to_buckets(path: Any, x: Any, layout: Layout) -> tuple[Any, ...]:
  """A params-shaped tree of a saved state, as a tuple of buckets of ``layout`` (with
  `optax.MaskedNode` for buckets of other labels)."""
  params_def = layout.treedef
  try:
    leaves = params_def.flatten_up_to(x)
  except (ValueError, TypeError):
    raise ValueError(
        f"Saved optimizer state at {jax.tree_util.keystr(path)} is "
        f"{jax.tree.structure(x, is_leaf=_is_masked)}; the new run keeps a params-shaped "
        f"tree there: {params_def}. Was it saved for the same params?") from None
  masked = [_is_masked(v) for v in leaves]
  # A bucket's state leaves share one dtype: the params' or, for moments kept in
  # another float dtype (adam(mu_dtype=...)), that one.
  dtypes = [b.dtype for b in layout.buckets]
  seen = set()
  for slot, v, m in zip(layout.slots, leaves, masked):
    if m:
      continue
    got = np.dtype(jnp.result_type(v))
    floats = jnp.issubdtype(got, jnp.floating) and jnp.issubdtype(slot.dtype, jnp.floating)
    if slot.bucket not in seen and floats:
      dtypes[slot.bucket] = got
    seen.add(slot.bucket)
    if np.shape(v) != slot.shape or got != dtypes[slot.bucket]:
      raise ValueError(
          f"Saved optimizer state at {jax.tree_util.keystr(path)}{slot.path} has shape "
          f"{np.shape(v)} and dtype {got}; the params there are {slot.shape} "
          f"{slot.dtype}" + (f" (and this state's other leaves in their bucket "
                             f"{dtypes[slot.bucket]})" if dtypes[slot.bucket] != slot.dtype
                             else "") + ".")
  buckets = []
  for b, bucket in enumerate(layout.buckets):
    flags = {masked[i] for i in bucket.slots}
    if len(flags) > 1:
      raise ValueError(
          f"Bucket {b} of the new layout mixes leaves the saved state masks and leaves it "
          "does not: plan the new run with the same labels= as the saved one.")
    buckets.append(flags == {True})
  new_layout = retyped(layout, dtypes)
  zeros = [jnp.zeros(s.shape, s.dtype) if m else v
           for s, v, m in zip(new_layout.slots, leaves, masked)]
  packed = pack(params_def.unflatten(zeros), new_layout).buckets
  return tuple(optax.MaskedNode() if m else p for p, m in zip(packed, buckets))


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
