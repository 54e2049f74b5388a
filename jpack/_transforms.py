"""optax transforms on packed buckets: `allreduce` (stateless) and `flat` (run on buckets)."""

from __future__ import annotations

import builtins
import dataclasses
import dis
import functools
import inspect
import types
from typing import Any, Callable, Mapping, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpack._collectives import pmean, psum
from jpack._layout import Layout, check_plan_options, plan
from jpack._pack import Packed, pack, unpack

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
    TypeError: ``inner`` holds an optax transformation that needs whole leaves (lamb,
      adafactor, masked, ...); it would silently compute something else on buckets.
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
  _refuse_inner(inner, "inside jpack.optax.flat")

  def init_fn(params):
    packed = _pack(params, labels, plan_options)
    _refuse_masked_state(inner, packed.buckets, "inside jpack.optax.flat")
    return FlatState(_labelled(inner, packed.layout).init(packed.buckets), packed.layout)

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


# -- refusing inner transforms that buckets would silently change ----------------------

# optax factories that need each leaf's shape or values, or the params tree itself
# (per-leaf norms, factored moments, masks and labels by leaf, line searches calling the
# loss): on buckets, which mix many leaves, they would compute something else.
_NEEDS_LEAVES = {
    "clip_by_block_rms", "adaptive_grad_clip", "per_example_global_norm_clip",
    "scale_by_trust_ratio", "lamb", "lars", "fromage", "scale_by_param_block_norm",
    "scale_by_param_block_rms", "scale_by_factored_rms", "adafactor", "sm3", "scale_by_sm3",
    "masked", "multi_transform", "partition", "muon", "scale_by_muon", "centralize",
    "novograd", "scale_by_novograd", "flatten", "scale_by_zoom_linesearch",
    "scale_by_backtracking_linesearch", "scale_by_galore", "galore",
    "hutchinson_estimator_diag_hessian", "scale_by_sophia", "sophia",
    "differentially_private_aggregate", "dpsgd",
}
# ... and those that need the whole gradient: right on all the buckets, wrong on a slice.
_NEEDS_WHOLE_GRADIENT = {
    "clip_by_global_norm", "normalize_by_update_norm", "lbfgs", "scale_by_lbfgs",
    "polyak_sgd", "scale_by_polyak", "apply_if_finite", "skip_not_finite",
    "skip_large_updates", "scale_by_distance_over_gradients", "dog", "dowg", "scale_by_dowg",
    "prodigy", "scale_by_prodigy", "contrib_dadapt_adamw", "dadapt_adamw",
    "scale_by_dadapt_adam", "mechanize", "scale_by_mechanic", "cocob", "scale_by_cocob",
    "normalize", "momo", "momo_adam", "sam", "scale_by_dog", "zero_nans",
    # measurements of the updates kept in the state (a slice's norm on each device)
    "snapshot", "monitor", "measure_with_ema",
}

# Draw random numbers from a key in their state: on slices, every device would draw the
# same numbers for its own slice (correlated noise, silently).
_DRAWS_NOISE = {"add_noise", "noisy_sgd"}


def _refuse_inner(inner: Any, where: str, *, slices: bool = False) -> None:
  """Raise TypeError if ``inner`` holds a transformation that buckets (or, with
  ``slices``, each device's slice of them) would silently change."""
  for fn in _functions_in(inner):
    name = fn.__qualname__.split(".<locals>")[0]
    optax_fn = fn.__module__.startswith("optax")
    if optax_fn and name in _NEEDS_LEAVES:
      raise TypeError(
          f"optax.{name} cannot run {where}: it needs each leaf's shape or values (or the "
          "params tree), but it would see 1-D buckets that mix many leaves and silently "
          "compute something else. Use labels= with a dict of transformations for masks, "
          "or jpack.optax.allreduce followed by the optimizer on the tree.")
    if slices and optax_fn and name in _NEEDS_WHOLE_GRADIENT:
      raise TypeError(
          f"optax.{name} cannot run {where}: it needs the whole gradient, but each device "
          "sees only a slice of each bucket, so it would silently compute something else. "
          "Use jpack.optax.clip_by_global_norm(max_norm, axis_name) for clipping, or "
          "jpack.optax.allreduce + the replicated optimizer.")
    if slices and optax_fn and name in _DRAWS_NOISE:
      raise TypeError(
          f"optax.{name} cannot run {where}: it draws noise from a key in its state, and "
          "every device would draw the same noise for its own slice of each bucket. Use "
          "jpack.optax.allreduce + the replicated optimizer.")
    if slices and getattr(fn, "global_norm_axis_name", "") is None:
      raise TypeError(
          f"jpack.optax.clip_by_global_norm without axis_name cannot run {where}: each "
          "device would clip its slice by the slice's own norm. Pass the axis the "
          "gradient is sharded over: jpack.optax.clip_by_global_norm(max_norm, axis_name).")


