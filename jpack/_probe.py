"""The optimizer check: where an optax transformation may run on buckets or slices.

`checker` reads a transformation's parts from the table in `jpack._known`. A part not in it
runs on the leaves of buckets or slices (traced to refuse a collective); on each device's
own leaves (ZeRO-1) it is probed once per process on a miniature of the params.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpack._internal import empty_shape, is_key_dtype
from jpack._known import COLLECTIVE, LEAVES, OK, REFUSE, Part, key_of, parts, public_name
from jpack._known import requirement
from jpack._labels import with_extra_args
from jpack._layout import Layout

_TARGETS = {"buckets": "buckets (1-D arrays that mix many leaves)",
            "slices": "each device's slice of the buckets",
            "owned": "each device's own whole leaves (the others left empty)",
            "owned_unit": "each device's own whole leaves (the others of one element)",
            "tree": "the params tree"}
_ALLREDUCE = "jpack.optax.allreduce followed by the optimizer on the params tree"
_DEVICES, _BIG_DIM, _SMALL_DIM, _LEAVES = 2, 128, 4, 3
_VALUES, _BOOST, _RTOL = (1.7, 1.3, 1.5), 1024.0, 1e-9


class _Refusal(NamedTuple):
  reason: str
  advice: str | None = None  # None: the caller's alternatives
  cause: BaseException | None = None


def checker(inner: Any, *, on: str, where: str, axis_name: Any = None,
            instead: str = _ALLREDUCE) -> Callable[..., str | None]:
  """``check(layout, name=None)``: where ``inner`` may run on params of ``layout``.

  Args:
    inner: an optax transformation, or a dict ``{label: transformation}``.
    on: ``"buckets"``, ``"slices"``, ``"owned"``, ``"owned_unit"`` or ``"tree"``.
    where: for messages, e.g. ``"inside jpack.optax.flat"``.
    axis_name: the data-parallel axis (a collective over any axis is refused).
    instead: for messages: what runs the optimizer on the params tree.

  Returns:
    ``check``: None where ``inner`` runs as is; on buckets or slices, the name of a part
    that needs the leaves; a `TypeError` where it cannot run (naming ``name`` if given).
  """
  if on not in _TARGETS:
    raise ValueError(f"on must be one of {tuple(_TARGETS)}, got {on!r}.")
  default = (f"Use jpack.optax.partition(transforms, labels) for masks (optax."
             f"clip_by_global_norm runs in every mode), or {instead}.")
  if on.startswith("owned"):
    default = ("ZeRO-1 (jpack.optax.sharded, mode='sharded') runs it on each device's own whole "
               "leaves, but it needs more than a device's own leaves. Use mode='packed' or "
               "jpack.optax.flat, which run it on all the leaves as optax does.")
  items = inner.items() if isinstance(inner, Mapping) else [(None, inner)]
  found = [(label, part) for label, tx in items for part in parts(tx)]

  def check(layout: Layout, name: str | None = None) -> str | None:
    culprit = None  # the first part that needs the leaves (only ever on buckets or slices)
    for label, part in found:
      slots = [s for s in layout.slots
               if label is None or str(layout.buckets[s.bucket].group[1]) == str(label)]
      why = part.kind and part.everywhere and requirement(part, [s.shape for s in slots])
      if why:
        raise TypeError(f"{name or part.name} cannot run {where}: {why}")
      outcome, refusal = _outcome(part, slots, on)
      if outcome == REFUSE:
        raise TypeError(f"{name or part.name} cannot run {where}: {refusal.reason} "
                        f"{refusal.advice or default}") from refusal.cause
      culprit = culprit or (part.name if outcome == LEAVES else None)
    return culprit

  return check


def _outcome(part: Part, slots: list, on: str) -> tuple[int, Any]:
  """(OK, LEAVES or REFUSE, the refusal) of ``part`` on ``on``."""
  if part.kind is COLLECTIVE:
    return REFUSE, _collective(on, None)
  if part.kind is not None:
    reason = ("it reduces over or divides by a leaf's dims" if part.kind.owned_unit == OK
              else "it reads statistics of the whole gradient (or of several leaves), "
              "which a device that owns only some leaves does not have")
    outcome = getattr(part.kind, on)
    return outcome, _Refusal(f"on {_TARGETS[on]}, {reason}.")
  spec = _miniature(slots)
  if not spec:
    return OK, None
  try:
    hash(part)
  except TypeError:  # an unhashable part (a transformation object of the user's own)
    return _in_worker(lambda: _probe(part, spec, on))
  return _verdict(part, spec, on)


@functools.lru_cache(maxsize=64)  # the verdicts, for the process
def _verdict(part: Part, spec: tuple, on: str) -> tuple[int, Any]:
  return _in_worker(lambda: _probe(part, spec, on))


def described(inner: Any) -> str:
  """``inner``'s factory (e.g. ``optax.apply_if_finite``), or "The optimizer"."""
  key = None if isinstance(inner, Mapping) else key_of(inner)
  return "The optimizer" if key is None else public_name(*key)


