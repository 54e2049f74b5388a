"""Gradient accumulation in data_parallel: k micro-batches, one reduction per step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpack

N = 8
K = 4
# A 1 MiB float32 embedding table: the platform's plan (jpack.step_options) gives it a
# bucket of its own, so the params fill several buckets. A lookup's gradient rows are
# sums of a few rows, which adam follows as closely on 8 devices as on one.
VOCAB = 16384


def _params(key=0):
  keys = jax.random.split(jax.random.key(key), 3)
  return {"w1": jax.random.normal(keys[0], (6, 16)) / 3, "b1": jnp.zeros(16),
          "embed": jax.random.normal(keys[2], (VOCAB, 16)) / 4,
          "w2": jax.random.normal(keys[1], (16, 5)) / 4, "b2": jnp.zeros(5),
          "scale": jnp.ones(5)}


def _loss(params, batch):
  x, y, ids = batch
  h = jnp.tanh(x @ params["w1"] + params["b1"] + params["embed"][ids])
  out = (h @ params["w2"] + params["b2"]) * params["scale"]
  loss = jnp.mean((out - y) ** 2)
  return loss, {"mae": jnp.mean(jnp.abs(out - y))}


def _batch(key, rows):
  kx, ky, ki = jax.random.split(jax.random.key(key), 3)
  return (jax.random.normal(kx, (rows, 6)), jax.random.normal(ky, (rows, 5)),
          jax.random.randint(ki, (rows,), 0, VOCAB))


def _reference(params, batches, lr=1e-2):
  """One device, plain optax: adam on the gradient of the mean loss over the whole batch."""
  tx = optax.adam(lr)
  state = tx.init(params)
  for batch in batches:
    (loss, aux), grads = jax.value_and_grad(_loss, has_aux=True)(params, batch)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, loss, aux


CASES = ["allreduce", "packed", "sharded", jpack.Mode("sharded", shard_accumulator=True)]


@pytest.mark.parametrize("mode", CASES, ids=["allreduce", "packed", "sharded", "zero2"])
def test_k_micro_batches_give_the_update_of_the_whole_batch(mode):
  params = _params()
  batches = [_batch(i, N * K * 2) for i in range(4)]
  dp = jpack.data_parallel(_loss, optax.adam(1e-2), params, mode=mode, has_aux=True,
                           accumulate=K)
  assert len(dp.layout.buckets) > 1
  state = dp.init(params)
  for batch in batches:
    state, metrics = dp.step(state, batch)
  want, loss, aux = _reference(params, batches)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
               dp.unpack(state), want)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
  np.testing.assert_allclose(metrics["aux"]["mae"], aux["mae"], rtol=1e-5)


def test_accumulating_bf16_params_matches_reference_of_the_same_policy():
  """bf16 params, f32 masters: each micro-batch's bf16 gradient is added in f32."""
  params = _params(1)
  batches = [_batch(10 + i, N * K * 2) for i in range(10)]

  def loss(p, batch):
    p = jax.tree.map(lambda v: v.astype(jnp.float32), p)  # bf16 values, f32 arithmetic
    return _loss(p, batch)[0]

  dp = jpack.data_parallel(loss, optax.adam(1e-2), params, mode="sharded", accumulate=K,
                           precision=jpack.Precision(param_dtype=jnp.bfloat16))
  state = dp.init(params)
  for batch in batches:
    state, _ = dp.step(state, batch)

  tx, masters = optax.adam(1e-2), params
  opt = tx.init(masters)
  for batch in batches:
    narrow = jpack.cast_params(masters, jnp.bfloat16)
    rows = jax.tree.map(lambda v: v.reshape((N * K, -1) + v.shape[1:]), batch)
    grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(narrow, rows)
    grads = jax.tree.map(lambda g: jnp.mean(g.astype(jnp.float32), axis=0), grads)
    updates, opt = tx.update(grads, opt, masters)
    masters = optax.apply_updates(masters, updates)
  want = jpack.cast_params(masters, jnp.bfloat16)
  for a, b in zip(jax.tree.leaves(dp.unpack(state)), jax.tree.leaves(want)):
    assert a.dtype == jnp.bfloat16
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.abs(a - b) <= np.abs(b) * 2.0 ** -7 + 1e-6)


# -- the compiled program: where the gradient collectives run ---------------------------

_COLLECTIVE = re.compile(r"= [^=]*? (all-reduce|reduce-scatter|all-gather|all-to-all)"
                         r"(?:-start)?\(")


def _computations(hlo):
  """{name: body lines} of every computation in compiled HLO text."""
  out, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m and not line.startswith(" "):
      name = "ENTRY" if line.startswith("ENTRY") else m.group(1)
      out[name] = []
    elif name is not None and line.startswith(" "):
      out[name].append(line)
  return out


