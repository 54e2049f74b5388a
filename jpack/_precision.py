"""Mixed precision: params in a narrow dtype for the loss, master copies for the optimizer.

A ``param_dtype`` policy says which dtype each floating param leaf is kept in for the
forward and backward pass (bf16, say). The optimizer keeps *master* copies in the dtype
the params had when it was initialised (float32, say), updates those, and the params are
the masters rounded to ``param_dtype``. Buckets are planned for the narrow params; the
master buckets have the same offsets in the wider dtype (`master_layout`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jpack._layout import Layout, retyped
from jpack._pack import Packed, pack

ParamDtype = Union[None, Any, Callable[[Any], Any]]


class Precision(NamedTuple):
  """The dtypes a data-parallel step keeps its params in and sends its gradients in.

  Attributes:
    param_dtype: the dtype the loss sees the params in (``jnp.bfloat16``; a tree of
      dtypes, or a function of the params, as in `jpack.cast_params`); the optimizer then
      updates master copies in the dtype of the params given to ``init`` (float32).
      None keeps the params as given.
    comm_dtype: the wire dtype of the gradient collectives (see `jpack.psum`); None
      sends them in the masters' dtype.

  Examples:
    >>> import jax.numpy as jnp, jpack
    >>> jpack.Precision(param_dtype=jnp.bfloat16).comm_dtype is None
    True
  """
  param_dtype: ParamDtype = None
  comm_dtype: Any = None


def check_precision(precision: Precision | None) -> Precision:
  """``precision`` as a `Precision` (None: full precision)."""
  if precision is None:
    return Precision()
  if not isinstance(precision, Precision):
    raise TypeError(f"precision must be a jpack.Precision(param_dtype=..., comm_dtype=...), "
                    f"got {type(precision).__name__}.")
  return precision


def cast_params(params: Any, param_dtype: ParamDtype) -> Any:
  """``params`` with every floating leaf cast to the dtype ``param_dtype`` gives it.

  Args:
    params: a tree of arrays (or `jax.ShapeDtypeStruct`s), e.g. float32 masters.
    param_dtype: a floating dtype for every floating leaf; or a tree of dtypes (and
      ``None`` for leaves to keep as they are) with the structure of ``params`` or a
      prefix of it; or a function ``params -> such a tree``. Integer, bool and complex
      leaves are never cast.

  Returns:
    The tree with the same structure, floating leaves in their ``param_dtype``.

  Raises:
    ValueError: naming the key path, when a dtype is not a floating dtype or the tree of
      dtypes does not match ``params``.

  Examples:
    >>> import jax.numpy as jnp, jpack
    >>> p = jpack.cast_params({"w": jnp.ones(2), "scale": jnp.ones(2)},
    ...                       {"w": jnp.bfloat16, "scale": None})
    >>> p["w"].dtype, p["scale"].dtype
    (dtype(bfloat16), dtype('float32'))
  """
  dtypes = leaf_dtypes(params, param_dtype)

  def cast(leaf, dtype):
    if dtype is None or np.dtype(leaf.dtype) == dtype:
      return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
    return jnp.asarray(leaf).astype(dtype)

  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten(cast(x, d) for x, d in zip(leaves, dtypes))


def leaf_dtypes(params: Any, param_dtype: ParamDtype) -> list[np.dtype | None]:
  """The dtype ``param_dtype`` gives each leaf of ``params`` (None: keep the leaf's)."""
  path_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  # jnp.bfloat16 is callable too: a dtype is checked first.
  policy = (param_dtype(params) if callable(param_dtype) and not _is_dtype(param_dtype)
            else param_dtype)
  if _is_dtype(policy):
    per_leaf = [policy] * len(path_leaves)
  else:
    try:  # a prefix tree gives each leaf of its subtree the same dtype, as labels= does
      full = jax.tree.map(lambda d, sub: jax.tree.map(lambda _: _Dtype(d), sub),
                          policy, params, is_leaf=lambda x: x is None or _is_dtype(x))
    except (ValueError, TypeError):
      raise ValueError(
          "param_dtype must be a floating dtype, or a tree of dtypes (None keeps a leaf as "
          "it is) with the structure of the params or a prefix of it; got "
          f"{jax.tree.structure(policy, is_leaf=_is_dtype)} for params "
          f"{jax.tree.structure(params)}.") from None
    per_leaf = [d.dtype for d in jax.tree.leaves(full)]
  out = []
  for (path, leaf), dtype in zip(path_leaves, per_leaf):
    if dtype is not None:
      dtype = _floating(dtype, jax.tree_util.keystr(path) or "<root>")
    if not jnp.issubdtype(np.dtype(leaf.dtype), jnp.floating):
      dtype = None  # integers, bools, keys and complex leaves are never cast
    out.append(dtype)
  return out


class _Dtype:
  """A dtype (or None) as a pytree leaf: None is an empty subtree to jax.tree."""

  def __init__(self, dtype: Any):
    self.dtype = dtype


def _is_dtype(x: Any) -> bool:
  if x is None or isinstance(x, (dict, list, tuple)):
    return False
  try:
    np.dtype(x)
  except TypeError:
    return False
  return True


def _floating(dtype: Any, where: str) -> np.dtype:
  try:
    d = np.dtype(dtype)
  except TypeError:
    d = None
  if d is None or not jnp.issubdtype(d, jnp.floating):
    raise ValueError(f"param_dtype for the leaf at {where} is {dtype!r}; it must be a "
                     "floating dtype such as jnp.bfloat16 (or None to keep the leaf as it "
                     "is).")
  return d


def master_layout(layout: Layout, params: Any) -> Layout:
  """The layout of the master buckets: ``layout`` (planned for the cast params) with each
  floating bucket in the widest dtype its leaves have in ``params`` (the masters)."""
  leaves = layout.treedef.flatten_up_to(params)
  dtypes = [np.dtype(b.dtype) for b in layout.buckets]
  for slot, leaf in zip(layout.slots, leaves):
    d = np.dtype(leaf.dtype)
    if jnp.issubdtype(d, jnp.floating) and jnp.issubdtype(dtypes[slot.bucket], jnp.floating):
      dtypes[slot.bucket] = np.dtype(jnp.promote_types(dtypes[slot.bucket], d))
  if dtypes == [np.dtype(b.dtype) for b in layout.buckets]:
    return layout
  return retyped(layout, dtypes)


def pack_masters(params: Any, layout: Layout) -> Packed:
  """``params`` (full precision) packed into the master buckets of ``layout``."""
  masters = master_layout(layout, params)
  leaves = masters.treedef.flatten_up_to(params)
  cast = [jnp.asarray(x).astype(masters.buckets[s.bucket].dtype)
          if jnp.issubdtype(masters.buckets[s.bucket].dtype, jnp.floating) else x
          for s, x in zip(masters.slots, leaves)]
  return pack(masters.treedef.unflatten(cast), masters)


def as_layout(packed: Any, layout: Layout) -> Any:
  """A `Packed` or `jpack.Shards` with the buckets cast to ``layout``'s dtypes (same
  offsets): the gradients in the masters' dtype, or the masters in the params'."""
  buckets = tuple(x if np.dtype(x.dtype) == b.dtype else x.astype(b.dtype)
                  for x, b in zip(packed.buckets, layout.buckets))
  return type(packed)(buckets, layout)


def check_masters(params: Any, where: str) -> None:
  """Masters come from a params tree: a `Packed` already lost the full precision."""
  if hasattr(params, "layout"):
    raise TypeError(
        f"{where} with param_dtype= keeps full-precision master copies of the params, so "
        f"init needs the params as a tree in full precision, not a "
        f"{type(params).__name__} (whose buckets are already in the params' dtype).")
