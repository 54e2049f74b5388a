"""ZeRO-1 for transformations that need whole leaves: each device owns whole leaves.

With shards that hold whole leaves (`jpack._layout.whole_leaf_shards`), `on_owned` runs the
transformation on each device's own leaves under a `lax.switch` on the device's index.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jpack._collectives import vary
from jpack._constants import by_param_leaf, compact, constant_outputs, set_per_device
from jpack._internal import empty_shape, is_key_dtype
from jpack._labels import with_extra_args
from jpack._layout import Layout
from jpack._owned_state import (Form, OwnedState, flatten_state, offsets, owners, owns,
                                stored, unflatten_state)
from jpack._pack import concat_with_gaps, updates_dtype


class _Device:
  """What one device owns: its leaves' slots in the shards of a layout."""

  def __init__(self, layout: Layout, k: int, unit: bool):
    self.k, self.layout, self.unit = k, layout, unit
    self.width = [b.size // layout.num_shards for b in layout.buckets]
    self.owns = owns(owners(layout), k)

  def tree(self, shards: tuple[Any, ...]) -> Any:
    """The params tree of this device's ``shards``, every other leaf empty (or ones)."""
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
    """Its leaves of ``tree`` in its shard of every bucket, zeros between, as ``dtypes``."""
    leaves, slots = self.layout.treedef.flatten_up_to(tree), self.layout.slots
    mine = [[j for j in b.slots if self.owns[j]] for b in self.layout.buckets]
    return tuple(concat_with_gaps(tuple(jnp.reshape(leaves[j], -1).astype(d) for j in js),
                                   tuple(slots[j].offset - self.k * w for j in js), w, d)
                 for js, w, d in zip(mine, self.width, dtypes))


def on_owned(tx: optax.GradientTransformation, layout: Layout, axis_name: Any,
             unit: bool = False) -> optax.GradientTransformationExtraArgs:
  """``tx`` on this device's shards of ``layout``'s buckets, as optax runs it on its own leaves,
  the others empty (or, with ``unit``, of one element: muon, sm3); an `OwnedState`."""
  tx = with_extra_args(tx)
  devices = [_Device(layout, k, unit) for k in range(layout.num_shards)]

  def switch(branches: list[Callable[..., Any]], *operands: Any) -> Any:
    if len(branches) == 1:
      return branches[0](*operands)
    return lax.switch(lax.axis_index(axis_name),
                      [lambda *a, f=f: vary(f(*a), axis_name) for f in branches], *operands)

  def settled(tree, args):
    """``init`` on ``tree(args)`` (traced once: tracing costs more than running it) and its
    state after an update, which may widen it (lars' bfloat16 trace)."""
    traced, init = jax.make_jaxpr(lambda a: tx.init(tree(a)), return_shape=True)(args)
    if not any(_narrow(x.dtype) for x in (*jax.tree.leaves(args), *jax.tree.leaves(init))):
      return traced, init  # nothing to widen: tracing an update costs as much again
    for extra in ({}, {"value": jax.ShapeDtypeStruct((), jnp.float32)}):
      with contextlib.suppress(Exception):  # needs other arguments: the init form then
        after = jax.eval_shape(lambda a, st, e: tx.update(tree(a), st, tree(a), **e)[1],
                               args, init, extra)
        if jax.tree.structure(after) == jax.tree.structure(init):
          return traced, after
    return traced, init

  def by_leaf(specs):
    """Every device's first state from two traces (on whole leaves, on stand-ins), where
    optax makes it leaf by leaf: a trace per device costs a second per hundred leaves."""
    whole = layout.treedef.unflatten([jax.ShapeDtypeStruct(s.shape, specs[s.bucket].dtype)
                                      for s in layout.slots])
    (f, sf), (e, se) = (settled(lambda t: t, whole),
                        settled(_Device(layout, -1, unit).tree, specs))
    found = by_param_leaf(f, sf, e, se, layout.treedef)
    if found is None:
      return None
    param, cf, ce = found
    lf, le = jax.tree.leaves(sf), jax.tree.leaves(se)
    if any(x.size > 64 for x, p in zip(ce, param) if p >= 0) or (  # kept by no `Form`
        (layout.treedef.node_data() or [None])[0] in (list, tuple) and any(  # counts?
            p >= 0 and a == b and np.array_equal(x, y)
            for a, b, x, y, p in zip(lf, le, cf, ce, param))):
      return None
    bare = lambda xs: tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs)  # noqa: E731
    form = Form(jax.tree.structure(sf), bare(lf), bare(le),
                tuple(tuple(np.reshape(x, -1).tolist()) if p >= 0 else ()
                      for x, p in zip(ce, param)), tuple(param))
    return form, [(form.tree.unflatten(form.leaves(d.owns)),
                   [a if p >= 0 and d.owns[p] else b for a, b, p in zip(cf, ce, param)])
                  for d in devices]

  shaped: dict[Any, Any] = {}  # by the shards' shapes: init and every update trace

  def init_shapes(shards):
    key = tuple((x.shape, np.dtype(x.dtype)) for x in shards)
    if key not in shaped:
      specs = tuple(jax.ShapeDtypeStruct(*k) for k in key)
      form, first = by_leaf(specs) or (None, [
          (like, constant_outputs(t)) for t, like in (settled(d.tree, specs) for d in devices)])
      shapes = [like for like, _ in first]
      kept = [[stored(x) for x in jax.tree.leaves(s)] for s in shapes]
      dtypes = tuple(sorted({d for leaves in kept for d, _ in leaves}))
      sizes = tuple(max(sum(n for d, n in leaves if d == name) for leaves in kept)
                    for name in dtypes)
      starts = [_start(c, like, dtypes) for like, c in first]
      shaped[key] = shapes, dtypes, sizes, starts, specs, form
    return shaped[key]

  def init_fn(shards):
    shards = tuple(shards)
    shapes, dtypes, sizes, starts, specs, form = init_shapes(shards)
    if all(s is not None for s in starts):  # the usual start, with no switch to trace
      buffers = tuple(set_per_device([s[j] for s in starts], d, size, axis_name)
                      for j, (d, size) in enumerate(zip(dtypes, sizes)))
      return OwnedState(vary(buffers, axis_name) if len(devices) > 1 else buffers, dtypes, form)
    branches = [lambda s, d=d, like=like: flatten_state(tx.init(d.tree(s)), like, dtypes, sizes)
                for d, like in zip(devices, shapes)]
    return OwnedState(tuple(switch(branches, shards)), dtypes, form)

  def update_fn(updates, state, params=None, **extra_args):
    updates = tuple(updates)
    params = None if params is None else tuple(params)
    shapes, dtypes, sizes, _, _, form = init_shapes(updates)
    if dtypes != state.dtypes:
      raise ValueError(f"The state holds buffers of {state.dtypes}, but the optimizer's "
                       f"state on these updates has {dtypes}: it was initialised for "
                       "another layout or optimizer.")

    def raw(d, like, u, buffers, p, extra):
      return tx.update(d.tree(u), unflatten_state(buffers, dtypes, like),
                       None if p is None else d.tree(p), **extra)

    outs = [jax.eval_shape(lambda *a, d=d, s=s: raw(d, s, *a), updates, state.buffers,
                           params, extra_args) for d, s in zip(devices, shapes)]
    for k, ((_, after), like) in enumerate(zip(outs, shapes)):  # and so checks `by_leaf`
      if [x.shape for x in jax.tree.leaves(after)] != [x.shape for x in jax.tree.leaves(like)]:
        raise ValueError(f"The optimizer's state on device {k} changes shape in its update: "
                         f"{jax.tree.map(jnp.shape, like)} -> {jax.tree.map(jnp.shape, after)}.")
    owned = {}  # slot index -> its owner's update: wider floats widen its bucket
    for d, (new, _) in zip(devices, outs):
      leaves = layout.treedef.flatten_up_to(new)
      owned.update((j, leaves[j]) for j, mine in enumerate(d.owns) if mine)
    out_dtypes = [updates_dtype(u.dtype, {j: owned[j] for j in b.slots if j in owned}, layout)
                  for u, b in zip(updates, layout.buckets)]

    branches = [lambda u, b, p, e, d=d, s=s: (
        lambda new: (d.shards(new[0], out_dtypes),
                     flatten_state(new[1], s, dtypes, sizes)))(raw(d, s, u, b, p, e))
                for d, s in zip(devices, shapes)]
    new, buffers = switch(branches, updates, state.buffers, params, extra_args)
    return tuple(new), OwnedState(tuple(buffers), dtypes, form)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _start(constants: list[Any] | None, like: Any, dtypes: tuple[str, ...]
           ) -> list[Any] | None:
  """Per buffer, the positions and values of a device's first state that are not zero,
  where its init makes ``constants`` alone; else None."""
  found: dict[str, list[Any]] = {d: [] for d in dtypes}
  leaves = jax.tree.leaves(like)
  for x, l, (d, at, _) in zip(constants or [None], leaves, offsets(leaves)):
    if x is None or is_key_dtype(l.dtype):
      return None
    if np.any(compact(x)):  # a few (muon's coefficients), or too many to set one by one
      if x.size > 4096:
        return None
      flat = np.asarray(x).astype(l.dtype).reshape(-1)
      found[d] += [(at + k, flat[k]) for k in np.flatnonzero(flat)]
  return [found[d] for d in dtypes]


def _narrow(dtype: Any) -> bool:
  """A float narrower than float32 (what optax's first update may widen)."""
  return (not is_key_dtype(dtype) and jnp.issubdtype(dtype, jnp.inexact)
          and np.dtype(dtype).itemsize < (8 if jnp.issubdtype(dtype, jnp.complexfloating) else 4))
