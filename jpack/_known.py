"""The optax transformations jpack knows, by their update function: where each may run.

What is not in the table is probed (`jpack._probe`). Wrappers (chain, masked, MultiSteps,
...) are read through: their verdict is the worst of their own and their inner ones'.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any, Callable, NamedTuple

import optax

OK, LEAVES, REFUSE = 0, 1, 2  # per target: runs there / needs whole leaves / refused


class Kind(NamedTuple):
  """The outcome of running a transformation on each target (see `jpack._probe`)."""
  buckets: int
  slices: int
  owned: int
  owned_unit: int
  tree: int = OK


ELEMENTWISE = Kind(OK, OK, OK, OK)
PER_LEAF = Kind(LEAVES, LEAVES, OK, OK)  # its own leaves suffice
PER_LEAF_UNIT = Kind(LEAVES, LEAVES, REFUSE, OK)  # needs non-empty stand-ins (a max, a dim)
WHOLE = Kind(OK, LEAVES, REFUSE, REFUSE)  # sums, maxima or dots over the whole gradient
COLLECTIVE = Kind(REFUSE, REFUSE, REFUSE, REFUSE, REFUSE)

_TABLE: dict[str, dict[Kind, tuple[str, ...]]] = {
    "optax._src.base": {ELEMENTWISE: ("identity", "set_to_zero")},
    "optax._src.factorized": {PER_LEAF: ("scale_by_factored_rms",)},
    "optax._src.transform": {
        ELEMENTWISE: (
            "apply_every", "scale", "scale_by_adadelta", "scale_by_adam", "scale_by_adamax",
            "scale_by_adan", "scale_by_amsgrad", "scale_by_belief", "scale_by_lion",
            "scale_by_optimistic_gradient", "scale_by_radam", "scale_by_rms",
            "scale_by_rprop", "scale_by_rss", "scale_by_schedule", "scale_by_sign",
            "scale_by_stddev", "scale_by_yogi"),
        PER_LEAF: ("centralize", "scale_by_novograd", "scale_by_param_block_norm",
                   "scale_by_param_block_rms", "scale_by_trust_ratio"),
        PER_LEAF_UNIT: ("scale_by_sm3",),
        WHOLE: ("normalize_by_update_norm", "scale_by_lbfgs", "scale_by_polyak")},
    "optax.contrib._acprop": {ELEMENTWISE: ("scale_by_acprop",)},
    "optax.contrib._ademamix": {ELEMENTWISE: ("scale_by_ademamix",
                                              "scale_by_simplified_ademamix")},
    "optax.contrib._adopt": {ELEMENTWISE: ("scale_by_adopt",)},
    "optax.contrib._cocob": {ELEMENTWISE: ("scale_by_cocob",)},
    "optax.contrib._complex_valued": {ELEMENTWISE: ("split_real_and_imaginary",)},
    "optax.contrib._dadapt_adamw": {WHOLE: ("dadapt_adamw",)},
    "optax.contrib._dog": {WHOLE: ("scale_by_dog", "scale_by_dowg")},
    "optax.contrib._galore": {PER_LEAF: ("scale_by_galore",)},
    "optax.contrib._madgrad": {ELEMENTWISE: ("scale_by_madgrad",)},
    "optax.contrib._mechanic": {WHOLE: ("mechanize",)},
    "optax.contrib._momo": {WHOLE: ("momo", "momo_adam")},
    "optax.contrib._muon": {PER_LEAF_UNIT: ("scale_by_muon", "scale_by_shape")},
    "optax.contrib._prodigy": {WHOLE: ("prodigy",)},
    "optax.contrib._reduce_on_plateau": {ELEMENTWISE: ("reduce_on_plateau",)},
    "optax.contrib._sam": {ELEMENTWISE: ("sam.<locals>.transparent_update_fn",),
                           WHOLE: ("normalize",)},
    "optax.contrib._schedule_free": {ELEMENTWISE: ("schedule_free",)},
    "optax.schedules._inject": {
        ELEMENTWISE: ("inject_hyperparams.<locals>.wrapped_transform.<locals>.update_fn",)},
    "optax.transforms._accumulation": {ELEMENTWISE: ("ema", "trace", "MultiSteps.update")},
    "optax.transforms._adding": {ELEMENTWISE: ("add_decayed_weights",),
                                 PER_LEAF: ("add_noise",)},
    "optax.transforms._clipping": {ELEMENTWISE: ("clip",),
                                   PER_LEAF: ("adaptive_grad_clip", "clip_by_block_rms"),
                                   WHOLE: ("clip_by_global_norm",)},
    "optax.transforms._combining": {ELEMENTWISE: ("chain", "named_chain"),
                                    PER_LEAF_UNIT: ("partition",)},
    "optax.transforms._conditionality": {
        ELEMENTWISE: ("conditionally_mask", "conditionally_transform"),
        WHOLE: ("apply_if_finite.<locals>.update",)},
    "optax.transforms._constraining": {ELEMENTWISE: ("keep_params_nonnegative",),
                                       PER_LEAF: ("zero_nans",)},
    "optax.transforms._masking": {PER_LEAF: ("masked",)},
    # jpack's own: they reduce over the data-parallel axis, which the step does itself.
    "jpack._transforms": {COLLECTIVE: ("allreduce",)},
    "jpack._sharded": {COLLECTIVE: ("sharded",)},
}
# A factory's name stands for "<factory>.<locals>.update_fn".
_KINDS = {(module, name if "." in name else f"{name}.<locals>.update_fn"): kind
          for module, kinds in _TABLE.items() for kind, names in kinds.items()
          for name in names}


class Part(NamedTuple):
  """A transformation that a user's optimizer is made of."""
  name: str  # its factory, e.g. "optax.scale_by_adam"
  kind: Kind | None  # None: not in the table, to be probed
  tx: Any
  everywhere: bool = True  # it runs on every leaf (not selected by a mask or labels)


