"""Flax NNX with jpack: docs/howto/nnx.md shows it, tests/test_integrations.py runs it."""

# --8<-- [start:setup]
import jax
jax.config.update("jax_num_cpu_devices", 8)   # 8 simulated devices; drop this on GPUs

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
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
class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))

model = MLP(nnx.Rngs(0))
graphdef, params, rest = nnx.split(model, nnx.Param, ...)   # rest: every other variable

def loss_fn(params, batch):
    model = nnx.merge(graphdef, params, rest)    # a fresh module on this device's params
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
# --8<-- [end:model]

# --8<-- [start:data_parallel]
mesh = jax.make_mesh((jax.device_count(),), ("batch",))
dp = jpack.data_parallel(loss_fn, optax.adamw(1e-2), params, mesh, mode="packed")
print(dp.layout.summary(leaves=True))   # the leaves of the nnx.State, by path

state = dp.init(params)
for batch in batches(100):
    state, metrics = dp.step(state, batch)  # a numpy batch is split over "batch" for you
nnx.update(model, dp.unpack(state))         # write the trained parameters into the model
# --8<-- [end:data_parallel]

# --8<-- [start:evaluate]
test = next(batches(1, size=1024, seed=2))
accuracy = float((model(test["image"]).argmax(-1) == test["label"]).mean())
print(f"loss {float(metrics['loss']):.3f}, test accuracy {accuracy:.2f}")
assert accuracy > 0.8
# --8<-- [end:evaluate]

# --8<-- [start:modes]
def train(mode, steps=5):
    dp = jpack.data_parallel(loss_fn, optax.adamw(1e-2), params, mesh, mode=mode)
    state = dp.init(params)
    for batch in batches(steps):
        state, _ = dp.step(state, batch)
    return dp.unpack(state)            # an nnx.State like `params`

packed = train("packed")
for mode in ("allreduce", "sharded", "fsdp"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 train(mode), packed)
# --8<-- [end:modes]

# --8<-- [start:shard_map]
tx = optax.chain(jpack.optax.allreduce("batch"), optax.adamw(1e-2))

def train_step(params, opt_state, batch):
    # jpack.vary: each device differentiates its own copy, so the gradients stay local
    # until jpack.optax.allreduce averages them, one collective per bucket.
    loss, grads = jax.value_and_grad(loss_fn)(jpack.vary(params, "batch"), batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, jax.lax.pmean(loss, "batch")

step = jax.jit(jax.shard_map(train_step, mesh=mesh,
                             in_specs=(P(), P(), P("batch")), out_specs=(P(), P(), P())))
model = MLP(nnx.Rngs(0))                                # start again from scratch
graphdef, params, rest = nnx.split(model, nnx.Param, ...)
replicated = NamedSharding(mesh, P())
params_on_mesh = jax.device_put(params, replicated)
opt_state = jax.device_put(tx.init(params), replicated)
for i, batch in enumerate(batches(100)):
    batch = jax.device_put(batch, NamedSharding(mesh, P("batch")))
    params_on_mesh, opt_state, loss = step(params_on_mesh, opt_state, batch)
    if i % 10 == 9:
        print(f"step {i + 1}: loss {float(loss):.3f}")  # also waits for the step
nnx.update(model, params_on_mesh)
accuracy = float((model(test["image"]).argmax(-1) == test["label"]).mean())
assert accuracy > 0.8
# --8<-- [end:shard_map]
