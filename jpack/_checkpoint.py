"""Checkpoints that no device count or mode is tied to.

A `FlatState` or `ShardedState` keeps the inner optimizer's state on buckets whose
lengths are padded for the number of devices (and, for ZeRO-1, split over them).
`gather_state` turns every such node of an optimizer state into the state the inner
optimizer has on the params tree (plain optax state, host arrays), and `scatter_state`
puts such a state back onto the buckets of any new run. `save_checkpoint` and
`restore_checkpoint` save a whole `jpack.TrainState` in that form with an Orbax
`CheckpointManager` (each tree written as one flat array per dtype), and refuse a
checkpoint of another model, of another optimizer or one whose save never finished,
naming what differs. The public names are in `jpack.checkpoint`: ``save``,
``restore``, ``gather_state`` and ``scatter_state``.

Orbax is imported only by those two functions: jpack does not depend on it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpack._collectives import Shards
from jpack._internal import leaf_from_flat
from jpack._layout import Layout, retyped
from jpack._owned_state import OwnedState, from_tree, to_tree
from jpack._pack import Packed, pack
from jpack._sharded import ShardedState, params_or_masters
from jpack._transforms import AllReduceState, FlatState

_NODES = (FlatState, ShardedState)
# The version of the saved form, in every checkpoint's metadata item.
FORMAT = 2
_TMP = ".orbax-checkpoint-tmp"  # how Orbax names a step directory it has not finalized


# -- the optimizer state as a tree ------------------------------------------------------


def gather_state(opt_state: Any) -> Any:
  """The optimizer state with every `FlatState` / `ShardedState` in it on the full tree.

  Takes any optimizer state: a bare `ShardedState` (ZeRO-1), the state of
  ``jpack.data_parallel``'s default ``mode="packed"`` (a chain whose second part is a
  `FlatState`), a plain optax state, or a tree holding several. Call it outside
  ``shard_map`` on the global state (each ZeRO-1 slice-shaped leaf is then a full
  bucket, sharded over the devices). Each `FlatState` / `ShardedState` becomes the state
  its inner optimizer would have on the params tree, ``inner.init(params)``: every tuple
  of buckets becomes a params-shaped tree, in the buckets' dtype (the params' dtype, or
  e.g. ``mu_dtype``), scalars (step counts) are kept, and what the inner optimizer
  keeps on the leaves (`jpack.optax.flat` runs the parts that buckets would change,
  e.g. all of ``optax.contrib.muon``, on the params tree) is in that form already and is
  kept too. Bucket padding depends on the device count, the tree does not: save this
  with any checkpointer.

  Every leaf comes back as a numpy array of its own (a host copy: the state may go on
  training, and donating its buffers, while a checkpointer writes it). Given an
  abstract state (`jax.ShapeDtypeStruct` leaves, from ``jax.eval_shape`` of an init),
  it returns the abstract tree form instead: a restore target for a checkpointer.

  Args:
    opt_state: the global optimizer state, or its ``jax.eval_shape``.

  Returns:
    ``opt_state`` with each `FlatState` / `ShardedState` replaced by its tree form: the
    inner state (for a `jpack.optax.partition`, the `optax.partition` state over the
    params), or, with master copies (``precision=jpack.Precision(param_dtype=...)``),
    ``{"inner_state": that, "master": the params tree in full precision}``.

  Raises:
    ValueError: a state of a hand-written ``jax.pmap`` step (one row per device on
      every leaf).

  Examples:
    >>> import jax.numpy as jnp, optax, jpack
    >>> params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    >>> state = jpack.optax.flat(optax.adam(0.1)).init(params)
    >>> jpack.checkpoint.gather_state(state)[0].mu["w"].shape    # state: a bucket of 128
    (2, 3)
  """
  return _gather(opt_state, _to_host)


def _gather(opt_state: Any, host: Callable[[Any], np.ndarray]) -> Any:
  """`gather_state`, taking each array to the host with ``host``."""
  return jax.tree.map(lambda x: _gather_node(x, host) if _is_node(x) else _host_leaf(x, host),
                      opt_state, is_leaf=_is_node)


def scatter_state(tree_state: Any, like: Any) -> Any:
  """Inverse of `gather_state`, onto the layout of a new run (any device count).

  Args:
    tree_state: a state from `gather_state` (e.g. restored from a checkpoint saved on
      another number of devices); with masters, the ``{"inner_state": ..., "master":
      ...}`` it returns in place of each node.
    like: the new run's optimizer state, or its ``jax.eval_shape``: a `ShardedState`, a
      `FlatState`, or any state holding them. It gives each node's bucket layout and
      every leaf's global shape and dtype; its values are not used.

  Returns:
    A state with ``like``'s structure: its `FlatState` / `ShardedState` nodes hold
    full buckets (each ZeRO-1 slice-shaped leaf whole, as outside ``shard_map``), the
    other leaves are ``tree_state``'s. Place it with the sharding of the new run's state
    (``jpack.data_parallel``'s step does that itself).

  Raises:
    ValueError: naming the key path, if the saved state's structure, shapes or dtypes
      do not match the new run's (another optimizer, other params, other labels, or
      masters on one side only).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jpack
    >>> params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    >>> tx = jpack.optax.flat(optax.adam(0.1))
    >>> saved = jpack.checkpoint.gather_state(tx.init(params))
    >>> state = jpack.checkpoint.scatter_state(saved, like=jax.eval_shape(tx.init, params))
    >>> type(state).__name__, state.inner_state[0].mu[0].shape   # 9 values, aligned
    ('FlatState', (128,))
  """
  if _is_node(like):
    return _scatter_node(tree_state, like, ())
  nodes, prefix = jax.tree_util.tree_flatten_with_path(like, is_leaf=_is_node)
  try:
    saved = prefix.flatten_up_to(tree_state)
  except (ValueError, TypeError):
    raise _structure_error(tree_state, gather_state(_abstract(like))) from None
  out = []
  for (path, node), x in zip(nodes, saved):
    if _is_node(node):
      out.append(_scatter_node(x, node, path))
    else:
      _check_leaf(path, x, node)
      out.append(x)
  return prefix.unflatten(out)


def _is_node(x: Any) -> bool:
  return isinstance(x, _NODES)


def _is_abstract(x: Any) -> bool:
  return isinstance(x, jax.ShapeDtypeStruct)


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _is_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _abstract(tree: Any) -> Any:
  """``tree`` with every leaf a `jax.ShapeDtypeStruct` of its global shape and dtype,
  without sharding (what is saved is host arrays)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _host_leaf(x: Any, host: Callable[[Any], np.ndarray]) -> Any:
  if _is_abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if _is_key(x):  # a typed PRNG key has no numpy form: kept as it is
    return x
  return host(x)


