"""Per-leaf transformations computed on buckets: lamb's trust ratio, static weight-decay
masks, global-norm clipping. A leaf's norm is a sum over its range of a bucket (on ZeRO-1
slices, partial sums completed by one small psum), and a per-leaf value is spread back
over that range. Offsets are aligned, so a bucket is summed block by block, a static
table giving each block's leaf; a slice reads its part of the table.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jpack._known import closure, injected, key_of, with_factory
from jpack._labels import chain_parts
from jpack._layout import Bucket, Layout


def on_buckets(tx: Any, layout: Layout, axis_name: Any,
               needs_leaves: Callable[[Any], str | None]
               ) -> optax.GradientTransformationExtraArgs | None:
  """``tx`` computed on the buckets of ``layout`` (or, with ``axis_name``, on this
  device's slices of them), if it is `optax.clip_by_global_norm`,
  `optax.scale_by_trust_ratio`, `optax.masked` with a mask static per leaf, or a chain
  or `optax.inject_hyperparams` of these and of parts that run on buckets; else None.

  Args:
    tx: a transformation.
    layout: the buckets' layout.
    axis_name: the axis the buckets are sliced over (ZeRO-1), or None for whole buckets.
    needs_leaves: the check: None when a transformation computes the same on buckets.

  Returns:
    A transformation taking and returning tuples of buckets (or slices), with ``tx``'s
    state, or None.
  """
  key = key_of(tx)
  if key == _EXTRA_ARGS:
    return on_buckets(closure(tx.update)["tx"], layout, axis_name, needs_leaves)
  swap = lambda part: on_buckets(part, layout, axis_name, needs_leaves)  # noqa: E731
  if "inner_factory" in closure(tx.update):  # inject_hyperparams: what it builds, swapped
    try:
      example = _chained(injected(tx), swap, needs_leaves)
    except Exception:  # noqa: BLE001 - a factory that needs other values: on the leaves
      return None
    return example and with_factory(tx, lambda built: _chained(built, swap, needs_leaves))
  found = closure(tx.update)
  if key == _CLIP and "max_norm" in found and all(
      jnp.issubdtype(b.dtype, jnp.inexact) for b in layout.buckets):
    return clip_by_global_norm(found["max_norm"], axis_name)
  if not all(jnp.issubdtype(b.dtype, jnp.floating) for b in layout.buckets) or any(
      len(b.slots) > 1 and b.size // _align(layout, b) > _MAX_BLOCKS for b in layout.buckets):
    return None  # its tables would be large constants: left to the leaves
  if key == _TRUST_RATIO and {"min_norm", "trust_coefficient", "eps"} <= found.keys():
    return trust_ratio(layout, axis_name, found["min_norm"], found["trust_coefficient"],
                       found["eps"])
  if key == _MASKED and {"inner", "mask"} <= found.keys():
    flags = static_mask(found["mask"], layout)
    inner = found["inner"]
    swapped = None if flags is None else swap(inner)
    if flags is None or (swapped is None and needs_leaves(inner) is not None):
      return None
    return masked(swapped or optax.with_extra_args_support(inner), flags, layout, axis_name)
  return None


def _chained(tx: Any, swap: Callable[[Any], Any], needs_leaves: Callable[[Any], Any]
             ) -> optax.GradientTransformation | None:
  """``tx``, or each part of a chain, on buckets: as it is, or swapped; else None."""
  parts = chain_parts(tx)
  swapped = [swap(p) or (p if needs_leaves(p) is None else None) for p in parts or [tx]]
  if None in swapped:
    return None
  return swapped[0] if parts is None else optax.chain(*swapped)


# The keys of the update functions recognised (see `jpack._known`).
_EXTRA_ARGS = key_of(optax.with_extra_args_support(optax.identity()))
_TRUST_RATIO = key_of(optax.scale_by_trust_ratio())
_MASKED = key_of(optax.masked(optax.identity(), lambda p: p))
_CLIP = key_of(optax.clip_by_global_norm(1.0))
# The most blocks a bucket of several leaves may have (each has two int32 table entries).
_MAX_BLOCKS = 1 << 21


def _align(layout: Layout, bucket: Bucket) -> int:
  return max(1, layout.align_bytes // bucket.dtype.itemsize)


def clip_by_global_norm(max_norm: Any, axis_name: Any
                        ) -> optax.GradientTransformationExtraArgs:
  """`optax.clip_by_global_norm` on buckets, or on slices of them over ``axis_name``
  (the padding between leaves is zero and adds nothing to the norm)."""

  def update(buckets, state, params=None, **extra_args):
    del params, extra_args
    squares = sum(jnp.sum(_abs2(b)) for b in buckets)
    if axis_name is not None:
      squares = lax.psum(squares, axis_name)
    norm = jnp.sqrt(squares)
    trigger = norm < max_norm
    return tuple(lax.select(trigger, b, (b / norm.astype(b.dtype)) * max_norm)
                 for b in buckets), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def _abs2(x: jax.Array) -> jax.Array:
  """``|x|^2`` in at least float32 (both parts of a complex value count)."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    return jnp.square(x.real.astype(jnp.float32)) + jnp.square(x.imag.astype(jnp.float32))
  return jnp.square(x.astype(jnp.float32))


def static_mask(mask: Any, layout: Layout) -> tuple[bool, ...] | None:
  """Each leaf's flag from an `optax.masked` mask (a tree like the params or a prefix of
  it, or a function of the params), if it is a Python or numpy bool per leaf without
  reading any value: the function is called on shapes (`jax.ShapeDtypeStruct`). None
  when it is not (a mask computed from values is left to the probe)."""
  stand_ins = layout.treedef.unflatten(
      [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in layout.slots])
  try:
    tree = mask(stand_ins) if callable(mask) else mask
    tree = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), tree, stand_ins)
    flags = layout.treedef.flatten_up_to(tree)
  except Exception:  # noqa: BLE001 - not static: the probe decides
    return None
  if not all(isinstance(f, (bool, np.bool_)) for f in flags):
    return None
  return tuple(bool(f) for f in flags)


