"""data_parallel: every mode equals a single-device full-batch reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpack


def init_cnn(key, hidden=16):
  """A small real model: conv -> relu -> pool -> dense, in pure JAX. With
  ``hidden=4096`` dense1's matrix is 1 MiB, which gets a bucket of its own."""
  k1, k2, k3 = jax.random.split(key, 3)
  return {"conv": {"w": jax.random.normal(k1, (3, 3, 1, 4)) * 0.3, "b": jnp.zeros(4)},
          "dense1": {"w": jax.random.normal(k2, (64, hidden)) * 0.1, "b": jnp.zeros(hidden)},
          "dense2": {"w": jax.random.normal(k3, (hidden, 3)) * 0.1, "b": jnp.zeros(3)}}


def loss_fn(params, batch):
  x, y = batch
  h = jax.lax.conv_general_dilated(x, params["conv"]["w"], (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  h = jax.nn.relu(h + params["conv"]["b"])
  h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
  h = jax.nn.relu(h.reshape(h.shape[0], -1) @ params["dense1"]["w"] + params["dense1"]["b"])
  logits = h @ params["dense2"]["w"] + params["dense2"]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def data(steps, batch=16):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(steps, batch, 8, 8, 1)).astype(np.float32)
  y = (x.reshape(steps, batch, -1).mean(-1) > 0).astype(np.int32) + (x[..., 0, 0, 0] > 1)
  return x, y.astype(np.int32)


def reference(params, steps, tx):
  """One device, full batch: what data parallelism must reproduce."""
  x, y = data(steps)
  state = tx.init(params)
  losses = []
  for i in range(steps):
    loss, g = jax.value_and_grad(loss_fn)(params, (x[i], y[i]))
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
    losses.append(float(loss))
  return params, losses


@pytest.mark.parametrize("mode", ["packed", "allreduce", "sharded"])
def test_every_mode_matches_single_device_training(mode):
  _check_matches_single_device_training(mode)


def _check_matches_single_device_training(mode):
  params = init_cnn(jax.random.key(0))
  steps = 12
  want, want_losses = reference(params, steps, optax.adam(1e-2))
  mesh = jax.make_mesh((8,), ("batch",))
  dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh, mode=mode)
  state = dp.init(params)
  x, y = data(steps)
  for i in range(steps):
    batch = jax.device_put((x[i], y[i]), NamedSharding(mesh, P("batch")))
    state, metrics = dp.step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), want_losses[i], rtol=1e-4)
  got = dp.unpack(state)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
  assert int(state.step) == steps
  return state


def _array_copies(hlo):
  """Copies of arrays in the compiled step's entry computation (a scalar copy, such as
  the gradient norm returned both as a metric and in the state, costs nothing)."""
  return re.findall(r"= \w+\[\d[\d,]*\][^ ]* copy\(", hlo[hlo.index("ENTRY"):])


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_packed_steps_update_parameter_buckets_in_place(mode):
  # Buckets holding a single leaf are unpacked as views. If an update may run before
  # the backward reads of that weight, XLA guards each such bucket with a full copy
  # per step; the step orders updates after the backward pass, so there is none.
  # dense1's 1 MiB matrix gets a bucket of its own (the platform's plan on CPU).
  params = init_cnn(jax.random.key(0), hidden=4096)
  mesh = jax.make_mesh((8,), ("batch",))
  dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh, mode=mode)
  solo = [b.slots for b in dp.layout.buckets if len(b.slots) == 1]
  assert [dp.layout.slots[j].path for (j,) in solo] == ["['dense1']['w']"]
  x, y = data(1)
  batch = jax.device_put((x[0], y[0]), NamedSharding(mesh, P("batch")))
  hlo = jax.jit(dp.step, donate_argnums=0).lower(dp.init(params), batch).compile().as_text()
  assert _array_copies(hlo) == []


