"""Find the optax transformations that buckets, or slices of them, would change.

`jpack.optax.flat`, `jpack.optax.sharded` and `jpack.data_parallel` run an optax
transformation on 1-D buckets that mix many leaves, or on each device's slice of them.
Only some transformations compute the same there: elementwise ones (sgd, adam, lion,
...) everywhere, and those that need the whole gradient (a global norm) on whole buckets.
No list of names keeps up with optax, so `checker` asks the transformation itself when
it is initialised: it runs it on a miniature of the params both ways and compares. On
slices (ZeRO-1) a difference is refused; on whole buckets, where every device holds the
whole gradient, `checker` names the transformation that differs, and `jpack.optax.flat`
runs it on the leaves instead (`jpack._labels.placed`).

What runs: ``init`` and three ``update`` calls on random values, once on the miniature
tree (the reference: what optax computes) and once the way jpack runs it: on the
miniature's buckets, or on each simulated device's slice of them. The second update's
gradients are 1024 times larger (clipping thresholds are crossed), the third holds a NaN
(a finiteness check on a slice sees only that slice). Parameters and gradients have a
scale of their own in every leaf, so a per-leaf statistic differs from a per-bucket or
per-slice one. A run without extra update arguments comes first; if it raises, one with
``value=`` (a loss, as polyak_sgd and reduce_on_plateau need).

What is compared: the updates of every step, leaf by leaf, and the final state, in which
every tuple of buckets is unpacked into leaves (along its last axis, so a history
stacked in front, as lbfgs keeps, compares too) and every other value must be equal on
all devices. Floats are probed as float64 (complex128), so that rounding (buckets sum a
global norm in another order than leaves), even amplified by a cancellation, stays far
below a real difference: a value passes within 1e-9 of the reference leaf's largest
magnitude (NaN and infinities must match exactly). Anything else raises a `TypeError`
naming the transformation, where its result differs (which leaf, by how much) and what
to use instead. The name comes from a second run, recorded with `sys.setprofile`: every
call of a function taking ``(updates, state)`` (optax's convention for ``update``), the
culprit being the innermost one whose input updates agree but whose output updates or
state do not. A state holding a PRNG key adds why: the noise drawn on buckets is not the
noise drawn on leaves, and every device would draw the same noise for its slice.

Tracers: ``init`` may run under `jax.jit`, `jax.shard_map`, `jax.pmap` or
`jax.eval_shape`, where its params are tracers. The probe reads only shapes, dtypes and
labels from the `Layout`, makes its own numpy values, and runs in a worker thread (on
the CPU, with 64-bit types and without jit): JAX keeps its trace and bound axis names
per thread, so the caller's trace and mesh axes stay out. Each run is traced and its
jaxpr evaluated by numpy (`jpack._numpy_eval`), so that the probe compiles nothing
(an operation numpy has no rule for runs in JAX alone); a run that needs values in
Python runs eagerly instead (a lax.cond then runs as Python, without compiling its
branches), as do the recorded runs that name a culprit where the jaxpr has control
flow.

Devices and collectives: two devices are simulated, one after the other, so the verdict
does not depend on the real device count. A collective in the transformation then
raises (no axis is bound); on slices the run is repeated under `jax.vmap` with the axis
name bound, so collectives run for real: a global norm that sums its squares over the
devices passes, a second reduce adds up different slices
and is refused (the reference runs under a vmap of one device, where a collective sees
the whole gradient). Where every device holds the whole gradient (flat, and
data_parallel's other modes) a collective over the axis is refused outright: a second
reduce when it reduces arrays, a statistic that adds up N copies when it reduces
scalars (told apart in the jaxpr from `jax.make_jaxpr` with ``axis_env``).

Miniature: per bucket group (dtype and label) up to four leaves, the largest of each
rank first, at least three (copies of smaller shape if the group has fewer, so that the
verdict holds when the group grows); each keeps its rank, its two largest dims cut to
128 (optax factors moments of dims from 128 on, so such shape-dependent behaviour still
shows), the others to 4. PRNG key and empty leaves are left out. Buckets are packed
without alignment padding, so slices cut across leaves. The cost does not grow with the
model: a few traces of a few updates of small arrays. The verdicts are kept for the
process (the last 64, by optimizer, miniature and target), so ``init`` traced again
(eval_shape, jit), the same step built again, or `jpack.optax.flat`'s own check after
``data_parallel``'s, does not probe again.

What cannot be probed: a transformation that still raises on the miniature tree (one
that needs the loss function, like line searches with ``value_fn=``, or a mask given as
a tree of the params' structure) is refused on slices with the error it raised, runs on
the leaves on buckets (where `jpack.optax.flat` then traces it on the params' shapes and
names what it raises), and is let through on the params tree (data_parallel's other
modes).

Limits: behaviour that the random values never trigger (a threshold above their scale)
is not seen, and a transformation whose result depends on the number of devices is
checked for two.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import sys
import threading
import types
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import optax

from jpack._internal import empty_shape, is_key_dtype
from jpack._labels import labelled, multi_transform, with_extra_args
from jpack._layout import Layout, plan
from jpack._numpy_eval import evaluate

_BIG_DIM = 128  # the two largest dims of a miniature leaf; optax factors from 128 on
_SMALL_DIM = 4  # its other dims
_MIN_LEAVES = 3  # per bucket group, copying leaves if it has fewer
_MAX_LEAVES = 4
_DEVICES = 2  # simulated devices for slices
_VALUES = (1.7, 1.3, 1.5)  # value= (a loss) of each update, where it is needed
_BOOST = 1024.0  # the second update's gradients
_RTOL = 1e-9  # of a leaf's largest magnitude, in float64: rounding, even amplified
_ON = ("buckets", "slices", "owned", "owned_unit", "tree")
_ALLREDUCE = "jpack.optax.allreduce followed by the optimizer on the params tree"
_TARGETS = {"buckets": "buckets (1-D arrays that mix many leaves)",
            "slices": "each device's slice of the buckets",
            "owned": "each device's own whole leaves (the others left empty)",
            "owned_unit": "each device's own whole leaves (the others of one element)",
            "tree": "the params tree"}
_MAX_VERDICTS = 64  # verdicts kept for the process, the least recently used dropped
_ANY_AXIS = object()  # in a verdict's key: it holds for every axis name


class _Leaf(NamedTuple):
  """One leaf of a miniature: what a verdict depends on (hashable)."""
  path: str  # the real leaf it stands for, shown in messages
  shape: tuple[int, ...]
  dtype: np.dtype
  label: str | None  # its bucket group's label


class _Mini(NamedTuple):
  """A miniature params tree with its inputs: a dict keyed "000", "001", ..."""
  spec: tuple[_Leaf, ...]
  shown: dict[str, str]  # key -> the path shown in messages
  layout: Layout  # its buckets, without alignment padding
  params: dict[str, np.ndarray]
  grads: tuple[dict[str, np.ndarray], ...]  # one per update


class _Refusal(NamedTuple):
  """Why a transformation cannot run where jpack would run it."""
  name: str  # the transformation
  reason: str
  advice: str | None  # None: the caller's alternatives
  cause: BaseException | None
  leaves: bool = False  # on the params tree it runs as optax runs it
  collective: bool = False  # found by a collective over the axis: depends on its name


class _PerDevice:
  """Stands for a value that differs between the simulated devices."""


def checker(inner: Any, *, on: str, where: str, axis_name: Any = None,
            instead: str = _ALLREDUCE) -> Callable[[Layout], str | None]:
  """A function that probes ``inner`` for a params `Layout`: where it may run.

  Args:
    inner: an optax transformation, or a dict ``{label: transformation}`` selected by
      the layout's bucket labels (as `jpack.optax.flat` does).
    on: where jpack runs it: ``"buckets"`` (whole buckets, every device holds the whole
      gradient; what buckets would change runs on the leaves instead), ``"slices"``
      (each device's slice, over ``axis_name``; what slices would change runs on the
      devices' own leaves instead), ``"owned"`` (each device's own whole leaves, as
      `jpack._owned.on_owned` runs it; ``"owned_unit"``: with one-element stand-ins
      for the other leaves), or ``"tree"`` (on the params tree, where only
      collectives over the axis are checked).
    where: for messages, e.g. ``"inside jpack.optax.flat"``.
    axis_name: the data-parallel axis (bound on slices, refused elsewhere).
    instead: for messages: what runs the optimizer on the params tree.

  Returns:
    ``check(layout, name=None)``, which raises `TypeError` if ``inner`` cannot run there (it
    computes something else on owned leaves than on the params tree; a collective over
    the axis where every device holds the whole gradient). On ``"buckets"`` and
    ``"slices"`` it returns, when they would change the result but the params tree does
    not, the name of the transformation that differs (``inner`` must then run on the
    leaves, or on owned leaves), else None.
    ``name`` replaces the transformation named in the error (the culprit another probe
    found). Verdicts are kept for the process (`_cached_verdict`).
  """
  if on not in _ON:
    raise ValueError(f"on must be one of {_ON}, got {on!r}.")
  default = (f"Use jpack.optax.partition(transforms, labels) for masks (optax.clip_by_global_norm runs in "
             f"every mode), or {instead}.")
  if on.startswith("owned"):
    default = ("ZeRO-1 (jpack.optax.sharded, data_parallel(mode='sharded')) runs a "
               "transformation that needs whole leaves on each device's own leaves, but this "
               "one needs more than a device's own leaves. Use mode='packed' or "
               "jpack.optax.flat, which run it on all the leaves and give optax's result; "
               "clip by the global norm with optax.clip_by_global_norm(max_norm) first in "
               "the chain (not inside inject_hyperparams, where jpack cannot see it); give "
               "a mask as a function of the params (mask=lambda params: ...), which the "
               "probe can run on a miniature.")

  def check(layout: Layout, name: str | None = None) -> str | None:
    spec = _miniature(layout)
    if not spec:
      return None
    refusal = _cached_verdict(inner, spec, on, axis_name)
    if refusal is None:
      return None
    if on in ("buckets", "slices") and refusal.leaves:
      return refusal.name
    raise TypeError(f"{name or refusal.name} cannot run {where}: {refusal.reason} "
                    f"{refusal.advice or default}") from refusal.cause

  return check


class Recent:
  """Values kept for the process, the least recently used dropped beyond ``limit``:
  the probe's verdicts (keyed by the optimizer's `identity`, the miniature, the target
  and the axis name), and `jpack.optax.flat`'s checks that passed. Thread-safe."""

  def __init__(self, limit: int):
    self.limit = limit
    self.kept: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    self.lock = threading.Lock()

  def get(self, keys: tuple[Any, ...]) -> tuple[bool, Any]:
    """(found, value) for the first of ``keys`` kept."""
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