# -- per-leaf ranges of a bucket ----------------------------------------------------------


class _Ranges:
  """Where the leaves of one bucket lie in the blocks of a slice of it (the whole bucket,
  or this device's slice: ``length`` elements from ``axis_index * length``)."""

  def __init__(self, layout: Layout, bucket: Bucket, length: int, axis_name: Any):
    starts = np.array([layout.slots[j].offset for j in bucket.slots], np.int64)
    ends = starts + [layout.slots[j].size for j in bucket.slots]
    # A block never crosses a leaf's start: each lies in one leaf's range (or the gap
    # after it). The largest such block keeps the tables below short.
    self.block = math.gcd(length, *map(int, starts))  # a multiple of the alignment
    self.count, self.length = len(starts), length
    self.sliced = axis_name is not None
    self.first = lax.axis_index(axis_name) * length if self.sliced else jnp.int32(0)
    if self.count == 1:
      self.leaf, self.end = None, jnp.asarray(ends[0], jnp.int32)
      return
    # Per block of the whole bucket: its leaf, and that leaf's end (static tables).
    leaf = np.searchsorted(starts, np.arange(bucket.size // self.block) * self.block,
                           side="right") - 1
    self.tables = leaf.astype(np.int32), ends[leaf].astype(np.int32)
    self.leaf, self.end = (self._mine(t) for t in self.tables)

  def _mine(self, table: np.ndarray) -> jax.Array:
    """This slice's part of a per-block table of the whole bucket."""
    if not self.sliced:
      return jnp.asarray(table)
    return lax.dynamic_slice_in_dim(jnp.asarray(table), self.first // self.block,
                                    self.length // self.block)

  def _per_element(self, per_block: jax.Array) -> jax.Array:
    shape = (self.length // self.block, self.block)
    return jnp.broadcast_to(per_block[:, None], shape).reshape(-1)

  def spread(self, values: jax.Array) -> jax.Array:
    """Per element of the slice: its leaf's entry of ``values`` (one per leaf)."""
    if self.count == 1:
      return jnp.broadcast_to(values[0], (self.length,))
    return self._per_element(jnp.take(values, self.leaf))

  def spread_static(self, values: np.ndarray) -> jax.Array:
    """`spread` of values known when tracing (a mask's flags): a table per block."""
    if self.count == 1:
      return jnp.broadcast_to(jnp.asarray(values[0]), (self.length,))
    return self._per_element(self._mine(values[self.tables[0]]))

  def sums_of_squares(self, x: jax.Array) -> jax.Array:
    """Each leaf's sum of squares over its range in the slice (in at least f32); the
    gaps between leaves are left out, whatever they hold."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    index = self.first + lax.iota(jnp.int32, self.length)
    end = self.end if self.count == 1 else self._per_element(self.end)
    squares = jnp.where(index < end, wide * wide, 0)
    if self.count == 1:
      return jnp.sum(squares)[None]
    per_block = jnp.sum(squares.reshape(-1, self.block), axis=1)
    return jax.ops.segment_sum(per_block, self.leaf, num_segments=self.count,
                               indices_are_sorted=True)


def trust_ratio(layout: Layout, axis_name: Any, min_norm: Any = 0.0,
                trust_coefficient: Any = 1.0, eps: Any = 0.0
                ) -> optax.GradientTransformationExtraArgs:
  """`optax.scale_by_trust_ratio` on the buckets of ``layout`` (or this device's
  slices of them, with ``axis_name``): each leaf's norms from its range, psum'd over
  ``axis_name`` (one small collective for every bucket together)."""

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("optax.scale_by_trust_ratio needs the params: pass them to "
                       "update (optax.apply_updates' params, or the buckets').")
    ranges = [_Ranges(layout, b, u.shape[0], axis_name)
              for b, u in zip(layout.buckets, updates)]
    sums = [jnp.stack([r.sums_of_squares(p), r.sums_of_squares(u)])
            for r, u, p in zip(ranges, updates, params)]
    widest = jnp.result_type(*(s.dtype for s in sums))
    total = jnp.concatenate([s.astype(widest) for s in sums], axis=1)
    if axis_name is not None:
      total = lax.psum(total, axis_name)
    out, at = [], 0
    for r, u, p in zip(ranges, updates, params):
      dtype = jnp.result_type(u.dtype, p.dtype)
      param_norm, update_norm = (
          _safe(jnp.sqrt(total[i, at:at + r.count]).astype(d), min_norm)
          for i, d in ((0, p.dtype), (1, u.dtype)))
      at += r.count
      ratio = trust_coefficient * param_norm / (update_norm + eps)
      ratio = jnp.where((param_norm == 0.0) | (update_norm == 0.0),
                        jnp.ones((), p.dtype), ratio)
      out.append(u * r.spread(ratio.astype(dtype)))
    return tuple(out), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def _safe(norm: jax.Array, min_norm: Any) -> jax.Array:
  """`optax.safe_norm`'s value: the norm, or ``min_norm`` where it is no larger."""
  return jnp.where(norm <= min_norm, jnp.asarray(min_norm, norm.dtype), norm)


def masked(inner: optax.GradientTransformationExtraArgs, flags: tuple[bool, ...],
           layout: Layout, axis_name: Any) -> optax.GradientTransformationExtraArgs:
  """`optax.masked` with one flag per leaf, on the buckets of ``layout`` (or this
  device's slices of them): ``inner`` runs on every bucket, and each element takes its
  result where its leaf's flag is True and the incoming update elsewhere. ``inner``
  must compute per element (or be `trust_ratio`), so that what it computes for the
  leaves left out changes nothing else."""
  per_bucket = [np.array([flags[j] for j in b.slots] or [False]) for b in layout.buckets]

  def init_fn(params):
    return optax.MaskedState(inner_state=inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    new, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    out = []
    for bucket, on, u, v in zip(layout.buckets, per_bucket, updates, new):
      if on.all() or not on.any():
        out.append(v if on.all() else u)
        continue
      keep = _Ranges(layout, bucket, u.shape[0], axis_name).spread_static(on)
      out.append(jnp.where(keep, v, u))
    return tuple(out), optax.MaskedState(inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