def key_of(tx: Any) -> tuple[str, str] | None:
  """(module, qualified name) of ``tx``'s update function (a method's too), or None."""
  update = getattr(getattr(tx, "update", None), "__func__", getattr(tx, "update", None))
  code = getattr(update, "__code__", None)
  return None if code is None else (getattr(update, "__module__", "") or "", code.co_qualname)


def parts(tx: Any, everywhere: bool = True) -> list[Part]:
  """``tx`` and the transformations inside a known wrapper (read through), outermost first."""
  key = key_of(tx)
  if key is None:
    return [Part(type(tx).__name__, None, tx)]
  if key == EXTRA_ARGS:  # optax.chain wraps each plain transformation it holds
    return parts(closure(tx.update)["tx"], everywhere)
  kind = _KINDS.get(key)
  found = [Part(public_name(*key), kind, tx, everywhere)]
  everywhere = everywhere and key[1].split(".")[0] not in ("masked", "partition")
  if kind is None:
    return found
  if key[1] == "MultiSteps.update":
    multi = tx.update.__self__
    if not multi._should_skip_update_fn.__qualname__.startswith("MultiSteps.__init__"):
      return [found[0]._replace(kind=None)]  # a user's skip function: probed whole
    return found + parts(multi._opt, everywhere)
  inner = closure(tx.update)
  if "inner_factory" in inner:  # inject_hyperparams builds its inner at every update
    try:
      return found + parts(injected(tx), everywhere)
    except Exception:  # noqa: BLE001 - a factory that needs other values: probed whole
      return [found[0]._replace(kind=None)]
  for sub in chain_parts(tx) or _transformations(list(inner.values())):
    found += parts(sub, everywhere)
  return found


def known(tx: Any) -> bool:
  """Whether every part of ``tx`` (or of each value of a dict of them) is in the table."""
  return all(p.kind is not None for t in (tx.values() if isinstance(tx, dict) else [tx])
             for p in parts(t))


EXTRA_ARGS = key_of(optax.with_extra_args_support(  # the wrapper's update
    optax.GradientTransformation(lambda p: None, lambda u, s, p=None: (u, s))))
