"""Per-leaf transformations computed on buckets: lamb's trust ratio, static masks, global-norm
clipping. A leaf's norm sums its range of a bucket (on ZeRO-1 slices, completed by one small
psum), and a per-leaf value is spread back over it, block by block with static tables.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jpack._internal import sum_of_squares
from jpack._known import EXTRA_ARGS, chain_parts, closure, injected, key_of, with_factory
from jpack._layout import Bucket, Layout


def on_buckets(tx: Any, layout: Layout, axis_name: Any,
               needs_leaves: Callable[[Any], str | None]
               ) -> optax.GradientTransformationExtraArgs | None:
  """``tx`` computed leaf by leaf on the buckets of ``layout`` (or slices of them), or None.

  For `optax.clip_by_global_norm`, `optax.scale_by_trust_ratio`, `optax.masked` with a
  static mask, and chains or `optax.inject_hyperparams` of these and of bucket-safe parts.

  Args:
    tx: a transformation.
    layout: the buckets' layout.
    axis_name: the axis the buckets are sliced over (ZeRO-1), or None for whole buckets.
    needs_leaves: the check: None when a transformation computes the same on buckets.
  """
  key, found = key_of(tx), closure(tx.update)
  swap = lambda part: on_buckets(part, layout, axis_name, needs_leaves)  # noqa: E731
  if key == EXTRA_ARGS:
    return swap(found["tx"])
  if "inner_factory" in found:  # inject_hyperparams: what it builds, swapped
    try:
      example = _chained(injected(tx), swap, needs_leaves)
    except Exception:  # noqa: BLE001 - a factory that needs other values: on the leaves
      return None
    return example and with_factory(tx, lambda built: _chained(built, swap, needs_leaves))
  if key == _CLIP and "max_norm" in found and all(
      jnp.issubdtype(b.dtype, jnp.inexact) for b in layout.buckets):
    return clip_by_global_norm(found["max_norm"], axis_name)
  if not all(jnp.issubdtype(b.dtype, jnp.floating) for b in layout.buckets) or any(
      len(b.slots) > 1 and b.size // max(1, layout.align_bytes // b.dtype.itemsize)
      > _MAX_BLOCKS for b in layout.buckets):
    return None  # its tables would be large constants: left to the leaves
  if key == _TRUST_RATIO and {"min_norm", "trust_coefficient", "eps"} <= found.keys():
    return trust_ratio(layout, axis_name, found["min_norm"], found["trust_coefficient"],
                       found["eps"])
  if key == _MASKED and {"inner", "mask"} <= found.keys():
    flags, inner = static_mask(found["mask"], layout), found["inner"]
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
_TRUST_RATIO = key_of(optax.scale_by_trust_ratio())
_MASKED = key_of(optax.masked(optax.identity(), lambda p: p))
_CLIP = key_of(optax.clip_by_global_norm(1.0))
# The most blocks a bucket of several leaves may have (each has two int32 table entries).
_MAX_BLOCKS = 1 << 21


def clip_by_global_norm(max_norm: Any, axis_name: Any) -> optax.GradientTransformationExtraArgs:
  """`optax.clip_by_global_norm` on buckets, or on slices of them over ``axis_name``."""

  def update(buckets, state, params=None, **extra_args):
    del params, extra_args
    squares = sum_of_squares(buckets)
    norm = jnp.sqrt(squares if axis_name is None else lax.psum(squares, axis_name))
    return tuple(lax.select(norm < max_norm, b, (b / norm.astype(b.dtype)) * max_norm)
                 for b in buckets), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


def static_mask(mask: Any, layout: Layout) -> tuple[bool, ...] | None:
  """Each leaf's flag from an `optax.masked` mask (a tree, a prefix, or a function called
  on `jax.ShapeDtypeStruct`s) if it is a bool per leaf without reading values, else None."""
  stand_ins = layout.treedef.unflatten(
      [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in layout.slots])
  try:
    tree = mask(stand_ins) if callable(mask) else mask
    tree = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), tree, stand_ins)
    flags = layout.treedef.flatten_up_to(tree)
  except Exception:  # noqa: BLE001 - not static: the probe decides
    return None
  return tuple(map(bool, flags)) if all(isinstance(f, (bool, np.bool_)) for f in flags) else None


class _Ranges:
  """Where the leaves of a bucket lie in the blocks of a slice of it (or the whole bucket)."""

  def __init__(self, layout: Layout, bucket: Bucket, length: int, axis_name: Any):
    starts = np.array([layout.slots[j].offset for j in bucket.slots], np.int64)
    ends = starts + [layout.slots[j].size for j in bucket.slots]
    # The largest block that crosses no leaf's start (a multiple of the alignment): each
    # lies in one leaf's range, or the gap after it.
    self.block = math.gcd(length, *map(int, starts))
    self.count, self.length, self.whole = len(starts), length, axis_name is None
    self.first = jnp.int32(0) if self.whole else lax.axis_index(axis_name) * length
    if self.count == 1:
      self.leaf, self.end = None, jnp.asarray(ends[0], jnp.int32)
      return
    # Per block of the whole bucket, its leaf and that leaf's end; a slice reads its part.
    self.leaves = np.searchsorted(starts, np.arange(bucket.size // self.block) * self.block,
                                  side="right").astype(np.int32) - 1
    self.leaf, self.end = map(self._mine, (self.leaves, ends[self.leaves].astype(np.int32)))

  def _mine(self, table: np.ndarray) -> jax.Array:
    """This slice's part of a per-block table of the whole bucket."""
    return jnp.asarray(table) if self.whole else lax.dynamic_slice_in_dim(
        jnp.asarray(table), self.first // self.block, self.length // self.block)

  def spread(self, values: Any) -> jax.Array:
    """Per element of the slice: its leaf's entry of ``values`` (one per leaf); numpy
    values (a mask's flags) through a static table, not a gather at run time."""
    if self.count == 1:
      return jnp.broadcast_to(values[0], (self.length,))
    per_block = (self._mine(values[self.leaves]) if isinstance(values, np.ndarray)
                 else jnp.take(values, self.leaf))
    return jnp.repeat(per_block, self.block)

  def sums_of_squares(self, x: jax.Array) -> jax.Array:
    """Each leaf's sum of squares over its range in the slice (at least f32, no gaps)."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    index = self.first + lax.iota(jnp.int32, self.length)
    end = self.end if self.count == 1 else jnp.repeat(self.end, self.block)
    squares = jnp.where(index < end, wide * wide, 0)
    if self.count == 1:
      return jnp.sum(squares)[None]
    per_block = jnp.sum(squares.reshape(-1, self.block), axis=1)
    return jax.ops.segment_sum(per_block, self.leaf, num_segments=self.count,
                               indices_are_sorted=True)


def trust_ratio(layout: Layout, axis_name: Any, min_norm: Any = 0.0,
                trust_coefficient: Any = 1.0, eps: Any = 0.0
                ) -> optax.GradientTransformationExtraArgs:
  """`optax.scale_by_trust_ratio` on the buckets of ``layout`` (or slices of them, with
  ``axis_name``: one small psum for every bucket together)."""

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("optax.scale_by_trust_ratio needs the params: pass them to "
                       "update (optax.apply_updates' params, or the buckets').")
    ranges = [_Ranges(layout, b, u.shape[0], axis_name) for b, u in zip(layout.buckets, updates)]
    sums = [jnp.stack([r.sums_of_squares(p), r.sums_of_squares(u)])
            for r, u, p in zip(ranges, updates, params)]
    total = jnp.concatenate(sums, axis=1)  # in the widest of their dtypes
    total = total if axis_name is None else lax.psum(total, axis_name)
    out, at = [], 0
    for r, u, p in zip(ranges, updates, params):
      param_norm, update_norm = (  # optax.safe_norm's values: at least min_norm
          jnp.maximum(jnp.sqrt(total[i, at:at + r.count]).astype(d), jnp.asarray(min_norm, d))
          for i, d in ((0, p.dtype), (1, u.dtype)))
      at += r.count
      ratio = trust_coefficient * param_norm / (update_norm + eps)
      ratio = jnp.where((param_norm == 0.0) | (update_norm == 0.0),
                        jnp.ones((), p.dtype), ratio)
      out.append(u * r.spread(ratio.astype(jnp.result_type(u.dtype, p.dtype))))
    return tuple(out), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def masked(inner: optax.GradientTransformationExtraArgs, flags: tuple[bool, ...],
           layout: Layout, axis_name: Any) -> optax.GradientTransformationExtraArgs:
  """`optax.masked` with a flag per leaf, on buckets (or slices): ``inner`` (per element, or
  `trust_ratio`) runs on every bucket, and an element takes its result where its flag is."""
  per_bucket = [np.array([flags[j] for j in b.slots] or [False]) for b in layout.buckets]

  def update_fn(updates, state, params=None, **extra_args):
    new, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    out = []
    for bucket, on, u, v in zip(layout.buckets, per_bucket, updates, new):
      if on.all() or not on.any():
        out.append(v if on.all() else u)
        continue
      keep = _Ranges(layout, bucket, u.shape[0], axis_name).spread(on)
      out.append(jnp.where(keep, v, u))
    return tuple(out), optax.MaskedState(inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(
      lambda params: optax.MaskedState(inner_state=inner.init(params)), update_fn)