def _refuse_masked_state(inner: Inner, buckets: Any, where: str) -> None:
  """Raise TypeError if ``inner`` (each of a dict's transformations) keeps a masked or
  multi-transform state when initialised on ``buckets``: a mask built at update time
  (``optax.inject_hyperparams(optax.adamw)(1e-3, mask=fn)``) hides from `_refuse_inner`,
  and on 1-D buckets ``fn`` would select something else (no leaf is 2-D: no decay)."""
  structs = jax.tree.map(lambda b: jax.ShapeDtypeStruct(np.shape(b), b.dtype), buckets)
  for t in (inner.values() if isinstance(inner, Mapping) else (inner,)):
    state = jax.eval_shape(t.init, structs)
    found = [x for x in jax.tree.leaves(state, is_leaf=_is_leafwise_state)
             if _is_leafwise_state(x)]
    if found:
      raise TypeError(
          f"The optimizer keeps a {type(found[0]).__name__} (a mask or labels chosen per "
          f"leaf, e.g. adamw(mask=...) built through optax.inject_hyperparams), which "
          f"cannot run {where}: its mask would see 1-D buckets that mix many leaves and "
          "silently select something else. Use labels= with a dict of transformations, "
          "or jpack.optax.allreduce followed by the optimizer on the tree.")


def _is_leafwise_state(x: Any) -> bool:
  return isinstance(x, (optax.MaskedState, optax.MultiTransformState))


def _refuse_reduce_in(inner: Any, where: str) -> None:
  """Raise TypeError if ``inner`` holds `allreduce` or `sharded`: ``where`` already reduces the
  gradients, so a second reduce is wasted (mean) or multiplies them by N (sum), and on
  ZeRO-1 slices it adds up different devices' slices."""
  for fn in _functions_in(inner):
    if getattr(fn, "jpack_reducer", None) is not None:
      raise TypeError(
          f"jpack.optax.{fn.jpack_reducer} cannot run {where}: the gradients are already "
          "reduced there, so it would reduce them a second time (mean: wasted "
          "collectives; sum: N times the gradient; on ZeRO-1 slices: a sum of different "
          "slices). Pass the optimizer without it.")


def _functions_in(obj: Any, depth: int = 0, seen: set[int] | None = None):
  """The functions reachable from ``obj`` through closures, tuples, dicts, partials,
  bound methods, optax objects' attributes (a GradientTransformation is a tuple of
  closures over its parts; ``optax.MultiSteps(...).gradient_transformation()`` one of
  bound methods of an object holding the wrapped optimizer) and, for functions outside
  the libraries, the module-level functions their code reads (`_globals_used`)."""
  seen = set() if seen is None else seen
  if depth > 12 or id(obj) in seen:
    return
  seen.add(id(obj))
  if isinstance(obj, types.FunctionType):
    yield obj
    for cell in obj.__closure__ or ():
      try:
        contents = cell.cell_contents
      except ValueError:  # empty cell
        continue
      yield from _functions_in(contents, depth + 1, seen)
    if (obj.__module__ or "").split(".")[0] not in _LIBRARIES:
      for item in _globals_used(obj):
        yield from _functions_in(item, depth + 1, seen)
  elif isinstance(obj, (tuple, list)):
    for item in obj:
      yield from _functions_in(item, depth + 1, seen)
  elif isinstance(obj, Mapping):
    for item in obj.values():
      yield from _functions_in(item, depth + 1, seen)
  elif isinstance(obj, functools.partial):
    yield from _functions_in(obj.func, depth + 1, seen)
  elif isinstance(obj, types.MethodType):
    yield from _functions_in(obj.__func__, depth + 1, seen)
    yield from _functions_in(obj.__self__, depth + 1, seen)
  elif type(obj).__module__.startswith("optax") and hasattr(obj, "__dict__"):
    for item in vars(obj).values():
      yield from _functions_in(item, depth + 1, seen)


# Library code is trusted to be what its name says; only user code (a factory handed to
# inject_hyperparams, a helper building a chain) is read for the optax functions it calls.
_LIBRARIES = {"optax", "jax", "jaxlib", "jpack", "numpy", "functools", "builtins"}


def _globals_used(fn: types.FunctionType) -> list[Any]:
  """The objects ``fn`` (and the lambdas and functions defined inside it) reads from its
  module: ``optax.clip_by_global_norm`` in ``lambda lr: optax.chain(
  optax.clip_by_global_norm(1.0), optax.sgd(lr))`` is only reachable this way, since the
  factory is called at every update, not when the transformation is built."""
  found = []
  codes = [fn.__code__]
  while codes:
    code = codes.pop()
    codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    obj = None
    for ins in dis.get_instructions(code):
      if ins.opname == "LOAD_GLOBAL":
        name = ins.argval
        obj = fn.__globals__.get(name, getattr(builtins, name, None))
      elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and obj is not None:
        obj = getattr(obj, ins.argval, None)
      else:
        obj = None
        continue
      # A transformation built once at module level (CLIP = optax.clip_by_global_norm(1.0))
      # and used inside a factory is only reachable here, like a function.
      if isinstance(obj, (types.FunctionType, functools.partial,
                          optax.GradientTransformation)):
        found.append(obj)
  return found
