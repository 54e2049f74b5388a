"""One device's gradient in a training step: the loss with its model state and aux,
over micro-batches accumulated in float32, ready for the mode's optax transformation."""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jpack._collectives import (Shards, axis_size, broadcast, is_varying, mean_to_slices,
                                slice_axes, vary)
from jpack._fsdp import carriers_for, gradient_carrier, wide_dtype
from jpack._layout import Layout, retyped
from jpack._pack import Packed, unpack
from jpack._precision import as_layout


def with_state(loss_fn: Callable[..., Any], has_aux: bool
                ) -> Callable[[Any, Any, Any], tuple[jax.Array, tuple[Any, Any]]]:
  """``loss_fn`` as ``(params, model_state, batch) -> (loss, (new_model_state, aux))``.

  A model state of None (``init(params)``) calls ``loss_fn(params, batch)``. What
  ``loss_fn`` returns is checked when the step traces (nothing is left of the check in
  the compiled step)."""
  def loss_of(params, model_state, batch):
    has_state = model_state is not None
    if has_state:
      out = _call(loss_fn, (params, model_state, batch), has_aux, has_state)
      loss, rest = _returned_pair(out, has_aux, has_state)
      if has_aux:
        model_state, aux = _returned_pair(rest, has_aux, has_state, part="rest")
      else:
        _check_not_state_and_aux(rest, model_state)
        model_state, aux = rest, None
    else:
      out = _call(loss_fn, (params, batch), has_aux, has_state)
      loss, aux = _returned_pair(out, has_aux, has_state) if has_aux else (out, None)
    if isinstance(loss, (tuple, list)):
      raise TypeError(f"loss_fn returned {_describe(loss)} where the loss goes, but "
                      f"{_expected(has_aux, has_state)}: {_fixes(has_aux, has_state)}.")
    return loss, (model_state, aux)
  return loss_of


def _expected(has_aux: bool, has_state: bool) -> str:
  """How data_parallel calls ``loss_fn``, and what it takes back, with these flags."""
  flags = (f"has_aux={has_aux} and " +
           ("a model state given to init" if has_state else "no model state given to init"))
  call = "loss_fn(params, model_state, batch)" if has_state else "loss_fn(params, batch)"
  back = {(False, False): "the scalar loss", (True, False): "(loss, aux)",
          (False, True): "(loss, new_model_state)",
          (True, True): "(loss, (new_model_state, aux))"}[has_aux, has_state]
  return f"with {flags}, data_parallel calls {call} and takes back {back}"


def _fixes(has_aux: bool, has_state: bool) -> str:
  """The flags a loss that does not fit ``has_aux`` and ``has_state`` may need."""
  fixes = []
  if not has_aux:
    fixes.append("a loss that also returns metrics needs has_aux=True and returns "
                 + ("(loss, (new_model_state, aux))" if has_state else "(loss, aux)"))
  if not has_state:
    fixes.append("one that takes and returns the model's state (Flax's batch_stats, Haiku's "
                 "state) is given its first value by dp.init(params, model_state), and "
                 "returns (loss, new_model_state)")
  if has_aux and has_state:
    fixes.append("return (loss, (new_model_state, aux))")
  return "; ".join(fixes)


def _returned_pair(out: Any, has_aux: bool, has_state: bool, part: str = "") -> tuple:
  """``out`` as the pair the flags promise, or a TypeError naming the flag to change."""
  if isinstance(out, (tuple, list)) and len(out) == 2:
    return tuple(out)
  where = "loss_fn returned" if not part else "loss_fn returned (loss, rest) with rest"
  fixes = []
  if not has_aux and has_state:
    fixes.append("if it returns (loss, (new_model_state, aux)), pass has_aux=True")
  if has_aux:
    fixes.append("if it returns no aux, drop has_aux=True")
  if has_state and not part:
    fixes.append("if it takes no model state, call dp.init(params) without one")
  raise TypeError(f"{where} {_describe(out)}, but {_expected(has_aux, has_state)}"
                  + (": " + "; ".join(fixes) if fixes else "") + ".")


def _describe(x: Any) -> str:
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of {len(x)}"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array of shape {tuple(x.shape)}"
  return f"a {type(x).__name__}"


def _check_not_state_and_aux(rest: Any, model_state: Any) -> None:
  """With has_state and without has_aux: ``(new_model_state, aux)`` where the new state
  alone goes (its first half is shaped like the state, the whole is not)."""
  structure = jax.tree.structure(model_state)
  if (isinstance(rest, (tuple, list)) and len(rest) == 2
      and jax.tree.structure(rest) != structure
      and jax.tree.structure(rest[0]) == structure):
    raise TypeError("loss_fn returned (loss, (new_model_state, aux)) (the first half of its "
                    "second element is shaped like the model state, the whole is not), but "
                    f"{_expected(False, True)}: pass has_aux=True.")