def _to_host(x: Any) -> np.ndarray:
  """The whole value of a (possibly sharded, possibly multi-process) array, as a numpy
  array of its own: a view of a device buffer would change when a step donates it."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if x.sharding.is_fully_replicated:  # every process holds it whole
      return np.array(x.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.array(multihost_utils.process_allgather(x, tiled=True))
  return np.array(x)


def _host_view(x: Any) -> np.ndarray:
  """The value of an array on this process as a numpy array that may share memory with
  its device buffer (CPU devices: a fully replicated array is not copied; otherwise the
  array that JAX copies it to the host into, not copied again). Only for what is copied
  at once: `save_checkpoint` concatenates the leaves of the saved form into new flat
  arrays. Scalars (kept apart, not concatenated) and arrays of several processes are
  copied, as `_to_host` does."""
  if isinstance(x, jax.Array) and x.is_fully_addressable and x.ndim:
    return np.asarray(x)
  return _to_host(x)


def _is_bucket_tuple(x: Any, sizes: tuple[int, ...]) -> bool:
  """A node of a `FlatState`'s or `ShardedState`'s inner state holding one array per
  bucket (with labels, `optax.MaskedNode` stands for other labels' buckets)."""
  return (isinstance(x, tuple) and len(x) == len(sizes) and len(sizes) > 0 and all(
      _is_masked(a) or (hasattr(a, "shape") and tuple(a.shape) == (s,))
      for a, s in zip(x, sizes)))


def _gather_node(state: FlatState | ShardedState, host: Callable[[Any], np.ndarray]) -> Any:
  """One `FlatState` / `ShardedState` as its inner optimizer's state on the tree."""
  layout = state.layout
  sizes = tuple(b.size for b in layout.buckets)
  is_buckets = functools.partial(_is_bucket_tuple, sizes=sizes)
  found = []

  def convert(x):
    if _is_masked(x):
      return x
    if isinstance(x, OwnedState):  # without a `Form`, no tree form: see `_check_owned`
      found.append(x)
      tree = to_tree(x, layout, host)
      return {_owned_key(layout): tuple(_host_leaf(b, host) for b in x.buffers)} if (
          tree is None) else tree
    if not is_buckets(x):
      return _host_leaf(x, host)
    found.append(x)
    return _buckets_to_tree(x, layout, host)

  out = jax.tree.map(convert, state.inner_state,
                     is_leaf=lambda x: isinstance(x, OwnedState) or is_buckets(x)
                     or _is_masked(x))
  # No buckets: either the inner optimizer runs on the leaves (flat keeps muon's state
  # on the params tree, already the tree form) or this is a jax.pmap state.
  leading = set() if found or not sizes else _rows_per_device(state.inner_state, layout)
  if leading:
    raise ValueError(
        "gather_state found no bucket-shaped state: its buckets (or leaves) have a "
        f"leading axis of size {sorted(leading)}, as in a jax.pmap state (one row per "
        "device). It needs the global state of a shard_map step (data_parallel's "
        "default), whose leaves are whole buckets or whole leaves.")
  if state.master is None:
    return out
  return {"inner_state": out, "master": convert(tuple(state.master))}


def _rows_per_device(inner_state: Any, layout: Layout) -> set[int]:
  """The leading axis sizes of what, in ``inner_state``, has a row per device as a
  ``jax.pmap`` state has: a tuple of buckets whose arrays are 2-D (a row of the whole
  bucket or of its ZeRO-1 slice per device), or a params-shaped tree whose every leaf has
  one more leading axis than the param. A state kept on the leaves has neither."""
  sizes = tuple(b.size for b in layout.buckets)
  shapes = [slot.shape for slot in layout.slots]
  leading: set[int] = set()

  def rows(x: Any) -> set[int]:
    if isinstance(x, tuple) and len(x) == len(sizes):
      arrays = [(a, s) for a, s in zip(x, sizes) if not _is_masked(a)]
      if arrays and all(hasattr(a, "shape") and len(a.shape) == 2
                        and s in (a.shape[1], a.shape[0] * a.shape[1]) for a, s in arrays):
        return {a.shape[0] for a, _ in arrays}
    try:
      leaves = layout.treedef.flatten_up_to(x)
    except (ValueError, TypeError):
      return set()
    arrays = [(a, s) for a, s in zip(leaves, shapes) if not _is_masked(a)]
    if arrays and all(hasattr(a, "shape") and tuple(a.shape[1:]) == s for a, s in arrays):
      return {a.shape[0] for a, _ in arrays}
    return set()

  def visit(x: Any) -> bool:
    found = rows(x)
    leading.update(found)
    return bool(found)

  jax.tree.leaves(inner_state, is_leaf=visit)
  return leading


def _buckets_to_tree(x: tuple[Any, ...], layout: Layout,
                     host: Callable[[Any], np.ndarray]) -> Any:
  """A tuple of state buckets as a params-shaped tree. With labels, optax.multi_transform
  gives each label's state MaskedNode() in place of the other labels' buckets; on the
  full tree it has MaskedNode() for their leaves."""
  if any(_is_abstract(a) for a in x):
    def leaf(slot):
      bucket = x[slot.bucket]
      if _is_masked(bucket):
        return optax.MaskedNode()
      # Moments may have another float dtype than the params (adam(mu_dtype=...)).
      same = np.dtype(bucket.dtype) == layout.buckets[slot.bucket].dtype
      return jax.ShapeDtypeStruct(slot.shape, slot.dtype if same else bucket.dtype)
    return layout.treedef.unflatten([leaf(s) for s in layout.slots])
  buckets = tuple(None if _is_masked(a) else host(a) for a in x)
  return layout.treedef.unflatten(
      optax.MaskedNode() if buckets[slot.bucket] is None else _host_leaf_of(buckets, slot)
      for slot in layout.slots)


def _host_leaf_of(buckets: tuple[np.ndarray, ...], slot: Any) -> Any:
  """A slot's leaf as a numpy view of a host bucket, in the bucket's dtype (moments may
  be kept in another float dtype than the params): numpy slices compile nothing."""
  return leaf_from_flat(buckets[slot.bucket][slot.offset:slot.offset + slot.size], slot)


def _scatter_node(tree_state: Any, like: FlatState | ShardedState,
                  root: tuple[Any, ...]) -> FlatState | ShardedState:
  """`scatter_state` onto one node; ``root`` is its key path in the whole state."""
  layout = like.layout
  saved_masters = (isinstance(tree_state, dict)
                   and set(tree_state) == {"inner_state", "master"})
  if (like.master is not None) != saved_masters:
    has = "has" if saved_masters else "has no"
    wants = "keeps" if like.master is not None else "keeps no"
    at = f" at {jax.tree_util.keystr(root)}" if root else ""
    raise ValueError(f"The saved optimizer state{at} {has} master params (Precision(param_dtype=)), "
                     f"and the new run {wants} masters: use the same Precision(param_dtype=) for both.")
  master = None
  if saved_masters:
    master = _saved_to_buckets(root + (jax.tree_util.DictKey("master"),),
                               tree_state["master"], layout)
    for i, (got, want) in enumerate(zip(master, like.master)):
      if np.dtype(got.dtype) != np.dtype(want.dtype):
        raise ValueError(f"Saved master bucket {i} is {got.dtype}; the new run keeps its "
                         f"masters in {want.dtype}.")
    tree_state = tree_state["inner_state"]
    root = root + (jax.tree_util.DictKey("inner_state"),)
  inner = _scatter_inner(tree_state, like.inner_state, layout, root)
  if isinstance(like, ShardedState):
    return ShardedState(inner, layout, master=master)
  return FlatState(inner, layout, master)


def _scatter_inner(tree_state: Any, like_inner: Any, layout: Layout,
                   root: tuple[Any, ...]) -> Any:
  """A saved inner state on the tree as the inner state on ``layout``'s buckets."""
  sizes = tuple(b.size for b in layout.buckets)
  # Where the new run's state holds a tuple of buckets, the saved one holds a params
  # tree: found by position, since shapes alone cannot tell a scalar param's moment
  # from a step count.
  is_buckets = functools.partial(_is_bucket_tuple, sizes=sizes)
  like_nodes, prefix = jax.tree_util.tree_flatten_with_path(
      like_inner, is_leaf=lambda x: isinstance(x, OwnedState) or is_buckets(x))
  try:
    saved = prefix.flatten_up_to(tree_state)
  except (ValueError, TypeError):
    converted = tree_state  # a structure mismatch: named below
  else:
    converted = prefix.unflatten(
        _check_owned(root + path, x, node, layout) if isinstance(node, OwnedState)
        else _saved_to_buckets(root + path, x, layout) if is_buckets(node) else x
        for (path, node), x in zip(like_nodes, saved))
  if jax.tree.structure(converted) != jax.tree.structure(like_inner):
    raise _structure_error(converted, like_inner, root)
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(converted),
                               jax.tree.leaves(like_inner)):
    _check_leaf(root + path, got, want)
  return converted