_CHAIN_CODE = optax.chain(optax.identity()).update.__code__  # every chain's update


def chain_parts(tx: Any) -> tuple[optax.GradientTransformationExtraArgs, ...] | None:
  """The transformations an `optax.chain` runs in turn, or None if ``tx`` is not one."""
  update = getattr(tx, "update", None)
  if getattr(update, "__code__", None) is not _CHAIN_CODE:
    return None
  updates = closure(update).get("update_fns")
  inits = closure(getattr(tx, "init", None)).get("init_fns")
  if updates is None or inits is None or len(updates) != len(inits):  # another optax
    return None
  return tuple(optax.GradientTransformationExtraArgs(i, u) for i, u in zip(inits, updates))


def _transformations(values: list[Any]) -> list[Any]:
  """The transformations among ``values``, in dicts, tuples and lists too."""
  found = []
  for value in values:
    if isinstance(value, optax.GradientTransformation):  # a tuple itself: first
      found.append(value)
    elif isinstance(value, (dict, tuple, list)):
      found += _transformations(list(value.values() if isinstance(value, dict) else value))
  return found


def closure(fn: Callable[..., Any]) -> dict[str, Any]:
  """The variables ``fn`` closes over (none if it is not a Python function)."""
  try:
    return dict(inspect.getclosurevars(getattr(fn, "__func__", fn)).nonlocals)
  except (TypeError, ValueError):
    return {}


def injected(tx: Any) -> optax.GradientTransformation:
  """The transformation an `optax.inject_hyperparams` builds, with its first values."""
  init = closure(tx.init)
  values = {k: f(f.init()) for k, f in init["sched_hps"].items()}
  return init["inner_factory"](**init["other_hps"], **init["numeric_hps"], **values)


def with_factory(tx: Any, wrap: Callable[[Any], Any]) -> optax.GradientTransformation:
  """An `optax.inject_hyperparams` ``tx`` whose inner is ``wrap(built)``, same state."""
  factory = closure(tx.init)["inner_factory"]

  def rebuilt(fn):
    cells = tuple(types.CellType(lambda *a, **k: wrap(factory(*a, **k)))
                  if name == "inner_factory" else cell
                  for name, cell in zip(fn.__code__.co_freevars, fn.__closure__))
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              cells)

  return optax.GradientTransformationExtraArgs(rebuilt(tx.init), rebuilt(tx.update))


def requirement(part: Part, shapes: list[tuple[int, ...]]) -> str | None:
  """Why optax itself cannot run ``part`` on leaves of ``shapes``, and what to use; or None."""
  if part.name == "optax.scale_by_sm3" and any(len(s) == 0 for s in shapes):
    return ("optax's sm3 keeps statistics per dimension and raises IndexError on a scalar "
            "leaf. Keep scalars out of it: jpack.optax.partition({'sm3': optax.sm3(lr), "
            "'rest': optax.adam(lr)}, labels), with the scalar leaves labelled 'rest'.")
  if (part.name == "optax.contrib.scale_by_muon"
      and closure(part.tx.update).get("weight_dimension_numbers", 0) is None):
    return ("without weight_dimension_numbers= optax's scale_by_muon raises a pytree-structure "
            "ValueError on any params. Use optax.contrib.muon(lr), which runs it on the "
            "matrices and adam on the other leaves, or pass weight_dimension_numbers=.")
  return None


def public_name(module: str, qualname: str) -> str:
  """The factory of an update function (``optax.scale_by_adam``), in a public module."""
  factory = qualname.split(".")[0]
  top = sys.modules.get(module.split(".")[0])
  spaces = [top] + [m for k, m in sorted(vars(top).items()) if isinstance(m, types.ModuleType)
                    and not k.startswith("_")] if top is not None else []
  for space in spaces:
    if getattr(getattr(space, factory, None), "__module__", None) == module:
      return f"{space.__name__}.{factory}"
  return f"{module}.{factory}" if module else factory