def refused(error: BaseException, inner: Any, where: str, when: str) -> TypeError:
  """The `TypeError` for ``error`` from ``inner``'s ``when``, naming the part that raised."""
  name, tb = described(inner), error.__traceback__
  while tb is not None:  # jpack._labels only runs the user's transformations
    code, module = tb.tb_frame.f_code, tb.tb_frame.f_globals.get("__name__", "")
    if "state" in code.co_varnames[1:2] and module != "jpack._labels":
      name = public_name(module, code.co_qualname)
    tb = tb.tb_next
  message = (str(error).splitlines() or [""])[0][:300].rstrip(".")
  return TypeError(
      f"{name} cannot run {where}: its {when} raised {type(error).__name__}: {message}. "
      "It may need the loss function (value_fn=, grad_fn=: line searches, SAM's opaque "
      "mode) or arguments for another params tree (a mask or labels given as a tree must "
      "have the params' structure). Check it on the params tree with plain optax first; "
      "if it runs there, please report this with the optimizer.")


def _collective(on: str, error: BaseException | None) -> _Refusal:
  if on.startswith("owned") or on == "slices":
    return _Refusal((
        "it runs a collective over a mesh axis, and on ZeRO-1 each device runs the "
        "optimizer on its own part of the gradient, which jpack.optax.sharded has "
        "reduce-scattered itself: a second reduce adds up different parts."),
        "Reduce nothing inside jpack.optax.sharded; optax.clip_by_global_norm(max_norm) in "
        "the chain clips by the global norm, which jpack computes on the slices.", error)
  return _Refusal((
      "it runs a collective over a mesh axis, but it would run on gradients that are "
      "already reduced, which every device holds whole."),
      "Reduce before the optimizer instead: optax.chain(jpack.optax.allreduce(axis_name), "
      "jpack.optax.flat(optimizer)), or jpack.optax.sharded(optimizer, axis_name) for ZeRO-1.",
      error)


def _probe(part: Part, spec: tuple, on: str) -> tuple[int, Any]:
  """The outcome of a part not in the table (on owned leaves: the tree's result or refused)."""
  tx, mini, want, error = with_extra_args(part.tx), _build(spec), None, None
  for extra in (False, True):  # value= (a loss) only if it needs one
    try:
      want = _run(tx, *mini, extra, abstract=not on.startswith("owned"))
      break
    except NameError as e:  # an unbound axis: a collective
      return REFUSE, _collective(on, e)
    except Exception as e:  # noqa: BLE001 - it needs what only the real params have
      error = error or e
  if not on.startswith("owned"):  # it runs on the leaves: optax's own computation
    return (OK if on == "tree" else LEAVES), None
  if want is None:
    return REFUSE, _Refusal(f"on a small params tree of its own it raised "
                            f"{type(error).__name__}: {str(error)[:200]}.", None, error)
  keys = sorted(mini[0])
  for d in range(_DEVICES):  # device d owns every other leaf, the rest are stand-ins
    others = {k for i, k in enumerate(keys) if i % _DEVICES != d}
    mine = lambda t: {k: np.ones(empty_shape(x.shape, on == "owned_unit"), x.dtype)  # noqa
                      if k in others else x for k, x in t.items()}
    try:
      got = _run(tx, mine(mini[0]), tuple(map(mine, mini[1])), extra)
    except Exception as e:  # noqa: BLE001 - named in the refusal (NameError: a collective)
      return REFUSE, (_collective(on, e) if isinstance(e, NameError)
                      else _Refusal(f"on {_TARGETS[on]} it raised {e!r:.200}.", None, e))
    found = _compare(want, got, others, dict(zip(keys, (path for path, _, _ in spec))))
    if found:
      return REFUSE, _Refusal((
          f"on {_TARGETS[on]}, {found}, compared with the params tree (a probe of three "
          "updates on random values). It reads more than each leaf on its own."))
  return OK, None


def _miniature(slots: list) -> tuple:
  """Per dtype, up to three leaves (the largest of each rank first), their two largest dims
  cut to 128 (optax factors from 128 on), the others to 4."""
  by_dtype: dict[Any, list] = {}
  for s in sorted(slots, key=lambda s: -s.size):
    if s.size and not is_key_dtype(s.dtype):
      by_dtype.setdefault(np.dtype(s.dtype), []).append(s)
  spec = []
  for dtype, group in by_dtype.items():
    chosen = sorted({len(s.shape): s for s in reversed(group)}.values(), key=lambda s: -s.size)
    if jnp.issubdtype(dtype, jnp.inexact):  # float64: rounding stays far below a difference
      dtype = np.dtype(np.complex128 if dtype.kind == "c" else np.float64)
    for s in (chosen + [s for s in group if s not in chosen])[:_LEAVES]:
      big = sorted(range(len(s.shape)), key=lambda i: -s.shape[i])[:2]
      spec.append((s.path, tuple(min(d, _BIG_DIM if i in big else _SMALL_DIM)
                                 for i, d in enumerate(s.shape)), dtype))
  return tuple(spec)


