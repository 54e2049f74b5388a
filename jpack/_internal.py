"""Facts about dtypes and tree structures that every jpack module needs.

The one module the others share internals through; it imports nothing from jpack.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_key_dtype(dtype: Any) -> bool:
  """A JAX PRNG key dtype (``jax.random.key(0).dtype``)."""
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def storage_dtype(dtype: Any) -> np.dtype:
  """The dtype of the bucket that stores leaves of ``dtype`` (uint32 words for keys)."""
  if is_key_dtype(dtype):
    return np.dtype(np.uint32)
  return np.dtype(dtype)


def key_words(dtype: Any) -> int:
  """uint32 words per element: a PRNG key holds several, an ordinary dtype one."""
  if is_key_dtype(dtype):
    return math.prod(dtype._impl.key_shape)
  return 1


def dtype_name(dtype: Any) -> str:
  """``float32``, ``bfloat16``, or ``key<threefry2x32>`` for PRNG keys."""
  if is_key_dtype(dtype):
    return f"key<{dtype._impl.name}>"
  return np.dtype(dtype).name


def dtype_from_name(name: str) -> Any:
  """Inverse of `dtype_name`."""
  if name.startswith("key<"):
    return jax.random.key(0, impl=name[4:-1]).dtype
  return jnp.dtype(name)


def bits_dtype(dtype: Any) -> np.dtype:
  """The unsigned integer of the same bit width (uint4 for 4-bit floats, which numpy
  reports as 1 byte wide)."""
  bits = (jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating)
          else 8 * np.dtype(dtype).itemsize)
  return np.dtype(jnp.uint4) if bits == 4 else np.dtype(f"uint{bits}")


def treedef_text(treedef: Any) -> str:
  """``str(treedef)`` without memory addresses, which differ between processes: static
  fields of custom nodes (an equinox module's activation function, say) print as
  ``<function relu at 0x7f...>``."""
  text = re.sub(r" at 0x[0-9a-fA-F]+", "", str(treedef))
  # Sets print in hash order, which for strings changes with PYTHONHASHSEED: sort the
  # elements of flat set reprs (no nested braces or dict colons).
  return re.sub(r"(frozenset\(|(?<=[\s(\[,=]))\{([^{}:]*)\}",
                lambda m: m.group(1) + "{" + ", ".join(sorted(m.group(2).split(", "))) + "}",
                text)


def where(path: str) -> str:
  """A leaf's key path for an error message (``<root>`` for a bare leaf)."""
  return path or "<root>"


def outside_jit(values: Any) -> bool:
  """No value is being traced: the call runs eagerly and may compile its own program."""
  return not any(isinstance(x, jax.core.Tracer) for x in values)


def leaf_from_flat(part: Any, slot: Any) -> Any:
  """A `jpack.Slot`'s leaf from its 1-D slice of a bucket (PRNG keys rewrapped)."""
  if is_key_dtype(slot.dtype):
    return jax.random.wrap_key_data(part.reshape(slot.shape + tuple(slot.dtype._impl.key_shape)),
                                    impl=slot.dtype._impl.name)
  return part.reshape(slot.shape)


def replicated(array: Any) -> Any:
  """A bucket sharded over an Explicit mesh axis, made replicated: leaves do not start at
  shard boundaries, and JAX refuses to slice across them (an Auto mesh lets XLA insert
  the same all-gather)."""
  sharding = getattr(jax.typeof(array), "sharding", None)
  if sharding is None or not any(sharding.spec):
    return array
  return jax.sharding.reshard(array, jax.sharding.NamedSharding(sharding.mesh, jax.P()))


def sum_of_squares(xs: Any) -> jax.Array:
  """Sum of ``|x|**2`` over arrays, in at least f32 (complex parts both counted)."""
  def one(x):
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return jnp.sum(jnp.real(x * jnp.conj(x)) if jnp.iscomplexobj(x) else x * x)

  return sum((one(x) for x in xs), jnp.float32(0))


def empty_shape(shape: tuple[int, ...], unit: bool = False) -> tuple[int, ...]:
  """The shape of a leaf another device owns (see `jpack._owned`): its rank with every dim
  0, so that what optax decides by rank (muon's 2-D weights, masks by ``ndim``) holds the
  same; a scalar becomes ``(0,)``. With ``unit``, every dim 1 (a scalar stays a scalar):
  for transformations that divide by a dim or reduce with ``max`` (muon, sm3), at the
  cost of running on a one-element stand-in."""
  if unit:
    return (1,) * len(shape)
  return (0,) * max(len(shape), 1)
