"""The optimizer check's numpy evaluation of traced functions gives what JAX computes.

`jpack._numpy_eval.evaluate` runs a function through its jaxpr with numpy, so that the
check compiles nothing. Each case here is compared with the same function run by JAX
itself (compiled, in float64), leaf by leaf.
"""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpack._numpy_eval import evaluate

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lamb": lambda: optax.lamb(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),
    "sm3": lambda: optax.sm3(1e-2),
    "lion": lambda: optax.lion(1e-2),
    "clip+sgd": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1e-2, 0.9)),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), 2),
}


def _steps(tx, params, grads):
  state = tx.init(params)
  updates = []
  for g in grads:
    u, state = tx.update(g, state, params)
    updates.append(u)
    params = optax.apply_updates(params, u)
  return updates, state


def _once(fn):
  """``fn``, failing the test if it is called more than once: evaluate traced it, and
  then evaluated the jaxpr with numpy instead of calling it again."""
  calls = []

  def counted(*args):
    calls.append(1)
    assert len(calls) == 1, "evaluate called the function: the numpy path was not taken"
    return fn(*args)

  return counted


def _assert_same(got, want):
  got_leaves, got_tree = jax.tree.flatten(got)
  want_leaves, want_tree = jax.tree.flatten(want)
  assert got_tree == want_tree
  for a, b in zip(got_leaves, want_leaves):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(b).max(
        initial=0.0, where=np.isfinite(b)) if np.issubdtype(b.dtype, np.inexact) else 0))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_steps_match_jax(name):
  rng = np.random.default_rng(1)
  shapes = {"w": (130, 6), "b": (6,), "m": (4, 3, 5)}
  with jax.enable_x64(True):
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s) * scale for k, s in shapes.items()}
             for scale in (1.0, 1e3, 1.0)]
    grads[2]["b"][0] = np.nan  # a non-finite step, as the check's third
    tx = OPTIMIZERS[name]()
    want = jax.jit(lambda p, g: _steps(tx, p, g))(params, grads)
    got = evaluate(_once(lambda p, g: _steps(tx, p, g)), params, grads)
  _assert_same(got, want)


def _control_flow(x, n):
  y = jax.lax.cond(x.sum() > 0, lambda a: a * 2, lambda a: a - 1, x)
  y = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 1.5), (0, y))[1]
  y = jax.lax.fori_loop(0, 3, lambda i, c: c + i, y)
  carry, ys = jax.lax.scan(lambda c, r: (c + r.sum(), r * c), 0.0, y.reshape(-1, 1))
  z = jax.lax.scan(lambda c, r: (c * 0.5 + r, c), 1.0, y.ravel(), reverse=True)
  return y, carry, ys, z


def _arithmetic(x, k):
  i = (x * 10).astype(jnp.int32)
  return (jax.lax.div(i, k), jax.lax.rem(i, k), jnp.round(x * 3), jnp.clip(x, -0.5, 0.5),
          jax.lax.select_n(jnp.abs(i) % 3, x, -x, 2 * x), jnp.argmax(x, axis=-1),
          jax.nn.relu(x), jax.nn.sigmoid(x), jnp.cumsum(x[0]), jax.lax.cummax(x, axis=1, reverse=True),
          jax.lax.integer_pow(x, -2), jnp.sign(x) * jnp.sqrt(jnp.abs(x)))


def _shapes(x, y):
  return (jnp.einsum("...ij,...jk->...ik", x, y), jnp.einsum("bij,bij->b", x, x),
          jnp.transpose(x, (2, 0, 1)), jnp.concatenate([x, x], axis=1)[:, ::2],
          jnp.broadcast_to(x.sum(axis=1, keepdims=True), x.shape), x.reshape(-1)[1:5],
          jnp.squeeze(x[:, :1], 1).max(axis=-1), jnp.arange(6).reshape(2, 3) * x.min(),
          x.at[1, 2].add(5.0))  # a scatter: no numpy rule, run by JAX alone


_FUNCTIONS = {"control flow": _control_flow, "arithmetic": _arithmetic, "shapes": _shapes}


@pytest.mark.parametrize("name", sorted(_FUNCTIONS))
def test_operations_match_jax(name):
  fn = _FUNCTIONS[name]
  with jax.enable_x64(True):
    compiled = jax.jit(fn)

  @hypothesis.settings(max_examples=20, deadline=None)
  @hypothesis.given(seed=st.integers(0, 2**16), n=st.integers(-1, 4), k=st.integers(1, 5))
  def check(seed, n, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 4))
    args = {"control flow": (x, np.int64(n)), "arithmetic": (x, np.int32(k)),
            "shapes": (x, rng.standard_normal((2, 4, 3)))}[name]
    with jax.enable_x64(True):
      _assert_same(evaluate(_once(fn), *args), compiled(*args))

  check()


def test_python_values_and_branches_on_values():
  """Leaves that are not arrays come back as they were; a function that branches on a
  value in Python (untraceable) is called instead, with the same result."""
  def fn(x):
    return {"n": 3, "none": None, "y": x + 1}

  got = evaluate(fn, np.ones(2))
  assert got["n"] == 3 and got["none"] is None
  np.testing.assert_array_equal(got["y"], np.full(2, 2.0))

  def branchy(x):
    return x * 2 if float(x.sum()) > 0 else x - 1

  np.testing.assert_array_equal(evaluate(branchy, np.ones(2)), np.full(2, 2.0))
  np.testing.assert_array_equal(evaluate(branchy, -np.ones(2)), np.full(2, -2.0))


def test_errors_are_the_functions_own():
  def bad(x):
    return x.reshape(3, 5)

  with pytest.raises(TypeError, match="reshape"):
    evaluate(bad, np.ones(4))
  with pytest.raises(NameError):
    evaluate(lambda x: jax.lax.psum(x, "no_such_axis"), np.ones(2))


def test_without_branches_a_function_with_control_flow_is_called():
  """With branches=False (the recorder's runs) a cond is not evaluated from the jaxpr:
  the function is called, so its Python calls happen."""
  calls = []

  def fn(x):
    calls.append("traced or called")
    return jax.lax.cond(x.sum() > 0, lambda a: a + 1, lambda a: a, x)

  with jax.disable_jit():
    got = evaluate(fn, np.ones(2), branches=False)
  np.testing.assert_array_equal(got, np.full(2, 2.0))
  assert len(calls) == 2  # traced once, then called
