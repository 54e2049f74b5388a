"""Trust ratios and static masks computed on buckets and on ZeRO-1's slices, leaf by leaf,
and optax.clip_by_global_norm on them (one norm of all the buckets, or of all the slices):
one update against optax on the tree, for random trees, alignments and bucket caps."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jpack

N = 8


@st.composite
def trees(draw):
  """A dict of 1-5 f32 leaves (some zero, some empty, at least one not), the updates for
  it, and a mask."""
  shapes = [draw(st.sampled_from([(3,), (7,), (5, 3), (40, 33), (2, 3, 4), (130,)]))]
  shapes += draw(st.lists(st.sampled_from([(3,), (7,), (5, 3), (40, 33), (0,), (2, 3, 4),
                                           (130,), ()]), max_size=4))
  rng = np.random.default_rng(draw(st.integers(0, 2**16)))
  zero = draw(st.lists(st.booleans(), min_size=len(shapes), max_size=len(shapes)))
  params = {f"p{i}": (np.zeros(s) if z else rng.normal(size=s)).astype(np.float32)
            for i, (s, z) in enumerate(zip(shapes, zero))}
  updates = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
  mask = {k: draw(st.booleans()) for k in params}
  options = {"align_bytes": draw(st.sampled_from([16, 64, 256])),
             "bucket_bytes": draw(st.sampled_from([256, 4096, 1 << 20]))}
  return params, updates, mask, options


def optimizers(mask):
  """What lamb, lars and adamw(mask=...) are made of, with hyperparameters set, and the
  global-norm clip put before them (a norm that clips most of these trees, and one that
  clips few)."""
  return [
      optax.scale_by_trust_ratio(),
      optax.scale_by_trust_ratio(min_norm=0.5, trust_coefficient=0.3, eps=1e-3),
      optax.masked(optax.add_decayed_weights(0.1), mask),
      optax.masked(optax.scale_by_trust_ratio(), lambda p: mask),
      optax.chain(optax.add_decayed_weights(0.1, mask=mask), optax.scale_by_trust_ratio(),
                  optax.scale(-0.1)),
      optax.clip_by_global_norm(1.0),
      optax.chain(optax.clip_by_global_norm(30.0), optax.masked(optax.scale_by_trust_ratio(),
                                                                lambda p: mask)),
  ]


def flat_update(tx, updates, params, options):
  wrapped = jpack.optax.flat(tx, plan_options=options)
  return wrapped.update(updates, wrapped.init(params), params)[0]


def sharded_update(tx, updates, params, options):
  """One update of ``jpack.optax.sharded(tx)`` on 8 devices, every device holding the
  same gradient (so that the mean is the gradient itself)."""
  wrapped = jpack.optax.sharded(tx, "batch", plan_options=options)
  mesh = jax.make_mesh((N,), ("batch",), devices=jax.devices()[:N])

  def body(u, p):
    return wrapped.update(jpack.vary(u, "batch"), wrapped.init(p), p)[0]

  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
  return jax.jit(f)(updates, params)


def assert_close(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("update", [flat_update, sharded_update], ids=["flat", "sharded"])
@settings(max_examples=6)
@given(trees())
def test_like_optax_on_the_tree(update, case):
  params, updates, mask, options = case
  for tx in optimizers(mask):
    want = tx.update(updates, tx.init(params), params)[0]
    assert_close(update(tx, updates, params, options), want)


def big_and_small():
  rng = np.random.default_rng(0)
  return {"emb": jnp.asarray(rng.normal(size=(512, 64)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(64,)), jnp.float32),
          "w": jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)}


@pytest.mark.parametrize("make", [
    lambda: optax.lamb(1e-3, weight_decay=0.1, mask=lambda p: jax.tree.map(
        lambda x: x.ndim > 1, p)),
    lambda: optax.adamw(1e-3, weight_decay=0.1, mask={"emb": True, "b": False, "w": True}),
])
def test_zero1_keeps_the_plain_layout_and_one_nth_of_the_state(caplog, make):
  """lamb and adamw(mask=...) need no leaf owned whole: the layout is the one planned
  for the params (no padding for the big embedding), the state 1/N of optax's, and init
  says once what runs leaf by leaf."""
  params = big_and_small()
  mesh = jax.make_mesh((N,), ("batch",), devices=jax.devices()[:N])
  tx = jpack.optax.sharded(make(), "batch")
  with caplog.at_level(logging.INFO, logger="jpack"):
    state = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P(),
                                         check_vma=False), params)
  assert state.layout == jpack.plan(params, num_shards=N)
  full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(make().init(params)))
  assert jpack.optax.state_bytes_per_device(state, N) <= 1.05 * full / N + 64
  lines = [r.getMessage() for r in caplog.records if r.name == "jpack"]
  assert len(lines) == 1 and "leaf by leaf" in lines[0], lines
  assert "own whole leaves" not in lines[0]


def test_a_mask_of_other_than_bools_is_left_to_the_probe():
  """A mask of ints (truthy to optax) is not taken as static flags: it runs where it did
  before (on the leaves in flat), and still matches optax."""
  params = big_and_small()
  updates = jax.tree.map(lambda x: x * 0.5 + 1, params)
  mask = lambda p: jax.tree.map(lambda x: int(x.shape[0] > 64), p)  # noqa: E731
  tx = optax.masked(optax.scale_by_trust_ratio(), mask)
  want = tx.update(updates, tx.init(params), params)[0]
  assert_close(flat_update(tx, updates, params, {}), want)


def test_a_bucket_too_long_for_its_tables_is_left_to_the_leaves():
  """A bucket of several leaves whose per-block tables would be large constants (tiny
  alignment, millions of elements) is not computed leaf by leaf; it still matches."""
  from jpack import _leafwise
  shapes = {"a": jax.ShapeDtypeStruct((3_000_000,), jnp.float32),
            "b": jax.ShapeDtypeStruct((5,), jnp.float32)}
  layout = jpack.plan(shapes, align_bytes=4, bucket_bytes=1 << 26, solo_bytes=None)
  assert len(layout.buckets) == 1
  assert _leafwise.on_buckets(optax.scale_by_trust_ratio(), layout, None,
                              lambda tx: None) is None
  assert _leafwise.on_buckets(optax.scale_by_trust_ratio(), jpack.plan(shapes), None,
                              lambda tx: None) is not None
