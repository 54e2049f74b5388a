"""The outputs of a traced ``init`` that constants alone decide, made on the host.

An optimizer's state starts as zeros and a step counter. A program that makes them
compiles a kernel per array (per leaf, for an optimizer run leaf by leaf), while the same
arrays placed from the host cost a transfer each. `on_host_where_constant` evaluates the
traced per-device ``init`` with numpy wherever its inputs do not enter, and compiles only
the rest (the params). `by_param_leaf` lets ZeRO-1's owned mode make every device's first
state from two traces, where optax makes it leaf by leaf.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.sharding import Mesh, NamedSharding

UNKNOWN = object()  # decided by the inputs, or by an operation not read here
VARYING = object()  # decided by the device's index: known device by device
_LIMIT = 1 << 24  # bytes: a larger output is made by the program, a larger result not held


def compact(x: np.ndarray) -> np.ndarray:
  """``x`` without the repeats of a broadcast (its dims of stride 0 cut to one)."""
  return x[tuple(slice(0, 1) if step == 0 else slice(None) for step in x.strides)]


def _broadcast(x, shape, broadcast_dimensions, **_):
  kept = [x.shape[broadcast_dimensions.index(d)] if d in broadcast_dimensions else 1
          for d in range(len(shape))]
  return np.broadcast_to(np.reshape(x, kept), shape)


def _reshape(x, new_sizes, dimensions, **_):
  if dimensions is not None:
    return UNKNOWN
  small = compact(x)  # a broadcast scalar stays one
  return np.broadcast_to(small.reshape(()), new_sizes) if small.size == 1 else (
      x.reshape(new_sizes))


_RULES: dict[str, Callable[..., Any]] = {  # one output each, exact in numpy
    "broadcast_in_dim": _broadcast,
    "convert_element_type": lambda x, new_dtype, **_: np.broadcast_to(
        compact(x).astype(new_dtype), x.shape),
    "reshape": _reshape,
    "concatenate": lambda *xs, dimension: np.concatenate(xs, dimension),
    "clamp": lambda low, x, high: np.clip(x, low, high),
    "squeeze": lambda x, dimensions: np.squeeze(x, tuple(dimensions)),
}


def evaluate(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any],
             index: Callable[[Any], Any]) -> list[Any]:
  """``jaxpr``'s outputs as numpy arrays where ``args`` (arrays, `UNKNOWN`, `VARYING`)
  decide them; ``index(axis_name)`` is the device's `lax.axis_index` (or `VARYING`)."""
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(v):
    return np.asarray(v.val, v.aval.dtype) if isinstance(v, Literal) else env.get(v, UNKNOWN)

  for eqn in jaxpr.eqns:
    env.update(zip(eqn.outvars, _apply(eqn, [read(v) for v in eqn.invars], index)))
  return [read(v) for v in jaxpr.outvars]


def _apply(eqn: Any, args: list[Any], index: Callable[[Any], Any]) -> list[Any]:
  name, params, count = eqn.primitive.name, eqn.params, len(eqn.outvars)
  inner = params.get("jaxpr", params.get("call_jaxpr"))
  if name == "axis_index":
    at = index(params["axis_name"])
    return [at if at is VARYING else np.asarray(at, eqn.outvars[0].aval.dtype)]
  if isinstance(inner, ClosedJaxpr) and name in ("jit", "pjit", "custom_jvp_call"):
    return evaluate(inner.jaxpr, inner.consts, args, index)
  if name == "cond" and args[0] is VARYING:  # its branch is known device by device
    return [VARYING] * count
  if name == "cond" and args[0] is not UNKNOWN:  # lax.switch clamps its index first
    branch = params["branches"][int(args[0])]
    return evaluate(branch.jaxpr, branch.consts, args[1:], index)
  rule = _RULES.get(name)
  if rule is None or count != 1 or any(x is UNKNOWN for x in args):
    return [UNKNOWN] * count
  if any(x is VARYING for x in args):
    return [VARYING]
  out = rule(*args, **params)
  return [out if out is UNKNOWN or compact(out).nbytes <= _LIMIT else UNKNOWN]


