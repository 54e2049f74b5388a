"""Flax Linen, Flax NNX, Equinox and Haiku models trained with jpack match plain training.

For each integration the reference is the framework's own single-device training loop on
the full batch (Flax's TrainState, nnx.Optimizer, eqx.filter_value_and_grad; for Haiku's
BatchNorm, whose state is given to dp.init(params, model_state), hk.transform_with_state
and optax); every `jpack.data_parallel` mode on the 8 CPU devices of conftest.py, and a
hand-written `jax.shard_map` step with `jpack.optax.allreduce`, must land on the same
params. The
how-to pages' code (docs/examples/) runs here too, an Orbax checkpoint of a ZeRO-1 run
resumes on another device count, and mistakes a Flax or Equinox user makes are refused
with errors that say what to do.
"""

import os
import pathlib
import re
import subprocess
import sys
from typing import Any, Callable, NamedTuple

import equinox as eqx
import flax
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
STEPS, LR, FEATURES, CLASSES = 5, 1e-2, 16, 4
MODES = ["packed", "allreduce", "sharded", "shard_map"]  # shard_map: the hand-written step


def batches():
  """STEPS full batches of 64 rows (8 per device), labels a model can learn."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(STEPS, 64, FEATURES)).astype(np.float32)
  y = (x @ rng.normal(size=(FEATURES, CLASSES))).argmax(-1).astype(np.int32)
  return [(x[i], y[i]) for i in range(STEPS)]


def cross_entropy(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def tx():
  return optax.adamw(LR, weight_decay=0.1)


class Integration(NamedTuple):
  params: Any                    # what jpack trains: the framework's params tree
  loss_fn: Callable[[Any, Any], jax.Array]
  reference: Callable[[], Any]   # the framework's own loop: params after STEPS steps


# Flax Linen: params = model.init(...)["params"], model.apply in the loss.

class LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(nn.relu(nn.Dense(32)(x)))


def linen():
  model = LinenMLP()
  params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]

  def loss_fn(params, batch):
    x, y = batch
    return cross_entropy(model.apply({"params": params}, x), y)

  def reference():
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx())

    @jax.jit
    def step(state, batch):
      return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, batch))

    for batch in batches():
      state = step(state, batch)
    return state.params

  return Integration(params, loss_fn, reference)


# Flax NNX: nnx.split into graphdef, params and the rest; nnx.merge in the loss.

class NNXMLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(FEATURES, 32, rngs=rngs)
    self.out = nnx.Linear(32, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def flax_nnx():
  graphdef, params, rest = nnx.split(NNXMLP(nnx.Rngs(0)), nnx.Param, ...)

  def loss_fn(params, batch):
    x, y = batch
    return cross_entropy(nnx.merge(graphdef, params, rest)(x), y)

  def reference():
    model = NNXMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
      x, y = batch
      grads = nnx.grad(lambda model: cross_entropy(model(x), y))(model)
      optimizer.update(model, grads)

    for batch in batches():
      step(model, optimizer, batch)
    return nnx.state(model, nnx.Param)

  return Integration(params, loss_fn, reference)


# Equinox: eqx.partition(model, eqx.is_inexact_array); eqx.combine in the loss. The model
# has the leaves that must not be trained: a function, a Python int, and None (no bias).

class EqxMLP(eqx.Module):
  hidden: eqx.nn.Linear
  out: eqx.nn.Linear
  activation: Callable     # a leaf: jax.nn.relu
  classes: int             # a leaf: a Python int, used as a static slice bound

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.hidden = eqx.nn.Linear(FEATURES, 32, key=k1)
    self.out = eqx.nn.Linear(32, CLASSES + 1, use_bias=False, key=k2)  # bias is None
    self.activation = jax.nn.relu
    self.classes = CLASSES

  def __call__(self, x):
    return self.out(self.activation(self.hidden(x)))[:self.classes]


def equinox():
  model = EqxMLP(jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_fn(params, batch):
    x, y = batch
    return cross_entropy(jax.vmap(eqx.combine(params, static))(x), y)

  def reference():
    model = EqxMLP(jax.random.key(0))
    optimizer = tx()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, batch):
      x, y = batch
      grads = eqx.filter_grad(lambda model: cross_entropy(jax.vmap(model)(x), y))(model)
      updates, opt_state = optimizer.update(grads, opt_state,
                                            eqx.filter(model, eqx.is_inexact_array))
      return eqx.apply_updates(model, updates), opt_state

    for batch in batches():
      model, opt_state = step(model, opt_state, batch)
    assert model.activation is jax.nn.relu and model.classes == CLASSES
    return eqx.filter(model, eqx.is_inexact_array)

  return Integration(params, loss_fn, reference)


INTEGRATIONS = {"linen": linen, "nnx": flax_nnx, "equinox": equinox}
_references = {}


def reference_params(name, integration):
  if name not in _references:  # one reference per integration, shared by the modes
    _references[name] = integration.reference()
  return _references[name]


def train_with_jpack(integration, mode):
  mesh = jax.make_mesh((8,), ("batch",))
  if mode != "shard_map":
    dp = jpack.data_parallel(integration.loss_fn, tx(), integration.params, mesh, mode=mode)
    state = dp.init(integration.params)
    for batch in batches():
      state, _ = dp.step(state, batch)
    return dp.unpack(state)

  chain = optax.chain(jpack.optax.allreduce("batch"), tx())

  def train_step(params, opt_state, batch):
    grads = jax.grad(integration.loss_fn)(jpack.vary(params, "batch"), batch)
    updates, opt_state = chain.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), P(), P("batch")),
                               out_specs=(P(), P())))
  replicated = NamedSharding(mesh, P())
  params = jax.device_put(integration.params, replicated)
  opt_state = jax.device_put(chain.init(integration.params), replicated)
  for batch in batches():
    params, opt_state = step(params, opt_state,
                             jax.device_put(batch, NamedSharding(mesh, P("batch"))))
  return params


def assert_same_params(got, want, rtol=1e-5):
  """The same tree type and paths, every leaf within rtol of the reference (relative to
  the leaf's largest magnitude, so near-zero entries do not decide it)."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  got_leaves, _ = jax.tree_util.tree_flatten_with_path(got)
  errors = []
  for (path, a), b in zip(got_leaves, jax.tree.leaves(want)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
    error = np.abs(a - b).max() / np.abs(b).max()
    if error > rtol:
      errors.append(f"{jax.tree_util.keystr(path)}: {error:.2e}")
  assert not errors, f"params differ from the single-device reference: {errors}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(INTEGRATIONS))
def test_jpack_matches_the_frameworks_single_device_training(name, mode):
  integration = INTEGRATIONS[name]()
  want = reference_params(name, integration)
  moved = max(np.abs(np.asarray(a) - np.asarray(b)).max()
              for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(integration.params)))
  assert moved > LR  # the reference trained: equal params are not both untouched
  got = train_with_jpack(integration, mode)
  assert_same_params(got, want)


def test_equinox_static_leaves_go_through_the_step_untouched():
  integration = equinox()
  dp = jpack.data_parallel(integration.loss_fn, tx(), integration.params, mode="sharded")
  assert {s.path for s in dp.layout.slots} == {".hidden.weight", ".hidden.bias", ".out.weight"}
  state, _ = dp.step(dp.init(integration.params), batches()[0])
  trained = dp.unpack(state)
  assert trained.activation is None and trained.classes is None and trained.out.bias is None
  _, static = eqx.partition(EqxMLP(jax.random.key(0)), eqx.is_inexact_array)
  model = eqx.combine(trained, static)
  assert model.activation is jax.nn.relu and model.classes == CLASSES
  assert jax.vmap(model)(batches()[0][0]).shape == (64, CLASSES)


def test_orbax_checkpoint_of_a_zero1_run_resumes_on_another_device_count(tmp_path):
  # docs/howto/checkpoints.md: gather the ZeRO-1 state, save it with Orbax, restore it
  # into the full-tree structure, scatter it onto 4 devices: the next step is the step
  # the 8-device run takes.
  integration = linen()
  mesh8 = jax.make_mesh((8,), ("batch",))
  mesh4 = jax.make_mesh((4,), ("batch",), devices=jax.devices()[:4])
  dp8 = jpack.data_parallel(integration.loss_fn, tx(), integration.params, mesh8,
                            mode="sharded")
  state = dp8.init(integration.params)
  first, *rest = batches()
  state, _ = dp8.step(state, first)
  ckpt = {"params": jax.device_get(dp8.unpack(state)),
          "opt_state": jpack.checkpoint.gather_state(jax.device_get(state.opt_state)),
          "step": jax.device_get(state.step)}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "step_1", ckpt)
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), integration.params)
  target = {"params": like, "opt_state": jax.eval_shape(tx().init, like),
            "step": jax.ShapeDtypeStruct((), jnp.int32)}
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "step_1", target)

  dp4 = jpack.data_parallel(integration.loss_fn, tx(), restored["params"], mesh4,
                            mode="sharded")
  fresh = dp4.init(restored["params"])
  opt_state = jpack.checkpoint.scatter_state(restored["opt_state"], like=fresh.opt_state)
  resumed = fresh._replace(
      opt_state=jax.device_put(opt_state, jax.tree.map(lambda x: x.sharding, fresh.opt_state)),
      step=jax.device_put(restored["step"], fresh.step.sharding))
  resumed, _ = dp4.step(resumed, rest[0])
  state, _ = dp8.step(state, rest[0])
  assert int(resumed.step) == int(state.step) == 2
  assert_same_params(dp4.unpack(resumed), dp8.unpack(state))


