"""Flax Linen with jpack: docs/howto/flax.md shows it, tests/test_integrations.py runs it."""

# --8<-- [start:setup]
import jax
jax.config.update("jax_num_cpu_devices", 8)   # 8 simulated devices; drop this on GPUs

import flax.linen as nn
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
class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)

model = MLP()
params = model.init(jax.random.key(0), jnp.zeros((1, 64)))["params"]   # not the variables

def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
# --8<-- [end:model]

# --8<-- [start:data_parallel]
mesh = jax.make_mesh((jax.device_count(),), ("batch",))
dp = jpack.data_parallel(loss_fn, optax.adamw(1e-2), params, mesh, mode="packed")
print(dp.layout.summary())              # the buckets of the Flax params

state = dp.init(params)
for batch in batches(100):
    state, metrics = dp.step(state, batch)  # a numpy batch is split over "batch" for you
trained = dp.unpack(state)              # the Flax params tree again
# --8<-- [end:data_parallel]

# --8<-- [start:evaluate]
test = next(batches(1, size=1024, seed=2))
logits = model.apply({"params": trained}, test["image"])
accuracy = float((logits.argmax(-1) == test["label"]).mean())
print(f"loss {float(metrics['loss']):.3f}, test accuracy {accuracy:.2f}")
assert accuracy > 0.8
# --8<-- [end:evaluate]

# --8<-- [start:modes]
def train(mode, steps=5):
    dp = jpack.data_parallel(loss_fn, optax.adamw(1e-2), params, mesh, mode=mode)
    state = dp.init(params)
    for batch in batches(steps):
        state, _ = dp.step(state, batch)
    return dp.unpack(state)

packed = train("packed")                 # the same batches for every mode
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
replicated = NamedSharding(mesh, P())
own_params = jax.device_put(params, replicated)
opt_state = jax.device_put(tx.init(params), replicated)
for i, batch in enumerate(batches(100)):
    batch = jax.device_put(batch, NamedSharding(mesh, P("batch")))
    own_params, opt_state, loss = step(own_params, opt_state, batch)
    if i % 10 == 9:
        print(f"step {i + 1}: loss {float(loss):.3f}")  # also waits for the step
# --8<-- [end:shard_map]

# --8<-- [start:batch_norm]
class CNNish(nn.Module):
    axis_name: str | None = None          # "batch": statistics over the whole batch

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(128, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                         axis_name=self.axis_name)(x)
        return nn.Dense(10)(nn.relu(x))

bn_model = CNNish(axis_name="batch")
variables = CNNish().init(jax.random.key(0), jnp.zeros((1, 64)))
bn_params, batch_stats = variables["params"], variables["batch_stats"]

def bn_loss(params, batch_stats, batch):
    logits, updates = bn_model.apply({"params": params, "batch_stats": batch_stats},
                                     batch["image"], mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, updates["batch_stats"]  # (loss, new model state)

dp = jpack.data_parallel(bn_loss, optax.adamw(1e-2), bn_params, mesh)
state = dp.init(bn_params, batch_stats)   # the model state is carried next to the params
for batch in batches(100):
    state, metrics = dp.step(state, batch)

trained_params, trained_stats = dp.unpack(state)   # what init took, on one device
eval_variables = {"params": trained_params, "batch_stats": trained_stats}
eval_logits = CNNish().apply(eval_variables, test["image"], train=False)
bn_accuracy = float((eval_logits.argmax(-1) == test["label"]).mean())
print(f"with BatchNorm: test accuracy {bn_accuracy:.2f}")
assert bn_accuracy > 0.8
# --8<-- [end:batch_norm]