def constant_outputs(traced: ClosedJaxpr) -> list[np.ndarray] | None:
  """The outputs of ``traced``, if constants alone decide them on every device."""
  outs = evaluate(traced.jaxpr, traced.consts, [UNKNOWN] * len(traced.in_avals),
                  lambda _: VARYING)
  return outs if all(isinstance(x, np.ndarray) for x in outs) else None


def by_param_leaf(whole: ClosedJaxpr, whole_state: Any, stand_in: ClosedJaxpr,
                  stand_in_state: Any, params: Any) -> tuple[list[int], list, list] | None:
  """For ``init`` traced on whole param leaves and on stand-ins (each a jaxpr and its state
  shapes): each state leaf's param leaf (-1: none), and both traces' constants. None
  unless constants alone make both, and each state leaf is one param leaf's or the same
  in both."""
  cw, cs = constant_outputs(whole), constant_outputs(stand_in)
  tree = jax.tree.structure(whole_state)
  if cw is None or cs is None or tree != jax.tree.structure(stand_in_state):
    return None
  param = [-1] * tree.num_leaves
  for j, i in by_param(jax.tree.unflatten(tree, range(tree.num_leaves)), params):
    param[i] = j
  lw, ls = jax.tree.leaves(whole_state), jax.tree.leaves(stand_in_state)
  if any(p < 0 and (lw[i] != ls[i] or not np.array_equal(cw[i], cs[i]))
         for i, p in enumerate(param)):
    return None
  return param, cw, cs


def by_param(tree: Any, params: Any) -> list[tuple[int, int]]:
  """(param leaf, leaf) for the int leaves of ``tree`` in its subtrees of the ``params``
  structure (optax's per-leaf states): at each param's place an int, a list of them (sm3's
  accumulators per dim), or nothing (a masked-out leaf, `optax.MaskedNode`)."""
  def ints(p):
    return [p] if isinstance(p, int) else p if type(p) is list and all(
        isinstance(q, int) for q in p) else None if jax.tree.leaves(p) else []

  found: list[tuple[int, int]] = []

  def visit(x):  # a node of the params' structure: its leaves found, not descended into
    with contextlib.suppress(ValueError, TypeError):
      pieces = [ints(p) for p in params.flatten_up_to(x)]
      if all(p is not None for p in pieces):
        found.extend((j, i) for j, p in enumerate(pieces) for i in p)
        return True
    return False

  jax.tree.leaves(tree, is_leaf=visit)
  return found


def set_per_device(pairs: list[list[tuple[int, Any]]], dtype: Any, size: int,
                   axis_name: Any) -> jax.Array:
  """A buffer of ``size`` zeros with device k's ``pairs[k]`` (position, value) set: a
  table of the pairs, not of the buffers, goes into the program."""
  if not any(pairs):
    return jnp.zeros(size, dtype)
  width = max(map(len, pairs))  # per device, padded with positions past the end
  at = np.array([[k for k, _ in p] + [size] * (width - len(p)) for p in pairs], np.int64)
  values = np.array([[v for _, v in p] + [0] * (width - len(p)) for p in pairs], dtype)
  k = lax.axis_index(axis_name) if len(pairs) > 1 else 0
  return jnp.zeros(size, dtype).at[jnp.asarray(at)[k]].set(jnp.asarray(values)[k], mode="drop")


def on_host_where_constant(fn: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
  """``jax.jit(fn)``, for ``fn`` a `jax.shard_map` over ``mesh`` of replicated inputs, with
  the outputs that constants decide made on the host (new arrays at every call: a step
  donates them); traced once per argument types."""
  cache: dict[Any, Any] = {}
  compiled = jax.jit(fn)

  def run(*args):
    leaves, tree = jax.tree.flatten(args)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):  # eval_shape, jit: no arrays
      return compiled(*args)
    key = (tree, tuple(jax.typeof(x) for x in leaves))
    if key not in cache:  # one trace: the program it lowers is the fallback
      traced = compiled.trace(*args)
      known = _known_outputs(traced.jaxpr, mesh)
      others = [i for i in range(len(traced.jaxpr.out_avals)) if i not in known]
      rest = _program(traced.jaxpr, others, mesh) if known else traced.lower().compile()
      cache[key] = known, others, rest, jax.tree.structure(traced.out_info)
    known, others, rest, out_tree = cache[key]
    outs = dict(zip(others, jax.tree.leaves(rest(*args)) if others else []))
    for i, (shape, sharding, by_index) in known.items():
      outs[i] = jax.make_array_from_callback(
          shape, sharding, lambda at, by_index=by_index: np.array(by_index[_key(at)]))
    return jax.tree.unflatten(out_tree, [outs[i] for i in range(len(outs))])

  return run


