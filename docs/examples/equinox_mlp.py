"""Equinox with jpack: docs/howto/equinox.md shows it, tests/test_integrations.py runs it."""

# --8<-- [start:setup]
import jax
jax.config.update("jax_num_cpu_devices", 8)   # 8 simulated devices; drop this on GPUs

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
import jpack

teacher = np.random.default_rng(0).normal(size=(64, 10))

def batches(steps, size=256, seed=1):
    """Stand-in for an input pipeline: dicts of numpy arrays, 10 learnable classes."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        image = rng.normal(size=(size, 64)).astype(np.float32)
        yield {"image": image, "label": (image @ teacher).argmax(-1).astype(np.int32)}
# --8<-- [end:setup]

# --8<-- [start:model]
model = eqx.nn.MLP(in_size=64, out_size=10, width_size=128, depth=1,
                   key=jax.random.key(0))
params, static = eqx.partition(model, eqx.is_inexact_array)   # arrays | everything else

def loss_fn(params, batch):
    model = eqx.combine(params, static)
    logits = jax.vmap(model)(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
# --8<-- [end:model]

# --8<-- [start:data_parallel]
mesh = jax.make_mesh((jax.device_count(),), ("batch",))
dp = jpack.data_parallel(loss_fn, optax.adamw(1e-2), params, mesh, mode="packed")
print(dp.layout.summary(leaves=True))   # the model's arrays, by path; no functions

state = dp.init(params)
for batch in batches(100):
    state, metrics = dp.step(state, batch)  # a numpy batch is split over "batch" for you
model = eqx.combine(dp.unpack(state), static)  # the trained arrays, the same functions
# --8<-- [end:data_parallel]

# --8<-- [start:evaluate]
test = next(batches(1, size=1024, seed=2))
accuracy = float((jax.vmap(model)(test["image"]).argmax(-1) == test["label"]).mean())
print(f"loss {float(metrics['loss']):.3f}, test accuracy {accuracy:.2f}")
assert accuracy > 0.8
assert model.activation is static.activation    # static leaves come back untouched
# --8<-- [end:evaluate]

# --8<-- [start:modes]
def train(mode, steps=5):
    dp = jpack.data_parallel(loss_fn, optax.adamw(1e-2), params, mesh, mode=mode)
    state = dp.init(params)
    for batch in batches(steps):
        state, _ = dp.step(state, batch)
    return dp.unpack(state)            # a filtered MLP like `params`: None for non-arrays

packed = train("packed")
for mode in ("allreduce", "sharded", "fsdp"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 train(mode), packed)
# --8<-- [end:modes]

# --8<-- [start:shard_map]
layout = jpack.plan(params)           # plan once: static, hashable
tx = optax.chain(jpack.optax.allreduce("batch"), optax.adamw(1e-2))

def packed_loss(packed, batch):
    return loss_fn(jpack.unpack(packed), batch)

def train_step(packed, opt_state, batch):
    # The gradient of a Packed is a Packed: jpack.optax.allreduce averages it with one
    # collective per bucket, and adamw updates the buckets, not the leaves.
    loss, grads = jax.value_and_grad(packed_loss)(jpack.vary(packed, "batch"), batch)
    updates, opt_state = tx.update(grads, opt_state, packed)
    packed = optax.apply_updates(packed, updates)
    return packed, opt_state, jax.lax.pmean(loss, "batch")

step = jax.jit(jax.shard_map(train_step, mesh=mesh,
                             in_specs=(P(), P(), P("batch")), out_specs=(P(), P(), P())))
replicated = NamedSharding(mesh, P())
packed = jax.device_put(jpack.pack(params, layout), replicated)
opt_state = jax.device_put(tx.init(packed), replicated)
for i, batch in enumerate(batches(100)):
    batch = jax.device_put(batch, NamedSharding(mesh, P("batch")))
    packed, opt_state, loss = step(packed, opt_state, batch)
    if i % 10 == 9:
        print(f"step {i + 1}: loss {float(loss):.3f}")  # also waits for the step
model = eqx.combine(jpack.unpack(packed), static)
accuracy = float((jax.vmap(model)(test["image"]).argmax(-1) == test["label"]).mean())
assert accuracy > 0.8
# --8<-- [end:shard_map]
