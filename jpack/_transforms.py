"""optax transforms on packed buckets: `allreduce` (stateless) and `flat` (run on buckets)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jpack import _cpu as cpu
from jpack._collectives import all_gather, axis_size, pmean, psum, reduce_scatter
from jpack._internal import sum_of_squares
from jpack._layout import Layout, check_plan_options, plan, retyped
from jpack._leafwise import on_buckets
from jpack._pack import Packed, pack, unpack
from jpack._precision import (ParamDtype, as_layout, cast_params, check_masters,
                              pack_masters)
from jpack._labels import Inner, Labels, check_inner, group_fn_for, placed, split_partition
from jpack._known import known
from jpack._probe import checker, described, refused

logger = logging.getLogger("jpack")


def allreduce(axis_name: Any, *, mean: bool = True, comm_dtype: Any = None,
              allow_int: bool = False, grad_norm: bool = False,
              plan_options: Mapping[str, Any] | None = None
              ) -> optax.GradientTransformation:
  """All-reduce the incoming updates over ``axis_name``, packed into a few buckets.

  Put it first in a chain, inside `jax.shard_map` or `jax.pmap`:
  ``optax.chain(jpack.optax.allreduce("batch"), optax.adamw(1e-3))``. Updates may be a
  tree (packed and unpacked around the collectives) or a `jpack.Packed` (used as is).

  Args:
    axis_name: the data-parallel mesh / pmap axis.
    mean: average (`jpack.pmean`) rather than sum (`jpack.psum`).
    comm_dtype: wire dtype of floating buckets (see `jpack.psum`).
    allow_int: with ``mean=True``, average integer leaves as the floor of the exact mean
      (see `jpack.pmean`) instead of refusing them; sums of integers are always exact.
    grad_norm: keep the global norm of the reduced updates in the state
      (`AllReduceState`), for logging; computed on the buckets, it costs one pass over
      them.
    plan_options: keyword arguments for `jpack.plan`, as one dict (e.g. the first of
      `jpack.step_options`); ``num_shards`` defaults to the axis size.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is `optax.EmptyState`, or
    `AllReduceState` with ``grad_norm=True``.

  Examples:
    >>> import optax, jpack
    >>> tx = optax.chain(jpack.optax.allreduce("batch"), optax.adam(1e-3))
  """
  plan_options = check_plan_options(plan_options, "jpack.optax.allreduce")
  reduce = pmean if mean else psum

  def init_fn(params):
    del params
    return AllReduceState(jnp.zeros((), jnp.float32)) if grad_norm else optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del params
    packed = updates
    if not isinstance(updates, Packed):
      packed = pack(updates, plan(updates, **{"num_shards": axis_size(axis_name),
                                              **plan_options}))
    options = {"allow_int": allow_int} if mean else {}
    if grad_norm and _norm_on_slices(packed.layout, axis_name, mean):
      # Packed updates go on to `flat`, which orders its updates after the loss: the
      # norm's all-reduce must then not be combined with the loss's (see below).
      after_loss = (value_scalars(extra_args.get("value")) if isinstance(updates, Packed)
                    else [])
      reduced, norm = _pmean_and_norm(packed, axis_name, comm_dtype, after_loss)
      state = AllReduceState(norm)
    else:
      reduced = reduce(packed, axis_name, comm_dtype=comm_dtype, **options)
      if grad_norm:
        state = AllReduceState(jnp.sqrt(sum_of_squares(reduced.buckets)))  # padding adds 0
    # Static slices: in a step they fuse into the optimizer's update.
    return (reduced if isinstance(updates, Packed) else unpack(reduced)), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _norm_on_slices(layout: Layout, axis_name: Any, mean: bool) -> bool:
  """Whether `_pmean_and_norm` applies: averaged floating buckets that split evenly."""
  n = axis_size(axis_name)
  return mean and n > 1 and all(
      b.size % n == 0 and jnp.issubdtype(b.dtype, jnp.floating) for b in layout.buckets)


def _pmean_and_norm(packed: Packed, axis_name: Any, comm_dtype: Any,
                    value: list[jax.Array]) -> tuple[Packed, jax.Array]:
  """`jpack.pmean` of ``packed`` and the global norm of the result.

  On CPU the mean is a reduce-scatter and an all-gather anyway, and the devices share
  the host's memory bandwidth: each squares only its slice, between the two, instead of
  every device reading every bucket (a pass over the whole gradient per device).
  Elsewhere one all-reduce per bucket, and the norm of the result.
  """
  def plain(p):
    reduced = pmean(p, axis_name, comm_dtype=comm_dtype)
    return reduced, jnp.sqrt(sum_of_squares(reduced.buckets))  # padding adds 0

  def on_slices(p):
    shards = reduce_scatter(p, axis_name, mean=True, comm_dtype=comm_dtype)
    # After ``value`` (the loss): XLA would otherwise combine the loss's all-reduce with
    # this one, and an update ordered after the loss would wait for every bucket.
    norm = jnp.sqrt(lax.psum(after(sum_of_squares(shards.buckets), *value), axis_name))
    return all_gather(shards, axis_name), norm

  return cpu.choose(on_slices, plain, packed)


class AllReduceState(NamedTuple):
  """State of `allreduce(..., grad_norm=True)`."""
  grad_norm: jax.Array  # global norm of the reduced updates of the last update


def value_scalars(value: Any) -> list[jax.Array]:
  """``value`` (an extra update argument, usually the loss) as scalars to order after."""
  return firsts([x for x in jax.tree.leaves(value) if isinstance(x, jax.Array)])


def after(tree: Any, *scalars: jax.Array) -> Any:
  """``tree`` unchanged, but each of its arrays computed after ``scalars``.

  Reduced bucket by bucket, the gradient of the last layer is ready while the backward
  pass still reads that layer's weights (and a loss metric nothing else needs may read
  any). XLA may then schedule the update of a donated parameter bucket before those
  reads, and it guards every such bucket with a full copy per step (MLP 24x1024: 23
  copies of 4 MiB per device). Making a gradient depend on a scalar the backward pass
  computes later (the gradient norm, the next bucket's gradient) orders its update after
  those reads, and the copies go. ``s > inf`` is false for every value, NaN included, and
  ``x - 0.0`` is exactly ``x`` (``-0.0`` too), so no value changes (a signalling NaN
  comes out quiet, still NaN).
  """
  if not scalars:
    return tree
  never = functools.reduce(jnp.logical_or, [s > jnp.inf for s in scalars])

  def depend(x):
    return x - never.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x

  return jax.tree.map(depend, tree)


# How many neighbouring buckets' gradients each bucket's update waits for: enough that
# the backward pass is past the bucket's params (a layer's weight and bias may sit in
# neighbouring buckets and be computed together), few enough that only a handful of
# reduced buckets are alive at once.
AHEAD, BEHIND = 2, 1
# flat on GPUs, where every matrix has a bucket of its own: one bucket ahead is past its
# reads, and keeps one reduced bucket fewer alive (less temporary memory, no copy).
# ZeRO-1's slices are small: it keeps AHEAD.
GPU_FLAT_AHEAD = 1


def after_neighbours(buckets: tuple[Any, ...], *scalars: jax.Array,
                     ahead: int = AHEAD) -> list[Any]:
  """Each bucket `after` ``scalars`` and one element of the gradients of its
  neighbours: the next ``ahead`` buckets and the previous ``BEHIND``.

  Buckets are in backward-ready order, so the next buckets' gradients are computed after
  this bucket's params were last read by the backward pass, and its update can overwrite
  them in place (no copy of a donated bucket). Ordering every update after every bucket
  does that for any model, but keeps every reduced bucket alive until the last one is
  reduced: a temporary the size of the gradient, which XLA:CPU maps fresh on every step
  (see docs/performance.md). Where a model reads a bucket's params later than its
  neighbours' gradients, XLA copies that bucket: slower, never wrong.
  """
  out = list(buckets)
  heads = {i: h for i, b in enumerate(buckets) for h in firsts(b)}  # floating, non-empty
  chained = list(heads)
  for k, i in enumerate(chained):
    near = chained[max(k - BEHIND, 0):k] + chained[k + 1:k + 1 + ahead]
    out[i] = after(buckets[i], *(heads[j] for j in near), *scalars)
  return out


def firsts(tree: Any) -> list[jax.Array]:
  """One element of every non-empty floating array of ``tree``: enough to depend on it."""
  return [jnp.real(x.reshape(-1)[0]) for x in jax.tree.leaves(tree)
          if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class FlatState:
  """State of `flat`.

  A pytree whose static field is the `Layout` of the buckets: updates packed with
  another layout are refused instead of mixing up leaves' moments.

  Attributes:
    inner_state: ``inner``'s state on the tuple of buckets (on the master buckets, with
      ``param_dtype``).
    layout: the static bucket `Layout` the state was initialised with (of the params in
      their ``param_dtype``).
    master: with ``param_dtype``, the master copy of every bucket, in the dtype the
      params had at ``init``; otherwise None.
  """

  inner_state: optax.OptState
  layout: Layout = dataclasses.field(metadata=dict(static=True))
  master: Any = None

  def __repr__(self) -> str:
    return layout_state_repr(self)


def layout_state_repr(state: Any) -> str:
  return (f"{type(state).__name__}(layout={state.layout.fingerprint}, "
          f"inner_state={state.inner_state!r})")


def flat(inner: optax.GradientTransformation, *, param_dtype: ParamDtype = None,
         plan_options: Mapping[str, Any] | None = None) -> optax.GradientTransformation:
  """Run ``inner`` on flat per-dtype buckets instead of on every leaf.

  The per-dtype, no-promotion successor of `optax.flatten`: an elementwise optimizer
  does a few large ops instead of hundreds of small ones. Updates come back as the tree
  (or as a `jpack.Packed` if they came in packed). What needs each leaf (a trust ratio,
  a ``mask=`` static per leaf) is computed leaf by leaf on the buckets, and what reads
  leaves' shapes (adafactor, muon, sm3) runs on the tree unpacked from them; ``init``
  reads which from a table of optax's transformations (yours run on the leaves) and
  logs it on the ``"jpack"`` logger (docs/zero.md).

  Args:
    inner: an optax transformation, or a `jpack.optax.partition` (buckets per label).
    param_dtype: keep the params in this dtype and f32 master copies in the state
      (``jpack.cast_params(masters, param_dtype)`` after each update; docs/recipes.md).
    plan_options: keyword arguments for `jpack.plan`, as one dict.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is `FlatState`; extra update
    arguments (``value=`` for ``optax.polyak_sgd``) are passed on to ``inner``.

  Raises:
    TypeError: ``inner`` cannot run here (a collective: the gradients are reduced
      already) or raises on the params; the message names it and the fix.
    ValueError: updates or params packed with another layout than ``state.layout``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jpack
    >>> params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    >>> decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # GPT-2's recipe
    >>> tx = jpack.optax.flat(optax.adamw(0.1, weight_decay=0.1, mask=decay))
    >>> zero = jax.tree.map(jnp.zeros_like, params)  # no gradient: only the decay moves
    >>> updates, state = tx.update(zero, tx.init(params), params)
    >>> round(float(updates["w"][0, 0]), 4), bool((updates["b"] == 0).all())
    (-0.01, True)
  """
  inner, labels = split_partition(inner)
  check_inner(inner, labels)
  plan_options = check_plan_options(plan_options, "jpack.optax.flat")
  where = "inside jpack.optax.flat"
  running = placement(inner, where)

  def init_fn(params):
    if param_dtype is None:
      packed = _pack(params, labels, plan_options)
      tx = running(packed.layout)  # probed on a miniature of the params
      with named_errors(inner, where, "init"):
        inner_state = tx.init(packed.buckets)
      return FlatState(inner_state, packed.layout)
    check_masters(params, "jpack.optax.flat")
    narrow = cast_params(params, param_dtype)
    layout = plan(narrow, group_fn=group_fn_for(narrow, labels), **plan_options)
    masters = pack_masters(params, layout)
    tx = running(masters.layout)
    with named_errors(inner, where, "init"):
      inner_state = tx.init(masters.buckets)
    return FlatState(inner_state, layout, masters.buckets)

  def update_fn(updates, state, params=None, **extra_args):
    layout = state.layout
    was_packed = isinstance(updates, Packed)
    masters = None if state.master is None else layout_of_masters(state)
    packed = pack_like(updates, layout, "updates", masters=masters)
    # After the loss and the neighbouring buckets' gradients: no copies of donated params.
    packed = packed if masters is None else as_layout(packed, masters)
    values = value_scalars(extra_args.get("value"))
    packed = Packed(tuple(cpu.choose(
        lambda b: after_neighbours(b, *values),
        lambda b: after_neighbours(b, *values, ahead=GPU_FLAT_AHEAD), packed.buckets)),
        packed.layout)
    flat_params = None if params is None else pack_like(params, layout, "params").buckets
    with named_errors(inner, where, "update"):
      new, inner_state, master = update_buckets(running(layout if masters is None else masters),
                                                packed.buckets,
                                                state, flat_params, extra_args)
    out = Packed(tuple(new), layout)
    return ((out if was_packed else unpack_as_returned(out)),
            FlatState(inner_state, layout, master))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def placement(inner: Inner, where: str
              ) -> Callable[[Layout], optax.GradientTransformationExtraArgs]:
  """``running(layout)``: ``inner`` over the tuple of buckets of ``layout``, its parts
  that buckets would change on the leaves (`placed`), as the probe finds on a
  miniature of ``layout``. Raises `TypeError` for what cannot run where every device
  holds the whole gradient. Says once per layout (INFO on the ``"jpack"`` logger) what
  runs on the leaves."""
  checks: dict[Any, Callable[[Layout], str | None]] = {}
  plans: dict[Layout, optax.GradientTransformationExtraArgs] = {}

  def running(layout: Layout) -> optax.GradientTransformationExtraArgs:
    if layout in plans:
      return plans[layout]

    def needs_leaves(tx):
      key = id(tx) if tx is inner else (tx.init, tx.update)
      if key not in checks:
        checks[key] = checker(tx, on="buckets", where=where)
      return checks[key](layout)

    tx, on_leaves, whole, computed = placed(
        inner, layout, needs_leaves,
        by_leaf=lambda tx: on_buckets(tx, layout, None, needs_leaves))
    if computed:
      logger.info("jpack.optax.flat (layout %s): %s on the buckets, leaf by leaf",
                  layout.fingerprint, ", ".join(dict.fromkeys(computed)))
    if on_leaves:
      if not known(inner):  # a known part's needs are read from the table, by name
        _check_on_leaves(tx, inner, layout, where)
      differ = ", ".join(dict.fromkeys(on_leaves))
      logger.info("jpack.optax.flat (layout %s): %s", layout.fingerprint,
                  f"{described(inner)} runs on the leaves ({differ} would differ on "
                  "buckets)" if whole else f"{differ} on the leaves (on buckets "
                  f"{'it' if len(set(on_leaves)) == 1 else 'they'} would differ), the "
                  "rest of the optimizer on buckets")
    plans[layout] = tx
    return tx

  return running


@functools.lru_cache(maxsize=64)
def _passed(key: Any) -> list[bool]:
  """A box, for an (optimizer, layout) pair, that holds True once its leaves' part passed."""
  return []


