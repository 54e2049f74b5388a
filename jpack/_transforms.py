"""optax transforms on packed buckets: `allreduce` (stateless) and `flat` (run on buckets)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpack._collectives import pmean, psum
from jpack._layout import Layout, check_plan_options, plan
from jpack._pack import Packed, pack, unpack
from jpack._probe import checker

Labels = Union[Callable[[Any], Any], Any, None]
Inner = Union[optax.GradientTransformation, Mapping[str, optax.GradientTransformation]]


def allreduce(axis_name: Any, *, mean: bool = True, comm_dtype: Any = None,
              method: str = "auto", allow_int: bool = False,
              **plan_options: Any) -> optax.GradientTransformation:
  """All-reduce the incoming updates over ``axis_name``, packed into a few buckets.

  Stateless; put it first in a chain, inside `jax.shard_map` or `jax.pmap`:
  ``optax.chain(jpack.optax.allreduce("batch"), optax.adamw(1e-3))``. Updates may be a
  tree (packed and unpacked around the collectives) or a `jpack.Packed` (used as is).

  Args:
    axis_name: the data-parallel mesh / pmap axis.
    mean: average (`jpack.pmean`) rather than sum (`jpack.psum`).
    comm_dtype: wire dtype of floating buckets (see `jpack.psum`).
    method: collective per bucket, see `jpack.psum`.
    allow_int: with ``mean=True``, average integer leaves as the floor of the exact mean
      (see `jpack.pmean`) instead of refusing them; sums of integers are always exact.
    **plan_options: options for `jpack.plan`.

  Returns:
    An `optax.GradientTransformation` with `optax.EmptyState`.

  Examples:
    >>> import optax, jpack
    >>> tx = optax.chain(jpack.optax.allreduce("batch"), optax.adam(1e-3))
  """
  check_plan_options(plan_options, "jpack.optax.allreduce")
  reduce = pmean if mean else psum

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    options = {} if isinstance(updates, Packed) else dict(plan_options)
    if mean:
      options["allow_int"] = allow_int
    return reduce(updates, axis_name, comm_dtype=comm_dtype, method=method,
                  **options), state

  update_fn.jpack_reducer = "allreduce"  # data_parallel / sharded refuse a second reduce
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _after(tree: Any, *scalars: jax.Array) -> Any:
  """``tree`` unchanged, but each of its arrays computed after ``scalars``.

  Reduced bucket by bucket, the gradient of the last layer is ready while the backward
  pass still reads that layer's weights (and a loss metric nothing else needs may read
  any). XLA may then schedule the update of a donated parameter bucket before those
  reads, and it guards every such bucket with a full copy per step (MLP 24x1024: 23
  copies of 4 MiB per device). Making every gradient depend on scalars that depend on
  all gradients (the gradient norm, the loss) orders the updates after the backward
  pass, and the copies go. ``s > inf`` is false for every value, NaN included, and
  ``x - 0.0`` is exactly ``x`` (``-0.0`` too), so no value changes (a signalling NaN
  comes out quiet, still NaN).
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


class _LayoutState:
  """Pytree plumbing shared by `FlatState` and `ShardedState`: one child, the inner
  optimizer's state; static data, the bucket `Layout`."""

  __slots__ = ("inner_state", "layout")

  def __init__(self, inner_state: optax.OptState, layout: Layout):
    self.inner_state = inner_state
    self.layout = layout

  def tree_flatten(self):
    return (self.inner_state,), self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children[0], layout)

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(layout={self.layout.fingerprint}, "
            f"inner_state={self.inner_state!r})")