# Haiku: hk.transform_with_state; BatchNorm's state (moving averages and int32 counters)
# is given to dp.init(params, model_state) as the model state, not put into the params.

def haiku_resnet(x, cross_replica_axis=None):
  """A residual block with BatchNorm on 4x4 images (the FEATURES as pixels)."""
  def norm(y):
    return hk.BatchNorm(True, True, decay_rate=0.9,
                        cross_replica_axis=cross_replica_axis)(y, is_training=True)

  x = jax.nn.relu(norm(hk.Conv2D(8, 3, with_bias=False)(x.reshape(-1, 4, 4, 1))))
  y = jax.nn.relu(norm(hk.Conv2D(8, 3, with_bias=False)(x)))
  x = jax.nn.relu(x + norm(hk.Conv2D(8, 3, with_bias=False)(y)))
  return hk.Linear(CLASSES)(hk.Flatten()(x))


def haiku_loss(cross_replica_axis):
  model = hk.transform_with_state(lambda x: haiku_resnet(x, cross_replica_axis))

  def loss_fn(params, model_state, batch):
    x, y = batch
    logits, model_state = model.apply(params, model_state, None, x)
    return cross_entropy(logits, y), model_state

  return loss_fn


def haiku_sgd():
  # SGD with momentum, as ResNets are trained. adam would divide by the square root of
  # second moments that rounding decides for the BatchNorm offsets followed by another
  # BatchNorm (their gradient is near zero): there, any two reduction orders differ
  # visibly, and the comparison would test rounding, not jpack.
  return optax.sgd(0.1, momentum=0.9)