_VERDICTS = Recent(_MAX_VERDICTS)


def _cached_verdict(inner: Any, spec: tuple[_Leaf, ...], on: str,
                    axis_name: Any) -> _Refusal | None:
  """`_verdict`, probed once per optimizer, miniature, target and axis name in the
  process. The axis name matters on slices (it is bound there) and to a collective's
  refusal; any other verdict holds for every axis name, so ``data_parallel``'s check
  and ``flat``'s (which knows no axis) share it."""
  base = (identity(inner), spec, on)
  try:
    hash(base + (axis_name,))
  except TypeError:  # an unhashable part (a transformation object of the user's own)
    return _in_worker(lambda: _verdict(inner, spec, on, axis_name))
  found, verdict = _VERDICTS.get((base + (axis_name,), base + (_ANY_AXIS,)))
  if found:
    return verdict
  verdict = _in_worker(lambda: _verdict(inner, spec, on, axis_name))
  exact = on in ("slices", "owned", "owned_unit") or (verdict is not None and verdict.collective)
  _VERDICTS.put(base + (axis_name if exact else _ANY_AXIS,), verdict)
  return verdict


def identity(inner: Any) -> Any:
  """A hashable stand-in for ``inner`` equal only to itself. An optax transformation is
  a pair of closures, so two ``adam(1e-3)`` are not equal, and its hyperparameters may
  be arrays or functions: its ``init`` and ``update`` are compared by identity (the key
  keeps them alive, so no other function takes their ids while the verdict is kept). A
  dict of transformations by label: its items."""
  if isinstance(inner, Mapping):
    return tuple((label, identity(tx)) for label, tx in inner.items())
  init, update = getattr(inner, "init", None), getattr(inner, "update", None)
  if init is None or update is None:
    return inner
  return (type(inner), init, update)


