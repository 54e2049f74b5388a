"""Every optax transformation: in flat and sharded the same as optax, or refused.

The catalogue is read from the installed optax and optax.contrib (every public factory
of a `GradientTransformation`), so a new optax release is covered: each factory is built
with small hyperparameters found from its signature and must, in `jpack.optax.flat` (the
optimizer of data_parallel's "packed" mode) and in `jpack.optax.sharded` (ZeRO-1, the
"sharded" mode; 8 CPU devices), either match plain optax on the mean gradient over five
steps or be refused with a TypeError that names it. Never a silent difference, and never
a refusal of the elementwise optimizers, nor of the global-norm clip (computed on the
buckets, and on the slices with one psum). ``flat`` runs what buckets would change on the
leaves, so it refuses only what plain optax cannot run on these params either
(`FLAT_REFUSED`); ``sharded`` refuses what neither its slices nor a device's own whole
leaves can run.
"""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack

N = 8
STEPS = 5

# Arguments by parameter name, for the parameters without a default.
ARGUMENTS = {
    "learning_rate": lambda: 1e-2,
    "max_norm": lambda: 1.0,
    "threshold": lambda: 1.0,
    "clipping": lambda: 0.1,
    "max_delta": lambda: 0.1,
    "eta": lambda: 0.1,
    "gamma": lambda: 0.55,
    "decay": lambda: 0.9,
    "step_size": lambda: 0.1,
    "step_size_fn": lambda: optax.exponential_decay(0.1, 1, 0.9),
    "max_consecutive_errors": lambda: 2,
    "every_k_schedule": lambda: 2,
    "sync_period": lambda: 2,
    "slow_step_size": lambda: 0.5,
    "max_backtracking_steps": lambda: 5,
    "max_linesearch_steps": lambda: 5,
    "l2_norm_clip": lambda: 1.0,
    "noise_multiplier": lambda: 0.1,
    "seed": lambda: 0,
    # Wrappers get an elementwise transformation: what they add decides.
    "inner": lambda: optax.adam(1e-2),
    "opt": lambda: optax.adam(1e-2),
    "optimizer": lambda: optax.adam(1e-2),
    "tx": lambda: optax.adam(1e-2),
    "base_optimizer": lambda: optax.adam(1e-2),
    "fast_optimizer": lambda: optax.adam(1e-2),
    "adv_optimizer": lambda: optax.sgd(1e-2),
    "inner_factory": lambda: optax.adam,
    "mask": lambda: lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
    "freeze_mask": lambda: lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
    "transforms": lambda: {"a": optax.adam(1e-2), "b": optax.sgd(1e-2)},
    "param_labels": lambda: lambda p: jax.tree.map(lambda x: "a" if x.ndim > 1 else "b", p),
    "should_transform_fn": lambda: lambda step: step % 2 == 0,
    "measure_name": lambda: "norm",
    "measure": lambda: optax.tree.norm,
    "measures": lambda: {"norm": optax.tree.norm},
    "f": lambda: lambda updates, params: jax.tree.map(lambda g: -0.1 * g, updates),
}

# Parameters with a default that warns (a key will be required), and *args.
PREFERRED = {"key": lambda: 0}
VARARGS = {"chain": lambda: (optax.scale_by_adam(), optax.scale(-1e-2)),
           "named_chain": lambda: (("adam", optax.scale_by_adam()),
                                   ("lr", optax.scale(-1e-2)))}

# Public callables without a return annotation whose arguments are not in ARGUMENTS:
# not transformation factories. A new one fails the test until it is classified here or
# its arguments are added above.
NOT_FACTORIES = {
    "optax.bias_correction": "a helper on moments",
    "optax.matrix_inverse_pth_root": "a matrix function",
    "optax.update_infinity_moment": "a helper on moments",
    "optax.update_moment": "a helper on moments",
    "optax.update_moment_per_elem_norm": "a helper on moments",
    "optax.contrib.schedule_free_eval_params": "reads params from a state",
    "optax.sigmoid_binary_cross_entropy": "a loss",
}

# Factories that cannot be built without arguments only a user can give.
NOT_BUILT: dict[str, str] = {}

# Cases a factory's defaults do not reach.
EXTRA = {"optax.sgd(momentum=0.9)": lambda: optax.sgd(1e-2, momentum=0.9)}