def haiku_reference(per_device):
  """Plain Haiku and optax on one device, on the full batch. Statistics over the whole
  batch (cross_replica_axis) are BatchNorm on one device; per-device statistics are 8
  models on 8 slices (vmap), whose gradients and floating state are averaged, and whose
  counters are equal."""
  model = hk.transform_with_state(haiku_resnet)
  params, model_state = model.init(jax.random.key(0), batches()[0][0])
  loss_fn, tx = haiku_loss(None), haiku_sgd()
  opt_state = tx.init(params)

  @jax.jit
  def step(params, model_state, opt_state, batch):
    grad = jax.grad(loss_fn, has_aux=True)
    if per_device:
      rows = jax.tree.map(lambda v: v.reshape((8, -1) + v.shape[1:]), batch)
      grads, new = jax.vmap(grad, in_axes=(None, None, 0))(params, model_state, rows)
      grads = jax.tree.map(lambda g: g.mean(0), grads)
      model_state = jax.tree.map(
          lambda s: s.mean(0) if jnp.issubdtype(s.dtype, jnp.inexact) else s[0], new)
    else:
      grads, model_state = grad(params, model_state, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), model_state, opt_state

  for batch in batches():
    params, model_state, opt_state = step(params, model_state, opt_state, batch)
  return params, model_state


# Every mode once, and both kinds of statistics (the suite's time is counted).
@pytest.mark.parametrize("mode,per_device", [("packed", False), ("sharded", True),
                                             ("allreduce", True)],
                         ids=["packed-cross_replica_axis", "sharded-per_device",
                              "allreduce-per_device"])
def test_haiku_batch_norm_matches_haiku_on_one_device(mode, per_device):
  # docs/howto/haiku.md: the params (SGD, within 1e-5 relative to each leaf's largest
  # entry) and the state (moving averages within the same, int32 counters exactly) of
  # every mode are those of one device.
  params, model_state = hk.transform_with_state(haiku_resnet).init(
      jax.random.key(0), batches()[0][0])
  dp = jpack.data_parallel(haiku_loss(None if per_device else "batch"), haiku_sgd(),
                           params, jax.make_mesh((8,), ("batch",)), mode=mode)
  state = dp.init(params, model_state)
  for batch in batches():
    state, _ = dp.step(state, batch)
  want_params, want_state = haiku_reference(per_device)
  moved = max(np.abs(np.asarray(a) - np.asarray(b)).max()
              for a, b in zip(jax.tree.leaves(want_params), jax.tree.leaves(params)))
  assert moved > 1e-2  # the reference trained
  got_params, got_state = dp.unpack(state)  # what init took: params and model state
  assert_same_params(got_params, want_params)
  assert_same_params(got_state, want_state)
  assert_same_params(state.model_state, want_state)
  counters = [x for x in jax.tree.leaves(state.model_state) if x.dtype == jnp.int32]
  assert counters and all(int(c) == STEPS for c in counters)