@jax.tree_util.register_pytree_node_class
class FlatState(_LayoutState):
  """State of `flat`.

  A pytree (not a NamedTuple) because it carries the static `Layout` of the buckets:
  updates packed with another layout are refused instead of mixing up leaves' moments.

  Attributes:
    inner_state: ``inner``'s state on the tuple of buckets.
    layout: the static bucket `Layout` the state was initialised with.
  """

  __slots__ = ()


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
      adam, adamw, lion, schedules, ...) or need only the whole gradient
      (``clip_by_global_norm``): per-leaf norms or shapes are not visible on buckets, and
      optax transformations that need them are refused. Or a dict ``{label:
      transformation}`` used with ``labels``.
    labels: per-leaf labels, as in `optax.multi_transform`: a tree of labels with the
      structure of the params (or a prefix of it: one label for a whole subtree), or a
      function ``params -> tree of labels``. Labels need not be strings (``True``,
      ``0``); the state is keyed by them as `optax.multi_transform`'s is. Leaves with
      different labels go to different buckets, and bucket ``i`` is updated by
      ``inner[label_i]``. Use it for masks: ``{"decay": optax.adamw(1e-3),
      "no_decay": optax.adam(1e-3), "frozen": optax.set_to_zero()}``.
    **plan_options: options for `jpack.plan`.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is `FlatState`; extra update
    arguments (``value=`` for ``optax.polyak_sgd``) are passed on to ``inner``.

  Raises:
    TypeError: from ``init``, when ``inner`` computes something else on buckets than on
      the params tree (lamb, adafactor, masks, noise, ...): ``init`` runs it both ways on
      a miniature of the params and compares.
    ValueError: from ``update``, when the updates or params are a `jpack.Packed` with
      another layout than the one the state was initialised with (``state.layout``).

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
  check_plan_options(plan_options, "jpack.optax.flat")
  check = checker(inner, on="buckets", where="inside jpack.optax.flat")

  def init_fn(params):
    packed = _pack(params, labels, plan_options)
    tx = _labelled(inner, packed.layout)
    check(packed.layout)  # on a miniature of the params: compares buckets with the tree
    return FlatState(tx.init(packed.buckets), packed.layout)

  def update_fn(updates, state, params=None, **extra_args):
    layout = state.layout
    was_packed = isinstance(updates, Packed)
    packed = _after_all(_pack_like(updates, layout, "updates"))  # no copies of donated params
    flat_params = None if params is None else _pack_like(params, layout, "params").buckets
    new, inner_state = _labelled(inner, layout).update(packed.buckets, state.inner_state,
                                                       flat_params, **extra_args)
    out = Packed(tuple(new), layout)
    return (out if was_packed else _unpack_as_returned(out)), FlatState(inner_state, layout)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# -- shared with the sharded optimizer -------------------------------------------------


def _group_fn_for(tree: Any, labels: Labels):
  """A `plan` group_fn that returns each leaf's label from ``labels``."""
  if labels is None:
    return None
  label_tree = labels(tree) if callable(labels) else labels
  error = ValueError(
      "labels must have the tree structure of the params (one label per leaf) or a prefix "
      "of it (one label for a whole subtree), as in optax.multi_transform; got "
      f"{jax.tree.structure(label_tree)} for params {jax.tree.structure(tree)}.")
  try:  # a prefix gives every leaf of its subtree the same label, as optax does
    label_tree = jax.tree.map(lambda label, sub: jax.tree.map(lambda _: label, sub),
                              label_tree, tree)
  except (ValueError, TypeError):
    raise error from None
  flat_labels = jax.tree.leaves(label_tree)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if len(flat_labels) != len(paths) or jax.tree.structure(label_tree) != jax.tree.structure(
      jax.tree.map(lambda _: 0, tree)):
    raise error
  by_path = dict(zip(paths, flat_labels))
  return lambda path, leaf: by_path[path]


def _pack(tree: Any, labels: Labels, plan_options: Mapping[str, Any], **extra) -> Packed:
  if isinstance(tree, Packed):
    return tree
  return pack(tree, plan(tree, group_fn=_group_fn_for(tree, labels), **plan_options, **extra))


def _unpack_as_returned(packed: Packed) -> Any:
  """Unpack buckets an inner optimizer returned, each leaf in its bucket's float dtype.
  Like optax on the tree, some optimizers return wider updates than the params
  (adam(mu_dtype=jnp.float32) or a float32 hyperparameter on bf16 params: float32
  updates; `optax.apply_updates` casts them back), and moments may be kept in another
  dtype. Any other dtype change (float updates for integer leaves, complex for real) is
  refused with the leaves it concerns."""
  layout = packed.layout
  dtypes = [np.dtype(x.dtype) for x in packed.buckets]
  changed = [i for i, (d, b) in enumerate(zip(dtypes, layout.buckets)) if d != b.dtype]
  for i in changed:
    got, bucket = dtypes[i], layout.buckets[i]
    if not (jnp.issubdtype(got, jnp.floating) and jnp.issubdtype(bucket.dtype, jnp.floating)):
      paths = [layout.slots[j].path for j in bucket.slots]
      shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
      raise TypeError(
          f"The inner optimizer returned {got} updates for bucket {i}, which holds "
          f"{bucket.dtype} leaves ({shown}); jpack never casts silently. Keep such leaves "
          "out of the optimizer: labels= with optax.set_to_zero() for them (integer "
          "counters, frozen tables), or out of the params.")
  if changed:
    layout = _retyped(layout, dtypes)
  return unpack(Packed(packed.buckets, layout))