def _owned_key(layout: Layout) -> str:
  """Where the saved form keeps an `OwnedState`'s buffers: a key naming what their
  contents depend on, so that a checkpoint's signature differs on another device count
  or layout even where the buffers' shapes happen to agree."""
  return f"owned by {layout.num_shards} devices, layout {layout.fingerprint}"


def _check_owned(path: tuple[Any, ...], got: Any, want: OwnedState,
                 layout: Layout) -> OwnedState:
  """Each device's state of the leaves it owns, from optax's state on the params tree
  (saved in any mode) where it has a `Form`; else as saved: buffers whose layout depends
  on the device count and the params' layout."""
  if want.form is not None:
    target = want.form.shapes()
    if jax.tree.structure(got) != jax.tree.structure(target):
      raise _structure_error(got, target, path)
    for (at, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(target)):
      _check_leaf(path + at, g, w)
    return from_tree(got, want, layout)
  shapes = lambda bs: [(tuple(np.shape(b)), str(jnp.result_type(b))) for b in bs]  # noqa: E731
  key = _owned_key(layout)
  if not (isinstance(got, dict) and set(got) == {key}
          and shapes(got[key]) == shapes(want.buffers)):
    raise ValueError(
        f"The saved optimizer state at {jax.tree_util.keystr(path)} does not fit the new "
        "run's: on ZeRO-1, a transformation that needs whole leaves, and whose state optax "
        "does not make leaf by leaf (a PRNG key in it, values read from the params), keeps "
        "it per device, flattened by the device count and the params' layout: it restores "
        "only onto the same ones. Restore on the same number of devices with the same "
        "params, or save from mode='packed'.")
  return OwnedState(tuple(got[key]), want.dtypes)