def _check_on_leaves(tx: optax.GradientTransformationExtraArgs, inner: Inner,
                     layout: Layout, where: str) -> None:
  """Raise from ``init`` what a probed (unknown) leaves' part raises on the params'
  shapes, which its probe's miniature is not: one abstract ``update``, without extra
  arguments and then with ``value=``. Once per optimizer and layout in the process (a
  notebook builds the same step again)."""
  try:
    passed = _passed((tuple(inner.items()) if isinstance(inner, Mapping) else inner, layout))
  except TypeError:  # an unhashable part (a transformation object of the user's own)
    passed = []
  if passed:
    return
  buckets = tuple(jax.ShapeDtypeStruct((b.size,), b.dtype) for b in layout.buckets)
  error = None
  for extra in ({}, {"value": jax.ShapeDtypeStruct((), jnp.float32)}):
    try:
      jax.eval_shape(lambda g, e: tx.update(g, tx.init(g), g, **e), buckets, extra)
      passed.append(True)
      return
    except Exception as e:  # noqa: BLE001 - named in the refusal
      error = error or e
  raise refused(error, inner, where, "update (on the params' shapes)") from error


@contextlib.contextmanager
def named_errors(inner: Inner, where: str, when: str):
  """Turn what ``inner`` raises into a `TypeError` naming it (`refused`); jpack's own
  `TypeError`s pass as they are."""
  try:
    yield
  except TypeError as e:
    if "jpack" in str(e):
      raise
    raise refused(e, inner, where, when) from e
  except Exception as e:  # noqa: BLE001 - named in the refusal
    raise refused(e, inner, where, when) from e


