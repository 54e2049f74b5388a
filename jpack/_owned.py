"""ZeRO-1 for transformations that need whole leaves: each device owns whole leaves.

With shards that hold whole leaves (`jpack._layout.whole_leaf_shards`), the
reduce-scatter hands each device the gradients of its own leaves. `on_owned` runs the
transformation there as optax runs it on the params tree, the other leaves empty (or of
one element), under a `lax.switch` on the device's index. Its state, whose structure
differs between devices, is kept in one padded 1-D buffer per dtype (1/N per device).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jpack._collectives import vary
from jpack._internal import empty_shape, is_key_dtype, key_words, leaf_from_flat
from jpack._labels import updates_dtype, with_extra_args
from jpack._layout import Layout, shard_of


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OwnedState:
  """The state of a transformation that runs on each device's own leaves.

  Attributes:
    buffers: one 1-D buffer per dtype (in the order of ``dtypes``), holding this device's
      optax state of its own leaves, flattened and padded to the longest device's.
    dtypes: the buffers' dtype names (static).
  """

  buffers: tuple[jax.Array, ...]
  dtypes: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))


class _Device:
  """What one device owns: its leaves' slots in the shards of a layout."""

  def __init__(self, layout: Layout, k: int, unit: bool):
    n = layout.num_shards
    self.k, self.layout, self.unit = k, layout, unit
    self.width = [b.size // n for b in layout.buckets]
    self.owns = [shard_of(layout, s) == k and s.size > 0 for s in layout.slots]

  def tree(self, shards: tuple[Any, ...]) -> Any:
    """The params tree of ``shards`` (this device's shard of every bucket): its own
    leaves from their shards, every other leaf empty (or ones, of one element)."""
    leaves, others = [], {}
    for j, slot in enumerate(self.layout.slots):
      x = shards[slot.bucket]
      if self.owns[j]:
        start = slot.offset - self.k * self.width[slot.bucket]
        leaves.append(x[start:start + slot.size].reshape(slot.shape))
      else:  # one array per shape and dtype, shared: a trace makes each one an operation
        key = (empty_shape(slot.shape, self.unit), x.dtype)
        if key not in others:
          others[key] = jnp.ones(*key)
        leaves.append(others[key])
    return self.layout.treedef.unflatten(leaves)

  def shards(self, tree: Any, dtypes: list[np.dtype]) -> tuple[jax.Array, ...]:
    """This device's leaves of ``tree`` placed into its shard of every bucket (zeros
    between and after them), bucket i in ``dtypes[i]``."""
    leaves = self.layout.treedef.flatten_up_to(tree)
    out = []
    for i, bucket in enumerate(self.layout.buckets):
      parts, end = [], 0
      for j in bucket.slots:
        if not self.owns[j]:
          continue
        slot = self.layout.slots[j]
        start = slot.offset - self.k * self.width[i]
        if start > end:
          parts.append(jnp.zeros(start - end, dtypes[i]))
        parts.append(jnp.reshape(leaves[j], -1))
        end = start + slot.size
      if end < self.width[i]:
        parts.append(jnp.zeros(self.width[i] - end, dtypes[i]))
      out.append(lax.convert_element_type(jnp.concatenate(parts), dtypes[i]))
    return tuple(out)


def _stored(x: Any) -> tuple[str, int]:
  """The buffer dtype of a state leaf and how many elements it takes there (a PRNG key
  as its uint32 words: optax splits it per leaf of the whole tree, so a device draws
  for its own leaves the numbers the tree would)."""
  size = int(np.prod(x.shape, dtype=np.int64))
  if is_key_dtype(x.dtype):
    return "uint32", size * key_words(x.dtype)
  return np.dtype(x.dtype).name, size


def _state_dtypes(shapes: list[Any]) -> tuple[str, ...]:
  return tuple(sorted({_stored(x)[0] for state in shapes for x in jax.tree.leaves(state)}))


def _flatten_state(state: Any, dtypes: tuple[str, ...], sizes: tuple[int, ...]) -> tuple:
  parts: dict[str, list[Any]] = {d: [] for d in dtypes}
  for x in jax.tree.leaves(state):
    if is_key_dtype(x.dtype):
      x = jax.random.key_data(x)
    parts[_stored(x)[0]].append(jnp.reshape(x, -1))
  out = []
  for d, size in zip(dtypes, sizes):
    used = sum(p.size for p in parts[d])
    if used < size:
      parts[d].append(jnp.zeros(size - used, d))
    # Strongly typed: a branch whose state is only Python scalars would be weakly typed.
    out.append(lax.convert_element_type(jnp.concatenate(parts[d]), d))
  return tuple(out)


def _unflatten_state(buffers: tuple, dtypes: tuple[str, ...], like: Any) -> Any:
  offsets = dict.fromkeys(dtypes, 0)
  index = {d: i for i, d in enumerate(dtypes)}
  leaves, treedef = jax.tree.flatten(like)
  out = []
  for x in leaves:
    d, size = _stored(x)
    part = buffers[index[d]][offsets[d]:offsets[d] + size]
    out.append(leaf_from_flat(part, x).astype(x.dtype) if not is_key_dtype(x.dtype)
               else leaf_from_flat(part, x))
    offsets[d] += size
  return treedef.unflatten(out)


def on_owned(tx: optax.GradientTransformation, layout: Layout, axis_name: Any,
             unit: bool = False) -> optax.GradientTransformationExtraArgs:
  """``tx`` over this device's shards of ``layout``'s buckets (whole leaves, see
  `jpack._layout.whole_leaf_shards`), run as optax runs it on the params tree of the
  leaves this device owns; the other leaves are empty, or with ``unit`` one-element
  stand-ins (for what divides by a dim or takes a max: muon, sm3). Its state is an
  `OwnedState`; its updates are this device's shards, zero outside its leaves."""
  tx = with_extra_args(tx)
  devices = [_Device(layout, k, unit) for k in range(layout.num_shards)]

  def switch(branches: list[Callable[..., Any]], *operands: Any) -> Any:
    if len(branches) == 1:
      return branches[0](*operands)
    index = lax.axis_index(axis_name)
    return lax.switch(index, [lambda *a, f=f: vary(f(*a), axis_name) for f in branches],
                      *operands)

  def settled(d, shards):
    """A device's state as it is after an update: optax may widen it in the first one
    (lars' trace of bfloat16 params becomes float32), and the buffers keep one form."""
    init = jax.eval_shape(lambda s: tx.init(d.tree(s)), shards)
    if not any(_narrow(x.dtype) for x in (*shards, *jax.tree.leaves(init))):
      return init  # nothing to widen: tracing an update of every device costs seconds
    for extra in ({}, {"value": jax.ShapeDtypeStruct((), jnp.float32)}):
      try:
        after = jax.eval_shape(lambda s, st, e: tx.update(d.tree(s), st, d.tree(s), **e)[1],
                               shards, init, extra)
      except Exception:  # noqa: BLE001 - needs other arguments: the init form then
        continue
      if jax.tree.structure(after) == jax.tree.structure(init):
        return after
    return init

  shaped: dict[Any, Any] = {}  # by the shards' shapes: init and every update trace

  def init_shapes(shards):
    key = tuple((x.shape, np.dtype(x.dtype)) for x in shards)
    if key not in shaped:
      shaped[key] = _shapes(key)
    return shaped[key]

  def _shapes(key):
    shards = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in key)
    shapes = [settled(d, shards) for d in devices]
    dtypes = _state_dtypes(shapes)
    sizes = tuple(max(sum(_stored(x)[1] for x in jax.tree.leaves(s) if _stored(x)[0] == name)
                      for s in shapes) for name in dtypes)
    return shapes, dtypes, sizes

  def init_fn(shards):
    shards = tuple(shards)
    shapes, dtypes, sizes = init_shapes(shards)
    branches = [lambda s, d=d, like=like: _flatten_state(_cast(tx.init(d.tree(s)), like),
                                                         dtypes, sizes)
                for d, like in zip(devices, shapes)]
    return OwnedState(tuple(switch(branches, shards)), dtypes)

  def update_fn(updates, state, params=None, **extra_args):
    updates = tuple(updates)
    params = None if params is None else tuple(params)
    shapes, dtypes, sizes = init_shapes(updates)
    if dtypes != state.dtypes:
      raise ValueError(f"The state holds buffers of {state.dtypes}, but the optimizer's "
                       f"state on these updates has {dtypes}: it was initialised for "
                       "another layout or optimizer.")

    def raw(d, like, u, buffers, p, extra):
      tree_params = None if p is None else d.tree(p)
      return tx.update(d.tree(u), _unflatten_state(buffers, dtypes, like), tree_params,
                       **extra)

    outs = [jax.eval_shape(lambda *a, d=d, s=s: raw(d, s, *a), updates, state.buffers,
                           params, extra_args) for d, s in zip(devices, shapes)]
    out_dtypes = _update_dtypes(layout, devices, updates, [u for u, _ in outs])

    branches = [lambda u, b, p, e, d=d, s=s: (
        lambda new: (d.shards(new[0], out_dtypes),
                     _flatten_state(_cast(new[1], s), dtypes, sizes)))(raw(d, s, u, b, p, e))
                for d, s in zip(devices, shapes)]
    new, buffers = switch(branches, updates, state.buffers, params, extra_args)
    return tuple(new), OwnedState(tuple(buffers), dtypes)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _narrow(dtype: Any) -> bool:
  """A float narrower than float32 (what optax's first update may widen)."""
  return (not is_key_dtype(dtype) and jnp.issubdtype(dtype, jnp.inexact)
          and np.dtype(dtype).itemsize < (8 if jnp.issubdtype(dtype, jnp.complexfloating)
                                          else 4))


def _cast(state: Any, like: Any) -> Any:
  """``state`` in the dtypes of ``like`` (its settled form: only ever wider)."""
  return jax.tree.map(lambda x, l: x if x.dtype == l.dtype else x.astype(l.dtype), state, like)


def _update_dtypes(layout: Layout, devices: list[_Device], updates: tuple,
                   returned: list[Any]) -> list[np.dtype]:
  """Each bucket's dtype for the updates: the gradients', or wider floats if the
  transformation returned them (as optax does for a float32 hyperparameter on bfloat16
  params); any other change of dtype is refused with the leaves it concerns."""
  owned = {}  # slot index -> the owner's update
  for d, tree in zip(devices, returned):
    leaves = layout.treedef.flatten_up_to(tree)
    owned.update((j, leaves[j]) for j, mine in enumerate(d.owns) if mine)
  return [updates_dtype(updates[i].dtype, {j: owned[j] for j in b.slots if j in owned},
                        layout) for i, b in enumerate(layout.buckets)]