def _check_leaf(path: tuple[Any, ...], got: Any, want: Any) -> None:
  if np.shape(got) != tuple(want.shape) or jnp.result_type(got) != want.dtype:
    raise ValueError(
        f"Saved optimizer state at {jax.tree_util.keystr(path)} has shape "
        f"{np.shape(got)} and dtype {jnp.result_type(got)}; the new run expects "
        f"{tuple(want.shape)} {want.dtype}.")


def _structure_error(got_tree: Any, want_tree: Any, root: tuple[Any, ...] = ()
                     ) -> ValueError:
  """The first key path where a saved state and the expected one part."""
  def paths(tree):
    return [jax.tree_util.keystr(root + p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]

  got, want = paths(got_tree), paths(want_tree)
  first = next((f"saved {g}, expected {w}" for g, w in zip(got, want) if g != w),
               f"saved {len(got)} leaves, expected {len(want)}")
  return ValueError("The saved optimizer state does not match the new optimizer's state "
                    f"structure (first difference: {first}): got "
                    f"{jax.tree.structure(got_tree)}, expected "
                    f"{jax.tree.structure(want_tree)}. Was it saved from the same inner "
                    "transformation (the same jpack.optax.partition), for the same params?")


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
          "does not: give the new run the same jpack.optax.partition labels as the saved one.")
    buckets.append(flags == {True})
  new_layout = retyped(layout, dtypes)
  zeros = [jnp.zeros(s.shape, s.dtype) if m else v
           for s, v, m in zip(new_layout.slots, leaves, masked)]
  packed = pack(params_def.unflatten(zeros), new_layout).buckets
  return tuple(optax.MaskedNode() if m else p for p, m in zip(packed, buckets))