# -- shared with the sharded optimizer -------------------------------------------------


def _pack(tree: Any, labels: Labels, plan_options: Mapping[str, Any], **extra) -> Packed:
  if isinstance(tree, Packed):
    return tree
  return pack(tree, plan(tree, group_fn=group_fn_for(tree, labels), **plan_options, **extra))


def unpack_as_returned(packed: Packed) -> Any:
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
          "out of the optimizer: jpack.optax.partition with optax.set_to_zero() for them (integer "
          "counters, frozen tables), or out of the params.")
  if changed:
    layout = retyped(layout, dtypes)
  return unpack(Packed(packed.buckets, layout))


def pack_like(tree: Any, layout: Layout, what: str = "updates",
              masters: Layout | None = None) -> Any:
  """``tree`` packed with ``layout``; a `Packed` (or `Shards`) must already use it. With
  ``masters`` (the layout of master buckets), updates in the masters' dtype are accepted
  too (accumulated in float32 for bfloat16 params)."""
  if not hasattr(tree, "layout"):
    if masters is None or masters == layout:
      return pack(tree, layout)
    try:
      return pack(tree, layout)
    except TypeError:
      try:
        return pack(tree, masters)
      except (TypeError, ValueError):
        pass
      raise
  if tree.layout != layout and not (masters is not None and tree.layout == masters):
    raise ValueError(
        f"The {what} are a {type(tree).__name__} with layout {tree.layout.fingerprint}, "
        f"but the optimizer state was initialised with layout {layout.fingerprint}: "
        "their buckets would pair different leaves. Pack them with the state's layout "
        f"(state.layout), or pass the {what} as a tree.")
  return tree