# What flat refuses, and why: optax on the params tree fails too, or needs what only the
# user can give (the loss function, per-example gradients), or returns no updates.
FLAT_REFUSED = {
    "optax.contrib.differentially_private_aggregate": "per-example gradients",
    "optax.contrib.dpsgd": "per-example gradients",
    "optax.contrib.hutchinson_estimator_diag_hessian": "obj_fn=, the loss",
    "optax.contrib.sophia": "obj_fn=, the loss (hutchinson_estimator_diag_hessian)",
    "optax.contrib.scale_by_muon": "optax raises on the scalar leaf",
    "optax.lbfgs": "value_fn=, the loss",
    "optax.scale_by_backtracking_linesearch": "value_fn=, the loss",
    "optax.scale_by_zoom_linesearch": "value_fn=, the loss",
    "optax.lookahead": "LookaheadParams, not params",
    "optax.measure_with_ema": "returns a measure, not updates",
    "optax.scale_by_distance_over_gradients": "optax gives the scalar leaf shape (1,)",
    "optax.scale_by_sm3": "optax raises on the scalar leaf",
    "optax.sm3": "optax raises on the scalar leaf",
}

# Per-coordinate optimizers: jpack must run them on buckets and on slices.
ELEMENTWISE = [
    "optax.sgd", "optax.sgd(momentum=0.9)", "optax.adam", "optax.adamw", "optax.lion",
    "optax.rmsprop", "optax.adagrad", "optax.scale_by_adam", "optax.scale_by_adamax",
    "optax.scale_by_adan",
    "optax.scale_by_amsgrad", "optax.scale_by_belief", "optax.scale_by_lion",
    "optax.scale_by_rms", "optax.scale_by_rss", "optax.scale_by_sign",
    "optax.scale_by_stddev", "optax.scale_by_yogi", "optax.scale_by_radam",
    "optax.scale_by_rprop", "optax.scale_by_adadelta", "optax.scale_by_optimistic_gradient",
    "optax.scale_by_learning_rate", "optax.scale_by_schedule",
    "optax.contrib.scale_by_acprop", "optax.contrib.scale_by_ademamix",
    "optax.contrib.scale_by_adopt", "optax.contrib.scale_by_simplified_ademamix",
    "optax.contrib.scale_by_cocob", "optax.contrib.scale_by_madgrad",
]

# Not per-coordinate, but jpack must run them on buckets and on slices too: the clip's
# norm is the whole gradient's (the slices' sums of squares added up over the devices).
NEVER_REFUSED = ELEMENTWISE + ["optax.clip_by_global_norm"]


def _public_callables():
  seen = set()
  for module in (optax, optax.contrib):
    for name in sorted(dir(module)):
      obj = getattr(module, name)
      if name.startswith("_") or id(obj) in seen:
        continue
      seen.add(id(obj))
      # Functions, and classes that hand out a transformation (MultiSteps); not states,
      # base types or type aliases.
      if inspect.isfunction(obj) or (inspect.isclass(obj)
                                     and hasattr(obj, "gradient_transformation")):
        yield f"{module.__name__}.{name}", obj


def _build(factory):
  """``factory`` called with ARGUMENTS for its parameters without a default, and the
  result made a transformation (a factory's factory called again, a MultiSteps asked
  for its transformation); None if a parameter is not in ARGUMENTS."""
  args, kwargs = (), {}
  for p in inspect.signature(factory).parameters.values():
    if p.kind is p.VAR_POSITIONAL:
      args = VARARGS[factory.__name__]()
    elif p.name in PREFERRED:
      kwargs[p.name] = PREFERRED[p.name]()
    elif p.default is p.empty and p.kind is not p.VAR_KEYWORD:
      if p.name not in ARGUMENTS:
        return None
      kwargs[p.name] = ARGUMENTS[p.name]()
  with warnings.catch_warnings():  # deprecated factories are still covered
    warnings.simplefilter("ignore", DeprecationWarning)
    out = factory(*args, **kwargs)
  if hasattr(out, "gradient_transformation"):
    out = out.gradient_transformation()
  if callable(out) and not isinstance(out, optax.GradientTransformation):
    return _build(out)
  return out


def _catalogue():
  factories, unknown = {}, []
  for name, obj in _public_callables():
    annotation = inspect.signature(obj).return_annotation
    unannotated = annotation is inspect.Signature.empty
    annotation = str(annotation)
    if "GradientTransformation" not in annotation and not unannotated:
      continue  # a loss, a schedule, a helper
    if name in NOT_FACTORIES or name in NOT_BUILT:
      continue
    try:
      built = _build(obj)
    except TypeError:
      built = None
    if isinstance(built, optax.GradientTransformation):
      factories[name] = lambda obj=obj: _build(obj)
    elif built is None or "GradientTransformation" in annotation:
      unknown.append(name)
  return {**factories, **EXTRA}, unknown