# -- a whole training state, with Orbax --------------------------------------------------


def save_checkpoint(manager: Any, step: int, state: Any, *, key: jax.Array | None = None,
                    force: bool = False) -> bool:
  """Save a `jpack.TrainState` with an Orbax ``CheckpointManager``, for any device count
  and mode (``jpack.checkpoint.save``).

  Call it after every step: when the manager's save policy skips ``step`` it returns
  False at once. Otherwise it copies the state to the host in its saved form and hands
  it to ``manager.save``; with asynchronous checkpointing (Orbax's default) the next
  steps run while the files are written, and a save that never finishes leaves no
  finished checkpoint. The saved form is the same in every mode and on every device
  count: the params tree, the optimizer state as ``optimizer.init(params)`` has it, the
  step, the key and the model state, each tree one flat array per dtype, with their key
  paths, shapes and dtypes in item ``"meta"`` (docs/howto/checkpoints.md). On several
  processes every process calls it, for the same ``step``, with a manager on a shared
  directory (Orbax's save is collective); process 0 writes.

  Args:
    manager: an ``orbax.checkpoint.CheckpointManager``.
    step: the step to save it as: ``state.step``, as the loop counts it (reading
      ``state.step`` would wait for the step to finish).
    state: the `jpack.TrainState` of a ``jpack.data_parallel`` step (or of a
      hand-written ``shard_map`` step), or a host copy of one.
    key: a PRNG key to save with it: typed (``jax.random.key``) or raw ``uint32`` data.
    force: save even if the manager's save policy would skip ``step``.

  Returns:
    Whether a save was started.

  Raises:
    ValueError: ``step`` is not ``state.step``, or the state is a ``jax.pmap`` step's.

  Examples:
    >>> import tempfile, jax, jax.numpy as jnp, optax, jpack
    >>> import orbax.checkpoint as ocp
    >>> params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    >>> dp = jpack.data_parallel(lambda p, x: jnp.mean(x @ p["w"] + p["b"]),
    ...                          optax.adam(0.1), params)
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
    ...   jpack.checkpoint.save(manager, 0, dp.init(params), key=jax.random.key(0))
    True
  """
  if not force and not manager.should_save(step):
    return False
  ocp = _orbax()
  # The trees as views of the state's buffers where JAX gives them (CPU devices), or
  # of JAX's host copies: _flat_form's concatenation is then jpack's one copy on the
  # host (Orbax makes its own), and no view outlives this call, so the next step may
  # donate the buffers.
  saved = _saved_form(state, key, _host_view)
  if int(saved["step"]) != step:
    raise ValueError(f"save_checkpoint was asked to save step {step}, but the state has "
                     f"taken {int(saved['step'])} steps: pass the loop's count of "
                     "state.step.")
  return manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(_flat_form(saved)),
      meta=ocp.args.JsonSave(_metadata(saved, key))), force=force)


