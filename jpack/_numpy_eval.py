"""Run a function on numpy values through its jaxpr, evaluated by numpy.

The optimizer check (`jpack._probe`) runs optax transformations on a miniature of the
params, eagerly: every operation on a shape it has not met compiles with XLA first,
about 40 ms each on a small CPU, and a first check meets dozens. The same operations,
traced once and evaluated by numpy, cost no compilation. `evaluate` does that where the
jaxpr holds only operations numpy has (the elementwise ones, reductions, dot_general,
reshapes, slices, control flow: what optax's transformations are made of). Any other
operation runs in JAX, that operation alone; the whole function runs eagerly only when
that fails (a PRNG key's dtype) or when it cannot be traced (it branches on values in
Python). The result is the same either way, up to rounding, and so is an error fn
raises.
"""

from __future__ import annotations

import string
from typing import Any, Callable

import jax
import jax.extend.core as jax_core
import numpy as np


def evaluate(fn: Callable[..., Any], *args: Any, branches: bool = True) -> Any:
  """``fn(*args)`` for numpy ``args``: traced, and evaluated with numpy where every
  operation allows it, otherwise called. Leaves of the result that are not arrays
  (Python numbers, None) are returned as ``fn`` returned them, and arrays as numpy
  arrays.

  Args:
    fn: a function of arrays, as `jax.jit` would take it.
    *args: numpy arrays (pytrees of them).
    branches: whether ``fn`` may be evaluated from a jaxpr with control flow (cond,
      while, scan). Without, such an ``fn`` is called instead: under `jax.disable_jit`
      a call runs the branch taken as Python, which a caller that watches the Python
      calls (the probe's recorder) needs to see.

  Returns:
    What ``fn(*args)`` returns.
  """
  kept: dict[str, Any] = {}

  def arrays_only(*a):
    leaves, kept["tree"] = jax.tree.flatten(fn(*a))
    kept["static"] = [None if isinstance(x, jax.core.Tracer) else x for x in leaves]
    return [x for x in leaves if isinstance(x, jax.core.Tracer)]

  try:
    closed = jax.make_jaxpr(arrays_only)(*args)
  except jax.errors.JAXTypeError:  # it needs values in Python (an `if` on one): call it
    return fn(*args)
  # Any other error is raised: called, fn would raise it at the same point, as nothing
  # before it could depend on values.
  if not branches and any(e.primitive.name in _BRANCHES for e in closed.jaxpr.eqns):
    return fn(*args)
  try:
    with np.errstate(all="ignore"):  # as XLA: inf and NaN, no warnings
      out = iter(_closed(closed, jax.tree.leaves(args)))
  except Exception:  # noqa: BLE001 - numpy or JAX could not evaluate it: call it
    return fn(*args)
  return jax.tree.unflatten(kept["tree"], [next(out) if x is None else x
                                           for x in kept["static"]])


def _closed(closed: Any, args: list) -> list:
  return _jaxpr(closed.jaxpr, closed.consts, args)


def _jaxpr(jaxpr: Any, consts: list, args: list) -> list:
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jax_core.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts):
    env[v] = np.asarray(x)
  for v, x in zip(jaxpr.invars, args):
    env[v] = np.asarray(x)
  for eqn in jaxpr.eqns:
    rule = _RULES.get(eqn.primitive.name)
    if rule is None:  # run by JAX, this one operation (a scatter, a PRNG's bits)
      outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.params)
    else:
      outs = rule(eqn.params, *map(read, eqn.invars))
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, x in zip(eqn.outvars, outs):
      # jax's dtype and shape, whatever numpy's promotion made of them
      env[v] = np.asarray(x).astype(v.aval.dtype, copy=False).reshape(v.aval.shape)
  return [read(v) for v in jaxpr.outvars]


# -- the rules: numpy for each primitive, (params, *operands) -> result ------------------


def _unary(f):
  return lambda params, x: f(x)


def _binary(f):
  return lambda params, x, y: f(x, y)


def _div(params, x, y):
  if np.issubdtype(np.asarray(x).dtype, np.integer):  # lax rounds towards zero
    q = np.floor_divide(x, y)
    return q + ((np.remainder(x, y) != 0) & ((x < 0) != (y < 0)))
  return np.true_divide(x, y)


def _round(params, x):
  if int(params["rounding_method"]) == 0:  # away from zero
    return np.sign(x) * np.floor(np.abs(x) + 0.5)
  return np.round(x)


def _select_n(params, which, *cases):
  if len(cases) == 1:
    return cases[0]
  return np.choose(np.asarray(which).astype(np.int64), np.broadcast_arrays(*cases))


def _broadcast_in_dim(params, x):
  shape = params["shape"]
  expanded = [1] * len(shape)
  for i, d in enumerate(params["broadcast_dimensions"]):
    expanded[d] = np.shape(x)[i]
  return np.broadcast_to(np.reshape(x, expanded), shape)


def _reduce(f):
  return lambda params, x: f(x, axis=tuple(params["axes"]))


def _argext(f):
  return lambda params, x: f(x, axis=params["axes"][0])


def _cumulative(f):
  def rule(params, x):
    axis = params["axis"]
    if params["reverse"]:
      return np.flip(f(np.flip(x, axis), axis=axis), axis)
    return f(x, axis=axis)
  return rule


def _dot_general(params, x, y):
  (lc, rc), (lb, rb) = params["dimension_numbers"]
  letters = iter(string.ascii_letters)
  xs = [next(letters) for _ in range(np.ndim(x))]
  ys = [next(letters) for _ in range(np.ndim(y))]
  for a, b in zip(tuple(lc) + tuple(lb), tuple(rc) + tuple(rb)):
    ys[b] = xs[a]
  batch = [xs[a] for a in lb]
  free_x = [xs[a] for a in range(np.ndim(x)) if a not in lc and a not in lb]
  free_y = [ys[b] for b in range(np.ndim(y)) if b not in rc and b not in rb]
  spec = f"{''.join(xs)},{''.join(ys)}->{''.join(batch + free_x + free_y)}"
  return np.einsum(spec, x, y)


