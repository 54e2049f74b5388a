"""The optimizer check: where an optax transformation may run on buckets or slices.

`checker` reads a transformation's parts from the table of known ones (`jpack._known`);
a part not in the table is probed once per process: ``init`` and three ``update`` calls
on a miniature of the params (float64, a scale per leaf, a 1024 times larger second
gradient, a NaN in the third), on the tree and as jpack would run it (buckets, two
simulated devices' slices, or each device's own leaves), compared leaf by leaf, state
too. It runs jitted in a worker thread (its own trace, no bound axis, 64-bit types).
What random values never trigger is not seen.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpack._internal import empty_shape, is_key_dtype
from jpack._known import COLLECTIVE, LEAVES, OK, REFUSE, Part, key_of, parts, public_name
from jpack._known import requirement
from jpack._labels import with_extra_args
from jpack._layout import Layout, plan

_ON = ("buckets", "slices", "owned", "owned_unit", "tree")
_TARGETS = {"buckets": "buckets (1-D arrays that mix many leaves)",
            "slices": "each device's slice of the buckets",
            "owned": "each device's own whole leaves (the others left empty)",
            "owned_unit": "each device's own whole leaves (the others of one element)",
            "tree": "the params tree"}
_ALLREDUCE = "jpack.optax.allreduce followed by the optimizer on the params tree"
_DEVICES, _BIG_DIM, _SMALL_DIM, _LEAVES = 2, 128, 4, 3  # optax factors dims from 128 on
_VALUES, _BOOST, _RTOL = (1.7, 1.3, 1.5), 1024.0, 1e-9


class _Refusal(NamedTuple):
  name: str
  reason: str
  advice: str | None = None  # None: the caller's alternatives
  cause: BaseException | None = None


def checker(inner: Any, *, on: str, where: str, axis_name: Any = None,
            instead: str = _ALLREDUCE) -> Callable[..., str | None]:
  """``check(layout, name=None)``: where ``inner`` may run for params of ``layout``.

  Args:
    inner: an optax transformation, or a dict ``{label: transformation}``.
    on: ``"buckets"``, ``"slices"``, ``"owned"``, ``"owned_unit"`` or ``"tree"``.
    where: for messages, e.g. ``"inside jpack.optax.flat"``.
    axis_name: the data-parallel axis (bound on slices).
    instead: for messages: what runs the optimizer on the params tree.

  Returns:
    ``check``, which returns None where ``inner`` runs as is, on buckets or slices the
    name of the part that needs the leaves, and raises `TypeError` where it cannot run
    (``name`` replaces the transformation named).
  """
  if on not in _ON:
    raise ValueError(f"on must be one of {_ON}, got {on!r}.")
  default = (f"Use jpack.optax.partition(transforms, labels) for masks (optax."
             f"clip_by_global_norm runs in every mode), or {instead}.")
  if on.startswith("owned"):
    default = ("ZeRO-1 (jpack.optax.sharded, data_parallel(mode='sharded')) runs a "
               "transformation that needs whole leaves on each device's own leaves, but this "
               "one needs more than a device's own leaves. Use mode='packed' or "
               "jpack.optax.flat, which run it on all the leaves and give optax's result.")
  items = inner.items() if isinstance(inner, Mapping) else [(None, inner)]
  found = [(label, part) for label, tx in items for part in parts(tx)]

  def check(layout: Layout, name: str | None = None) -> str | None:
    worst, culprit = OK, None
    for label, part in found:
      slots = [s for s in layout.slots
               if label is None or str(layout.buckets[s.bucket].group[1]) == str(label)]
      why = part.kind and part.everywhere and requirement(part, [s.shape for s in slots])
      if why:
        raise TypeError(f"{name or part.name} cannot run {where}: {why}")
      outcome, refusal = _outcome(part, slots, on, axis_name)
      if outcome > worst:
        worst, culprit = outcome, refusal or _Refusal(part.name, "")
    if worst == OK or (worst == LEAVES and on in ("buckets", "slices")):
      return None if culprit is None else culprit.name
    raise TypeError(f"{name or culprit.name} cannot run {where}: {culprit.reason} "
                    f"{culprit.advice or default}") from culprit.cause

  return check


def _outcome(part: Part, slots: list, on: str, axis_name: Any) -> tuple[int, Any]:
  """(OK, LEAVES or REFUSE, the refusal) of ``part`` on ``on``."""
  if part.kind is COLLECTIVE:
    return REFUSE, _collective(part.name, on, None)
  if part.kind is not None:
    reason = ("it reduces over or divides by a leaf's dims" if part.kind.owned_unit == OK
              else "it reads statistics of the whole gradient (or of several leaves), "
              "which a device that owns only some leaves does not have")
    outcome = getattr(part.kind, on)
    return outcome, _Refusal(part.name, f"on {_TARGETS[on]}, {reason}.") if outcome else None
  spec = _miniature(slots)
  if not spec:
    return OK, None
  key = (identity(part.tx), spec, on, axis_name if on == "slices" else None)
  try:
    found, verdict = _VERDICTS.get((key,))
  except TypeError:  # an unhashable part (a transformation object of the user's own)
    return _in_worker(lambda: _probe(part, spec, on, axis_name))
  if not found:
    verdict = _in_worker(lambda: _probe(part, spec, on, axis_name))
    _VERDICTS.put(key, verdict)
  return verdict


class Recent:
  """Values kept for the process, the least recently used dropped beyond ``limit``."""

  def __init__(self, limit: int):
    self.limit = limit
    self.kept: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    self.lock = threading.Lock()

  def get(self, keys: tuple[Any, ...]) -> tuple[bool, Any]:
    with self.lock:
      for key in keys:
        if key in self.kept:
          self.kept.move_to_end(key)
          return True, self.kept[key]
    return False, None

  def put(self, key: Any, value: Any) -> None:
    with self.lock:
      self.kept[key] = value
      while len(self.kept) > self.limit:
        self.kept.popitem(last=False)


_VERDICTS = Recent(64)


def identity(inner: Any) -> Any:
  """A hashable stand-in for ``inner`` equal only to itself (its ``init`` and
  ``update`` by identity, kept alive by the key); a dict of them: its items."""
  if isinstance(inner, Mapping):
    return tuple((label, identity(tx)) for label, tx in inner.items())
  init, update = getattr(inner, "init", None), getattr(inner, "update", None)
  return inner if init is None or update is None else (type(inner), init, update)


def described(inner: Any) -> str:
  """``inner``'s factory (e.g. ``optax.apply_if_finite``), or "The optimizer"."""
  key = None if isinstance(inner, Mapping) else key_of(inner)
  return "The optimizer" if key is None else public_name(*key)


