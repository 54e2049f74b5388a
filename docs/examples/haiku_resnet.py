"""Haiku with jpack: docs/howto/haiku.md shows it, tests/test_integrations.py runs it."""

# --8<-- [start:setup]
import jax
jax.config.update("jax_num_cpu_devices", 8)   # 8 simulated devices; drop this on GPUs

import functools

import haiku as hk
import jax.numpy as jnp
import numpy as np
import optax
import jpack

teacher = np.random.default_rng(0).normal(size=(64, 10))

def batches(steps, size=256, seed=1):
    """Stand-in for an input pipeline: 8x8 one-channel images, 10 learnable classes."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        image = rng.normal(size=(size, 8, 8, 1)).astype(np.float32)
        label = (image.reshape(size, 64) @ teacher).argmax(-1).astype(np.int32)
        yield {"image": image, "label": label}
# --8<-- [end:setup]

# --8<-- [start:model]
def resnet(x, is_training, cross_replica_axis=None, dropout=0.0):
    def norm(y):   # statistics over cross_replica_axis too, when it is given
        return hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9,
                            cross_replica_axis=cross_replica_axis)(y, is_training)

    def block(x, channels, stride):
        y = jax.nn.relu(norm(hk.Conv2D(channels, 3, stride, with_bias=False)(x)))
        y = norm(hk.Conv2D(channels, 3, with_bias=False)(y))
        if stride > 1 or x.shape[-1] != channels:    # projection shortcut
            x = norm(hk.Conv2D(channels, 1, stride, with_bias=False)(x))
        return jax.nn.relu(x + y)

    x = jax.nn.relu(norm(hk.Conv2D(16, 3, with_bias=False)(x)))
    x = hk.Flatten()(block(block(x, 16, 1), 32, 2))
    if is_training and dropout:           # draws from the rng that apply is given
        x = hk.dropout(hk.next_rng_key(), dropout, x)
    return hk.Linear(10)(x)

model = hk.transform_with_state(resnet)   # init and evaluation: no axis outside the step
train_model = hk.transform_with_state(functools.partial(resnet, cross_replica_axis="batch"))
params, model_state = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)), is_training=True)

def loss_fn(params, model_state, batch):
    logits, model_state = train_model.apply(params, model_state, None,   # rng: none drawn
                                            batch["image"], is_training=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, model_state           # (loss, new model state)
# --8<-- [end:model]

# --8<-- [start:state]
print(jax.tree.map(lambda x: f"{x.dtype}{list(x.shape)}", model_state["batch_norm/~/mean_ema"]))
# --8<-- [end:state]

# --8<-- [start:wrong]
def loss_of_both(both, batch):         # the state next to the params: refused
    params, model_state = both
    return loss_fn(params, model_state, batch)[0]

try:
    jpack.data_parallel(loss_of_both, optax.sgd(0.1), (params, model_state))
except TypeError as error:
    print(error)
    assert "dp.init(params, model_state)" in str(error)
# --8<-- [end:wrong]

# --8<-- [start:data_parallel]
mesh = jax.make_mesh((jax.device_count(),), ("batch",))
tx = optax.sgd(0.05, momentum=0.9)
dp = jpack.data_parallel(loss_fn, tx, params, mesh)
print(dp.layout.summary())              # the buckets of the Haiku params (no state)

state = dp.init(params, model_state)    # the model state is carried next to the params
for batch in batches(100):
    state, metrics = dp.step(state, batch)  # a numpy batch is split over "batch" for you
# --8<-- [end:data_parallel]

# --8<-- [start:evaluate]
test = next(batches(1, size=1024, seed=2))
trained_params, trained_state = dp.unpack(state)   # what init took, on one device
logits, _ = model.apply(trained_params, trained_state, None,
                        test["image"], is_training=False)  # the moving averages
accuracy = float((logits.argmax(-1) == test["label"]).mean())
print(f"loss {float(metrics['loss']):.3f}, test accuracy {accuracy:.2f}")
assert accuracy > 0.6
# --8<-- [end:evaluate]

# --8<-- [start:modes]
def train(mode, loss_fn=loss_fn, steps=5):
    dp = jpack.data_parallel(loss_fn, tx, params, mesh, mode=mode)
    state = dp.init(params, model_state)
    for batch in batches(steps):
        state, _ = dp.step(state, batch)
    return dp.unpack(state)              # (params, model_state)

packed = train("packed")                 # the same batches for every mode
for mode in ("allreduce", "sharded", "fsdp"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 train(mode), packed)
# --8<-- [end:modes]

# --8<-- [start:per_device]
local_model = hk.transform_with_state(resnet)   # no cross_replica_axis

def local_loss(params, model_state, batch):
    logits, model_state = local_model.apply(params, model_state, None, batch["image"],
                                            is_training=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, model_state

_, whole = train("packed", steps=1)
_, local = train("packed", local_loss, steps=1)
first = "batch_norm/~/mean_ema", "batch_norm/~/var_ema"
np.testing.assert_allclose(local[first[0]]["average"], whole[first[0]]["average"],
                           rtol=1e-5, atol=1e-6)   # the mean of the means: the same
assert (local[first[1]]["average"] < whole[first[1]]["average"]).all()  # variances: smaller
# --8<-- [end:per_device]

# --8<-- [start:rng]
dropout_model = hk.transform_with_state(
    functools.partial(resnet, cross_replica_axis="batch", dropout=0.2))

def dropout_loss(params, model_state, batch):
    rng, next_rng = jax.random.split(model_state["rng"])    # the same on every device
    rng = jax.random.fold_in(rng, jax.lax.axis_index("batch"))   # one per device
    logits, haiku_state = dropout_model.apply(params, model_state["haiku"], rng,
                                              batch["image"], is_training=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, {"haiku": haiku_state, "rng": next_rng}

dp = jpack.data_parallel(dropout_loss, tx, params, mesh)
state = dp.init(params, {"haiku": model_state, "rng": jax.random.key(1)})
for batch in batches(5):
    state, metrics = dp.step(state, batch)
haiku_state = state.model_state["haiku"]    # for evaluation, as above
# --8<-- [end:rng]
