"""A model for ``python -m benchmarks gpu_compile --model gpu_model:model`` (docs/gpu.md).

``model()`` returns the params, the loss on one device's batch, and one device's batch:
shapes are enough (`jax.ShapeDtypeStruct`), nothing is allocated or run.
"""

import jax
import jax.numpy as jnp


def model():
  width, depth = 256, 4
  params = {f"layer{i}": {"w": jax.ShapeDtypeStruct((width, width), jnp.float32),
                          "b": jax.ShapeDtypeStruct((width,), jnp.float32)}
            for i in range(depth)}

  def loss_fn(params, batch):
    x, y = batch
    for i in range(depth):
      x = jnp.tanh(x @ params[f"layer{i}"]["w"] + params[f"layer{i}"]["b"])
    return jnp.mean((x - y) ** 2)

  batch = (jax.ShapeDtypeStruct((16, width), jnp.float32),   # 16 rows per GPU
           jax.ShapeDtypeStruct((16, width), jnp.float32))
  return params, loss_fn, batch