def test_step_places_host_batches_and_names_bad_ones():
  params = init_cnn(jax.random.key(0))
  want, want_losses = reference(params, 1, optax.adam(1e-2))
  mesh = jax.make_mesh((8,), ("batch",))
  x, y = data(1)
  for batch in [(x[0], y[0]), (jnp.asarray(x[0]), jnp.asarray(y[0]))]:  # host, one device
    dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh)
    state, metrics = dp.step(dp.init(params), batch)
    np.testing.assert_allclose(float(metrics["loss"]), want_losses[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
  with pytest.raises(ValueError, match=r"Batch leaf at \[1\] has shape \(12,\).*8 devices"):
    dp.step(state, (x[0], y[0][:12]))
  with pytest.raises(ValueError, match=r"Batch leaf at \[1\] has shape \(\)"):
    dp.step(state, (x[0], np.int32(3)))


def loss_with_aux(params, batch):
  """The loss, plus metrics: accuracy and a value that reads the params (weight norm)."""
  x, y = batch
  loss = loss_fn(params, batch)
  h = jax.lax.conv_general_dilated(x, params["conv"]["w"], (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return loss, {"mean_act": jnp.mean(h), "w_norm": jnp.sum(params["dense1"]["w"] ** 2),
                "correct": jnp.sum(y == 0)}


@pytest.mark.parametrize("mode", ["packed", "allreduce", "sharded"])
def test_has_aux_metrics_are_averaged_over_devices(mode):
  params = init_cnn(jax.random.key(0), hidden=4096)  # dense1's matrix in a bucket of its own
  mesh = jax.make_mesh((8,), ("batch",))
  dp = jpack.data_parallel(loss_with_aux, optax.adam(1e-2), params, mesh, mode=mode,
                           has_aux=True)
  x, y = data(1)
  state = dp.init(params)
  _, metrics = dp.step(state, (x[0], y[0]))
  # Reference: each device's aux on its 2 rows, averaged in numpy.
  per_device = [loss_with_aux(params, (x[0][2 * d:2 * d + 2], y[0][2 * d:2 * d + 2]))[1]
                for d in range(8)]
  for key in ["mean_act", "w_norm", "correct"]:
    want = np.mean([np.asarray(a[key], np.float64) for a in per_device])
    np.testing.assert_allclose(float(metrics["aux"][key]), want, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["loss"]), float(loss_fn(params, (x[0], y[0]))),
                             rtol=1e-5)
  if mode in ("packed", "sharded"):  # aux reading the params adds no parameter copy
    hlo = jax.jit(dp.step, donate_argnums=0).lower(
        dp.init(params), jax.device_put((x[0], y[0]), NamedSharding(mesh, P("batch")))
    ).compile().as_text()
    assert _array_copies(hlo) == []


@pytest.mark.parametrize("mode", ["packed", "allreduce", "sharded"])
def test_gradient_accumulation_with_optax_multisteps(mode):
  params = init_cnn(jax.random.key(0))
  steps = 6
  tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3)
  want, _ = reference(params, steps, tx.gradient_transformation())
  mesh = jax.make_mesh((8,), ("batch",))
  dp = jpack.data_parallel(loss_fn, tx.gradient_transformation(), params, mesh, mode=mode)
  state = dp.init(params)
  x, y = data(steps)
  for i in range(steps):
    state, _ = dp.step(state, (x[i], y[i]))
  for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
  with pytest.raises(TypeError, match=r"got MultiSteps \(for optax.MultiSteps, pass its"):
    jpack.data_parallel(loss_fn, tx, params, mesh, mode=mode)


def test_non_float_params_are_refused_with_their_path():
  params = {"w": jnp.ones((2, 2)), "count": jnp.zeros((), jnp.int32)}
  with pytest.raises(TypeError, match=r"Param leaf at \['count'\] has dtype int32"):
    jpack.data_parallel(lambda p, b: jnp.sum(p["w"]), optax.sgd(0.1), params,
                        jax.make_mesh((8,), ("batch",)))
  with pytest.raises(TypeError, match=r"Param leaf at \['n'\] has dtype int32"):
    jpack.data_parallel(lambda p, b: 0.0, optax.sgd(0.1), {"w": jnp.ones(2), "n": 3})
  with pytest.raises(TypeError, match=r"Leaf at \['f'\] is a function, not an array"):
    jpack.data_parallel(lambda p, b: 0.0, optax.sgd(0.1), {"w": jnp.ones(2), "f": lambda x: x})


@pytest.mark.parametrize("transform", ["sharded", "flat"])
def test_jpack_transforms_in_a_hand_written_step_update_in_place(transform):
  # The same guarantee for users who write their own step around jpack's transforms.
  params = init_cnn(jax.random.key(0))
  mesh = jax.make_mesh((8,), ("batch",))
  packed = jpack.pack(params, jpack.plan(params, num_shards=8, solo_bytes=1))
  if transform == "sharded":
    tx = jpack.optax.sharded(optax.adam(1e-2), "batch")
  else:
    tx = optax.chain(jpack.optax.allreduce("batch"), jpack.optax.flat(optax.adam(1e-2)))
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
  specs = jax.tree.map(lambda x: P("batch") if x.ndim else P(), jax.eval_shape(init, packed))
  opt_state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs,
                                    check_vma=False))(packed)

  def step(p, s, batch):
    varying = jax.lax.pcast(p, "batch", to="varying")
    grads = jax.grad(lambda q: loss_fn(jpack.unpack(q), batch))(varying)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("batch")),
                               out_specs=(P(), specs), check_vma=False), donate_argnums=(0, 1))
  x, y = data(1)
  batch = jax.device_put((x[0], y[0]), NamedSharding(mesh, P("batch")))
  hlo = step.lower(packed, opt_state, batch).compile().as_text()
  assert _array_copies(hlo) == []