def refused(error: BaseException, inner: Any, where: str, when: str) -> TypeError:
  """The `TypeError` for an ``error`` that ``inner`` raised in ``when`` (``"init"`` or
  ``"update"``) on the real params: it names the innermost transformation that raised
  and what to do."""
  name = _raiser(error)
  if name == "The optimizer":
    name = described(inner)
  message = (str(error).splitlines() or [""])[0][:300].rstrip(".")
  return TypeError(
      f"{name} cannot run {where}: its {when} raised {type(error).__name__}: {message}. "
      "It may need the loss function (value_fn=, grad_fn=: line searches, SAM's opaque "
      "mode) or arguments for another params tree (a mask or labels given as a tree must "
      "have the params' structure). Check it on the params tree with plain optax first; "
      "if it runs there, please report this with the optimizer.")


def _in_worker(fn: Callable[[], Any]) -> Any:
  """``fn()`` in a fresh thread, on the CPU where there is one (the probe's small arrays
  need no accelerator), with 64-bit types: no trace or bound axis of the caller's
  reaches it."""
  try:
    device = jax.local_devices(backend="cpu")[0]
  except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu): the default device
    device = None

  def run():
    # Without jit, a lax.cond or scan runs as Python on concrete values instead of
    # compiling each of its bodies, and the calls inside them are recorded like others.
    with jax.enable_x64(True), jax.default_device(device), jax.disable_jit():
      return fn()

  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jpack-probe") as pool:
    return pool.submit(run).result()


# -- the miniature ---------------------------------------------------------------------