def _retyped(layout: Layout, dtypes: list[np.dtype]) -> Layout:
  """``layout`` with bucket i (and its leaves) of ``dtypes[i]``: same element offsets."""
  slots = tuple(slot._replace(dtype=dtypes[slot.bucket]) for slot in layout.slots)
  buckets = tuple(dataclasses.replace(b, dtype=d) for b, d in zip(layout.buckets, dtypes))
  return dataclasses.replace(layout, slots=slots, buckets=buckets)


def _pack_like(tree: Any, layout: Layout, what: str = "updates") -> Any:
  """``tree`` packed with ``layout``; a `Packed` (or `Shards`) must already use it."""
  if not hasattr(tree, "layout"):
    return pack(tree, layout)
  if tree.layout != layout:
    raise ValueError(
        f"The {what} are a {type(tree).__name__} with layout {tree.layout.fingerprint}, "
        f"but the optimizer state was initialised with layout {layout.fingerprint}: "
        "their buckets would pair different leaves. Pack them with the state's layout "
        f"(state.layout), or pass the {what} as a tree.")
  return tree


def _with_extra_args(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``tx`` taking optax's extra update arguments (``value=`` for polyak_sgd or
  reduce_on_plateau). `optax.with_extra_args_support` drops them for every plain
  `GradientTransformation`, even one whose update takes ``**extra_args`` and passes them
  on, as ``optax.MultiSteps(...).gradient_transformation()`` does: that one gets them."""
  if isinstance(tx, optax.GradientTransformationExtraArgs):
    return tx
  try:
    takes_them = any(p.kind is inspect.Parameter.VAR_KEYWORD
                     for p in inspect.signature(tx.update).parameters.values())
  except (TypeError, ValueError):  # no signature to read (a builtin): assume not
    takes_them = False
  if takes_them:
    return optax.GradientTransformationExtraArgs(tx.init, tx.update)
  return optax.with_extra_args_support(tx)


def _multi_transform(transforms: Mapping[Any, optax.GradientTransformation],
                     labels: Any) -> optax.GradientTransformationExtraArgs:
  """`optax.multi_transform` whose transforms all receive the extra update arguments."""
  return optax.multi_transform({k: _with_extra_args(v) for k, v in transforms.items()},
                               labels)


def _labelled(inner: Inner, layout: Layout) -> optax.GradientTransformationExtraArgs:
  """``inner`` as one transformation over the tuple of buckets, taking optax's extra
  update arguments (``value=`` for polyak_sgd or reduce_on_plateau) like a chain does."""
  if not isinstance(inner, Mapping):
    return _with_extra_args(inner)
  bucket_labels = tuple(b.group[1] for b in layout.buckets)
  missing = sorted({str(x) for x in bucket_labels} - {str(k) for k in inner})
  if missing:
    hint = ""
    if any(x is None for x in bucket_labels):
      hint = (" Buckets labelled None come from a layout planned without a group_fn: a "
              "Packed carries its own layout, so plan it with the labels (e.g. "
              "jpack.plan(params, group_fn=lambda path, leaf: label_of[path])), or pass "
              "the params as a tree with labels=.")
    raise ValueError(f"labels {missing} have no transformation; inner has "
                     f"{sorted(inner)}.{hint}")
  # A layout keeps labels as str (it is hashed and compared across processes); the state
  # keeps the user's keys (True, 0, ...), as optax.multi_transform(inner, labels) does.
  key_of: dict[str, Any] = {}
  for k in inner:
    if str(k) in key_of:
      raise ValueError(f"labels {key_of[str(k)]!r} and {k!r} are the same label to a jpack "
                       "layout, which keeps labels as str: rename one.")
    key_of[str(k)] = k
  return _multi_transform(dict(inner),
                          lambda buckets: tuple(key_of[str(x)] for x in bucket_labels))


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
