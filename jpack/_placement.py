"""Placing a step's inputs on the mesh: the batch split over the axis, the state
replicated (or split, for ZeRO-1 slices), from host values, other devices or other
processes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding


def place_batch(batch: Any, sharding: NamedSharding, axis_name: str,
                 accumulate: int = 1) -> Any:
  """Split each batch leaf's leading dimension over the axis, unless it already is.

  Host values (numpy arrays; a nested Python list is a tree of scalars, not an array)
  and arrays on other devices are this process's rows of the global batch; in a single
  process that is the whole batch.
  """
  check_micro_batches(batch, len(sharding.addressable_devices), accumulate)

  def place(path, x):
    if isinstance(x, jax.core.Tracer):  # the step is being traced by an outer jit
      return _constrain(x, sharding)
    if isinstance(x, jax.Array) and x.sharding == sharding:
      return x
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
      # Same placement, but shard_map also checks the sharding's type (on one device,
      # a plain array is "equivalent" yet not split over the axis): relabel, no copy.
      return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      raise ValueError(f"Batch leaf at {jax.tree_util.keystr(path) or '<root>'} is a global "
                       f"array sharded as {x.sharding}; data_parallel expects its leading "
                       f"dimension split over {axis_name!r} ({sharding.spec}).")
    check_splits(path, np.shape(x), len(sharding.addressable_devices), axis_name)
    if jax.process_count() == 1:
      return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))

  return jax.tree_util.tree_map_with_path(place, batch)


def check_micro_batches(batch: Any, devices: int, accumulate: int) -> None:
  """With ``accumulate`` > 1, every batch leaf's rows split into that many micro-batches
  on every device, and all leaves have the same rows (micro-batch j of one leaf must
  hold the examples of micro-batch j of the others)."""
  if accumulate == 1:
    return
  rows = {}
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shape = np.shape(x)
    where = jax.tree_util.keystr(path) or "<root>"
    if not shape or shape[0] % (devices * accumulate):
      raise ValueError(
          f"Batch leaf at {where} has shape {shape}; with accumulate={accumulate} its "
          f"leading (batch) dimension must split into {accumulate} micro-batches on each "
          f"of {devices} devices, i.e. be a multiple of {devices * accumulate}.")
    rows[where] = shape[0]
  if len(set(rows.values())) > 1:
    shown = ", ".join(f"{k}: {v}" for k, v in rows.items())
    raise ValueError(
        f"With accumulate={accumulate}, every batch leaf must have the same number of "
        f"rows (the micro-batch axis is cut from the rows), but they differ: {shown}.")


def check_splits(path: Any, shape: tuple[int, ...], devices: int, axis_name: str) -> None:
  if not shape or shape[0] % devices:
    raise ValueError(
        f"Batch leaf at {jax.tree_util.keystr(path) or '<root>'} has shape {shape}; its "
        f"leading (batch) dimension must split evenly over this process's {devices} "
        f"devices of axis {axis_name!r}.")


def _constrain(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """A traced value moved to ``sharding``: `jax.reshard` on Explicit mesh axes (the
  default), a sharding constraint on Auto ones (reshard refuses those)."""
  types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
  named = [a for entry in sharding.spec if entry is not None
           for a in (entry if isinstance(entry, tuple) else (entry,))]
  if all(types[a] == jax.sharding.AxisType.Explicit for a in named):
    return jax.reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)


def place(x: Any, sharding: NamedSharding) -> Any:
  """A state leaf with the sharding the step expects. Already placed (the usual case,
  every step) it is returned as is; a host value or an array placed otherwise holds the
  whole (global) leaf, as `jax.device_get` of a state gives, and is placed (ZeRO-1
  slices split over the axis, the rest replicated)."""
  if isinstance(x, jax.core.Tracer):
    return _constrain(x, sharding)
  if isinstance(x, jax.Array) and (x.sharding == sharding or not x.is_fully_addressable):
    return x  # a global array placed otherwise: shard_map names the mismatch
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  # Each process supplies its own value (processes may differ where the step does not
  # rely on it: `replicate` for init, whose broadcast from root makes them equal).
  value = np.asarray(x)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def replicate(x: Any, sharding: NamedSharding) -> jax.Array:
  """Place this process's value on each of its devices, as a replicated global array.

  Unlike ``jax.device_put``, processes may pass different values (each initialised its
  own params): the broadcast from ``root`` in ``init`` then makes them equal.
  """
  if isinstance(x, jax.core.Tracer):  # init traced (jax.eval_shape, jit): shard_map places it
    return x
  return place(x, sharding)