FACTORIES, UNKNOWN = _catalogue()


def test_every_factory_is_built_or_classified():
  assert not UNKNOWN, (f"{UNKNOWN}: add their arguments to ARGUMENTS, or list them in "
                       "NOT_FACTORIES / NOT_BUILT with the reason.")
  assert len(FACTORIES) > 100
  assert set(NEVER_REFUSED) <= set(FACTORIES)
  assert set(FLAT_REFUSED) <= set(FACTORIES)


def params():
  rng = np.random.default_rng(0)
  return {"s": np.float32(0.5), "v": rng.normal(size=5).astype(np.float32),
          "m": rng.normal(size=(3, 4)).astype(np.float32),
          "t": rng.normal(size=(2, 3, 2)).astype(np.float32)}


def grads():
  """Per step and device, as one array per leaf: [step, device, *shape]."""
  rng = np.random.default_rng(1)
  return jax.tree.map(lambda x: rng.normal(size=(STEPS, N) + np.shape(x)).astype(np.float32),
                      params())


def refusal(init) -> str | None:
  try:
    init()
  except TypeError as e:
    assert "cannot run inside jpack.optax." in str(e), e  # names it and where
    return str(e)
  return None


def takes_value(tx) -> bool:
  kinds = {p.name: p.kind for p in inspect.signature(tx.update).parameters.values()}
  return "value" in kinds or inspect.Parameter.VAR_KEYWORD in kinds.values()


def run(mesh, make, flat, sharded):
  """(plain optax, flat, sharded) params after STEPS steps, in one shard_map; flat and
  sharded on the mean gradient's buckets and slices, None where refused."""
  ref = make()
  extra = {"value": jnp.float32(1.5)} if takes_value(ref) else {}

  def steps(tx, p, gs):
    def one(carry, g):
      p, state = carry
      u, state = tx.update(g, state, p, **extra)
      return (optax.apply_updates(p, u), state), None

    carry = (p, tx.init(p))
    try:
      return jax.lax.scan(one, carry, gs)[0][0]
    except TypeError:  # a state that changes structure (optax.monitor's first update)
      for k in range(STEPS):
        carry = one(carry, jax.tree.map(lambda x: x[k], gs))[0]
      return carry[0]

  def body(p, g):
    mine = jax.tree.map(lambda x: x[:, 0], g)  # this device's gradient of each step
    mean = jax.tree.map(lambda x: jax.lax.pmean(x, "batch"), mine)
    return (steps(ref, p, mean), flat and steps(flat, p, mean),
            sharded and steps(sharded, p, mine))

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "batch")),
                            out_specs=P(), check_vma=False))
  return f(jax.device_put(params(), NamedSharding(mesh, P())),
           jax.device_put(grads(), NamedSharding(mesh, P(None, "batch"))))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # deprecated ones are covered
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_matches_optax_or_is_refused(name):
  make = FACTORIES[name]
  mesh = jax.make_mesh((N,), ("batch",))
  flat, sharded = jpack.optax.flat(make()), jpack.optax.sharded(make(), "batch")
  flat_refused = refusal(lambda: flat.init(params()))
  init = jax.shard_map(sharded.init, mesh=mesh, in_specs=P(), out_specs=P(),
                       check_vma=False)
  sharded_refused = refusal(lambda: jax.eval_shape(init, params()))
  if name in NEVER_REFUSED:
    assert not flat_refused and not sharded_refused, flat_refused or sharded_refused
  got_flat = got_sharded = None
  if not (flat_refused and sharded_refused):
    try:
      want, got_flat, got_sharded = run(mesh, make, None if flat_refused else flat,
                                        None if sharded_refused else sharded)
    except TypeError as e:  # what the inner optimizer raises at update, named
      assert "cannot run inside jpack.optax.flat" in str(e), e
      flat_refused = str(e)
      if not sharded_refused:
        want, got_flat, got_sharded = run(mesh, make, None, sharded)
  assert bool(flat_refused) == (name in FLAT_REFUSED), flat_refused or FLAT_REFUSED[name]
  if sharded_refused and not flat_refused:  # ZeRO-1 points to the mode that runs it
    assert "mode='packed'" in sharded_refused, sharded_refused
  for got in (got_flat, got_sharded):
    for k in want if got is not None else ():
      np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-4,
                                 atol=1e-5, err_msg=f"{name} at {k}")