def layout_of_masters(state: Any) -> Layout:
  """The layout of ``state.master``: ``state.layout`` in the masters' dtypes."""
  dtypes = [np.dtype(m.dtype) for m in state.master]
  if dtypes == [b.dtype for b in state.layout.buckets]:
    return state.layout
  return retyped(state.layout, dtypes)


def update_buckets(tx: optax.GradientTransformationExtraArgs, grads: tuple[Any, ...],
                   state: Any, params: tuple[Any, ...] | None, extra_args: dict[str, Any]
                   ) -> tuple[tuple[Any, ...], Any, tuple[Any, ...] | None]:
  """``tx`` on buckets (or slices) of ``state`` (a `FlatState` or `ShardedState`):
  ``(updates, inner_state, master)``. With masters, ``tx`` updates them and the updates
  take ``params`` to the new masters rounded (`apply_to_masters`)."""
  if state.master is None:
    new, inner_state = tx.update(grads, state.inner_state, params, **extra_args)
    return new, inner_state, None
  new, inner_state = tx.update(grads, state.inner_state, state.master, **extra_args)
  new, master = apply_to_masters(new, state.master, params, state.layout)
  return new, inner_state, master


def apply_to_masters(updates: Any, masters: tuple[Any, ...], params: tuple[Any, ...] | None,
                     layout: Layout) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """The inner optimizer's ``updates`` applied to the master buckets, and the updates
  that take the params there.

  Returns ``(param_updates, new_masters)``: the new masters are ``masters + updates``
  in the masters' dtype (as `optax.apply_updates` computes it); ``param_updates`` are
  the new masters rounded to the params' dtype minus the params, in the masters'
  dtype, so that ``optax.apply_updates(params, param_updates)`` gives the rounded
  masters (the difference of two bfloat16 values is exact in float32). Without
  ``params``, they are taken to be the masters rounded, which they are by
  construction.
  """
  new_masters, param_updates = [], []
  for i, (u, m, b) in enumerate(zip(updates, masters, layout.buckets)):
    new = (m + u).astype(m.dtype)
    new_masters.append(new)
    if np.dtype(m.dtype) == b.dtype:  # no narrower params: the update is the update
      param_updates.append(u)
      continue
    old = m.astype(b.dtype) if params is None else params[i]
    param_updates.append(new.astype(b.dtype).astype(m.dtype) - old.astype(m.dtype))
  return tuple(param_updates), tuple(new_masters)