def test_haiku_state_in_the_params_is_refused_naming_where_the_model_state_goes():
  # Haiku's state next to the params: its int32 counters cannot be differentiated, and
  # the error says where the state goes instead.
  params, model_state = hk.transform_with_state(haiku_resnet).init(
      jax.random.key(0), batches()[0][0])
  with pytest.raises(TypeError, match=r"(?s)\['counter'\] has dtype int32.*"
                                      r"dp\.init\(params, model_state\)"):
    jpack.data_parallel(lambda both, batch: 0.0, haiku_sgd(), (params, model_state))


# The pages' code: docs/examples/*.py, shown by the pages with pymdownx.snippets.

def test_every_example_is_shown_by_a_page_and_the_pages_show_only_examples():
  pages = {p: p.read_text() for p in (ROOT / "docs").rglob("*.md")}
  included = {m for text in pages.values()
              for m in re.findall(r'--8<-- "(docs/examples/[\w.]+\.py)(?::\w+)?"', text)}
  assert included == {str(p.relative_to(ROOT)) for p in EXAMPLES}
  for page in ["flax.md", "nnx.md", "equinox.md", "haiku.md"]:  # no code the tests do not run
    text = pages[ROOT / "docs" / "howto" / page]
    for block in re.findall(r"^```py[ \t]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
      assert block.strip().startswith("--8<--"), f"docs/howto/{page}: untested code {block}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, str(example)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, f"{example.relative_to(ROOT)} failed:\n{result.stderr[-5000:]}"


# Mistakes, refused with an error that names the problem and the fix.

class EqxWithInt(eqx.Module):
  linear: eqx.nn.Linear
  classes: int             # a Python int leaf: jpack would pack it as int32

  def __call__(self, x):
    return self.linear(x)[:self.classes]


UNFILTERED = {  # an Equinox model passed whole, and the path of its first non-array leaf
    "function_leaf": (lambda: EqxMLP(jax.random.key(0)), r"\.activation"),
    "int_leaf": (lambda: EqxWithInt(eqx.nn.Linear(FEATURES, CLASSES, key=jax.random.key(0)),
                                    CLASSES), r"\.classes"),
}


@pytest.mark.parametrize("case", list(UNFILTERED))
def test_unfiltered_equinox_model_is_refused_with_its_path(case):
  make, path = UNFILTERED[case]
  with pytest.raises(TypeError, match=path):
    jpack.data_parallel(lambda model, batch: 0.0, tx(), make())


@pytest.mark.parametrize("case", list(UNFILTERED))
def test_unfiltered_equinox_model_error_says_how_to_partition(case):
  # An Equinox user needs the fix, not only the path: split the model first.
  make, _ = UNFILTERED[case]
  with pytest.raises(TypeError, match=r"eqx\.partition\(model, eqx\.is_inexact_array\)"):
    jpack.data_parallel(lambda model, batch: 0.0, tx(), make())


class LinenWithBatchNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(CLASSES)(nn.BatchNorm(use_running_average=True)(x))


def test_flax_variables_with_other_collections_are_refused():
  # {"params": ..., "batch_stats": ...} is a valid tree: jpack would train BatchNorm's
  # running statistics with the optimizer (they normalise the input, so they get
  # gradients) instead of leaving them to BatchNorm. It must be refused when the step is
  # built, naming the collections.
  model = LinenWithBatchNorm()
  variables = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))
  assert set(variables) == {"params", "batch_stats"}

  def loss_fn(variables, batch):
    x, y = batch
    return cross_entropy(model.apply(variables, x), y)

  with pytest.raises(ValueError, match=r"(?s)Flax variables.*'batch_stats'.*\[\"params\"\]"):
    jpack.data_parallel(loss_fn, tx(), variables)


def test_flax_variables_where_params_are_expected_are_refused():
  # model.init(...) returned whole, where the loss expects variables["params"]: refused
  # by the first step at the latest (today Flax refuses it when the loss is traced, with
  # "You should instead pass in your dict's ["params"]"), never trained silently.
  integration = linen()
  variables = {"params": integration.params}
  with pytest.raises((ValueError, flax.errors.FlaxError), match=r'\["params"\]'):
    dp = jpack.data_parallel(integration.loss_fn, tx(), variables)
    dp.step(dp.init(variables), batches()[0])