def refused(error: BaseException, inner: Any, where: str, when: str) -> TypeError:
  """The `TypeError` for an ``error`` that ``inner`` raised in ``when`` on the real
  params, naming the innermost transformation that raised and what to do."""
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


def _collective(name: str, on: str, error: BaseException | None) -> _Refusal:
  if on.startswith("owned") or on == "slices":
    return _Refusal(name, (
        "it runs a collective over a mesh axis, and on ZeRO-1 each device runs the "
        "optimizer on its own part of the gradient, which jpack.optax.sharded has "
        "reduce-scattered itself: a second reduce adds up different parts."),
        "Reduce nothing inside jpack.optax.sharded; clip by the global norm with "
        "optax.clip_by_global_norm(max_norm) in the chain, which jpack computes on the "
        "slices.", error)
  return _Refusal(name, (
      "it runs a collective over a mesh axis, but it would run on gradients that are "
      "already reduced, which every device holds whole."),
      "Reduce before the optimizer instead: optax.chain(jpack.optax.allreduce("
      "axis_name), jpack.optax.flat(optimizer)), or jpack.optax.sharded(optimizer, "
      "axis_name) for ZeRO-1.", error)


# -- the probe of a part not in the table ----------------------------------------------


class _Mini(NamedTuple):
  spec: tuple  # ((path, shape, dtype), ...): what the verdict depends on
  layout: Layout  # its buckets, without alignment padding, in two shards
  params: dict[str, np.ndarray]
  grads: tuple[dict[str, np.ndarray], ...]


