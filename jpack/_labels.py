"""How a user's optimizer runs over a tuple of buckets: labels (`partition`), extra update
arguments, and `placed`, which runs the parts that buckets would change on the leaves.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence, Union

import jax
import optax

from jpack._known import chain_parts
from jpack._layout import Layout
from jpack._pack import to_buckets, to_tree

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
  if jax.tree.structure(label_tree) != jax.tree.structure(jax.tree.map(lambda _: 0, tree)):
    raise error
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  by_path = dict(zip(paths, jax.tree.leaves(label_tree)))
  return lambda path, leaf: by_path[path]


def partition(transforms: Mapping[Any, optax.GradientTransformation],
              param_labels: Labels) -> optax.GradientTransformationExtraArgs:
  """`optax.partition` that jpack can read: it gives each label its own buckets.

  Args:
    transforms: ``{label: transformation}``; ``optax.set_to_zero()`` freezes leaves.
    param_labels: a tree of labels like the params (or a prefix), or a function of them.

  Returns:
    An `optax.GradientTransformationExtraArgs` with ``transforms`` and ``param_labels``.

  Examples:
    >>> import optax, jpack
    >>> tx = jpack.optax.partition({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()},
    ...                            {"w": "train", "embedding": "frozen"})
    >>> sorted(tx.transforms)
    ['frozen', 'train']
  """
  if not isinstance(transforms, Mapping):
    raise TypeError(f"jpack.optax.partition takes a dict {{label: transformation}} first, "
                    f"got {type(transforms).__name__}: for one optimizer, pass it alone.")
  check_inner(dict(transforms), param_labels)
  tx = multi_transform(transforms, param_labels)
  return _Partition(tx.init, tx.update, dict(transforms), param_labels)


class _Partition(optax.GradientTransformationExtraArgs):
  """`optax.partition`'s transformation, with the transforms and labels it was made of."""

  def __new__(cls, init, update, transforms, param_labels):
    self = super().__new__(cls, init, update)
    self.transforms, self.param_labels = transforms, param_labels
    return self


def split_partition(optimizer: Any) -> tuple[Inner, Labels]:
  """``(inner, labels)`` of a `partition`, or ``(optimizer, None)``; a bare dict is refused."""
  if isinstance(optimizer, _Partition):
    return optimizer.transforms, optimizer.param_labels
  if isinstance(optimizer, Mapping):
    raise TypeError("A dict of transformations needs the labels of its leaves: pass "
                    "jpack.optax.partition(transforms, param_labels), as optax.partition.")
  return optimizer, None