def test_hand_written_pmap_step_matches_single_device_training():
  # jax.pmap stays a supported way to write a step by hand: jpack.pmean under pmap.
  params = init_cnn(jax.random.key(1))
  steps = 3
  tx = optax.adam(1e-2)
  want, _ = reference(params, steps, tx)

  def local_step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    grads = jpack.pmean(grads, "batch")          # one collective per bucket
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.pmap(local_step, axis_name="batch")
  n = jax.device_count()
  assert n == 8
  replicate = lambda tree: jax.tree.map(lambda x: jnp.stack([x] * n), tree)
  p, s = replicate(params), replicate(tx.init(params))
  x, y = data(steps)
  for i in range(steps):
    batch = jax.tree.map(lambda v: v.reshape((n, -1) + v.shape[1:]), (x[i], y[i]))
    p, s = step(p, s, batch)
  assert jax.tree.structure(p) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(want)):
    a = np.asarray(a)
    assert a.shape == (n,) + b.shape
    for d in range(n):  # every device holds the same params, one-device optax's
      np.testing.assert_allclose(a[d], np.asarray(b), rtol=1e-5, atol=1e-7)


def test_grad_norm_metric_is_the_global_norm_of_the_mean_gradient():
  params = init_cnn(jax.random.key(2))
  x, y = data(1)
  want = optax.tree.norm(jax.grad(loss_fn)(params, (x[0], y[0])))
  mesh = jax.make_mesh((8,), ("batch",))
  for mode in ("allreduce", "packed", "sharded"):
    dp = jpack.data_parallel(loss_fn, optax.sgd(0.0), params, mesh, mode=mode)
    _, metrics = dp.step(dp.init(params), jax.device_put((x[0], y[0]),
                                                         NamedSharding(mesh, P("batch"))))
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(want), rtol=1e-4)


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_bf16_wire_trains_like_the_reference_to_bf16_rounding(mode):
  params = init_cnn(jax.random.key(3))
  steps = 4
  want, _ = reference(params, steps, optax.sgd(0.1))
  mesh = jax.make_mesh((8,), ("batch",))
  dp = jpack.data_parallel(loss_fn, optax.sgd(0.1), params, mesh, mode=mode,
                           precision=jpack.Precision(comm_dtype=jnp.bfloat16))
  state = dp.init(params)
  x, y = data(steps)
  for i in range(steps):
    state, _ = dp.step(state, jax.device_put((x[i], y[i]), NamedSharding(mesh, P("batch"))))
  got = dp.unpack(state)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype == jnp.float32
    # sgd(0.1) x 4 steps of gradients rounded to bf16 (2**-8 relative) on the wire
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-2, atol=2e-3)
  # and the compiled step really moves 16-bit words
  hlo = jax.jit(dp.step).lower(state, jax.device_put((x[0], y[0]), NamedSharding(
      mesh, P("batch")))).compile().as_text()
  assert "u16[" in hlo