def _slice(params, x):
  strides = params["strides"] or (1,) * np.ndim(x)
  return x[tuple(slice(s, e, k) for s, e, k in
                 zip(params["start_indices"], params["limit_indices"], strides))]


def _iota(params):
  shape, dim = params["shape"], params["dimension"]
  expanded = [1] * len(shape)
  expanded[dim] = shape[dim]
  return np.broadcast_to(np.arange(shape[dim]).reshape(expanded), shape)


def _clamp(params, lo, x, hi):
  return np.minimum(np.maximum(x, lo), hi)


def _call(key):
  def rule(params, *args):
    return _closed(params[key], list(args))
  return rule


def _cond(params, index, *args):
  branches = params["branches"]
  return _closed(branches[int(np.clip(index, 0, len(branches) - 1))], list(args))


def _while(params, *args):
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  cond_consts, body_consts, carry = args[:nc], args[nc:nc + nb], list(args[nc + nb:])
  while bool(_closed(params["cond_jaxpr"], [*cond_consts, *carry])[0]):
    carry = _closed(params["body_jaxpr"], [*body_consts, *carry])
  return carry


def _scan(params, *args):
  nconsts, ncarry = params["num_consts"], params["num_carry"]
  consts, carry = args[:nconsts], list(args[nconsts:nconsts + ncarry])
  xs = args[nconsts + ncarry:]
  steps = range(params["length"])
  ys = []
  for i in (reversed(steps) if params["reverse"] else steps):
    out = _closed(params["jaxpr"], [*consts, *carry, *(x[i] for x in xs)])
    carry, y = out[:ncarry], out[ncarry:]
    ys.append(y)
  if params["reverse"]:
    ys.reverse()
  body_out = params["jaxpr"].jaxpr.outvars[ncarry:]
  stacked = [np.stack([y[k] for y in ys]) if ys else
             np.zeros((0, *v.aval.shape), v.aval.dtype) for k, v in enumerate(body_out)]
  return [*carry, *stacked]


_BRANCHES = ("cond", "while", "scan")
_RULES: dict[str, Callable[..., Any]] = {
    "add": _binary(np.add), "sub": _binary(np.subtract), "mul": _binary(np.multiply),
    "div": _div, "rem": _binary(np.fmod), "pow": _binary(np.power),
    "max": _binary(np.maximum), "min": _binary(np.minimum), "atan2": _binary(np.arctan2),
    "nextafter": _binary(np.nextafter),
    "eq": _binary(np.equal), "ne": _binary(np.not_equal), "lt": _binary(np.less),
    "le": _binary(np.less_equal), "gt": _binary(np.greater),
    "ge": _binary(np.greater_equal),
    "and": _binary(np.bitwise_and), "or": _binary(np.bitwise_or),
    "xor": _binary(np.bitwise_xor), "not": _unary(np.invert),
    "neg": _unary(np.negative), "abs": _unary(np.abs), "sign": _unary(np.sign),
    "sqrt": _unary(np.sqrt), "rsqrt": _unary(lambda x: 1 / np.sqrt(x)),
    "cbrt": _unary(np.cbrt), "exp": _unary(np.exp), "exp2": _unary(np.exp2),
    "log": _unary(np.log), "log1p": _unary(np.log1p), "expm1": _unary(np.expm1),
    "tanh": _unary(np.tanh), "logistic": _unary(lambda x: 1 / (1 + np.exp(-x))),
    "sin": _unary(np.sin), "cos": _unary(np.cos), "tan": _unary(np.tan),
    "floor": _unary(np.floor), "ceil": _unary(np.ceil), "round": _round,
    "is_finite": _unary(np.isfinite), "square": _unary(np.square),
    "real": _unary(np.real), "imag": _unary(np.imag), "conj": _unary(np.conj),
    "integer_pow": lambda params, x: np.power(x, params["y"]),
    "convert_element_type": lambda params, x: np.asarray(x).astype(params["new_dtype"]),
    "copy": _unary(np.array), "copy_p": _unary(np.array),
    "select_n": _select_n, "clamp": _clamp,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": lambda params, x, *dyn: np.reshape(x, params["new_sizes"]),
    "squeeze": lambda params, x: np.squeeze(x, axis=tuple(params["dimensions"])),
    "transpose": lambda params, x: np.transpose(x, params["permutation"]),
    "reduce_sum": _reduce(np.sum), "reduce_max": _reduce(np.max),
    "reduce_min": _reduce(np.min), "reduce_prod": _reduce(np.prod),
    "reduce_and": _reduce(np.all), "reduce_or": _reduce(np.any),
    "argmax": _argext(np.argmax), "argmin": _argext(np.argmin),
    "cumsum": _cumulative(np.cumsum), "cumprod": _cumulative(np.cumprod),
    "cummax": _cumulative(np.maximum.accumulate),
    "cummin": _cumulative(np.minimum.accumulate),
    "dot_general": _dot_general, "slice": _slice, "iota": _iota,
    "concatenate": lambda params, *xs: np.concatenate(xs, axis=params["dimension"]),
    "jit": _call("jaxpr"), "closed_call": _call("call_jaxpr"),
    "custom_jvp_call": _call("call_jaxpr"), "custom_vjp_call": _call("call_jaxpr"),
    "cond": _cond, "while": _while, "scan": _scan,
}