def _miniature(slots: list) -> tuple:
  """Per dtype, up to three leaves (the largest of each rank first), their two largest
  dims cut to 128 and the others to 4; key and empty leaves left out."""
  by_dtype: dict[Any, list] = {}
  for s in sorted(slots, key=lambda s: -s.size):
    if s.size and not is_key_dtype(s.dtype):
      by_dtype.setdefault(np.dtype(s.dtype), []).append(s)
  spec = []
  for dtype, group in by_dtype.items():
    ranks = {len(s.shape): s for s in reversed(group)}
    chosen = sorted(ranks.values(), key=lambda s: -s.size)
    chosen += [s for s in group if s not in chosen]
    if jnp.issubdtype(dtype, jnp.inexact):  # float64: rounding stays far below a difference
      dtype = np.dtype(np.complex128 if jnp.issubdtype(dtype, jnp.complexfloating)
                       else np.float64)
    for s in chosen[:_LEAVES]:
      big = sorted(range(len(s.shape)), key=lambda i: -s.shape[i])[:2]
      spec.append((s.path, tuple(min(d, _BIG_DIM if i in big else _SMALL_DIM)
                                 for i, d in enumerate(s.shape)), dtype))
  return tuple(spec)


def _build(spec: tuple) -> _Mini:
  structs = {f"{i:03d}": jax.ShapeDtypeStruct(shape, dtype)
             for i, (_, shape, dtype) in enumerate(spec)}
  layout = plan(structs, align_bytes=1, bucket_bytes=2**40, max_leaves=None,
                solo_bytes=None, num_shards=_DEVICES)
  rng = np.random.default_rng(0)

  def random(boost=1.0):
    out = {}
    for k, x in structs.items():
      scale = 2.0 ** rng.uniform(-2, 2) * boost
      if jnp.issubdtype(x.dtype, jnp.inexact):
        v = rng.standard_normal(x.shape) * scale
        v = v + 1j * v[::-1] if jnp.issubdtype(x.dtype, jnp.complexfloating) else v
      else:
        v = rng.integers(0, 2, x.shape) if x.dtype == np.bool_ else rng.integers(0, 4, x.shape)
      out[k] = np.array(v).astype(x.dtype)
    return out

  params, grads = random(), (random(), random(_BOOST), random())
  inexact = [k for k, x in structs.items() if jnp.issubdtype(x.dtype, jnp.inexact)]
  if inexact:
    grads[2][inexact[0]].reshape(-1)[0] = np.nan
  return _Mini(spec, layout, params, grads)


def _in_worker(fn: Callable[[], Any]) -> Any:
  """``fn()`` in a fresh thread on the CPU, with 64-bit types: no trace or bound axis of
  the caller's reaches it."""
  try:
    device = jax.local_devices(backend="cpu")[0]
  except RuntimeError:  # no CPU backend: the default device
    device = None

  def run():
    with jax.enable_x64(True), jax.default_device(device):
      return fn()

  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jpack-probe") as pool:
    return pool.submit(run).result()


def _probe(part: Part, spec: tuple, on: str, axis_name: Any) -> tuple[int, Any]:
  mini, tx = _build(spec), with_extra_args(part.tx)
  error = None
  for extra in (False, True):  # value= (a loss) only if it needs one
    try:
      if on == "slices":  # a collective sees the whole gradient on one device
        want = _first(_run(tx, _first(mini.params, None), _first(mini.grads, None), extra,
                           1, axis_name))
      else:
        want = _run(tx, mini.params, mini.grads, extra)
      break
    except NameError as e:  # an unbound axis: a collective
      return REFUSE, _collective(part.name, on, e)
    except Exception as e:  # noqa: BLE001 - it needs what only the real params have
      error = error or e
  else:
    if on in ("buckets", "slices"):  # on the leaves optax's own error is named
      return LEAVES, None
    return (OK, None) if on == "tree" else (REFUSE, _Refusal(part.name, (
        f"on a small params tree of its own it raised {type(error).__name__}: "
        f"{str(error)[:200]}."), None, error))
  if on == "tree":
    return OK, None
  try:
    found = _target(tx, mini, on, extra, axis_name, want)
  except NameError as e:
    return REFUSE, _collective(part.name, on, e)
  except Exception as e:  # noqa: BLE001 - named in the refusal
    if on in ("buckets", "slices"):
      return LEAVES, None
    return REFUSE, _Refusal(part.name, f"on {_TARGETS[on]} it raised {e!r:.200}.", None, e)
  if found is None:
    return OK, None
  return (LEAVES if on in ("buckets", "slices") else REFUSE), _Refusal(part.name, (
      f"on {_TARGETS[on]}, {found}, compared with the params tree (a probe of three "
      "updates on random values). It reads more than each element on its own "
      "(per-leaf or whole-gradient statistics, random numbers, shapes)."))