def restore_checkpoint(manager: Any, like: Any, *, step: int | None = None
                       ) -> tuple[Any, jax.Array | None]:
  """Restore what ``jpack.checkpoint.save`` saved, onto a new run of any device count and
  mode (``jpack.checkpoint.restore``).

  Checks the checkpoint's metadata before reading any array: the params' and the
  optimizer state's key paths, shapes and dtypes must be ``like``'s (the optimizer state
  as on the params tree). On several processes, every process calls it.

  Args:
    manager: an ``orbax.checkpoint.CheckpointManager``, or the directory it writes to.
    like: the new run's `jpack.TrainState`, or ``jax.eval_shape(dp.init, params)``
      (``dp`` the new ``jpack.data_parallel``, on any mesh, in any mode).
    step: the step to restore; default: the latest finished one.

  Returns:
    ``(state, key)``: a `jpack.TrainState` like ``like`` of host values (``dp.step``
    places them), and the saved PRNG key, or None if none was saved.

  Raises:
    FileNotFoundError: the directory holds no finished checkpoint (or none for
      ``step``), e.g. only one whose save was interrupted.
    ValueError: the checkpoint is of another model, optimizer or precision (naming the
      first key path that differs), or was not written by ``jpack.checkpoint.save``.

  Examples:
    >>> import tempfile, jax, jax.numpy as jnp, optax, jpack
    >>> import orbax.checkpoint as ocp
    >>> params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    >>> dp = jpack.data_parallel(lambda p, x: jnp.mean(x @ p["w"] + p["b"]),
    ...                          optax.adam(0.1), params)
    >>> directory = tempfile.mkdtemp()
    >>> with ocp.CheckpointManager(directory) as manager:
    ...   _ = jpack.checkpoint.save(manager, 0, dp.init(params), key=jax.random.key(7))
    >>> sharded = jpack.data_parallel(lambda p, x: jnp.mean(x @ p["w"] + p["b"]),
    ...                               optax.adam(0.1), params, mode="sharded")
    >>> state, key = jpack.checkpoint.restore(directory,
    ...                                       jax.eval_shape(sharded.init, params))
    >>> int(state.step), type(state.opt_state).__name__, key.dtype
    (0, 'ShardedState', key<fry>)
  """
  ocp = _orbax()
  if isinstance(manager, (str, os.PathLike)):
    directory = os.path.abspath(manager)
    if not os.path.isdir(directory):
      raise FileNotFoundError(f"no finished checkpoint in {directory}: no such directory.")
    options = ocp.CheckpointManagerOptions(create=False)
    with ocp.CheckpointManager(directory, options=options) as opened:
      return restore_checkpoint(opened, like, step=step)
  manager.wait_until_finished()  # a save of this manager still in flight
  manager.reload()               # and steps another process finished
  step = _finished_step(manager, step)
  where = f"{manager.directory}, step {step}"
  meta = _read_meta(manager, step, where)
  target = _target(like, meta)
  _check_same(meta["params"], _signature(target["params"]), "params", where,
              meta.get("fingerprint"))
  _check_same(meta["opt_state"], _signature(target["opt_state"]), "optimizer state",
              where)
  if "model_state" in target:
    _check_same(meta["model_state"], _signature(target["model_state"]), "model_state",
                where)
  flat = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(_flat_form(target)))).state
  restored = _from_flat_form(flat, target)
  return _from_saved(restored, like), _key_of(restored, meta)


def _orbax() -> Any:
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("save_checkpoint and restore_checkpoint use Orbax: "
                      "pip install 'jpack[orbax]' (or orbax-checkpoint).") from e
  return ocp


def _params_tree(params: Any, host: Callable[[Any], np.ndarray] = _to_host) -> Any:
  """The params as a tree of host arrays (abstract params: of `jax.ShapeDtypeStruct`).
  ZeRO-3's `Shards`, seen from outside ``shard_map``, hold the whole buckets split over
  the devices, as a `Packed` does."""
  if not isinstance(params, (Packed, Shards)):
    return jax.tree.map(lambda x: _host_leaf(x, host), params)
  if any(_is_abstract(b) for b in params.buckets):
    return params.layout.shapes()
  # One host array per bucket; the leaves are views of these.
  buckets = tuple(host(b) for b in params.buckets)
  return params.layout.treedef.unflatten(_host_leaf_of(buckets, s)
                                         for s in params.layout.slots)


def _optimizer_part(opt_state: Any) -> Any:
  """The optimizer's own state in a step's state: without the all-reduce in front of it
  (``data_parallel``'s "packed" and "allreduce" modes chain ``jpack.optax.allreduce``,
  whose state is a gradient norm for logging, or nothing), so that every mode saves the
  same thing."""
  if _is_allreduce_chain(opt_state):
    return opt_state[1]
  return opt_state


def _is_allreduce_chain(x: Any) -> bool:
  return (type(x) is tuple and len(x) == 2
          and isinstance(x[0], (AllReduceState, optax.EmptyState)))


def _saved_form(state: Any, key: Any, host: Callable[[Any], np.ndarray]) -> dict[str, Any]:
  """What `save_checkpoint` saves, the same in every mode: host copies, or with
  ``host=_host_view`` views of the state's buffers where they can be (the trees only:
  the step and the key are copies)."""
  # ZeRO-3 with masters keeps no params: saved, as every mode saves them, from the masters.
  params = params_or_masters(state.params, _optimizer_part(state.opt_state))
  saved = {"params": _params_tree(params, host),
           "opt_state": _gather(_optimizer_part(state.opt_state), host),
           "step": _to_host(state.step)}
  if key is not None:
    saved["key"] = _to_host(jax.random.key_data(key) if _is_key(key) else key)
  model_state = getattr(state, "model_state", None)
  if model_state is not None:
    saved["model_state"] = jax.tree.map(host, model_state)
  return saved


def _signature(tree: Any) -> list[list[Any]]:
  """``[key path, shape, dtype]`` of every leaf: what a checkpoint's metadata records
  and a new run compares."""
  return [[jax.tree_util.keystr(path), list(np.shape(x)), _dtype_name(x.dtype)]
          for path, x in jax.tree_util.tree_leaves_with_path(tree)]


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: Any) -> str:
  # Cached: numpy builds the name anew on every call, once per leaf of a save.
  return np.dtype(dtype).name