def test_initial_params_are_broadcast_from_device_0():
  """Each device starts from different values; after init all hold device 0's."""
  mesh = jax.make_mesh((8,), ("batch",))
  params = {"w": jnp.zeros(3)}
  dp = jpack.data_parallel(lambda p, b: jnp.sum(p["w"] * b), optax.sgd(0.1), params, mesh,
                           mode="allreduce")
  # Simulate processes that initialised differently: device i holds i + 1.
  per_device = [jax.device_put(np.full(3, i + 1, np.float32), d) for i, d in
                enumerate(mesh.devices.flat)]
  w = jax.make_array_from_single_device_arrays((3,), NamedSharding(mesh, P()), per_device)
  state = dp.init({"w": w})
  assert len(state.params["w"].addressable_shards) == 8
  for shard in state.params["w"].addressable_shards:
    np.testing.assert_array_equal(shard.data, np.full(3, 1.0))


def test_bad_mode_and_mesh():
  params = init_cnn(jax.random.key(0))
  with pytest.raises(ValueError, match="mode must be one of"):
    jpack.data_parallel(loss_fn, optax.sgd(0.1), params, mode="zero3")
  with pytest.raises(ValueError, match="mode must be one of"):
    jpack.data_parallel(loss_fn, optax.sgd(0.1), params, mode=jpack.Mode("zero3"))
  for removed in ("per_leaf", "ravel"):  # baselines live in benchmarks/, not in the API
    with pytest.raises(ValueError, match="mode must be one of"):
      jpack.data_parallel(loss_fn, optax.sgd(0.1), params, mode=removed)
  with pytest.raises(TypeError, match=r"mode must be one of .* or a jpack.Mode, got int"):
    jpack.data_parallel(loss_fn, optax.sgd(0.1), params, mode=1)
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, got str"):
    jpack.data_parallel(loss_fn, optax.sgd(0.1), params, "batch")


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_the_axis_comes_from_the_mesh(mode):
  # No axis_name: a mesh over an axis of any name is the data-parallel axis.
  params = init_cnn(jax.random.key(0))
  want, want_losses = reference(params, 1, optax.adam(1e-2))
  mesh = jax.make_mesh((8,), ("data",))
  dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh, mode=mode)
  x, y = data(1)
  state, metrics = dp.step(dp.init(params), (x[0], y[0]))
  np.testing.assert_allclose(float(metrics["loss"]), want_losses[0], rtol=1e-5)
  assert state.params.buckets[0].sharding.mesh.axis_names == ("data",)
  for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_a_mesh_with_a_second_axis_trains_when_that_axis_has_size_one():
  params = init_cnn(jax.random.key(0))
  want, want_losses = reference(params, 2, optax.adam(1e-2))
  with pytest.raises(ValueError, match=r"one data-parallel axis, or two .*the mesh "
                     r"\{'batch': 2, 'model': 2, 'x': 2\} has 3 axes of size > 1"):
    jpack.data_parallel(loss_fn, optax.adam(1e-2), params,
                        jax.make_mesh((2, 2, 2), ("batch", "model", "x")))
  mesh = jax.make_mesh((8, 1), ("batch", "model"))
  dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh)
  state = dp.init(params)
  x, y = data(2)
  for i in range(2):  # host batches: split over the 8 devices of 'batch'
    state, metrics = dp.step(state, (x[i], y[i]))
    np.testing.assert_allclose(float(metrics["loss"]), want_losses[i], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


_UNSYNCED_LOOP = """
import jax, jax.numpy as jnp, numpy as np, optax, jpack
jax.config.update("jax_num_cpu_devices", 8)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype(np.float32)
y = x.sum(1, keepdims=True)
params = {"w": np.zeros((8, 1), np.float32), "b": np.zeros(1, np.float32)}
loss_fn = lambda p, batch: jnp.mean((batch[0] @ p["w"] + p["b"] - batch[1]) ** 2)
tx = optax.adam(1e-2)
ref, s = jax.tree.map(jnp.asarray, params), tx.init(params)
for _ in range(150):  # one device, full batch: the reference
    u, s = tx.update(jax.grad(loss_fn)(ref, (x, y)), s, ref)
    ref = optax.apply_updates(ref, u)
for mode in ["packed", "sharded", "allreduce"]:
    dp = jpack.data_parallel(loss_fn, tx, params, mode=mode)
    state = dp.init(params)
    mesh = jax.make_mesh((8,), ("batch",))
    # Placed once: no transfer per step.
    batch = jax.device_put((x, y), jax.NamedSharding(mesh, jax.P("batch")))
    for _ in range(150):  # never synchronised by the loop itself
        state, metrics = dp.step(state, batch)
    got = dp.unpack(state)
    for k in ref:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), atol=1e-5)
print("ok")
"""


def test_steps_dispatched_without_synchronising_do_not_deadlock(tmp_path):
  # XLA:CPU aborted a loop of ~40 queued collective steps ("Expected 8 threads to join
  # the rendezvous"); data_parallel's step bounds the queue. A subprocess: the abort
  # would take pytest with it.
  import subprocess
  import sys
  script = tmp_path / "loop.py"
  script.write_text(_UNSYNCED_LOOP)
  out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().endswith("ok")


@pytest.mark.parametrize("mode", ["sharded", "packed", "allreduce"])
def test_init_can_be_traced_by_eval_shape_and_jit(mode):
  params = init_cnn(jax.random.key(0))
  dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mode=mode)
  real = dp.init(params)
  shapes = jax.eval_shape(dp.init, params)  # e.g. `like=` for restoring a checkpoint
  assert jax.tree.structure(shapes) == jax.tree.structure(real)
  for a, b in zip(jax.tree.leaves(shapes), jax.tree.leaves(real)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
  jitted = jax.jit(dp.init)(params)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(real)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["allreduce", "packed", "sharded"])
