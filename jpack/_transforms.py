"""optax transforms on packed buckets: `allreduce` (stateless) and `flat` (run on buckets)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from jpack._collectives import pmean, psum
from jpack._layout import Layout, plan
from jpack._pack import Packed, pack, unpack

Labels = Union[Callable[[Any], Any], Any, None]
Inner = Union[optax.GradientTransformation, Mapping[str, optax.GradientTransformation]]


def allreduce(axis_name: Any, *, mean: bool = True, comm_dtype: Any = None,
              method: str = "auto", **plan_options: Any) -> optax.GradientTransformation:
  """All-reduce the incoming updates over ``axis_name``, packed into a few buckets.

  Stateless; put it first in a chain, inside `jax.shard_map` or `jax.pmap`:
  ``optax.chain(jpack.optax.allreduce("batch"), optax.adamw(1e-3))``. Updates may be a
  tree (packed and unpacked around the collectives) or a `jpack.Packed` (used as is).

  Args:
    axis_name: the data-parallel mesh / pmap axis.
    mean: average (`jpack.pmean`) rather than sum (`jpack.psum`).
    comm_dtype: wire dtype of floating buckets (see `jpack.psum`).
    method: collective per bucket, see `jpack.psum`.
    **plan_options: options for `jpack.plan`.

  Returns:
    An `optax.GradientTransformation` with `optax.EmptyState`.

  Examples:
    >>> import optax, jpack
    >>> tx = optax.chain(jpack.optax.allreduce("batch"), optax.adam(1e-3))
  """
  reduce = pmean if mean else psum

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    options = {} if isinstance(updates, Packed) else plan_options
    return reduce(updates, axis_name, comm_dtype=comm_dtype, method=method,
                  **options), state

  return optax.GradientTransformation(init_fn, update_fn)


def _after(tree: Any, *scalars: jax.Array) -> Any:
  """``tree`` unchanged, but each of its arrays computed after ``scalars``.

  Reduced bucket by bucket, the gradient of the last layer is ready while the backward
  pass still reads that layer's weights (and a loss metric nothing else needs may read
  any). XLA may then schedule the update of a donated parameter bucket before those
  reads, and it guards every such bucket with a full copy per step (MLP 24x1024: 23
  copies of 4 MiB per device). Making every gradient depend on scalars that depend on
  all gradients (the gradient norm, the loss) orders the updates after the backward
  pass, and the copies go. ``s > inf`` is false for every value, NaN included, and
  ``x - 0.0`` is exactly ``x`` (``-0.0`` too), so no value changes.
  """
  if not scalars:
    return tree
  never = functools.reduce(jnp.logical_or, [s > jnp.inf for s in scalars])

  def depend(x):
    return x - never.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x

  return jax.tree.map(depend, tree)


def _after_all(tree: Any) -> Any:
  """`_after` every array of ``tree``: each depends on one element of every other."""
  return _after(tree, *_firsts(tree))


def _firsts(tree: Any) -> list[jax.Array]:
  """One element of every non-empty floating array of ``tree``: enough to depend on it."""
  return [jnp.real(x.reshape(-1)[0]) for x in jax.tree.leaves(tree)
          if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]


class FlatState(NamedTuple):
  """State of `flat`."""
  inner_state: optax.OptState  # `inner`'s state on the tuple of buckets


def flat(inner: Inner, *, labels: Labels = None,
         **plan_options: Any) -> optax.GradientTransformation:
  """Run ``inner`` on flat per-dtype buckets instead of on every leaf.

  The per-dtype, no-promotion successor of `optax.flatten`: ``inner`` sees a tuple of
  1-D bucket arrays (one per bucket, each in its leaves' own dtype), so an elementwise
  optimizer does a few large ops instead of hundreds of small ones. Updates come back as
  the original tree with the original dtypes (or as a `jpack.Packed` if they came in
  packed).

  Args:
    inner: the transformation to run on the buckets. Must be elementwise (sgd, momentum,
      adam, adamw, lion, schedules, ...): per-leaf norms or shapes are not visible on
      buckets. Or a dict ``{label: transformation}`` used with ``labels``.
    labels: per-leaf labels, as in `optax.multi_transform`: a tree of labels with the
      structure of the params, or a function ``params -> tree of labels``. Leaves with
      different labels go to different buckets, and bucket ``i`` is updated by
      ``inner[label_i]``. Use it for masks: ``{"decay": optax.adamw(1e-3),
      "no_decay": optax.adam(1e-3), "frozen": optax.set_to_zero()}``.
    **plan_options: options for `jpack.plan`.

  Returns:
    An `optax.GradientTransformation` whose state is `FlatState`.

  Examples:
    >>> import jax.numpy as jnp, optax, jpack
    >>> params = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    >>> tx = jpack.optax.flat(optax.adam(0.1))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> updates["w"].shape
    (2, 2)
  """
  _check_inner(inner, labels)

  def init_fn(params):
    packed = _pack(params, labels, plan_options)
    return FlatState(_labelled(inner, packed.layout).init(packed.buckets))

  def update_fn(updates, state, params=None):
    was_packed = isinstance(updates, Packed)
    packed = _after_all(_pack(updates, labels, plan_options))  # no copies of donated params
    layout = packed.layout
    flat_params = None if params is None else _pack_like(params, layout).buckets
    new, inner_state = _labelled(inner, layout).update(packed.buckets, state.inner_state,
                                                       flat_params)
    out = Packed(tuple(new), layout)
    return (out if was_packed else unpack(out)), FlatState(inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


# -- shared with the sharded optimizer -------------------------------------------------


def _group_fn_for(tree: Any, labels: Labels):
  """A `plan` group_fn that returns each leaf's label from ``labels``."""
  if labels is None:
    return None
  label_tree = labels(tree) if callable(labels) else labels
  try:
    flat_labels = jax.tree.leaves(label_tree)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  except Exception as e:  # pragma: no cover - defensive
    raise ValueError(f"labels could not be read: {e}") from e
  if len(flat_labels) != len(paths) or jax.tree.structure(label_tree) != jax.tree.structure(
      jax.tree.map(lambda _: 0, tree)):
    raise ValueError(
        "labels must have the same tree structure as the params (one label per leaf); "
        f"got {jax.tree.structure(label_tree)} for params {jax.tree.structure(tree)}.")
  by_path = dict(zip(paths, flat_labels))
  return lambda path, leaf: by_path[path]


def _pack(tree: Any, labels: Labels, plan_options: Mapping[str, Any], **extra) -> Packed:
  if isinstance(tree, Packed):
    return tree
  return pack(tree, plan(tree, group_fn=_group_fn_for(tree, labels), **plan_options, **extra))


def _pack_like(tree: Any, layout: Layout) -> Packed:
  return tree if isinstance(tree, Packed) else pack(tree, layout)


def _labelled(inner: Inner, layout: Layout) -> optax.GradientTransformation:
  """``inner`` as one transformation over the tuple of buckets."""
  if not isinstance(inner, Mapping):
    return inner
  bucket_labels = tuple(b.group[1] for b in layout.buckets)
  missing = sorted({str(x) for x in bucket_labels} - {str(k) for k in inner})
  if missing:
    raise ValueError(f"labels {missing} have no transformation; inner has {sorted(inner)}.")
  transforms = {str(k): v for k, v in inner.items()}
  return optax.multi_transform(transforms, lambda buckets: tuple(str(x) for x in bucket_labels))


def _check_inner(inner: Inner, labels: Labels) -> None:
  if isinstance(inner, Mapping):
    if labels is None:
      raise TypeError("inner is a dict of transformations, so labels= is required to say "
                      "which leaves each one updates.")
    for k, v in inner.items():
      if not isinstance(v, optax.GradientTransformation):
        raise TypeError(f"inner[{k!r}] is a {type(v).__name__}, expected an "
                        "optax.GradientTransformation.")
  elif not isinstance(inner, optax.GradientTransformation):
    hint = (" (for optax.MultiSteps, pass its .gradient_transformation())"
            if hasattr(inner, "gradient_transformation") else "")
    raise TypeError(f"inner must be an optax.GradientTransformation (or a dict of them with "
                    f"labels=), got {type(inner).__name__}{hint}.")