def _fingerprint(signature: list[list[Any]]) -> str:
  """A short hash of the params' paths, shapes and dtypes: unlike
  ``Layout.fingerprint``, it does not depend on the bucket padding (the device count)."""
  return hashlib.sha256(json.dumps(signature).encode()).hexdigest()[:16]


def _metadata(saved: dict[str, Any], key: Any) -> dict[str, Any]:
  params = _signature(saved["params"])
  return {"jpack_checkpoint": FORMAT, "step": int(saved["step"]),
          "fingerprint": _fingerprint(params), "params": params,
          "opt_state": _signature(saved["opt_state"]),
          "model_state": (_signature(saved["model_state"]) if "model_state" in saved
                          else None),
          "key": (None if key is None else
                  {"impl": str(jax.random.key_impl(key)) if _is_key(key) else None,
                   "shape": list(saved["key"].shape)})}


# The parts of the saved form that are trees of arrays, each written as a few flat arrays.
_FLAT_PARTS = ("params", "opt_state", "model_state")
_SCALARS = "scalars"


def _flat_form(saved: dict[str, Any]) -> dict[str, Any]:
  """What Orbax writes: each tree of ``saved`` as one flat array per dtype. Orbax's cost
  grows with the number of arrays far more than with their bytes, and the tree form
  has a few per param."""
  return {name: _flatten_part(x) if name in _FLAT_PARTS else x for name, x in saved.items()}