def test_a_zero1_optimizer_inside_the_step_is_refused(mode):
  # jpack.optax.sharded reduce-scatters too: inside mode="sharded" it re-planned each
  # device's slice and summed different devices' slices (wrong params, silently).
  params = init_cnn(jax.random.key(0))
  with pytest.raises(TypeError, match="jpack.optax.sharded cannot run inside data_parallel"):
    jpack.data_parallel(loss_fn, jpack.optax.sharded(optax.sgd(1e-2), "batch"), params,
                        mode=mode)


@pytest.mark.parametrize("mode", ["allreduce", "packed", "sharded"])
def test_optax_clip_by_global_norm_clips_by_the_whole_gradients_norm(mode):
  # Every device holds the whole gradient outside mode="sharded", a 1/N slice of it in
  # "sharded": either way the norm must be the whole mean gradient's, as on one device
  # (a norm summed over the axis would be sqrt(8) times too big; one of a slice, too small).
  params = init_cnn(jax.random.key(0))
  steps = 3
  x, y = data(steps)
  norm = float(optax.tree.norm(jax.grad(loss_fn)(params, (x[0], y[0]))))
  max_norm = norm / 4  # clipping is on at every step
  make = lambda: optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(0.5))
  want, want_losses = reference(params, steps, make())
  dp = jpack.data_parallel(loss_fn, make(), params, mode=mode)
  state = dp.init(params)
  for i in range(steps):
    state, metrics = dp.step(state, (x[i], y[i]))
    np.testing.assert_allclose(float(metrics["loss"]), want_losses[i], rtol=1e-4)
    assert float(metrics["grad_norm"]) > max_norm
  for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_a_mask_built_at_update_time_runs_on_the_leaves(mode):
  # inject_hyperparams builds adamw(mask=fn) at every update, so the name walk never saw
  # optax.masked; on 1-D buckets no leaf has ndim > 1 and weight decay was dropped. flat
  # (mode="packed") runs it on the leaves, as optax does; ZeRO-1 on each device's own
  # whole leaves.
  params = init_cnn(jax.random.key(0))
  tx = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
      learning_rate=1e-2, weight_decay=0.1,
      mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
  # It matches plain optax; without the decay on the matrices it would be off by
  # 1e-3 * w.
  x, y = data(1)
  want, _ = reference(params, 1, tx)
  dp = jpack.data_parallel(loss_fn, tx, params, mode=mode)
  state, _ = dp.step(dp.init(params), (x[0], y[0]))
  for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("mode", ["allreduce", "packed", "sharded"])