def _call(loss_fn: Callable[..., Any], args: tuple, has_aux: bool, has_state: bool) -> Any:
  """``loss_fn(*args)``; a signature that `check_loss_fn` could not read (``*args``)
  and that does not take these arguments gets a note naming the flag."""
  try:
    return loss_fn(*args)
  except TypeError as e:
    # Python's own message for a call that does not fit the signature; the note is a
    # hint, as the TypeError may come from deeper inside loss_fn.
    if re.search(r"positional argument|required keyword", str(e)):
      e.add_note(f"If loss_fn's own signature refused this call: "
                 f"{_expected(has_aux, has_state)}; {_fixes(has_aux, has_state)}.")
    raise


def check_loss_fn(loss_fn: Callable[..., Any], has_state: bool) -> None:
  """A ``loss_fn`` whose signature cannot take the arguments it will be given, refused
  with what to change. Signatures that ``inspect`` cannot read, or that take ``*args``,
  pass here (their calls are checked when the step traces)."""
  if not callable(loss_fn):
    raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
  try:
    signature = inspect.signature(loss_fn)  # follows functools.partial, __call__, __wrapped__
  except (TypeError, ValueError):  # builtins, some C extensions
    return
  names = [p.name for p in signature.parameters.values()
           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

  def takes(n):
    try:
      signature.bind(*range(n))
    except TypeError:
      return False
    return True

  n = 3 if has_state else 2
  if takes(n):
    return
  shown = f"loss_fn{signature}"
  if not has_state and takes(3):
    raise TypeError(f"{shown} takes 3 arguments, but init got no model state, so the step "
                    "calls loss_fn(params, batch). If "
                    f"{names[1] if len(names) > 1 else 'its second argument'!r} is the "
                    "model's state (Flax's batch_stats, Haiku's state), pass its first value "
                    "to init: dp.init(params, model_state); loss_fn(params, model_state, "
                    "batch) then returns (loss, new_model_state). Otherwise bind the extra "
                    "argument with functools.partial.")
  if has_state and takes(2):
    raise TypeError(f"{shown} takes 2 arguments, but init got a model state, so the step "
                    "calls loss_fn(params, model_state, batch). Call dp.init(params) without "
                    "one if the model has no state, or add the model_state argument.")
  raise TypeError(f"{shown} cannot be called as "
                  + ("loss_fn(params, model_state, batch)" if has_state
                     else "loss_fn(params, batch)")
                  + ": take exactly these positional arguments, and bind any others with "
                  "functools.partial.")


def accumulated_grads(loss_fn: Callable[..., Any], params_as: str, axis_name: str,
                       masters: Layout, accumulate: int, accumulator: str, comm_dtype: Any,
                       keep_gathered: bool = False, remat_policy: Any = None
                       ) -> Callable[[Any, Any, Any], tuple[Any, Any, Any, Any]]:
  """``(params, model_state, batch) -> (loss, aux, grads, model_state)`` on one device:
  the mean over ``accumulate`` micro-batches, with the gradients in the masters' dtypes
  (``masters``, the layout the optimizer takes) and, with the "sharded" accumulator or
  params kept as `jpack.Shards` (``params_as="shards"``, ZeRO-3), already
  reduce-scattered (`jpack.Shards`). ``params_as`` is "tree", "packed" or "shards";
  ``loss_fn`` is `with_state`'s."""
  packed_params = params_as != "tree"
  if params_as == "shards":
    accumulator = "sharded"
    carried = gradient_carrier(loss_fn, axis_name, keep_gathered=keep_gathered,
                               remat_policy=remat_policy)

  def one(params, model_state, batch):
    if params_as == "shards":  # the gradient is the gather's transpose: a reduce-scatter
      (loss, (model_state, aux)), grads = jax.value_and_grad(
          lambda c: carried(params, c, model_state, batch), has_aux=True)(
              carriers_for(params, axis_name))
      return loss, aux_to_mean(aux), Shards(grads, params.layout), model_state

    def loss_of(p):
      return loss_fn(unpack(p) if packed_params else p, model_state, batch)

    # Differentiate w.r.t. this device's copy: grads stay local (no per-leaf psum
    # inserted by shard_map's autodiff) until the transformation reduces them in buckets.
    (loss, (model_state, aux)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        vary(params, axis_name))
    return loss, aux_to_mean(aux), grads, model_state

  if accumulate == 1:
    def grads_of(params, model_state, batch):
      loss, aux, grads, model_state = one(params, model_state, batch)
      return (loss, aux, as_layout(grads, masters) if packed_params else grads,
              model_state)
    return grads_of

  # Accumulated in at least float32: a sum of bfloat16 gradients would lose their bits.
  wide = retyped(masters, [wide_dtype(b.dtype) for b in masters.buckets])

  def widen(grads):
    if not packed_params:
      return jax.tree.map(lambda g: g.astype(wide_dtype(g.dtype)), grads)
    grads = as_layout(grads, wide)
    if accumulator == "sharded" and params_as != "shards":  # ZeRO-2: only this slice kept
      grads = mean_to_slices(grads, axis_name, comm_dtype=comm_dtype)
    return grads

  def zeros(params):
    if not packed_params:
      return jax.tree.map(lambda p: jnp.zeros(p.shape, wide_dtype(p.dtype)), params)
    if accumulator == "sharded":
      n = axis_size(slice_axes(axis_name)[1])
      return Shards(tuple(jnp.zeros(b.size // n, b.dtype) for b in wide.buckets), wide)
    return Packed(tuple(jnp.zeros(b.size, b.dtype) for b in wide.buckets), wide)

  # Slices come reduced over the replica axes: the sum over micro-batches varies only
  # over the slice axis.
  carry_axes = slice_axes(axis_name)[1] if accumulator == "sharded" else axis_name

  def grads_of(params, model_state, batch):
    micro = jax.tree.map(lambda x: x.reshape((accumulate, -1) + x.shape[1:]), batch)

    def add(carry, micro_batch):
      total, model_state = carry
      loss, aux, grads, model_state = one(params, model_state, micro_batch)
      return (jax.tree.map(jnp.add, total, widen(grads)), model_state), (loss, aux)

    if model_state is not None:  # the carry's type: as the loss leaves it
      model_state = _match_varying(model_state, jax.eval_shape(
          lambda: one(params, model_state, jax.tree.map(lambda x: x[0], micro))[3]),
          axis_name)
    (total, model_state), (losses, aux) = lax.scan(
        add, (vary(zeros(params), carry_axes), model_state), micro)
    mean = jax.tree.map(lambda g: g / accumulate, total)
    if packed_params:
      mean = as_layout(mean, masters)
    else:
      mean = jax.tree.map(lambda g, p: g.astype(p.dtype), mean, params)
    return (jnp.mean(losses), jax.tree.map(lambda a: jnp.mean(a, axis=0), aux), mean,
            model_state)

  return grads_of


def _match_varying(tree: Any, like: Any, axis_name: str) -> Any:
  """``tree`` typed as varying over the axis where ``like`` is (a scan's carry must keep
  its type, and a model state the loss computes per device comes out varying)."""
  return jax.tree.map(lambda x, l: vary(x, axis_name) if is_varying(l, axis_name) else x,
                      tree, like)


def average_state(model_state: Any, axis_name: str) -> Any:
  """The new model state, equal on every device: floating leaves that differ between
  devices (per-device batch statistics) are averaged; other varying leaves are taken
  from device 0 (they should not differ)."""
  def one(x):
    if not is_varying(x, axis_name):
      return x
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return lax.pmean(x, axis_name)
    return broadcast(x, axis_name, root=0)
  return jax.tree.map(one, model_state)


def check_accumulate(accumulate: Any) -> None:
  if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
    raise ValueError(f"accumulate must be a positive int (micro-batches per step), got "
                     f"{accumulate!r}.")


def aux_to_mean(aux: Any) -> Any:
  """``aux`` ready for ``lax.pmean``: Python scalars become arrays, and integers and bools
  float32 (a mean in uint8 would wrap: eight 200s sum to 64), as documented."""
  def one(path, x):
    try:
      x = jnp.asarray(x)
    except TypeError as e:  # a string, None in a list, an object: JAX's error has no path
      raise TypeError(f"aux at {jax.tree_util.keystr(path) or '<root>'} is "
                      f"{type(x).__name__} {x!r:.60}, not a number or numeric array: "
                      "metrics are averaged over the devices. Return it elsewhere.") from e
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      raise TypeError(f"aux at {jax.tree_util.keystr(path) or '<root>'} is a PRNG key "
                      "array: metrics are averaged over the devices, keys cannot be. "
                      "Return it elsewhere.")
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)
  return jax.tree_util.tree_map_with_path(one, aux)
