"""What a new user trips on gets an error that names the fix: a loss that does not fit
the model state given to init (or not) / ``has_aux``, model state in the params, a state
that ``step`` donated."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpack


def init_model(key):
  """A small real model: dense -> batch norm -> relu -> dense, in plain JAX."""
  k1, k2 = jax.random.split(key)
  params = {"dense1": {"w": jax.random.normal(k1, (5, 16)) * 0.3},
            "bn": {"scale": jnp.ones(16), "offset": jnp.zeros(16)},
            "dense2": {"w": jax.random.normal(k2, (16, 3)) * 0.3, "b": jnp.zeros(3)}}
  # As Haiku's BatchNorm keeps it: running averages, and an int32 counter.
  state = {"bn": {"mean": jnp.zeros(16), "var": jnp.ones(16),
                  "counter": jnp.zeros((), jnp.int32)}}
  return params, state


def apply(params, state, x):
  h = x @ params["dense1"]["w"]
  mean, var = h.mean(0), h.var(0)
  h = (h - mean) / jnp.sqrt(var + 1e-5) * params["bn"]["scale"] + params["bn"]["offset"]
  logits = jax.nn.relu(h) @ params["dense2"]["w"] + params["dense2"]["b"]
  bn = state["bn"]
  new = {"bn": {"mean": 0.9 * bn["mean"] + 0.1 * mean, "var": 0.9 * bn["var"] + 0.1 * var,
                "counter": bn["counter"] + 1}}
  return logits, new


def stateful_loss(params, model_state, batch):
  x, y = batch
  logits, new = apply(params, model_state, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new


def plain_loss(params, batch):
  return stateful_loss(params, init_model(jax.random.key(0))[1], batch)[0]


def data(rows=16):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(rows, 5)).astype(np.float32),
          rng.integers(0, 3, rows).astype(np.int32))


def build(loss, mode="packed", **flags):
  params, _ = init_model(jax.random.key(0))
  return jpack.data_parallel(loss, optax.adam(1e-2), params, mode=mode, **flags)


def init(dp, with_state):
  """``dp.init(params, model_state)`` or ``dp.init(params)``."""
  params, model_state = init_model(jax.random.key(0))
  return dp.init(params, model_state) if with_state else dp.init(params)


# -- the loss's signature, at init (which says whether there is a model state) -----------


class StatefulLoss:
  def __call__(self, params, model_state, batch):
    return stateful_loss(params, model_state, batch)


def loss_with_model(params, model_state, batch, *, model):
  del model
  return stateful_loss(params, model_state, batch)


@pytest.mark.parametrize("loss", [
    stateful_loss, StatefulLoss(), functools.partial(loss_with_model, model="net"),
    jax.jit(stateful_loss)], ids=["function", "callable", "partial", "jit"])
def test_a_loss_that_takes_a_model_state_without_one_given_to_init_says_how(loss):
  # Python's own error would be "missing 1 required positional argument", at the step.
  dp = build(loss)
  with pytest.raises(TypeError, match=r"takes 3 arguments, but init got no model state, so "
                     r"the step calls loss_fn\(params, batch\).*'model_state' is the "
                     r"model's state.*pass its first value to init: "
                     r"dp.init\(params, model_state\)"):
    init(dp, with_state=False)
  init(dp, with_state=True)  # the same step, with the state: fine


def test_a_model_state_given_with_a_loss_that_takes_none_says_how():
  dp = build(plain_loss)
  with pytest.raises(TypeError, match=r"loss_fn\(params, batch\) takes 2 arguments, but "
                     r"init got a model state, so the step calls loss_fn\(params, "
                     r"model_state, batch\)\. Call dp.init\(params\) without one"):
    init(dp, with_state=True)
  init(dp, with_state=False)


def test_a_loss_with_other_required_arguments_is_told_to_bind_them():
  def loss(params, batch, rng, temperature):
    return plain_loss(params, batch)

  dp = build(loss)
  for with_state, call in [(False, "batch"), (True, "model_state, batch")]:
    with pytest.raises(TypeError, match=rf"cannot be called as loss_fn\(params, {call}\): "
                       r"take exactly these positional arguments.*functools\.partial"):
      init(dp, with_state)
  with pytest.raises(TypeError, match=r"loss_fn must be callable, got dict"):
    build({"loss": plain_loss})


def test_a_loss_taking_args_is_checked_when_the_step_traces():
  # *args hides the signature from inspect: Python's error, with a note naming the flag.
  def wrapped(*args):
    return stateful_loss(*args)

  dp = build(wrapped)
  state = dp.init(init_model(jax.random.key(0))[0])
  with pytest.raises(TypeError, match=r"missing 1 required positional argument(.|\n)*"
                     r"If loss_fn's own signature refused this call: with has_aux=False and "
                     r"no model state given to init, data_parallel calls "
                     r"loss_fn\(params, batch\)(.|\n)*is given its first value by "
                     r"dp.init\(params, model_state\)"):
    dp.step(state, data())


# -- what the loss returns, when the step traces ----------------------------------------


def _step_once(loss, mode="packed", with_state=False, **flags):
  dp = build(loss, mode=mode, **flags)
  return dp.step(init(dp, with_state), data())


@pytest.mark.parametrize("mode", ["packed", "allreduce", "sharded"])
def test_a_loss_returning_metrics_without_has_aux_names_the_flag(mode):
  def loss(params, batch):
    return plain_loss(params, batch), {"accuracy": 1.0}

  # JAX's own error: "Gradient only defined for scalar-output functions".
  with pytest.raises(TypeError, match=r"loss_fn returned a tuple of 2 where the loss goes, "
                     r"but with has_aux=False and no model state given to init, "
                     r"data_parallel calls loss_fn\(params, batch\) and takes back the "
                     r"scalar loss: a loss that also returns metrics needs has_aux=True"):
    _step_once(loss, mode)


def test_state_and_metrics_without_has_aux_names_the_flag():
  def loss(params, model_state, batch):
    value, new = stateful_loss(params, model_state, batch)
    return value, (new, {"accuracy": 1.0})

  with pytest.raises(TypeError, match=r"returned \(loss, \(new_model_state, aux\)\).*"
                     r"pass has_aux=True"):
    _step_once(loss, with_state=True)


def test_has_aux_without_metrics_names_the_flag_to_drop():
  with pytest.raises(TypeError, match=r"loss_fn returned an array of shape \(\), but with "
                     r"has_aux=True and no model state given to init.*takes back "
                     r"\(loss, aux\): if it returns no aux, drop has_aux=True"):
    _step_once(plain_loss, has_aux=True)
  with pytest.raises(TypeError, match=r"loss_fn returned \(loss, rest\) with rest a dict, "
                     r"but with has_aux=True and a model state given to init.*"
                     r"drop has_aux=True"):
    _step_once(stateful_loss, with_state=True, has_aux=True)


def test_a_loss_returning_only_the_loss_with_a_model_state_says_how():
  # The model state given to init, but loss_fn returns the loss alone.
  def loss(params, model_state, batch):
    return stateful_loss(params, model_state, batch)[0]

  with pytest.raises(TypeError, match=r"loss_fn returned an array of shape \(\), but with "
                     r"has_aux=False and a model state given to init, data_parallel calls "
                     r"loss_fn\(params, model_state, batch\) and takes back "
                     r"\(loss, new_model_state\): .*if it takes no model state, call "
                     r"dp.init\(params\) without one"):
    _step_once(loss, with_state=True)


def test_a_model_state_that_is_a_pair_is_not_mistaken_for_state_and_aux():
  # (mean, counter): a tuple of two, shaped like the state it replaces.
  def loss(params, model_state, batch):
    mean, counter = model_state
    value, new = stateful_loss(params, {"bn": {"mean": mean, "var": jnp.ones(16),
                                               "counter": counter}}, batch)
    return value, (new["bn"]["mean"], new["bn"]["counter"])

  params, _ = init_model(jax.random.key(0))
  dp = build(loss)
  state = dp.init(params, (jnp.zeros(16), jnp.zeros((), jnp.int32)))
  state, metrics = dp.step(state, data())
  assert int(state.model_state[1]) == 1 and np.isfinite(float(metrics["loss"]))


# -- model state in the params ----------------------------------------------------------


def test_model_state_in_the_params_is_sent_to_init():
  params, model_state = init_model(jax.random.key(0))
  merged = {**params, "bn": {**params["bn"], **model_state["bn"]}}  # Haiku's state, merged
  with pytest.raises(TypeError, match=r"Param leaf at \['bn'\]\['counter'\] has dtype int32;"
                     r".*looks like model state.*pass it apart, as the model state: "
                     r"dp.init\(params, model_state\), and loss_fn\(params, model_state, "
                     r"batch\) -> \(loss, new_model_state\)"):
    jpack.data_parallel(plain_loss, optax.adam(1e-2), merged)


def test_a_prng_key_in_the_params_is_sent_to_init():
  params, _ = init_model(jax.random.key(0))
  params["dropout"] = {"rng": jax.random.key(1)}
  with pytest.raises(TypeError, match=r"Param leaf at \['dropout'\]\['rng'\] has dtype "
                     r"key<threefry2x32>;.*PRNG-key leaf.*dp.init\(params, model_state\)"):
    jpack.data_parallel(plain_loss, optax.adam(1e-2), params, mode="sharded")


# -- a donated state --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["packed", "allreduce", "sharded"])
def test_reading_a_donated_state_says_step_donated_it(mode):
  params, model_state = init_model(jax.random.key(0))
  dp = build(stateful_loss, mode=mode)
  first = dp.init(params, model_state)
  second, _ = dp.step(first, data())
  stats = second.model_state                      # read before the next step: not a copy
  kept = jax.device_get(second.model_state["bn"]["counter"])  # a host copy: survives it
  third, _ = dp.step(second, data())
  with pytest.raises(RuntimeError, match=r"already passed to step\(\), which donates the "
                     r"whole state \(params, opt_state, step and model_state\).*Read the "
                     r"state step\(\) returned, or copy"):
    dp.unpack(second)
  with pytest.raises(RuntimeError, match=r"already passed to step\(\).*Use the state step\(\) "
                     r"returned"):
    dp.step(second, data())
  with pytest.raises(RuntimeError, match="deleted"):  # JAX's own, as TrainState says
    np.asarray(stats["bn"]["mean"])
  assert int(kept) == 1 and int(third.model_state["bn"]["counter"]) == 2
  params, model_state = dp.unpack(third)  # what init took
  jax.tree.map(np.asarray, params)
  assert int(model_state["bn"]["counter"]) == 2


def test_partition_takes_a_dict_of_transformations():
  with pytest.raises(TypeError, match="takes a dict"):
    jpack.optax.partition(optax.adam(1e-3), {"x": "a"})
  with pytest.raises(TypeError, match=r"inner\['a'\]"):
    jpack.optax.partition({"a": "adam"}, {"x": "a"})


# -- an optimizer optax itself cannot run on these params -------------------------------


@pytest.mark.parametrize("make,name,fix", [
    (lambda: optax.sm3(0.1), "optax.scale_by_sm3", r"IndexError on a scalar leaf.*"
     r"jpack.optax.partition\(\{'sm3': optax.sm3\(lr\), 'rest'"),
    (lambda: optax.scale_by_sm3(), "optax.scale_by_sm3", r"jpack.optax.partition"),
    (lambda: optax.contrib.scale_by_muon(), "optax.contrib.scale_by_muon",
     r"without weight_dimension_numbers=.*Use optax.contrib.muon\(lr\)"),
], ids=["sm3", "scale_by_sm3", "scale_by_muon"])
@pytest.mark.parametrize("where", ["flat", "sharded", "data_parallel"])
def test_an_optimizer_optax_cannot_run_on_the_params_is_named_with_the_fix(
    make, name, fix, where):
  # optax's own errors would be a bare IndexError (sm3 on a scalar) or a pytree-structure
  # ValueError (scale_by_muon without weight_dimension_numbers), from deep inside.
  params, _ = init_model(jax.random.key(0))
  params["temperature"] = jnp.float32(1.0)
  inside = {"flat": "jpack.optax.flat", "sharded": "jpack.optax.sharded",
            "data_parallel": "data_parallel's optimizer"}[where]
  with pytest.raises(TypeError, match=rf"{name} cannot run inside {inside}.*: .*{fix}"):
    if where == "flat":
      jpack.optax.flat(make()).init(params)
    elif where == "sharded":
      mesh = jax.make_mesh((8,), ("batch",))
      tx = jpack.optax.sharded(make(), "batch")
      jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(),
                                   check_vma=False), params)
    else:
      jpack.data_parallel(plain_loss, make(), params, mode="sharded")


def test_sm3_on_leaves_without_scalars_runs():
  # Labelled apart, the scalars go to another optimizer: sm3 runs on the rest.
  params, _ = init_model(jax.random.key(0))
  params["temperature"] = jnp.float32(1.0)
  labels = jax.tree.map(lambda x: "rest" if x.ndim == 0 else "sm3", params)
  tx = jpack.optax.partition({"sm3": optax.sm3(0.1), "rest": optax.adam(0.1)}, labels)
  state = jpack.optax.flat(tx).init(params)
  assert state.layout is not None
