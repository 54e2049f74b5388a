"""The state of a transformation run on each device's own leaves (`jpack._owned`).

Each device keeps optax's state on its params tree, its own leaves whole and the others
stand-ins, flattened into one buffer per dtype. Where optax makes that state leaf by leaf,
a `Form` says which state leaf is which param leaf's: `to_tree` and `from_tree` then turn
the buffers into optax's state on the whole params tree and back, the form checkpoints save.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpack._internal import is_key_dtype, key_words, leaf_from_flat, storage_dtype
from jpack._layout import Layout, shard_of


@dataclasses.dataclass(frozen=True)
class Form:
  """Where optax makes the state leaf by leaf: state leaf i is param leaf ``param[i]``'s
  (-1: no one leaf's, the same on every device), of shape ``whole[i]`` on the device that
  owns that leaf and ``stand[i]``, holding ``fill[i]``, on the others."""

  tree: Any  # the state's treedef
  whole: tuple[jax.ShapeDtypeStruct, ...]
  stand: tuple[jax.ShapeDtypeStruct, ...]
  fill: tuple[tuple[Any, ...], ...]  # a stand-in's first values, flat (a few at most)
  param: tuple[int, ...]
  _hash: int = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):  # hashed at every step's dispatch: once here
    object.__setattr__(self, "_hash", hash((self.tree, self.whole, self.stand, self.param)))

  def __hash__(self) -> int:
    return self._hash

  def leaves(self, owns: Sequence[bool]) -> list[jax.ShapeDtypeStruct]:
    """The state leaves' shapes on a device that owns param leaf j where ``owns[j]``."""
    return [whole if p >= 0 and owns[p] else stand
            for whole, stand, p in zip(self.whole, self.stand, self.param)]

  def shapes(self) -> Any:
    """The state on the whole params tree, abstract."""
    return self.tree.unflatten(self.whole)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OwnedState:
  """The state of a transformation that runs on each device's own leaves."""

  buffers: tuple[jax.Array, ...]  # per dtype: this device's optax state, flattened, padded
  dtypes: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))  # their names
  form: Form | None = dataclasses.field(default=None, metadata=dict(static=True))


def stored(x: Any) -> tuple[str, int]:
  """A state leaf's buffer dtype and size there (a PRNG key as its uint32 words)."""
  name, words = _storage(x.dtype)
  return name, math.prod(x.shape) * words


_storage = functools.lru_cache(lambda dtype: (storage_dtype(dtype).name, key_words(dtype)))


def offsets(leaves: Sequence[Any]) -> list[tuple[str, int, int]]:
  """Each state leaf's buffer, start and size there, as `flatten_state` places them."""
  ends: dict[str, int] = {}
  out = []
  for x in leaves:
    d, size = stored(x)
    out.append((d, ends.get(d, 0), size))
    ends[d] = ends.get(d, 0) + size
  return out


def flatten_state(state: Any, like: Any, dtypes: tuple, sizes: tuple) -> tuple:
  """``state`` in the dtypes of ``like`` (its settled form: only ever wider), one buffer
  per dtype padded to ``sizes``."""
  parts: dict[str, list[Any]] = {d: [] for d in dtypes}
  cast = lambda x, l: x if x.dtype == l.dtype else x.astype(l.dtype)  # noqa: E731
  for x in jax.tree.leaves(jax.tree.map(cast, state, like)):
    if is_key_dtype(x.dtype):
      x = jax.random.key_data(x)
    parts[stored(x)[0]].append(jnp.reshape(x, -1))
  # Padded to the largest device's size; strongly typed, as a branch whose state is only
  # Python scalars would be weakly typed.
  return tuple(lax.convert_element_type(jnp.concatenate(
      parts[d] + [jnp.zeros(size - sum(p.size for p in parts[d]), d)]), d)
      for d, size in zip(dtypes, sizes))


def unflatten_state(buffers: tuple, dtypes: tuple[str, ...], like: Any) -> Any:
  """The state of shapes ``like`` that `flatten_state` put in ``buffers``."""
  by_dtype, (leaves, tree) = dict(zip(dtypes, buffers)), jax.tree.flatten(like)
  return tree.unflatten([leaf_from_flat(by_dtype[d][at:at + size], x)
                         for (d, at, size), x in zip(offsets(leaves), leaves)])


def owners(layout: Layout) -> list[int]:
  """Per param leaf, the device that owns it (-1: an empty leaf, no one's)."""
  return [-1 if s.size == 0 else shard_of(layout, s) for s in layout.slots]


def owns(owner: Sequence[int], k: int) -> list[bool]:
  """Per param leaf, whether device ``k`` owns it (``k`` -1: none, every leaf a stand-in)."""
  return [k >= 0 and o == k for o in owner]


def to_tree(state: OwnedState, layout: Layout, host: Callable[[Any], np.ndarray]) -> Any:
  """optax's state on the whole params tree, as host arrays (abstract for an abstract
  ``state``), from the global buffers (device k's at row k); None without a `Form`."""
  form = state.form
  if form is None:
    return None
  if any(isinstance(b, jax.ShapeDtypeStruct) for b in state.buffers):
    return form.shapes()
  owner, n = owners(layout), layout.num_shards
  rows = {d: host(b).reshape(n, -1) for d, b in zip(state.dtypes, state.buffers)}
  by_device: dict[int, list[Any]] = {}  # each device's leaves' offsets, as needed
  leaves = []
  for i, (whole, p) in enumerate(zip(form.whole, form.param)):
    k = 0 if p < 0 else owner[p]
    if k < 0:  # an empty leaf's state, held by no device
      leaves.append(np.zeros(whole.shape, whole.dtype))
      continue
    if k not in by_device:
      by_device[k] = offsets(form.leaves(owns(owner, k)))
    d, at, size = by_device[k][i]
    leaves.append(rows[d][k, at:at + size].reshape(whole.shape))
  return form.tree.unflatten(leaves)


def from_tree(tree_state: Any, like: OwnedState, layout: Layout) -> OwnedState:
  """`to_tree`'s inverse onto ``like``'s form and buffers (host arrays, device k's at row
  k): each device's own leaves from ``tree_state``, its stand-ins as they start."""
  form, owner, n = like.form, owners(layout), layout.num_shards
  saved = form.tree.flatten_up_to(tree_state)
  rows = {d: np.zeros((n, b.shape[0] // n), d) for d, b in zip(like.dtypes, like.buffers)}
  for k in range(n):
    likes = form.leaves(owns(owner, k))
    for (d, at, size), shape, x, fill, p in zip(offsets(likes), likes, saved, form.fill,
                                                form.param):
      value = x if p < 0 or owner[p] == k else np.asarray(fill, shape.dtype)
      rows[d][k, at:at + size] = np.reshape(value, -1)
  return OwnedState(tuple(rows[d].reshape(-1) for d in like.dtypes), like.dtypes, form)
