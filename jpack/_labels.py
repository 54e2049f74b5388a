"""How a user's optimizer runs over a tuple of buckets: labels and extra arguments.

`jpack.optax.flat`, `jpack.optax.sharded` and `jpack.data_parallel` take an optax
transformation, or a dict ``{label: transformation}`` with per-leaf ``labels=`` as in
`optax.multi_transform`. Leaves of different labels get different buckets, and each
bucket is updated by its label's transformation.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Union

import jax
import optax

from jpack._layout import Layout

Labels = Union[Callable[[Any], Any], Any, None]
Inner = Union[optax.GradientTransformation, Mapping[str, optax.GradientTransformation]]


def group_fn_for(tree: Any, labels: Labels):
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


def with_extra_args(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``tx`` taking optax's extra update arguments (``value=`` for polyak_sgd or
  reduce_on_plateau). `optax.with_extra_args_support` drops them for every plain
  `GradientTransformation`, even one whose update takes ``**extra_args`` and passes them
  on, as ``optax.MultiSteps(...).gradient_transformation()`` does: that one gets them."""
  try:
    parameters = inspect.signature(tx.update).parameters.values()
  except (TypeError, ValueError):  # no signature to read (a builtin): assume the protocol
    return optax.with_extra_args_support(tx)
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return optax.GradientTransformationExtraArgs(tx.init, tx.update)
  if not isinstance(tx, optax.GradientTransformationExtraArgs):
    return optax.with_extra_args_support(tx)
  # An update that names its extra arguments (optax.contrib.sam: grad_fn=) gets only
  # those: a chain passes every transformation all of them (value= for the loss).
  named = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}

  def update(updates, state, params=None, **extra_args):
    return tx.update(updates, state, params, **{k: v for k, v in extra_args.items()
                                                if k in named})

  return optax.GradientTransformationExtraArgs(tx.init, update)


def multi_transform(transforms: Mapping[Any, optax.GradientTransformation],
                     labels: Any) -> optax.GradientTransformationExtraArgs:
  """`optax.multi_transform` whose transforms all receive the extra update arguments."""
  return optax.multi_transform({k: with_extra_args(v) for k, v in transforms.items()},
                               labels)


def labelled(inner: Inner, layout: Layout) -> optax.GradientTransformationExtraArgs:
  """``inner`` as one transformation over the tuple of buckets, taking optax's extra
  update arguments (``value=`` for polyak_sgd or reduce_on_plateau) like a chain does."""
  if not isinstance(inner, Mapping):
    return with_extra_args(inner)
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
  return multi_transform(dict(inner),
                          lambda buckets: tuple(key_of[str(x)] for x in bucket_labels))


def check_inner(inner: Inner, labels: Labels) -> None:
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