def test_an_optimizer_that_reduces_again_is_refused(mode):
  # The step reduces the gradients itself: a jpack.optax.allreduce in the optimizer
  # would reduce them twice (with mean=False, N times the gradient).
  params = init_cnn(jax.random.key(0))
  for tx in (optax.chain(jpack.optax.allreduce("batch"), optax.adam(1e-2)),
             optax.chain(jpack.optax.allreduce("batch", mean=False), optax.sgd(1e-2))):
    with pytest.raises(TypeError, match="allreduce cannot run inside data_parallel"):
      jpack.data_parallel(loss_fn, tx, params, mode=mode)


@pytest.mark.parametrize("mode", ["packed", "sharded", "allreduce"])
def test_scalar_parameters_train_and_read_back_on_the_default_mesh(mode):
  # A replicated bucket on an Explicit mesh has spec P(None,), which a 0-d leaf cannot
  # take: reading the params back placed each leaf with it and failed.
  params = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3),
            "temperature": np.float32(1.5)}
  loss = lambda p, x: jnp.mean((x @ p["w"]) * p["temperature"]) ** 2
  x = np.arange(32, dtype=np.float32).reshape(8, 4) / 32
  dp = jpack.data_parallel(loss, optax.sgd(0.1), params, mode=mode)
  state = dp.init(params)
  for k, v in dp.unpack(state).items():
    np.testing.assert_array_equal(np.asarray(v), params[k])
  state, _ = dp.step(state, x)
  g = jax.grad(loss)(params, x)  # one device, full batch: the reference
  got = dp.unpack(state)
  assert got["temperature"].shape == ()
  # One device's arrays: usable outside jit next to arrays the user made.
  assert all(len(v.sharding.device_set) == 1 for v in got.values())
  np.testing.assert_array_equal(got["w"] + jnp.ones((4, 3)), np.asarray(got["w"]) + 1)
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k]), params[k] - 0.1 * np.asarray(g[k]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["packed", "sharded", "allreduce"])
def test_aux_metrics_are_true_means_and_used_states_are_refused(mode):
  params = {"w": np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)}
  x = np.arange(32, dtype=np.float32).reshape(8, 4) / 32

  def loss(p, batch):
    x, keys = batch
    noise = jax.vmap(lambda k: jax.random.uniform(k))(keys)  # keys in the batch
    value = jnp.mean((x @ p["w"]) ** 2) + 0 * noise.sum()
    # A Python scalar, and a uint8 whose sum over 8 devices would wrap (8 * 200).
    return value, {"lr": 0.5, "u8": jnp.uint8(200), "n": x.shape[0]}

  dp = jpack.data_parallel(loss, optax.sgd(0.1), params, mode=mode, has_aux=True)
  state = dp.init(params)
  new, metrics = dp.step(state, (x, jax.random.split(jax.random.key(0), 8)))
  assert float(metrics["aux"]["lr"]) == 0.5 and float(metrics["aux"]["u8"]) == 200.0
  assert float(metrics["aux"]["n"]) == 1.0  # one row per device
  # `state` was donated to the step: reusing it is a clear error, not a crash.
  with pytest.raises(RuntimeError, match="already passed to step"):
    dp.step(state, (x, jax.random.split(jax.random.key(0), 8)))
  dp.step(new, (x, jax.random.split(jax.random.key(1), 8)))