def _target(tx, mini: _Mini, on: str, extra: bool, axis_name: Any, want) -> str | None:
  """How ``tx`` run on ``on`` differs from ``want`` (its run on the tree), or None."""
  if on in ("buckets", "slices"):
    devices = _DEVICES if on == "slices" else 0
    cut = (lambda t: _buckets(t, mini.layout, devices))
    got = _run(tx, cut(mini.params), tuple(map(cut, mini.grads)), extra, devices, axis_name)
    return _compare(want, _as_tree(got, mini, devices), mini)
  keys = sorted(mini.params)
  for d in range(_DEVICES):  # device d owns every other leaf, the rest are stand-ins
    others = {k for i, k in enumerate(keys) if i % _DEVICES != d}
    mine = lambda t: {k: np.ones(empty_shape(x.shape, on == "owned_unit"), x.dtype)  # noqa
                      if k in others else x for k, x in t.items()}
    updates, state = _run(tx, mine(mini.params), tuple(map(mine, mini.grads)), extra)
    masked = lambda t: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda p, x: optax.MaskedNode() if any(getattr(k, "key", None) in others
                                               for k in p) else x, t)
    found = _compare((want[0], masked(want[1])), (updates, masked(state)), mini, others)
    if found:
      return found
  return None


def _steps(tx: Any, params: Any, grads: tuple, extra: bool) -> tuple[list, Any]:
  state, out = tx.init(params), []
  for g, value in zip(grads, _VALUES):
    u, state = tx.update(g, state, params, **({"value": jnp.float32(value)} if extra else {}))
    out.append(u)
    params = optax.apply_updates(params, u)
  return out, state


def _run(tx, params, grads, extra, devices=0, axis_name=None):
  fn = lambda p, g: _steps(tx, p, g, extra)  # noqa: E731
  if devices:
    fn = jax.vmap(fn, axis_name=axis_name, axis_size=devices)
  keyless = lambda x: jax.random.key_data(x) if is_key_dtype(x.dtype) else x  # noqa: E731
  return jax.tree.map(np.asarray, jax.jit(lambda p, g: jax.tree.map(keyless, fn(p, g)))(
      params, grads))


def _first(tree: Any, index: Any = 0) -> Any:
  """Every array's first row (``index=None``: with a device axis of one added)."""
  return jax.tree.map(lambda x: x[index], tree)


def _buckets(tree: dict, layout: Layout, devices: int) -> tuple:
  buckets = [np.zeros(b.size, b.dtype) for b in layout.buckets]
  for key, slot in zip(sorted(tree), layout.slots):
    buckets[slot.bucket][slot.offset:slot.offset + slot.size] = tree[key].reshape(-1)
  return tuple(b.reshape(devices, -1) if devices else b for b in buckets)