def _calls(lines):
  return set(re.findall(r"(?:body|condition|to_apply|calls|branch_computations)="
                        r"\{?%([\w.\-]+)", "\n".join(lines)))


def _reachable(computations, roots):
  seen, todo = set(), list(roots)
  while todo:
    c = todo.pop()
    if c not in seen and c in computations:
      seen.add(c)
      todo.extend(_calls(computations[c]))
  return seen


def _collectives(computations, names):
  return sorted(m.group(1) for c in names for line in computations[c]
                if (m := _COLLECTIVE.search(line)))


def _loop(hlo):
  """The collectives inside the micro-batch loop, its trip count, and the collectives
  outside it."""
  comps = _computations(hlo)
  whiles = [line for line in comps["ENTRY"] if " while(" in line]
  assert len(whiles) == 1, whiles
  body = re.search(r"body=%([\w.\-]+)", whiles[0]).group(1)
  trips = int(re.search(r'"known_trip_count":\{"n":"(\d+)"\}', whiles[0]).group(1))
  inside = _reachable(comps, [body])
  outside = _reachable(comps, ["ENTRY"]) - inside
  return _collectives(comps, inside), trips, _collectives(comps, outside)


def _compiled(mode, accumulate):
  params = _params()
  dp = jpack.data_parallel(_loss, optax.adam(1e-2), params, mode=mode, has_aux=True,
                           accumulate=accumulate)
  assert len(dp.layout.buckets) > 1
  batch = _batch(0, N * K * 2)
  hlo = jax.jit(dp.step, donate_argnums=0).lower(dp.init(params), batch).compile().as_text()
  return hlo, dp.layout


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_one_gradient_reduction_per_step(mode):
  hlo, layout = _compiled(mode, K)
  inside, trips, outside = _loop(hlo)
  assert trips == K
  assert inside == []  # no micro-step communicates
  # Outside the loop: the same collectives as a step without accumulation, i.e. each
  # bucket's gradient reduced once.
  plain, _ = _compiled(mode, 1)
  comps = _computations(plain)
  assert outside == _collectives(comps, _reachable(comps, ["ENTRY"]))
  reductions = [c for c in outside if c in ("reduce-scatter", "all-to-all")]
  if mode == "packed":
    reductions += [c for c in outside if c == "all-reduce"]
  assert len(reductions) >= len(layout.buckets)


def test_zero2_reduce_scatters_every_micro_step():
  hlo, layout = _compiled(jpack.Mode("sharded", shard_accumulator=True), K)
  inside, trips, outside = _loop(hlo)
  assert trips == K
  # One reduce-scatter per bucket in the loop body, which runs K times.
  assert [c for c in inside if c != "reduce-scatter"] == []
  assert len(inside) == len(layout.buckets)
  assert "reduce-scatter" not in outside and "all-to-all" not in outside
  assert outside.count("all-gather") == len(layout.buckets)  # the new params


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.0, "4", True])
def test_accumulate_must_be_a_positive_int(bad):
  with pytest.raises(ValueError, match="accumulate must be a positive int"):
    jpack.data_parallel(_loss, optax.sgd(0.1), _params(), has_aux=True, accumulate=bad)


@pytest.mark.parametrize("mode", ["packed", "allreduce"])
def test_sharded_accumulator_needs_sharded_mode(mode):
  with pytest.raises(ValueError, match=r"Mode\(shard_accumulator=True\) reduce-scatters "
                     r"every micro-batch's gradients.*only mode 'sharded'.*got "
                     rf"Mode\('{mode}', shard_accumulator=True\)"):
    jpack.data_parallel(_loss, optax.sgd(0.1), _params(), has_aux=True,
                        mode=jpack.Mode(mode, shard_accumulator=True), accumulate=2)


def test_micro_batches_must_divide_the_batch():
  dp = jpack.data_parallel(_loss, optax.sgd(0.1), _params(), has_aux=True, accumulate=3)
  state = dp.init(_params())
  with pytest.raises(ValueError, match=r"Batch leaf at \[0\].*accumulate=3.*multiple of 24"):
    dp.step(state, _batch(0, 32))


def test_batch_leaves_must_agree_on_the_micro_batch_axis():
  dp = jpack.data_parallel(_loss, optax.sgd(0.1), _params(), has_aux=True, accumulate=2)
  state = dp.init(_params())
  x, y, ids = _batch(0, 32)
  with pytest.raises(ValueError, match=r"same number of rows.*\[0\]: 32, \[1\]: 16"):
    dp.step(state, (x, y[:16], ids))