def _miniature(layout: Layout) -> tuple[_Leaf, ...]:
  groups: dict[Any, list] = {}
  for slot in layout.slots:
    if slot.size and not is_key_dtype(slot.dtype):
      groups.setdefault(layout.buckets[slot.bucket].group, []).append(slot)
  leaves: list[_Leaf] = []
  for (_, label), slots in groups.items():
    slots.sort(key=lambda s: -s.size)
    by_rank = {len(s.shape): s for s in reversed(slots)}  # the largest of each rank
    chosen = sorted(by_rank.values(), key=lambda s: -s.size)[:_MAX_LEAVES]
    chosen += [s for s in slots if s not in chosen][:max(0, _MIN_LEAVES - len(chosen))]
    group = [_Leaf(s.path, _small(s.shape), _probed_dtype(s.dtype), label) for s in chosen]
    while len(group) < _MIN_LEAVES:
      last = group[-1]
      group.append(last._replace(path=f"{last.path} (a copy)",
                                 shape=tuple(max(1, d // 2) for d in last.shape)))
    leaves += group
  return tuple(leaves)


def _probed_dtype(dtype: Any) -> np.dtype:
  """float64 (complex128) for every float: a global norm summed by leaf or by bucket
  rounds differently, and in a narrower type that rounding, amplified by a
  cancellation, could hide a difference as small as a weight decay's."""
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return np.dtype(np.complex128)
  if jnp.issubdtype(dtype, jnp.floating):
    return np.dtype(np.float64)
  return dtype


def _small(shape: tuple[int, ...]) -> tuple[int, ...]:
  big = sorted(range(len(shape)), key=lambda i: -shape[i])[:2]
  return tuple(min(d, _BIG_DIM if i in big else _SMALL_DIM) for i, d in enumerate(shape))


def _build(spec: tuple[_Leaf, ...], devices: int) -> _Mini:
  keys = [f"{i:03d}" for i in range(len(spec))]
  structs = {k: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for k, leaf in zip(keys, spec)}
  label_of = {jax.tree_util.keystr((jax.tree_util.DictKey(k),)): leaf.label
              for k, leaf in zip(keys, spec)}
  layout = plan(structs, group_fn=lambda path, _: label_of[path], align_bytes=1,
                bucket_bytes=2**40, max_leaves=None, solo_bytes=None, num_shards=devices)
  rng = np.random.default_rng(0)
  params = {k: _random(rng, leaf) for k, leaf in zip(keys, spec)}
  grads = tuple({k: _random(rng, leaf, boost) for k, leaf in zip(keys, spec)}
                for boost in (False, True, False))
  inexact = [k for k, leaf in zip(keys, spec) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
  if inexact:
    grads[2][inexact[0]].reshape(-1)[0] = np.nan
  return _Mini(spec, {k: leaf.path for k, leaf in zip(keys, spec)}, layout, params, grads)


def _random(rng: np.random.Generator, leaf: _Leaf, boost: bool = False) -> np.ndarray:
  """Random values of ``leaf``'s shape and dtype, at a scale of their own."""
  dtype, shape = leaf.dtype, leaf.shape
  if jnp.issubdtype(dtype, jnp.inexact):
    scale = 2.0 ** rng.uniform(-2, 2) * (_BOOST if boost else 1.0)
    x = rng.standard_normal(shape) * scale
    if jnp.issubdtype(dtype, jnp.complexfloating):
      x = x + 1j * rng.standard_normal(shape) * scale
  elif dtype == np.bool_:
    x = rng.random(shape) < 0.5
  elif jnp.issubdtype(dtype, jnp.unsignedinteger):
    x = rng.integers(0, 4, shape)
  else:
    x = rng.integers(-3, 4, shape)
  return np.array(x).astype(dtype)


def _buckets(tree: dict[str, np.ndarray], layout: Layout, devices: int) -> tuple:
  """``tree`` packed into ``layout``'s buckets, each split into ``devices`` rows (if
  any)."""
  buckets = [np.zeros(b.size, b.dtype) for b in layout.buckets]
  for key, slot in zip(sorted(tree), layout.slots):
    buckets[slot.bucket][slot.offset:slot.offset + slot.size] = tree[key].reshape(-1)
  return tuple(b.reshape(devices, -1) if devices else b for b in buckets)


# -- running the transformation --------------------------------------------------------


def _transformations(inner: Any, mini: _Mini):
  """(``inner`` on the miniature tree, ``inner`` as jpack runs it on its buckets), or
  None when a bucket label has no transformation (``init`` names it)."""
  if not isinstance(inner, Mapping):
    return with_extra_args(inner), labelled(inner, mini.layout)
  key_of = {str(k): k for k in inner}
  if any(str(leaf.label) not in key_of for leaf in mini.spec):
    return None
  labels = {k: key_of[str(leaf.label)] for k, leaf in zip(sorted(mini.params), mini.spec)}
  return multi_transform(inner, labels), labelled(inner, mini.layout)


def _steps(tx: Any, params: Any, grads: tuple, extra: bool) -> tuple[list, Any]:
  """``init`` and one ``update`` per gradient, applying each: (updates, last state)."""
  state = tx.init(params)
  updates = []
  for g, value in zip(grads, _VALUES):
    u, state = tx.update(g, state, params, **({"value": jnp.float32(value)} if extra else {}))
    updates.append(u)
    params = optax.apply_updates(params, u)
  return updates, state


class _Run(NamedTuple):
  """One probe run: `_steps` of ``tx``, directly (``devices == 0``) or on each of
  ``devices`` simulated devices (the inputs' leading axis): one after the other, or with
  ``axis_name`` under a vmap that binds it for collectives."""
  tx: Any
  params: Any
  grads: tuple
  extra: bool  # pass value=
  devices: int
  axis_name: Any


def _run(run: _Run, record: bool = False) -> tuple[Any, list]:
  """((updates, state), and with ``record`` each recorded call's ((names, state type,
  state holds a key), (input updates, output updates, output state)))."""
  calls: list = []

  def one(params, grads):
    def steps(params, grads):
      if not record:
        return _steps(run.tx, params, grads, run.extra), []
      with _Recorder() as recorder:
        out = _steps(run.tx, params, grads, run.extra)
      recorded[:] = recorder.calls  # of the last run (a trace, and maybe the call)
      return out, recorder.values

    recorded: list = []
    out, values = evaluate(steps, params, grads, branches=not record)
    if not calls:
      calls.extend(recorded)
    return _arrays(out), _arrays(values)

  if not run.devices:
    out, values = one(run.params, run.grads)
  elif run.axis_name is None:
    out, values = _stacked([one(*jax.tree.map(lambda x: x[d], (run.params, run.grads)))
                            for d in range(run.devices)])
  else:
    out, values = jax.vmap(one, axis_name=run.axis_name,
                           axis_size=run.devices)(run.params, run.grads)
  return out, list(zip(calls, values))


def _stacked(trees: list) -> Any:
  """The devices' values, stacked as a vmap would return them (PRNG keys as their
  data)."""
  def stack(*xs):
    return np.stack([np.asarray(jax.random.key_data(x) if is_key_dtype(x.dtype) else x)
                     for x in xs])
  return jax.tree.map(stack, *trees)


def _arrays(tree: Any) -> Any:
  """``tree`` with every leaf that is not an array (a Python number) made None."""
  return jax.tree.map(lambda x: x if isinstance(x, (jax.Array, np.ndarray, np.generic))
                      else None, tree)


class _Recorder:
  """While active, records every call of a transformation's ``update`` made at the
  probe's own trace level (not inside a jaxpr being traced, as a lax.cond's under vmap):
  its name and those of the calls around it, its input updates, its output updates and
  state."""

  def __init__(self):
    self.calls: list[tuple[tuple[str, ...], str, bool]] = []
    self.values: list[tuple[Any, Any, Any]] = []
    self._stack: list[tuple[str, Any]] = []

  def __enter__(self):
    self._trace = jax_core.get_opaque_trace_state(convention="jpack")
    self._previous = sys.getprofile()
    sys.setprofile(self._event)
    return self

  def __exit__(self, *exc_info):
    sys.setprofile(self._previous)

  def _event(self, frame: types.FrameType, event: str, arg: Any) -> None:
    if event not in ("call", "return") or not _is_update(frame.f_code):
      return
    if event == "call":
      name = _name(frame.f_globals.get("__name__", ""), frame.f_code.co_qualname)
      self._stack.append((name, frame.f_locals.get(_arguments(frame.f_code)[0])))
      return
    name, inputs = self._stack.pop()
    same_trace = jax_core.get_opaque_trace_state(convention="jpack") == self._trace
    if same_trace and isinstance(arg, tuple) and len(arg) == 2:
      state = arg[1]
      keys = any(is_key_dtype(getattr(x, "dtype", np.float32))
                 for x in jax.tree.leaves(state))
      self.calls.append((tuple(n for n, _ in self._stack) + (name,), type(state).__name__,
                         keys))
      self.values.append((inputs, arg[0], state))


def _arguments(code: types.CodeType) -> tuple[str, ...]:
  args = code.co_varnames[:code.co_argcount]
  return args[1:] if args[:1] == ("self",) else args


def _is_update(code: types.CodeType) -> bool:
  """An ``update(updates, state, ...)`` (or ``opt_state``; the first argument may have
  any name)."""
  return any(a.endswith("state") for a in _arguments(code)[1:2])


def _is_transform(code: types.CodeType) -> bool:
  return _is_update(code) or (code.co_name in ("init", "init_fn")
                              and _arguments(code)[:1] == ("params",))


# -- the verdict -----------------------------------------------------------------------


def _verdict(inner: Any, spec: tuple[_Leaf, ...], on: str, axis_name: Any) -> _Refusal | None:
  if on.startswith("owned"):
    return _owned_verdict(inner, spec, axis_name, unit=on == "owned_unit")
  devices = _DEVICES if on == "slices" else 0
  mini = _build(spec, max(devices, 1))
  txs = _transformations(inner, mini)
  if txs is None:
    return None
  tree_tx, bucket_tx = txs
  want_run, want = _reference(tree_tx, mini, on, axis_name)
  if want_run is None:
    if isinstance(want, NameError):
      return _collective(want, tree_tx, mini, on, axis_name)._replace(collective=True)
    if on == "tree":
      return None
    # It needs something of the real params (a mask given as a tree): on the leaves it
    # gets them, as in optax, and its errors are named there if it still raises.
    return _raised(want, on, "on a small params tree of its own")._replace(
        leaves=on in ("buckets", "slices"))
  if on == "tree":
    return None
  got_run = _Run(bucket_tx, _buckets(mini.params, mini.layout, devices),
                 tuple(_buckets(g, mini.layout, devices) for g in mini.grads),
                 want_run.extra, devices, None)
  try:
    try:
      got, _ = _run(got_run)
    except NameError:
      if not devices:
        raise
      got_run = got_run._replace(axis_name=axis_name)  # a collective: bind the axis
      got, _ = _run(got_run)
  except NameError as e:
    return _collective(e, tree_tx, mini, on, axis_name)._replace(collective=True)
  except Exception as e:  # noqa: BLE001 - named in the refusal
    return _raised(e, on, f"on {_TARGETS[on]}, though not on the params tree,")._replace(
        leaves=on in ("buckets", "slices"))
  found = _compare(want, got, mini, want_run.devices, devices)
  if found is None:
    return None
  # On slices, even with the axis bound (a chain may hold a collective and a part that
  # needs whole leaves): the parts are probed on owned leaves, which refuse collectives.
  return _differs(found, _culprit(want_run, got_run, mini), on, described(inner),
                  got_run.axis_name)._replace(leaves=on in ("buckets", "slices"))


def _owned_verdict(inner: Any, spec: tuple[_Leaf, ...], axis_name: Any,
                   unit: bool) -> _Refusal | None:
  """The verdict on owned leaves: each simulated device runs ``inner`` on the miniature
  tree in which it owns every other leaf (the rest empty, as `jpack._owned` runs it),
  one device after the other, without an axis (the owned code runs no collective); the
  owners' updates of every step must be the tree's, and so must each device's final
  state outside the other device's leaves (`_owned_state_difference`)."""
  mini = _build(spec, 1)
  txs = _transformations(inner, mini)
  if txs is None:
    return None
  tree_tx = txs[0]
  on = "owned_unit" if unit else "owned"
  want_run, want = _reference(tree_tx, mini, on, axis_name)
  if want_run is None:
    if isinstance(want, NameError):
      return _owned_collective(want)
    return _raised(want, on, "on a small params tree of its own")
  keys = sorted(mini.params)
  owner = {k: i % _DEVICES for i, k in enumerate(keys)}

  def mine(tree, d):
    return {k: x if owner[k] == d else np.ones(empty_shape(x.shape, unit), x.dtype)
            for k, x in tree.items()}

  got = []
  for d in range(_DEVICES):
    run = _Run(tree_tx, mine(mini.params, d), tuple(mine(g, d) for g in mini.grads),
               want_run.extra, 0, None)
    try:
      got.append(_run(run)[0])
    except NameError as e:
      return _owned_collective(e)
    except Exception as e:  # noqa: BLE001 - named in the refusal
      return _raised(e, on, f"on {_TARGETS[on]}, though not on the params tree,")
  for step, updates in enumerate(want[0]):
    merged = {k: got[owner[k]][0][step][k] for k in keys}
    found = _difference(updates, merged, mini, f"update {step + 1}")
    if found:
      return _differs(found, None, on, described(inner), None)
  for d, (_, state) in enumerate(got):
    found = _owned_state_difference(want[1], state, {k for k in keys if owner[k] != d}, mini)
    if found:
      return _differs(found, None, on, described(inner), None)
  return None


def _owned_state_difference(want: Any, got: Any, others: set[str], mini: _Mini) -> str | None:
  """How a device's final state differs from the tree's, leaving out what belongs to
  leaves it does not own (a path through one of their keys): every other value (step
  counts, a norm kept in the state) must be the tree's."""
  leaf = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  if jax.tree.structure(want, is_leaf=leaf) != jax.tree.structure(got, is_leaf=leaf):
    return None  # decided by the stand-ins' shapes: what differs shows in the updates

  def comparable(path, x):  # what is another device's stands masked on both sides
    if any(isinstance(k, jax.tree_util.DictKey) and k.key in others for k in path):
      return optax.MaskedNode()
    return x if leaf(x) or not is_key_dtype(x.dtype) else jax.random.key_data(x)

  return _difference(*(jax.tree_util.tree_map_with_path(comparable, t, is_leaf=leaf)
                       for t in (want, got)), mini, "the final state")


def _owned_collective(error: NameError) -> _Refusal:
  return _Refusal(_raiser(error), (
      f"it runs a collective over a mesh axis ({error}), and slices would change its "
      "result, but on ZeRO-1 a transformation that needs whole leaves runs on each "
      "device's own leaves, without collectives."),
      "Reduce nothing inside jpack.optax.sharded, which reduce-scatters the gradient "
      "itself; clip by the global norm with optax.clip_by_global_norm(max_norm) in the "
      "chain, which jpack computes on the slices.", error)


def _reference(tx: Any, mini: _Mini, on: str, axis_name: Any) -> tuple[Any, Any]:
  """(run, output) of ``tx`` on the miniature tree, or (None, the error it raised).

  Tried without extra arguments, then with value=; on slices, where a collective over
  the axis is allowed, under a vmap of one device that binds it if it needs it."""
  error = None
  for extra in (False, True):
    for devices in ((0, 1) if on == "slices" else (0,)):
      params, grads = ((mini.params, mini.grads) if devices == 0 else
                       jax.tree.map(lambda x: x[None], (mini.params, mini.grads)))
      run = _Run(tx, params, grads, extra, devices, axis_name if devices else None)
      try:
        return run, _run(run)[0]
      except NameError as e:  # an unbound axis: bind it if allowed
        error = e
      except Exception as e:  # noqa: BLE001 - named in the refusal
        error = e
        break
  return None, error


def _compare(want: Any, got: Any, mini: _Mini, want_devices: int,
             devices: int) -> str | None:
  """Where a run on buckets differs from the run on the tree (None: nowhere)."""
  want = _as_tree(want, mini, want_devices, buckets=False)
  got = _as_tree(got, mini, devices, buckets=True)
  for k, (a, b) in enumerate(zip(want[0], got[0])):
    found = _difference(a, b, mini, f"update {k + 1}")
    if found:
      return found
  return _difference(want[1], got[1], mini, "the final state")


class _Call(NamedTuple):
  """A recorded call of a transformation's update, in both runs."""
  names: tuple[str, ...]  # its transformation and those around it, outermost first
  state_type: str
  keys: bool  # its state holds a PRNG key
  want: tuple  # (input updates, output updates, output state) on the tree
  got: tuple  # the same on buckets, as the tree holds them


def _culprit(want_run: _Run, got_run: _Run,
             mini: _Mini) -> tuple[_Call, str, list[str]] | None:
  """The innermost recorded call whose input updates agree but whose output updates or
  state do not, how they differ, and the non-transparent calls around it."""
  try:
    (_, want), (_, got) = _run(want_run, record=True), _run(got_run, record=True)
  except Exception:  # noqa: BLE001 - the refusal then names no transformation
    return None
  calls = []
  for (call, a), (other, b) in zip(want, got):
    if call[0] != other[0]:  # the runs took different paths from here
      return _Call(*other, (), ()), "", []
    calls.append(_Call(*call, _as_tree(a, mini, want_run.devices, buckets=False),
                       _as_tree(b, mini, got_run.devices, buckets=True)))
  for i, call in enumerate(calls):
    if _difference(call.want[0], call.got[0], mini, "") is not None:
      continue  # fed other updates: it only passes a difference on
    found = (_difference(call.want[1], call.got[1], mini, "its update")
             or _difference(call.want[2], call.got[2], mini, "its state"))
    if found:
      return call, found, _around(calls, i, mini)
  return None


def _around(calls: list[_Call], i: int, mini: _Mini) -> list[str]:
  """The names of the calls ``calls[i]`` runs inside, outermost first, leaving out
  wrappers that pass their inner call's updates through unchanged."""
  names, inner, out = calls[i].names, calls[i], []
  for call in calls[i + 1:]:
    if len(call.names) < len(inner.names) and call.names == names[:len(call.names)]:
      same = all(_difference(call.got[k], inner.got[k], mini, "") is None for k in (0, 1))
      if not same:
        out.append(call.names[-1])
      inner = call
  return out[::-1]


def described(inner: Any) -> str:
  """``inner``'s factory (e.g. ``optax.apply_if_finite``), or "The optimizer"."""
  update = getattr(inner, "update", None)
  code = getattr(getattr(update, "__func__", update), "__code__", None)
  if code is None or isinstance(inner, Mapping):
    return "The optimizer"
  return _name(getattr(update, "__module__", "") or "", code.co_qualname)


def _differs(found: str, culprit: Any, on: str, described: str,
             collective: Any) -> _Refusal:
  target = _TARGETS[on]
  name, context, keys = described, "", False
  if culprit is not None:
    call, detail, around = culprit
    name, keys, found = call.names[-1], call.keys, detail or found
    if around:
      context = f"; it runs inside {' > '.join(around)}"
    if call.state_type not in ("EmptyState", "tuple", "NoneType", "dict", "list"):
      article = "an" if call.state_type[:1] in "AEIOU" else "a"
      context += f"; it keeps {article} {call.state_type}"
  if collective is not None:
    why = (f"It runs a collective over {collective!r}: on slices a reduce adds up different "
           "parts of the gradient (the gradient is reduced already), and a statistic is "
           "right only if it combines the devices' parts into the whole gradient's.")
  elif keys:
    why = (f"It draws random numbers from a key in its state: on {target} it draws other "
           "numbers than on the leaves" + ("; every device would draw the same numbers "
                                            "for its own slice." if on == "slices" else "."))
  elif on.startswith("owned"):
    why = ("It reads more than each leaf on its own (statistics of the whole gradient, "
           "or of several leaves), which a device that owns only some leaves does not "
           "have.")
  else:
    whole = (", or statistics of the whole gradient, which a slice does not have"
             if on == "slices" else "")
    why = ("It is not elementwise: it reads each leaf's shape or values (per-leaf norms, "
           f"masks, factored moments){whole}.")
  return _Refusal(name, f"on {target}, {found}, compared with the params tree (a "
                  f"probe of three updates on random values{context}). {why}", None, None)


def _raised(error: BaseException, on: str, where: str) -> _Refusal:
  message = (str(error).splitlines() or [""])[0][:300]
  reason = (f"{where} it raised {type(error).__name__}: {message.rstrip('.')}. A "
            "transformation that needs the loss function (value_fn=, grad_fn=: line "
            "searches, SAM's opaque mode) or the params' tree structure (a mask or labels "
            f"given as a tree) cannot run on {_TARGETS[on]}.")
  return _Refusal(_raiser(error), reason, None, error)


def _raiser(error: BaseException) -> str:
  """The innermost transformation in ``error``'s traceback."""
  name, tb = "The optimizer", error.__traceback__
  while tb is not None:
    # jpack._labels only runs the user's transformations, on buckets or on the leaves.
    if (_is_transform(tb.tb_frame.f_code)
        and tb.tb_frame.f_globals.get("__name__") != "jpack._labels"):
      frame = tb.tb_frame
      name = _name(frame.f_globals.get("__name__", ""), frame.f_code.co_qualname)
    tb = tb.tb_next
  return name


# -- collectives -----------------------------------------------------------------------


def _collective(error: NameError, tx: Any, mini: _Mini, on: str,
                axis_name: Any) -> _Refusal:
  """The refusal of a transformation that runs a collective where none is bound."""
  found = None
  for extra in ((False, True) if axis_name is not None and on != "slices" else ()):
    try:
      jaxpr = jax.make_jaxpr(lambda: _steps(tx, mini.params, mini.grads, extra),
                             axis_env=[(axis_name, _DEVICES)])()
    except Exception:  # noqa: BLE001 - another axis (or value= needed): tried below
      continue
    found = [e for e in _equations(jaxpr.jaxpr) if _names_axis(e.params, axis_name)]
    break
  if not found:
    return _Refusal(_raiser(error), (
        f"it runs a collective over a mesh axis ({error}), but it would run on gradients "
        "that are already reduced, which every device holds whole."),
        "Reduce before the optimizer instead: optax.chain(jpack.optax.allreduce("
        "axis_name), jpack.optax.flat(optimizer)), or jpack.optax.sharded(optimizer, "
        "axis_name) for ZeRO-1.", error)
  arrays = [e for e in found if any(math.prod(getattr(v.aval, "shape", ())) > 1
                                    for v in e.invars)]
  # Named from the error's traceback: the source of an equation keeps too few frames.
  name, prim = _raiser(error), (arrays or found)[0].primitive.name
  if arrays:
    return _Refusal(name, (
        f"it reduces the gradient over {axis_name!r} ({prim}), which is already reduced "
        "there: a second reduce wastes collectives (mean) or multiplies the gradient by "
        "the number of devices (sum)."), "Pass the optimizer without it.", error)
  return _Refusal(f"{name}(..., {axis_name!r})", (
      f"it computes a statistic over {axis_name!r} ({prim}), but every device holds the "
      "whole gradient there, so the devices' copies add up (a global norm comes out "
      "sqrt(N) times too big)."),
      "Leave the axis out (optax.clip_by_global_norm(max_norm) computes the right norm "
      "in every mode): an axis is right only on ZeRO-1 slices.", error)


def _equations(jaxpr: Any):
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (tuple, list)) else (value,)):
        if isinstance(sub, jax_core.ClosedJaxpr):
          yield from _equations(sub.jaxpr)
        elif isinstance(sub, jax_core.Jaxpr):
          yield from _equations(sub)


def _names_axis(params: Mapping[str, Any], axis_name: Any) -> bool:
  def names(value):
    try:
      return value == axis_name or (isinstance(value, (tuple, list, frozenset))
                                    and axis_name in value)
    except Exception:  # noqa: BLE001 - an array parameter: not an axis
      return False
  return any(names(v) for v in params.values())


def _name(module: str, qualname: str) -> str:
  """``optax.scale_by_adam`` for the code of ``scale_by_adam.<locals>.update_fn`` in
  ``optax._src.transform``: its factory, under the shortest public module that has it."""
  factory = qualname.split(".")[0]
  top = sys.modules.get(module.split(".")[0])
  spaces = [top] + [m for k, m in sorted(vars(top).items()) if isinstance(m, types.ModuleType)
                    and not k.startswith("_")] if top is not None else []
  for space in spaces:
    if getattr(getattr(space, factory, None), "__module__", None) == module:
      return f"{space.__name__}.{factory}"
  return f"{module}.{factory}" if module else factory


# -- comparing -------------------------------------------------------------------------


def _as_tree(value: Any, mini: _Mini, devices: int, *, buckets: bool) -> Any:
  """A run's value as the run on the tree holds it.

  With ``buckets``, every tuple of buckets (or of slices, one row per device) is
  unpacked into the miniature's leaves, along its last axis (a history of updates
  stacked in front stays in front). With ``devices`` (a leading device axis), every
  other array is the first device's, or `_PerDevice` where the devices differ."""
  sizes = [b.size for b in mini.layout.buckets]

  def fits(a, size):
    shape = tuple(getattr(a, "shape", ()))
    if devices:
      return len(shape) >= 2 and shape[0] == devices and shape[-1] * devices == size
    return len(shape) >= 1 and shape[-1] == size

  def is_buckets(x):
    return (buckets and isinstance(x, tuple) and len(x) == len(sizes) and all(
        isinstance(a, optax.MaskedNode) or fits(a, s) for a, s in zip(x, sizes)))

  def whole(a, size):  # a device axis in front becomes part of the last one
    a = np.asarray(a)
    return np.moveaxis(a, 0, -2).reshape(a.shape[1:-1] + (size,)) if devices else a

  def convert(x):
    if is_buckets(x):
      return _unpacked(tuple(a if isinstance(a, optax.MaskedNode) else whole(a, s)
                             for a, s in zip(x, sizes)), mini)
    if isinstance(x, optax.MaskedNode):
      return x
    x = np.asarray(jax.random.key_data(x) if is_key_dtype(x.dtype) else x)
    if not devices:
      return x
    if any(_mismatch(x[0], x[i]) for i in range(1, devices)):
      return _PerDevice()
    return x[0]

  return jax.tree.map(convert, value,
                      is_leaf=lambda x: is_buckets(x) or isinstance(x, optax.MaskedNode))


def _unpacked(buckets: tuple, mini: _Mini) -> dict[str, Any]:
  out = {}
  for key, slot in zip(sorted(mini.params), mini.layout.slots):
    bucket = buckets[slot.bucket]
    if isinstance(bucket, optax.MaskedNode):
      out[key] = bucket
    else:
      part = bucket[..., slot.offset:slot.offset + slot.size]
      out[key] = part.reshape(bucket.shape[:-1] + slot.shape)
  return out


def _difference(want: Any, got: Any, mini: _Mini, what: str) -> str | None:
  """How ``got`` differs from ``want`` (a sentence starting with ``what``), or None."""
  leaf = lambda x: isinstance(x, (optax.MaskedNode, _PerDevice))  # noqa: E731
  a, a_def = jax.tree_util.tree_flatten_with_path(want, is_leaf=leaf)
  b, b_def = jax.tree_util.tree_flatten_with_path(got, is_leaf=leaf)
  if a_def != b_def:
    pair = next(((p, q) for (p, _), (q, _) in zip(a, b) if p != q), None)
    if pair is None:
      return f"{what} has {len(b)} arrays where the params tree's has {len(a)}"
    return (f"{what} has another structure: {_shown(pair[1], mini) or 'the root'} where "
            f"the params tree's has {_shown(pair[0], mini) or 'the root'}")
  for (path, x), (_, y) in zip(a, b):
    at = f"{what} at {_shown(path, mini)}" if path else what
    if isinstance(y, _PerDevice):
      return f"{at} differs between the devices"
    if isinstance(x, optax.MaskedNode) != isinstance(y, optax.MaskedNode):
      return f"{at} is {'not ' if isinstance(x, optax.MaskedNode) else ''}masked"
    if isinstance(x, optax.MaskedNode):
      continue
    if np.shape(x) != np.shape(y):
      return f"{at} has shape {np.shape(y)} where the params tree's has {np.shape(x)}"
    found = _mismatch(x, y)
    if found:
      return f"{at} {found}"
  return None


def _shown(path: tuple, mini: _Mini) -> str:
  return "".join(mini.shown[k.key] if isinstance(k, jax.tree_util.DictKey)
                 and k.key in mini.shown else jax.tree_util.keystr((k,)) for k in path)


def _mismatch(want: Any, got: Any) -> str | None:
  """How ``got`` differs from ``want`` beyond rounding, or None."""
  a, b = np.asarray(want), np.asarray(got)
  inexact = [d for d in (a.dtype, b.dtype) if jnp.issubdtype(d, jnp.inexact)]
  if not inexact:
    if np.array_equal(a, b):
      return None
    return f"differs (by up to {np.max(np.abs(a.astype(np.int64) - b.astype(np.int64)))})"
  wide = np.complex128 if any(jnp.issubdtype(d, jnp.complexfloating) for d in inexact) \
      else np.float64
  a, b = a.astype(wide), b.astype(wide)
  if not np.array_equal(np.isnan(a), np.isnan(b)):
    return "is NaN where the params tree's is not (or the other way round)"
  infinite = np.isinf(a) | np.isinf(b)
  if not np.array_equal(a[infinite], b[infinite]):
    return "is infinite where the params tree's is not (or the other way round)"
  finite = np.isfinite(a)
  if not finite.any():
    return None
  err = float(np.max(np.abs(a[finite] - b[finite])))
  scale = float(np.max(np.abs(a[finite])))
  if err <= _RTOL * scale:
    return None
  return f"differs by up to {err:.3g} (the largest magnitude there is {scale:.3g})"