def _as_tree(value: Any, mini: _Mini, devices: int) -> Any:
  """A run on buckets as the run on the tree holds it: every tuple of buckets (a device
  axis in front joined) unpacked into leaves along its last axis; any other array the
  first device's, or a str where the devices differ."""
  sizes = [b.size for b in mini.layout.buckets]

  def fits(a, size):
    shape = getattr(a, "shape", ())
    return (len(shape) >= 2 and shape[0] == devices and shape[-1] * devices == size
            if devices else len(shape) >= 1 and shape[-1] == size)

  def is_buckets(x):
    return isinstance(x, tuple) and len(x) == len(sizes) and all(
        isinstance(a, optax.MaskedNode) or fits(a, s) for a, s in zip(x, sizes))

  def convert(x):
    if isinstance(x, optax.MaskedNode):
      return x
    if not is_buckets(x):
      same = not devices or all(np.array_equal(x[0], y, equal_nan=x.dtype.kind in "fc")
                                for y in x[1:])
      return (x[0] if devices else x) if same else "differs between the devices"
    whole = [a if isinstance(a, optax.MaskedNode) or not devices else
             np.moveaxis(a, 0, -2).reshape(a.shape[1:-1] + (s,)) for a, s in zip(x, sizes)]
    out = {}
    for key, slot in zip(sorted(mini.params), mini.layout.slots):
      b = whole[slot.bucket]
      out[key] = b if isinstance(b, optax.MaskedNode) else b[
          ..., slot.offset:slot.offset + slot.size].reshape(b.shape[:-1] + slot.shape)
    return out

  return jax.tree.map(convert, value,
                      is_leaf=lambda x: is_buckets(x) or isinstance(x, optax.MaskedNode))


def _compare(want: Any, got: Any, mini: _Mini, others: set = frozenset()) -> str | None:
  """Where ``got`` (updates per step, final state) differs from ``want``, or None."""
  shown = {f"{i:03d}": path for i, (path, _, _) in enumerate(mini.spec)}
  for k, (a, b) in enumerate(zip(want[0], got[0])):
    a, b = ({n: x for n, x in t.items() if n not in others} for t in (a, b))
    found = _difference(a, b, f"update {k + 1}", shown)
    if found:
      return found
  if others and jax.tree.structure(want[1]) != jax.tree.structure(got[1]):
    return None  # decided by the stand-ins' shapes: what differs shows in the updates
  return _difference(want[1], got[1], "the final state", shown)


def _difference(want: Any, got: Any, what: str, shown: dict[str, str]) -> str | None:
  leaf = lambda x: isinstance(x, (optax.MaskedNode, str))  # noqa: E731
  a, a_def = jax.tree_util.tree_flatten_with_path(want, is_leaf=leaf)
  b, b_def = jax.tree_util.tree_flatten_with_path(got, is_leaf=leaf)
  if a_def != b_def:
    return f"{what} has another structure ({len(b)} arrays where the tree's has {len(a)})"
  for (path, x), (_, y) in zip(a, b):
    at = what + "".join(shown.get(getattr(k, "key", None)) or jax.tree_util.keystr((k,))
                        for k in path)
    if isinstance(y, str) or isinstance(x, optax.MaskedNode) != isinstance(y, optax.MaskedNode):
      return f"{at} {y if isinstance(y, str) else 'is masked on one side only'}"
    if isinstance(x, optax.MaskedNode):
      continue
    found = _mismatch(np.asarray(x), np.asarray(y))
    if found:
      return f"{at} {found}"
  return None


def _mismatch(a: np.ndarray, b: np.ndarray) -> str | None:
  """How ``b`` differs from ``a`` beyond rounding (1e-9 of the largest magnitude)."""
  if a.shape != b.shape:
    return f"has shape {b.shape} where the params tree's has {a.shape}"
  if not (a.dtype.kind in "fc" or b.dtype.kind in "fc"):
    return None if np.array_equal(a, b) else "differs"
  a, b = a.astype(np.complex128), b.astype(np.complex128)
  if not np.array_equal(np.isnan(a), np.isnan(b)):
    return "is NaN where the params tree's is not (or the other way round)"
  infinite = np.isinf(a) | np.isinf(b)
  if not np.array_equal(a[infinite], b[infinite]):
    return "is infinite where the params tree's is not (or the other way round)"
  finite = np.isfinite(a)
  err = float(np.max(np.abs(a[finite] - b[finite]), initial=0.0))
  scale = float(np.max(np.abs(a[finite]), initial=0.0))
  return None if err <= _RTOL * scale else (
      f"differs by up to {err:.3g} (the largest magnitude there is {scale:.3g})")