def _build(spec: tuple) -> tuple[dict, tuple]:
  """Params and three gradients: the second 1024 times larger, a NaN in the third."""
  rng = np.random.default_rng(0)

  def random(boost=1.0):
    out = {}
    for i, (_, shape, dtype) in enumerate(spec):
      v = rng.standard_normal(shape) * 2.0 ** rng.uniform(-2, 2) * boost
      v = v + 1j * v[::-1] if dtype.kind == "c" else v if dtype.kind == "f" else (
          rng.integers(0, 2 if dtype == np.bool_ else 4, shape))
      out[f"{i:03d}"] = np.array(v).astype(dtype)
    return out

  grads = (random(), random(_BOOST), random())
  inexact = [x for x in grads[2].values() if x.dtype.kind in "fc"]
  if inexact:
    inexact[0].reshape(-1)[0] = np.nan
  return random(), grads


def _in_worker(fn: Callable[[], Any]) -> Any:
  """``fn()`` in a fresh thread on the CPU with 64-bit types, out of the caller's trace."""
  try:
    device = jax.local_devices(backend="cpu")[0]
  except RuntimeError:  # no CPU backend: the default device
    device = None

  def run():
    with jax.enable_x64(True), jax.default_device(device):
      return fn()

  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jpack-probe") as pool:
    return pool.submit(run).result()


def _run(tx: Any, params: dict, grads: tuple, extra: bool, abstract: bool = False) -> Any:
  """(updates per step, last state) of ``init`` and an ``update`` per gradient, jitted."""

  def steps(params, grads):
    state, out = tx.init(params), []
    for g, value in zip(grads, _VALUES):
      kwargs = {"value": jnp.float32(value)} if extra else {}
      u, state = tx.update(g, state, params, **kwargs)
      out.append(u)
      params = optax.apply_updates(params, u)
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key_dtype(x.dtype) else x,
                        (out, state))

  if abstract:
    return jax.eval_shape(steps, params, grads)
  return jax.tree.map(np.asarray, jax.jit(steps)(params, grads))


def _compare(want: Any, got: Any, others: set, shown: dict[str, str]) -> str | None:
  """Where ``got`` (updates per step, final state) differs from ``want`` outside ``others``."""
  leaf = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731

  def mine(tree):  # another device's leaves (a path through their key) masked out
    return jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_map_with_path(
        lambda p, x: optax.MaskedNode() if any(getattr(k, "key", None) in others for k in p)
        else x, tree), is_leaf=leaf)

  pairs = [(f"update {k + 1}", a, b) for k, (a, b) in enumerate(zip(want[0], got[0]))]
  if jax.tree.structure(want[1]) == jax.tree.structure(got[1]):  # else shaped by stand-ins
    pairs.append(("the final state", want[1], got[1]))
  for what, tree_a, tree_b in pairs:
    (a, a_def), (b, b_def) = mine(tree_a), mine(tree_b)
    if a_def != b_def:
      return f"{what} has another structure ({len(b)} arrays where the tree's has {len(a)})"
    for (path, x), (_, y) in zip(a, b):
      found = (None if leaf(x) and leaf(y) else "is masked on one side only"
               if leaf(x) or leaf(y) else _mismatch(np.asarray(x), np.asarray(y)))
      if found:
        return what + "".join(shown.get(getattr(k, "key", None)) or jax.tree_util.keystr((k,))
                              for k in path) + f" {found}"
  return None


def _mismatch(a: np.ndarray, b: np.ndarray) -> str | None:
  """How ``b`` differs from ``a`` beyond rounding (1e-9 of the largest magnitude)."""
  if a.shape != b.shape:
    return f"has shape {b.shape} where the params tree's has {a.shape}"
  if not (a.dtype.kind in "fc" or b.dtype.kind in "fc"):
    return None if np.array_equal(a, b) else "differs"
  a, b = a.astype(np.complex128), b.astype(np.complex128)
  special = ~(np.isfinite(a) & np.isfinite(b))
  if not np.array_equal(a[special], b[special], equal_nan=True):
    return "is NaN or infinite where the params tree's is not (or the other way round)"
  err = float(np.max(np.abs(a[~special] - b[~special]), initial=0.0))
  scale = float(np.max(np.abs(a[~special]), initial=0.0))
  return None if err <= _RTOL * scale else (
      f"differs by up to {err:.3g} (the largest magnitude there is {scale:.3g})")