def _from_flat_form(flat: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
  """The saved form back from what Orbax read; ``target`` (abstract) gives each tree's
  structure, leaf shapes and dtypes, already checked against the checkpoint's meta."""
  return {name: _unflatten_part(flat[name], target[name]) if name in _FLAT_PARTS else x
          for name, x in flat.items()}


def _is_loose(x: Any) -> bool:
  """A leaf kept as an array of its own: a scalar (a step count), or a typed PRNG key
  (no numpy dtype to share a flat array with)."""
  return len(np.shape(x)) == 0 or _is_key(x)


def _flatten_part(tree: Any) -> dict[str, Any]:
  """``{dtype name: the leaves of that dtype, raveled and concatenated in leaf order},
  "scalars": [the loose leaves in leaf order]}``. The order is the tree form's, which
  depends on neither the device count nor the mode; the leaves' shapes are in the meta.
  Empty containers are left out (Orbax writes nothing for them)."""
  groups: dict[str, list[Any]] = {}
  loose = []
  for x in jax.tree.leaves(tree):
    if _is_loose(x):
      loose.append(x)
    else:
      groups.setdefault(_dtype_name(x.dtype), []).append(x)
  out: dict[str, Any] = {name: _concatenate(xs) for name, xs in groups.items()}
  if loose:
    out[_SCALARS] = loose
  return out


def _concatenate(xs: list[Any]) -> Any:
  if any(_is_abstract(x) for x in xs):
    return jax.ShapeDtypeStruct((sum(math.prod(x.shape) for x in xs),), xs[0].dtype)
  return np.concatenate([np.ravel(x) for x in xs])


def _unflatten_part(flat: dict[str, Any], like: Any) -> Any:
  """Inverse of `_flatten_part`, into ``like``'s structure: numpy views of the flat
  arrays (nothing is compiled or copied)."""
  leaves, treedef = jax.tree.flatten(like)
  offsets = dict.fromkeys(flat, 0)
  loose = iter(flat.get(_SCALARS, ()))
  out = []
  for x in leaves:
    if _is_loose(x):
      out.append(next(loose))
      continue
    name, size = _dtype_name(x.dtype), math.prod(x.shape)
    start = offsets[name]
    out.append(np.asarray(flat[name])[start:start + size].reshape(x.shape))
    offsets[name] = start + size
  return treedef.unflatten(out)


def _finished_step(manager: Any, step: int | None) -> int:
  """``step``, or the latest finished one; an error naming the directory otherwise."""
  steps = sorted(manager.all_steps())
  if step is None and steps:
    return steps[-1]
  if step in steps:
    return step
  directory = manager.directory
  unfinished = sorted(p.name for p in directory.iterdir() if _TMP in p.name) \
      if directory.exists() else []
  what = "no finished checkpoint" + ("" if step is None else f" of step {step}")
  detail = (f"; unfinished (a save was interrupted): {', '.join(unfinished)}"
            if unfinished else "")
  finished = f"; finished steps: {steps}" if steps else ""
  raise FileNotFoundError(f"{what} in {directory}{detail}{finished}.")


def _read_meta(manager: Any, step: int, where: str) -> dict[str, Any]:
  ocp = _orbax()
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  except (FileNotFoundError, KeyError, ValueError) as e:
    raise ValueError(f"The checkpoint in {where} has no readable 'meta' item ({e}): "
                     "it was not written by jpack.checkpoint.save.") from None
  version = meta.get("jpack_checkpoint") if isinstance(meta, dict) else None
  if isinstance(version, int) and version != FORMAT:
    raise ValueError(f"The checkpoint in {where} is in jpack's checkpoint format {version}; "
                     f"this jpack reads format {FORMAT} only: restore it with the jpack "
                     "that wrote it.")
  if version != FORMAT:
    raise ValueError(f"The checkpoint in {where} was not written by "
                     f"jpack.checkpoint.save (format {FORMAT}): its 'meta' item is "
                     f"{str(meta)[:200]}.")
  return meta


def _target(like: Any, meta: dict[str, Any]) -> dict[str, Any]:
  """The abstract saved form of ``like``: what the checkpoint must hold, and Orbax's
  restore target (host arrays, no sharding)."""
  # Abstract first: a real ``like``'s values are never read (on several processes
  # ``like`` is a real state, see restore_checkpoint: reading it would copy it).
  like = _abstract(like)
  target = {"params": _params_tree(params_or_masters(like.params,
                                                     _optimizer_part(like.opt_state))),
            "opt_state": gather_state(_optimizer_part(like.opt_state)),
            "step": jax.ShapeDtypeStruct((), like.step.dtype)}
  if meta.get("key") is not None:
    target["key"] = jax.ShapeDtypeStruct(tuple(meta["key"]["shape"]), np.uint32)
  model_state = getattr(like, "model_state", None)
  if (model_state is not None) != (meta.get("model_state") is not None):
    has = "carries" if meta.get("model_state") is not None else "carries no"
    wants = "carries" if model_state is not None else "carries no"
    raise ValueError(f"The checkpoint {has} model_state and the new run's TrainState "
                     f"{wants} model_state (given to dp.init(params, model_state)): use the same "
                     "for both.")
  if model_state is not None:
    target["model_state"] = model_state
  return target


def _check_same(saved: list[list[Any]], new: list[list[Any]], what: str, where: str,
                fingerprint: str | None = None) -> None:
  """Refuse a checkpoint whose leaves differ from the new run's, naming the first."""
  if saved == new:
    return
  old = {path: (tuple(shape), dtype) for path, shape, dtype in saved}
  now = {path: (tuple(shape), dtype) for path, shape, dtype in new}
  for path in [p for p, *_ in saved] + [p for p, *_ in new]:
    if old.get(path) == now.get(path):
      continue
    shown = path or "<root>"
    if path not in now:
      detail = f"{shown} is in the checkpoint, not in the new run"
    elif path not in old:
      detail = f"{shown} is in the new run, not in the checkpoint"
    else:
      (s0, d0), (s1, d1) = old[path], now[path]
      detail = f"{shown} is {s0} {d0} in the checkpoint, {s1} {d1} in the new run"
    break
  else:
    detail = "the same leaves come in another order"
  hint = {"params": "it is of another model.",
          "optimizer state": "was it saved with the same optimizer (partition "
                             "labels included) and Precision(param_dtype=)?",
          "model_state": "was it saved from the same model?"}[what]
  prints = ""
  if fingerprint is not None:
    prints = f" (params fingerprint {fingerprint} saved, {_fingerprint(new)} now)"
  raise ValueError(f"The checkpoint in {where} does not fit the new run: in the {what}, "
                   f"{detail}{prints}; {hint}")


def _from_saved(restored: dict[str, Any], like: Any) -> Any:
  """The restored saved form as a state like ``like`` (host values)."""
  params = restored["params"]
  if like.params is None:  # ZeRO-3 with masters: the restored masters are the params
    params = None
  elif isinstance(like.params, Packed):
    params = pack(params, like.params.layout)
  elif isinstance(like.params, Shards):  # the whole buckets: dp.step splits them
    params = Shards(pack(params, like.params.layout).buckets, like.params.layout)
  opt_like = like.opt_state
  if _is_allreduce_chain(opt_like):
    # The all-reduce keeps only the last step's gradient norm (a metric): zero again.
    first = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), opt_like[0])
    opt_state = (first, scatter_state(restored["opt_state"], opt_like[1]))
  else:
    opt_state = scatter_state(restored["opt_state"], opt_like)
  fields = {"params": params, "opt_state": opt_state,
            "step": np.asarray(restored["step"], like.step.dtype)}
  if "model_state" in restored:
    fields["model_state"] = restored["model_state"]
  return like._replace(**fields)


def _key_of(restored: dict[str, Any], meta: dict[str, Any]) -> jax.Array | None:
  if "key" not in restored:
    return None
  impl = meta["key"]["impl"]
  data = np.asarray(restored["key"], np.uint32)
  return data if impl is None else jax.random.wrap_key_data(data, impl=impl)
