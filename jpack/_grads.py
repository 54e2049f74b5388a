"""One device's gradient in a training step: the loss with its model state and aux,
over micro-batches accumulated in float32, ready for the mode's optax transformation."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jpack._collectives import Shards, axis_size, broadcast, is_varying, reduce_scatter, vary
from jpack._layout import Layout, retyped
from jpack._pack import Packed, unpack
from jpack._precision import as_layout


def with_state(loss_fn: Callable[..., Any], has_aux: bool, has_state: bool
                ) -> Callable[[Any, Any, Any], tuple[jax.Array, tuple[Any, Any]]]:
  """``loss_fn`` as ``(params, model_state, batch) -> (loss, (new_model_state, aux))``."""
  def loss_of(params, model_state, batch):
    if has_state:
      loss, rest = loss_fn(params, model_state, batch)
      model_state, aux = rest if has_aux else (rest, None)
    else:
      loss, aux = loss_fn(params, batch) if has_aux else (loss_fn(params, batch), None)
    return loss, (model_state, aux)
  return loss_of


def accumulated_grads(loss_fn: Callable[..., Any], packed_params: bool, axis_name: str,
                       masters: Layout, accumulate: int, accumulator: str, comm_dtype: Any
                       ) -> Callable[[Any, Any, Any], tuple[Any, Any, Any, Any]]:
  """``(params, model_state, batch) -> (loss, aux, grads, model_state)`` on one device:
  the mean over ``accumulate`` micro-batches, with the gradients in the masters' dtypes
  (``masters``, the layout the optimizer takes) and, with the "sharded" accumulator,
  already reduce-scattered (`jpack.Shards`). ``loss_fn`` is `with_state`'s."""

  def one(params, model_state, batch):
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
  wide = retyped(masters, [_accumulation_dtype(b.dtype) for b in masters.buckets])

  def widen(grads):
    if not packed_params:
      return jax.tree.map(lambda g: g.astype(_accumulation_dtype(g.dtype)), grads)
    grads = as_layout(grads, wide)
    if accumulator == "sharded":  # ZeRO-2: only this device's slice is kept
      grads = reduce_scatter(grads, axis_name, mean=True, comm_dtype=comm_dtype)
    return grads

  def zeros(params):
    if not packed_params:
      return jax.tree.map(lambda p: jnp.zeros(p.shape, _accumulation_dtype(p.dtype)), params)
    if accumulator == "sharded":
      n = axis_size(axis_name)
      return Shards(tuple(jnp.zeros(b.size // n, b.dtype) for b in wide.buckets), wide)
    return Packed(tuple(jnp.zeros(b.size, b.dtype) for b in wide.buckets), wide)

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
        add, (vary(zeros(params), axis_name), model_state), micro)
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


def _accumulation_dtype(dtype: Any) -> np.dtype:
  d = np.dtype(dtype)
  if jnp.issubdtype(d, jnp.floating) and d.itemsize < 4:
    return np.dtype(np.float32)
  return d


def check_accumulate(accumulate: Any, accumulator: str, mode: str) -> None:
  if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
    raise ValueError(f"accumulate must be a positive int (micro-batches per step), got "
                     f"{accumulate!r}.")
  if accumulator not in ("local", "sharded"):
    raise ValueError(f"accumulator must be 'local' or 'sharded', got {accumulator!r}.")
  if accumulator == "sharded" and mode != "sharded":
    raise ValueError("accumulator='sharded' reduce-scatters every micro-step's gradients "
                     "into this device's slice, which only mode='sharded' (ZeRO-1) updates; "
                     f"got mode={mode!r}.")


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