def test_a_prng_key_or_a_string_in_aux_is_refused_with_its_path():
  params = {"w": np.ones((4, 2), np.float32)}
  loss = lambda p, x: (jnp.mean(x @ p["w"]), {"key": jax.random.key(0)})
  dp = jpack.data_parallel(loss, optax.sgd(0.1), params, has_aux=True)
  with pytest.raises(TypeError, match=r"aux at \['key'\] is a PRNG key"):
    dp.step(dp.init(params), np.ones((8, 4), np.float32))
  text = lambda p, x: (jnp.mean(x @ p["w"]), {"acc": 1.0, "tag": "train"})
  dp = jpack.data_parallel(text, optax.sgd(0.1), params, has_aux=True)
  with pytest.raises(TypeError, match=r"aux at \['tag'\] is str 'train', not a number"):
    dp.step(dp.init(params), np.ones((8, 4), np.float32))


def test_init_checks_params_against_the_layout_and_a_dict_optimizer_is_refused():
  params = {"w": np.ones((4, 2), np.float32), "b": np.zeros(2, np.float32)}
  loss = lambda p, x: jnp.mean(x @ p["w"] + p["b"])
  dp = jpack.data_parallel(loss, optax.sgd(0.1), params)
  # device_put would have made a float64 numpy leaf float32 silently.
  with pytest.raises(TypeError, match=r"\['b'\] has dtype float64"):
    dp.init({"w": params["w"], "b": np.zeros(2, np.float64)})
  # Leaves are grouped by labels through jpack.optax.partition only: a dict of
  # transformations has no labels, and plan options are not data_parallel's.
  with pytest.raises(TypeError, match=r"A dict of transformations needs the labels.*"
                     r"jpack.optax.partition\(transforms, param_labels\)"):
    jpack.data_parallel(loss, {"a": optax.sgd(0.1)}, params)
  with pytest.raises(TypeError, match="group_fn"):
    jpack.data_parallel(loss, optax.sgd(0.1), params, group_fn=lambda p, x: "a")


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_a_tree_where_packed_modes_keep_a_packed_gets_a_clear_error(mode):
  params = init_cnn(jax.random.key(0))
  dp = jpack.data_parallel(loss_fn, optax.sgd(1e-2), params, mode=mode)
  fresh = dp.init(params)
  x, y = data(1)
  with pytest.raises(TypeError, match=r"TrainState.params is a dict.*jpack.pack\(tree, dp.layout\)"):
    dp.step(fresh._replace(params=params), (x[0], y[0]))
  state, _ = dp.step(fresh._replace(params=jpack.pack(params, dp.layout)), (x[0], y[0]))
  want, _ = reference(params, 1, optax.sgd(1e-2))
  for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("where", ["host", "device 0", "opt_state on device 0"])