def _program(closed: ClosedJaxpr, others: list[int], mesh: Mesh) -> Callable[..., Any]:
  """``closed``'s outputs ``others`` alone, jitted: its `jax.shard_map`'s body pruned to
  what they need (tracing the whole body again costs as much as the first time)."""
  (eqn,), body = closed.jaxpr.eqns, closed.jaxpr.eqns[0].params["jaxpr"]
  needed = {body.outvars[i] for i in others}
  eqns = []
  for e in reversed(body.eqns):
    if e.effects or needed.intersection(e.outvars):
      eqns.append(e)
      needed.update(v for v in e.invars if not isinstance(v, Literal))
  pruned = body.replace(eqns=eqns[::-1], outvars=[body.outvars[i] for i in others],
                        debug_info=body.debug_info.with_unknown_names())
  per_device = jax.shard_map(
      lambda *a: tuple(jax.core.eval_jaxpr(pruned, (), *a)), mesh=mesh,
      in_specs=tuple(eqn.params["in_specs"]), check_vma=False,
      out_specs=tuple(eqn.params["out_specs"][i] for i in others))
  return jax.jit(lambda *args: per_device(*_operands(closed, jax.tree.leaves(args))))


def _operands(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
  """The operands of ``closed``'s one equation (its `jax.shard_map`), for inputs ``args``."""
  env = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))
  return [v.val if isinstance(v, Literal) else env[v] for v in closed.jaxpr.eqns[0].invars]


def _known_outputs(closed: ClosedJaxpr, mesh: Mesh) -> dict[int, Any]:
  """``{i: (shape, sharding, {index: value})}`` for the outputs of ``closed`` (one
  `jax.shard_map` of replicated inputs) that constants decide, on this process's devices."""
  eqns, outs = closed.jaxpr.eqns, closed.jaxpr.outvars
  if len(eqns) != 1 or eqns[0].primitive.name != "shard_map" or outs != eqns[0].outvars:
    return {}
  body, specs = eqns[0].params["jaxpr"], eqns[0].params["out_specs"]
  args = _operands(closed, [UNKNOWN] * len(closed.jaxpr.invars))

  def values(coords):
    def index(axis_name):
      if coords is None:
        return VARYING
      names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
      return int(np.ravel_multi_index([coords[n] for n in names],
                                      [mesh.shape[n] for n in names]))
    return [x if x is UNKNOWN or x is VARYING or (
        (x.shape, x.dtype) == (v.aval.shape, v.aval.dtype) and x.nbytes <= _LIMIT)
            else UNKNOWN for x, v in zip(evaluate(body, (), args, index), body.outvars)]

  devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  alike = values(None)
  per_device = dict.fromkeys(devices, alike)
  if any(x is VARYING for x in alike):
    per_device = {d: values(dict(zip(mesh.axis_names, np.argwhere(mesh.devices == d)[0])))
                  for d in devices}
  known = {}
  for i, spec in enumerate(specs):
    shape = outs[i].aval.shape  # global
    sharding = NamedSharding(mesh, spec)
    by_index: dict[Any, Any] = {}
    for d, at in sharding.addressable_devices_indices_map(shape).items():
      x = per_device[d][i]
      seen = by_index.setdefault(_key(at), x)
      if x is UNKNOWN or x is VARYING or not (seen is x or np.array_equal(seen, x)):
        break
    else:
      known[i] = shape, sharding, by_index
  return known


def _key(at: tuple[slice, ...]) -> tuple[Any, ...]:
  return tuple((s.start, s.stop) for s in at)

