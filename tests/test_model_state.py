"""Model state that is not trained (Flax BatchNorm's batch_stats) in data_parallel."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpack

nn = pytest.importorskip("flax.linen")

N = 8


class Net(nn.Module):
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, use_bias=False)(x)   # BatchNorm follows: a bias would do nothing
    x = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name, momentum=0.9)(x)
    return nn.Dense(3)(nn.relu(x))


def _data(rows=64, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(rows, 5)).astype(np.float32) * 2 + 1,
          rng.integers(0, 3, rows).astype(np.int32))


def _variables():
  v = Net().init(jax.random.key(0), jnp.zeros((2, 5)))
  return v["params"], v["batch_stats"]


def _loss_with(model):
  def loss(params, batch_stats, batch):
    x, y = batch
    logits, new = model.apply({"params": params, "batch_stats": batch_stats}, x,
                              mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new["batch_stats"]
  return loss


def _close(a, b):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


def _reference(batches, per_device):
  """Plain Flax + optax on one device. Synchronised BatchNorm is BatchNorm over the whole
  batch; per-device BatchNorm is N models on N slices (vmap), whose gradients and
  statistics are averaged."""
  params, stats = _variables()
  loss = _loss_with(Net())
  tx = optax.adam(1e-2)
  opt = tx.init(params)
  for batch in batches:
    if per_device:
      rows = jax.tree.map(lambda v: v.reshape((N, -1) + v.shape[1:]), batch)
      grads, new = jax.vmap(jax.grad(loss, has_aux=True), in_axes=(None, None, 0))(
          params, stats, rows)
      grads, stats = jax.tree.map(lambda g: g.mean(0), (grads, new))
    else:
      grads, stats = jax.grad(loss, has_aux=True)(params, stats, batch)
    updates, opt = tx.update(grads, opt, params)
    params = optax.apply_updates(params, updates)
  return params, stats


@pytest.mark.parametrize("mode", ["packed", "sharded", "allreduce"])
@pytest.mark.parametrize("synchronised", [True, False], ids=["axis_name", "per_device"])
def test_batch_norm_matches_flax_on_one_device(mode, synchronised):
  batches = [_data(seed=i) for i in range(5)]
  params, stats = _variables()
  model = Net("batch" if synchronised else None)
  dp = jpack.data_parallel(_loss_with(model), optax.adam(1e-2), params, mode=mode)
  state = dp.init(params, stats)
  for batch in batches:
    state, metrics = dp.step(state, batch)
  want_params, want_stats = _reference(batches, per_device=not synchronised)
  _close(state.model_state, want_stats)
  # unpack gives back what init took: (params, model_state), on one device.
  got_params, got_stats = dp.unpack(state)
  _close(got_params, want_params)
  _close(got_stats, want_stats)
  assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(got_stats))
  assert np.isfinite(metrics["loss"])


def test_accumulated_micro_batches_update_the_state_in_turn():
  k = 2
  params, stats = _variables()
  dp = jpack.data_parallel(_loss_with(Net("batch")), optax.sgd(0.1), params,
                           mode="packed", accumulate=k)
  batch = _data()
  state, _ = dp.step(dp.init(params, stats), batch)
  # Micro-batch j is rows j of every device's k groups: BatchNorm over them, in turn.
  loss = _loss_with(Net())
  micro = jax.tree.map(lambda v: v.reshape((N, k, -1) + v.shape[1:]), batch)
  total = jax.tree.map(jnp.zeros_like, params)
  want_stats = stats
  for j in range(k):
    rows = jax.tree.map(lambda v: v[:, j].reshape((-1,) + v.shape[3:]), micro)
    grads, want_stats = jax.grad(loss, has_aux=True)(params, want_stats, rows)
    total = jax.tree.map(jnp.add, total, grads)
  want = jax.tree.map(lambda p, g: p - 0.1 * g / k, params, total)
  got_params, got_stats = dp.unpack(state)
  _close(got_params, want)
  _close(got_stats, want_stats)
  _close(state.model_state, want_stats)


def test_init_takes_a_model_state_exactly_when_the_loss_does():
  params, stats = _variables()
  dp = jpack.data_parallel(_loss_with(Net()), optax.sgd(0.1), params)
  with pytest.raises(TypeError, match=r"takes 3 arguments, but init got no model state.*"
                     r"dp.init\(params, model_state\)"):
    dp.init(params)
  assert jax.tree.structure(dp.init(params, stats).model_state) == jax.tree.structure(stats)
  plain = jpack.data_parallel(lambda p, b: jnp.sum(p["Dense_1"]["bias"]), optax.sgd(0.1),
                              params)
  with pytest.raises(TypeError, match=r"takes 2 arguments, but init got a model state.*"
                     r"Call dp.init\(params\) without one"):
    plain.init(params, stats)
  assert plain.init(params).model_state is None