@pytest.mark.parametrize("mesh_axis_type", ["default", "Auto"])
@pytest.mark.parametrize("mode", ["sharded", "packed", "allreduce"])
def test_a_restored_state_steps_on(mode, mesh_axis_type, where):
  # jax.device_get(state) (a checkpoint read back as numpy), or that copy put on one
  # device: the step places it again, splitting ZeRO-1's slices over the axis.
  params = init_cnn(jax.random.key(0))
  want, want_losses = reference(params, 3, optax.adam(1e-2))
  mesh = (jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
          if mesh_axis_type == "Auto" else None)
  dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh, mode=mode)
  x, y = data(3)
  state, _ = dp.step(dp.init(params), (x[0], y[0]))
  restored = jax.device_get(state)
  assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(restored.opt_state))
  if where == "device 0":
    restored = jax.device_put(restored, jax.devices()[0])
  if where == "opt_state on device 0":  # params and counter still placed by the step
    restored = state._replace(opt_state=jax.device_put(restored.opt_state, jax.devices()[0]))
  for i in (1, 2):
    restored, metrics = dp.step(restored, (x[i], y[i]))
    np.testing.assert_allclose(float(metrics["loss"]), want_losses[i], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(dp.unpack(restored)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("mode", ["packed", "sharded", "allreduce"])
@pytest.mark.parametrize("name", ["reduce_on_plateau", "polyak_sgd", "multisteps"])
def test_optimizers_that_read_the_loss_get_it_as_value(name, mode):
  # optax passes the loss as update(..., value=loss); the step gives the mean loss over
  # the devices, which is the full batch's loss, as in one-device training.
  # MultiSteps(...).gradient_transformation() is a plain GradientTransformation whose
  # update passes **extra_args on: optax.with_extra_args_support alone would drop them.
  def make():
    if name == "polyak_sgd":
      return optax.polyak_sgd(max_learning_rate=0.5)
    plateau = optax.chain(optax.sgd(0.3), optax.contrib.reduce_on_plateau(
        patience=1, factor=0.5, cooldown=0, accumulation_size=1, rtol=1e-3))
    if name == "multisteps":
      return optax.MultiSteps(plateau, every_k_schedule=2).gradient_transformation()
    return plateau
  params = init_cnn(jax.random.key(0))
  if mode == "sharded" and name == "polyak_sgd":
    # Its step size needs the whole gradient's norm; ZeRO-1 holds a slice per device.
    with pytest.raises(TypeError, match="scale_by_polyak cannot run inside"):
      jpack.data_parallel(loss_fn, make(), params, mode=mode)
    return
  steps = 8
  x, y = data(steps)
  tx = make()
  want, opt_state = params, tx.init(params)
  for i in range(steps):
    loss, g = jax.value_and_grad(loss_fn)(want, (x[i], y[i]))
    u, opt_state = tx.update(g, opt_state, want, value=loss)
    want = optax.apply_updates(want, u)
  if name == "reduce_on_plateau":
    assert float(opt_state[1].scale) < 1.0  # the plateau was reached: value was read
  dp = jpack.data_parallel(loss_fn, make(), params, mode=mode)
  state = dp.init(params)
  for i in range(steps):
    state, _ = dp.step(state, (x[i], y[i]))
  for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("mode", ["sharded", "packed", "allreduce"])
def test_the_step_runs_under_an_outer_jit(mode, axis_type):
  # Traced batches and states are moved to the step's shardings: jax.reshard on
  # Explicit mesh axes, a sharding constraint on Auto ones (reshard refuses those).
  params = init_cnn(jax.random.key(0))
  want, want_losses = reference(params, 2, optax.adam(1e-2))
  mesh = jax.make_mesh((8,), ("batch",),
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  dp = jpack.data_parallel(loss_fn, optax.adam(1e-2), params, mesh, mode=mode)
  step = jax.jit(dp.step)
  state = dp.init(params)
  x, y = data(2)
  for i in range(2):
    state, metrics = step(state, (x[i], y[i]))
    np.testing.assert_allclose(float(metrics["loss"]), want_losses[i], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