def with_extra_args(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``tx`` taking optax's extra update arguments (``value=`` for polyak_sgd), also where
  `optax.with_extra_args_support` would drop them (an update taking ``**extra_args``)."""
  try:
    parameters = inspect.signature(tx.update).parameters.values()
  except (TypeError, ValueError):  # no signature to read (a builtin): assume the protocol
    return optax.with_extra_args_support(tx)
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return optax.GradientTransformationExtraArgs(tx.init, tx.update)
  if not isinstance(tx, optax.GradientTransformationExtraArgs):
    return optax.with_extra_args_support(tx)
  # An update that names its extra arguments (sam: grad_fn=) gets only those of a chain's.
  named = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}

  def update(updates, state, params=None, **extra_args):
    return tx.update(updates, state, params, **{k: v for k, v in extra_args.items() if k in named})

  return optax.GradientTransformationExtraArgs(tx.init, update)


def multi_transform(transforms: Mapping[Any, optax.GradientTransformation],
                     labels: Any) -> optax.GradientTransformationExtraArgs:
  """`optax.multi_transform` whose transforms all receive the extra update arguments."""
  return optax.multi_transform({k: with_extra_args(v) for k, v in transforms.items()}, labels)


def _keys(inner: Mapping[Any, Any], layout: Layout) -> dict[str, Any]:
  """``inner``'s keys by their str (a layout keeps labels as str; the state, as in optax,
  the user's keys), one for each bucket's label."""
  bucket_labels = [b.group[1] for b in layout.buckets]
  missing = sorted({str(x) for x in bucket_labels} - {str(k) for k in inner})
  if missing:
    hint = (" Buckets labelled None come from a layout planned without labels: plan it "
            "with jpack.plan(params, group_fn=lambda path, leaf: label_of[path]), or pass "
            "the params as a tree.") if any(x is None for x in bucket_labels) else ""
    raise ValueError(f"labels {missing} have no transformation; inner has {sorted(inner)}.{hint}")
  key_of: dict[str, Any] = {}
  for k in inner:
    if str(k) in key_of:
      raise ValueError(f"labels {key_of[str(k)]!r} and {k!r} are the same label to a jpack "
                       "layout, which keeps labels as str: rename one.")
    key_of[str(k)] = k
  return key_of


def check_inner(inner: Inner, labels: Labels) -> None:
  if isinstance(inner, Mapping):
    if labels is None:
      raise TypeError("inner is a dict of transformations, which needs the labels of its "
                      "leaves: pass jpack.optax.partition(transforms, param_labels).")
    for k, v in inner.items():
      if not isinstance(v, optax.GradientTransformation):
        raise TypeError(f"inner[{k!r}] is a {type(v).__name__}, expected an "
                        "optax.GradientTransformation.")
  elif not isinstance(inner, optax.GradientTransformation):
    hint = (" (for optax.MultiSteps, pass its .gradient_transformation())"
            if hasattr(inner, "gradient_transformation") else "")
    raise TypeError(f"inner must be an optax.GradientTransformation (or a dict of them with "
                    f"jpack.optax.partition), got {type(inner).__name__}{hint}.")


def placed(inner: Inner, layout: Layout, needs_leaves: Callable[[Any], str | None],
           leaves: Callable[[Any, Layout], optax.GradientTransformationExtraArgs] | None = None,
           by_leaf: Callable[[Any], optax.GradientTransformationExtraArgs | None] = (
               lambda tx: None),
           ) -> tuple[optax.GradientTransformationExtraArgs, tuple[str, ...], bool,
                      tuple[str, ...]]:
  """``inner`` over the tuple of buckets, the parts buckets would change on the leaves.

  Args:
    inner: the user's transformation, or a dict of them by the labels in ``layout``.
    layout: the buckets' layout.
    needs_leaves: the check: None where ``tx`` runs on buckets, else the name that differs.
    leaves: runs ``tx`` on the leaves (default `on_leaves`; ZeRO-1: owned leaves).
    by_leaf: ``tx`` computed on the buckets leaf by leaf, or None.

  Returns:
    ``(tx, on_leaves, whole, by_leaf)``: ``tx`` on buckets with ``inner``'s state, the names
    of the parts run on the leaves, whether all of it is, the names computed leaf by leaf.
  """
  culprit, run = needs_leaves(inner), leaves or on_leaves
  if isinstance(inner, Mapping):  # each bucket's (or leaf's) transformation, by the labels
    key_of = _keys(inner, layout)
    if culprit is None:
      return multi_transform(dict(inner), lambda buckets: tuple(
          key_of[str(b.group[1])] for b in layout.buckets)), (), False, ()
    labels = layout.treedef.unflatten(
        [key_of[str(layout.buckets[s.bucket].group[1])] for s in layout.slots])
    return run(multi_transform(dict(inner), labels), layout), (culprit,), True, ()
  if culprit is None:
    return with_extra_args(inner), (), False, ()
  swapped = by_leaf(inner)
  if swapped is not None:
    return swapped, (), False, (culprit,)
  parts = chain_parts(inner)
  if parts is None:
    return run(inner, layout), (culprit,), True, ()
  steps, names, computed = [], [], []
  for part in parts:
    tx, inside, whole, inside_computed = placed(part, layout, needs_leaves, leaves, by_leaf)
    # A part whole on the leaves takes the params tree itself (not ZeRO-1's owned leaves):
    # consecutive such parts pass it on without packing in between.
    steps.append((part, True) if whole and leaves is None else (tx, False))
    names += inside
    computed += inside_computed
  if not names and not computed:  # each part passes, the whole does not: no split to trust
    return run(inner, layout), (culprit,), True, ()
  return in_turn(steps, layout), tuple(names), False, tuple(computed)


def on_leaves(tx: optax.GradientTransformation,
              layout: Layout) -> optax.GradientTransformationExtraArgs:
  """``tx`` run on the params tree of the buckets (its state ``tx``'s on the tree)."""
  tx = with_extra_args(tx)

  def init_fn(buckets):
    return tx.init(to_tree(buckets, layout))

  def update_fn(updates, state, params=None, **extra_args):
    tree_params = None if params is None else to_tree(params, layout)
    new, state = tx.update(to_tree(updates, layout), state, tree_params, **extra_args)
    return to_buckets(new, layout), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def in_turn(steps: Sequence[tuple[optax.GradientTransformationExtraArgs, bool]],
            layout: Layout) -> optax.GradientTransformationExtraArgs:
  """`optax.chain` of ``steps``, each ``(tx, takes_tree)``: on the params tree or the
  buckets, the updates unpacked or packed only where the next step wants the other form."""
  trees = any(takes_tree for _, takes_tree in steps)

  def init_fn(buckets):
    tree = to_tree(buckets, layout) if trees else None
    return tuple(tx.init(tree if takes_tree else buckets) for tx, takes_tree in steps)

  def update_fn(updates, state, params=None, **extra_args):
    as_tree, new_state = False, []
    tree_params = None if params is None or not trees else to_tree(params, layout)
    for (tx, takes_tree), s in zip(steps, state):
      if takes_tree != as_tree:
        updates = to_tree(updates, layout) if takes_tree else to_buckets(updates, layout)
        as_tree = takes_tree
      updates, s = tx.update(updates, s, tree_params if takes_tree else params, **extra_args)
      new_state.append(s)
    return (to_buckets(updates, layout) if as_tree else updates), tuple(new_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
