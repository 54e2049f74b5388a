"""`python -m jpack demo`: train a small MLP data-parallel in every mode and compare them.

Nothing here touches JAX's backend at import time: `setup_devices` must run first so the
demo can ask for N simulated CPU devices (``jax_num_cpu_devices``), which JAX only
accepts before its backend starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Sequence

from jpack import _reference
from jpack._reference import human_bytes

DEMO_MODES = ("per_leaf", "jit", "allreduce", "sharded", "fsdp")  # the default comparison
ALL_MODES = ("per_leaf", "jit", "allreduce", "packed", "sharded", "fsdp")
COMM_DTYPES = ("none", "float32", "bfloat16")
PARAM_DTYPES = ("float32", "bfloat16")
# The modes that keep float32 masters in the optimizer state and give the loss the
# params in param_dtype (data_parallel's precision=jpack.Precision(param_dtype=)); the
# others keep float32 params and cast them for the loss, the same forward and backward
# with no separate masters. "fsdp" keeps the masters only and gathers them rounded.
MASTER_MODES = ("packed", "sharded", "fsdp")
# The usual steps without jpack: a shard_map step with a pmean per leaf (`per_leaf_step`,
# the baseline) and plain jax.jit on sharded arrays (`jit_step`). Every other mode is
# jpack.data_parallel's.
BASELINE = "per_leaf"
PLAIN_MODES = (BASELINE, "jit")


@dataclasses.dataclass
class ModeResult:
  """What one mode measured."""
  mode: str
  losses: list[float]           # loss of every step
  step_ms: list[float]          # wall time of every step (the first includes compiling)
  compile_s: float              # time of the first step: trace + compile + run
  collectives: dict[str, int]   # collective ops in the compiled step, by kind
  collective_arrays: int        # arrays those ops move (XLA may merge ops into tuples)
  grad_bytes: int               # gradient bytes sent into the reduction per step
  opt_state_bytes: int          # optimizer state bytes each device holds
  test_accuracy: float
  params_as: str = "float32"    # how the params are kept (`params_kept_as`)
  accumulate: int = 1           # micro-batches per step
  state_bytes: int = 0          # params + optimizer state (masters included), per device

  @property
  def median_ms(self) -> float:
    rest = self.step_ms[1:]
    return statistics.median(rest) if rest else float("nan")

  @property
  def final_loss(self) -> float:
    return self.losses[-1] if self.losses else float("nan")


# -- devices and data ------------------------------------------------------------------


def setup_devices(n: int) -> list[Any]:
  """Ask JAX for ``n`` simulated CPU devices; return the first ``n`` CPU devices.

  Must run before any JAX array exists. If the backend is already up (e.g. when called
  from a process that used JAX), the existing devices are used when there are enough.
  """
  import jax

  try:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    pass  # backend already initialised: fall through and use what exists
  devices = jax.devices("cpu")
  if len(devices) < n:
    raise RuntimeError(
        f"The demo needs {n} CPU devices but JAX already started with {len(devices)}. "
        "Run it in a fresh process (python -m jpack demo) or pass --devices "
        f"{len(devices)}.")
  return devices[:n]


def load_digits(seed: int, test_fraction: float = 0.2):
  """scikit-learn's bundled 8x8 digits (1797 images, no download), standardized, split."""
  import numpy as np

  try:
    from sklearn.datasets import load_digits as _load
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("The jpack demo needs scikit-learn, matplotlib and tqdm: "
                      "pip install 'jpack[demo]'") from e
  data = _load()
  x = data.data.astype(np.float32)
  y = data.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  n_test = int(round(test_fraction * len(x)))
  test, train = order[:n_test], order[n_test:]
  mean = x[train].mean(0)
  std = x[train].std(0) + 1e-6  # some border pixels are always 0
  x = (x - mean) / std
  return x[train], y[train], x[test], y[test]


# -- the model -------------------------------------------------------------------------


def init_mlp(key, in_dim: int, width: int, depth: int, classes: int) -> dict:
  """Input projection, ``depth`` residual blocks (LayerNorm -> Dense -> gelu), a head.

  Each block has 4 leaves (ln scale/bias, w, b), so the tree has 4 * depth + 6 leaves:
  many small ones, the case where per-leaf collectives hurt.
  """
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(key, depth + 2)

  def dense(k, fan_in, fan_out):
    w = jax.random.normal(k, (fan_in, fan_out), jnp.float32) * math.sqrt(2.0 / fan_in)
    return {"w": w, "b": jnp.zeros((fan_out,), jnp.float32)}

  def norm(dim):
    return {"scale": jnp.ones((dim,), jnp.float32), "bias": jnp.zeros((dim,), jnp.float32)}

  params = {"embed": dense(keys[0], in_dim, width)}
  for i in range(depth):
    params[f"block{i:02d}"] = {"norm": norm(width), "dense": dense(keys[i + 1], width, width)}
  params["head"] = {"norm": norm(width), "dense": dense(keys[-1], width, classes)}
  return params


def _layer_norm(p, x):
  import jax.numpy as jnp

  # Statistics in float32: a bfloat16 variance of nearly equal values loses its digits.
  z = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  mean = z.mean(-1, keepdims=True)
  var = ((z - mean) ** 2).mean(-1, keepdims=True)
  z = (z - mean) / jnp.sqrt(var + 1e-5)
  return z.astype(x.dtype) * p["scale"] + p["bias"]


def forward(params: dict, x):
  """Logits of the MLP, computed in the dtype of its params (bfloat16 params: bfloat16
  activations, as mixed precision intends; a float32 input alone would promote them)."""
  import jax

  x = x.astype(params["embed"]["w"].dtype)
  h = x @ params["embed"]["w"] + params["embed"]["b"]
  for name in sorted(k for k in params if k.startswith("block")):
    p = params[name]
    z = _layer_norm(p["norm"], h)
    h = h + jax.nn.gelu(z @ p["dense"]["w"] + p["dense"]["b"])
  z = _layer_norm(params["head"]["norm"], h)
  return z @ params["head"]["dense"]["w"] + params["head"]["dense"]["b"]


def loss_fn(params: dict, batch) -> Any:
  """Mean softmax cross-entropy over ``batch``: one device's slice in a shard_map step,
  the global batch under plain jit (the same mean, the slices being equal)."""
  import jax.numpy as jnp
  import optax

  x, y = batch
  logits = forward(params, x).astype(jnp.float32)  # the softmax in float32 at least
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def params_kept_as(mode: str, param_dtype: Any = None) -> str:
  """How ``mode`` keeps the params: in ``param_dtype`` with float32 masters, or float32
  (cast for the loss when ``param_dtype`` is set)."""
  import numpy as np

  if param_dtype is None:
    return "float32"
  name = np.dtype(param_dtype).name
  if mode == "fsdp":
    return f"f32 master, {name} gathered"
  return f"{name} + f32 master" if mode in MASTER_MODES else f"float32, {name} in loss"


def build_step(mode: str, loss_fn, optimizer, params: dict, mesh, comm_dtype: Any = None,
               *, param_dtype: Any = None, accumulate: int = 1) -> Any:
  """Mode ``mode``'s `jpack.DataParallel`: a plain step, or jpack.data_parallel's.

  ``comm_dtype``: the wire dtype of jpack's gradient collectives (the plain steps
  ignore it). ``param_dtype``: the packed, sharded and fsdp modes give the loss the
  params in it, from float32 masters
  (``data_parallel(precision=jpack.Precision(param_dtype=))``); the others keep float32
  params and cast them for the loss. ``accumulate``: micro-batches
  per step, ``data_parallel``'s or ``optax.MultiSteps`` in the plain steps. The buckets
  are jpack's choice for the mesh's platform (`jpack.step_options`).
  """
  import jpack

  plain = {"per_leaf": _reference.per_leaf_step, "jit": _reference.jit_step}
  if mode in plain:
    return plain[mode](loss_fn, optimizer, params, mesh, param_dtype=param_dtype,
                       accumulate=accumulate)
  if mode not in MASTER_MODES:  # data_parallel keeps no masters in this mode
    loss_fn, param_dtype = _reference.loss_in(loss_fn, param_dtype), None
  return jpack.data_parallel(
      loss_fn, optimizer, params, mesh, mode=mode,
      precision=jpack.Precision(param_dtype=param_dtype, comm_dtype=comm_dtype),
      accumulate=accumulate)


# -- measuring -------------------------------------------------------------------------


def grad_bytes_per_step(layout, mode: str, comm_dtype, accumulate: int = 1) -> int:
  """Bytes entering the gradient reduction each step, on one device.

  jpack modes send whole buckets (padding included) in ``comm_dtype`` when set (bf16
  halves f32), once per step; ``layout`` is that of the gradients as reduced (with
  ``param_dtype``, the float32 masters'). The plain steps send the parameters' own
  bytes, on every one of ``accumulate`` micro-batches (``optax.MultiSteps``).
  """
  import jax.numpy as jnp

  if mode in PLAIN_MODES:
    return layout.leaf_nbytes * accumulate
  total = 0
  for b in layout.buckets:
    floating = jnp.issubdtype(b.dtype, jnp.floating)  # complex buckets keep their dtype
    wire = jnp.dtype(comm_dtype) if (floating and comm_dtype is not None) else b.dtype
    total += b.size * wire.itemsize
  return total


def state_bytes_per_device(tree) -> int:
  """Bytes of ``tree``'s arrays that one device holds, from their shardings: replicated
  leaves whole, ZeRO slices 1/N (of a state: params + masters and moments)."""
  import jax

  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


# -- the demo --------------------------------------------------------------------------


def run(*, devices: int = 8, steps: int = 200, batch_size: int = 256,
        modes: Sequence[str] = DEMO_MODES,
        comm_dtype: str = "none", param_dtype: str = "float32", accumulate: int = 1,
        out: str | os.PathLike = "jpack-demo-out", seed: int = 0, width: int = 128,
        depth: int = 12, lr: float = 1e-3, progress: bool = True,
        stream=None) -> list[ModeResult]:
  """Train the digits MLP in each mode and print the comparison; returns the results.

  ``param_dtype`` "bfloat16": the packed and sharded modes keep bf16 params with float32
  masters in the optimizer state, fsdp the masters only; the other modes keep float32
  params and cast them for the loss. ``accumulate``: micro-batches per step
  (``optax.MultiSteps`` in per_leaf and jit).
  """
  stream = sys.stdout if stream is None else stream

  def say(*a):
    print(*a, file=stream, flush=True)

  _check_options(modes, devices, batch_size, comm_dtype, steps, param_dtype, accumulate)
  out_dir = pathlib.Path(out)
  if out_dir.exists() and not out_dir.is_dir():  # found now, not after training
    raise ValueError(f"out {str(out_dir)!r} exists and is not a directory")

  t_start = time.perf_counter()
  devs = setup_devices(devices)
  x_train, y_train, x_test, y_test = load_digits(seed)  # before JAX work: clear error first
  _check_plot_deps()

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  wire = {"none": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}[comm_dtype]
  narrow = None if param_dtype == "float32" else jnp.dtype(param_dtype)
  mesh = jax.sharding.Mesh(np.array(devs), ("batch",),
                           axis_types=(jax.sharding.AxisType.Explicit,))
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.P("batch"))

  params0 = init_mlp(jax.random.key(seed), x_train.shape[1], width, depth, 10)
  n_params = sum(x.size for x in jax.tree.leaves(params0))
  say(f"jpack demo: {len(x_train)} train / {len(x_test)} test digits (8x8), "
      f"MLP {x_train.shape[1]}-{width}x{depth}-10 with {len(jax.tree.leaves(params0))} "
      f"leaves, {n_params:,} params; {devices} simulated CPU devices, global batch "
      f"{batch_size} ({batch_size // devices}/device), {steps} steps, "
      f"comm dtype {comm_dtype}, param dtype {param_dtype}, accumulate {accumulate}")

  # Every mode sees the same batches, so the loss curves are comparable.
  rng = np.random.default_rng(seed)
  batches = [(x_train[idx], y_train[idx]) for idx in
             (rng.choice(len(x_train), batch_size, replace=False) for _ in range(steps))]

  results = []
  for i, mode in enumerate(modes):
    optimizer = optax.adamw(lr, weight_decay=1e-4)
    dp = build_step(mode, loss_fn, optimizer, params0, mesh, wire, param_dtype=narrow,
                    accumulate=accumulate)
    if i == 0:
      say("\nParameter layout (jpack.plan):")
      say(dp.layout.summary())
      say("")
    state, batch, losses, times = _train(dp, params0, batches, batch_sharding,
                                         _progress(steps, mode, progress, say))
    colls = _reference.count_collectives(_reference.compiled_hlo(dp, state, batch))
    acc = accuracy(dp.unpack(state), x_test, y_test, narrow)
    results.append(ModeResult(
        mode=mode, losses=losses, step_ms=times, compile_s=times[0] / 1e3,
        collectives=colls.count, collective_arrays=colls.arrays,
        grad_bytes=grad_bytes_per_step(_reduced_layout(dp.layout, mode, narrow, params0),
                                       mode, wire, accumulate),
        opt_state_bytes=state_bytes_per_device(state.opt_state),
        test_accuracy=acc, params_as=params_kept_as(mode, narrow),
        accumulate=accumulate,
        state_bytes=state_bytes_per_device((state.params, state.opt_state))))

  say("")
  say(format_table(results))
  out_dir.mkdir(parents=True, exist_ok=True)
  png = plot(results, out_dir / "jpack-demo.png",
             title=f"jpack demo: digits MLP, {devices} CPU devices, batch {batch_size}")
  (out_dir / "results.json").write_text(json.dumps(
      {"devices": devices, "steps": steps, "batch_size": batch_size,
       "comm_dtype": comm_dtype, "param_dtype": param_dtype, "accumulate": accumulate,
       "results": [{**dataclasses.asdict(r), "median_ms": r.median_ms,
                    "final_loss": r.final_loss} for r in results]}, indent=1))
  say(f"\nWrote {png} and {out_dir / 'results.json'} "
      f"(total {time.perf_counter() - t_start:.1f} s)")
  return results


def loss_params(params, param_dtype: Any = None):
  """The params as the loss sees them: cast to ``param_dtype`` (a no-op where they are
  kept in it already)."""
  if param_dtype is None:
    return params
  import jpack

  return jpack.cast_params(params, param_dtype)


def _reduced_layout(layout, mode: str, param_dtype: Any, params: dict):
  """The layout of the gradients as reduced: with params kept in ``param_dtype``, the
  float32 masters' (the gradients are cast to them before the reduction)."""
  if param_dtype is None or mode not in MASTER_MODES:
    return layout
  from jpack._precision import master_layout

  return master_layout(layout, params)


def _check_options(modes: Sequence[str], devices: int, batch_size: int, comm_dtype: str,
                   steps: int, param_dtype: str = "float32", accumulate: int = 1) -> None:
  for m in modes:
    if m not in ALL_MODES:
      raise ValueError(f"unknown mode {m!r}; choose from {', '.join(ALL_MODES)}")
  if batch_size % devices:
    raise ValueError(f"batch size {batch_size} must be divisible by devices {devices}")
  if comm_dtype not in COMM_DTYPES:
    raise ValueError(f"comm_dtype must be one of {COMM_DTYPES}, got {comm_dtype!r}")
  if steps < 2:  # the first step compiles: step times need a second one
    raise ValueError(f"steps must be >= 2 (the first step compiles), got {steps}")
  if param_dtype not in PARAM_DTYPES:
    raise ValueError(f"param_dtype must be one of {PARAM_DTYPES}, got {param_dtype!r}")
  if accumulate < 1 or (batch_size // devices) % accumulate:
    raise ValueError(f"accumulate {accumulate} must be >= 1 and divide the per-device "
                     f"batch {batch_size // devices} (micro-batches of equal size)")


def accuracy(params: dict, x, y, param_dtype: Any = None) -> float:
  """The share of ``x`` that the MLP classifies as ``y``, with the params as the loss
  sees them (cast to ``param_dtype``)."""
  import jax
  import numpy as np

  logits = jax.jit(forward)(loss_params(params, param_dtype), x)
  return float((np.asarray(logits).argmax(-1) == y).mean())


def _train(dp, params0: dict, batches: Sequence[Any], sharding, bar=None) -> tuple:
  """One step of ``dp`` per host batch, each timed alone (the batch placed first).

  Returns the final state, the last placed batch, and every step's loss and time (ms).
  """
  import jax

  bar = bar or _Progress(len(batches), "", False, None)
  state = dp.init(params0)
  losses, times = [], []
  batch = None
  for step, host_batch in enumerate(batches):
    batch = jax.block_until_ready(jax.device_put(host_batch, sharding))
    t0 = time.perf_counter()
    state, metrics = dp.step(state, batch)
    jax.block_until_ready((state, metrics))
    ms = (time.perf_counter() - t0) * 1e3
    losses.append(float(metrics["loss"]))
    times.append(ms)
    bar.update(step, losses[-1], ms)
  bar.close()
  return state, batch, losses, times


def format_table(results: Sequence[ModeResult]) -> str:
  """The comparison table (plain text, aligned)."""
  base = next((r for r in results if r.mode == BASELINE), results[0] if results else None)
  header = ("mode", "params", "accumulate", "step ms (median)",
            f"speed-up vs {base.mode if base else BASELINE}", "compile s",
            "collectives AR/RS/AG/A2A [arrays]", "grad bytes/step", "opt state/device",
            "params+opt/device", "final loss", "test acc")
  rows = []
  for r in results:
    c = r.collectives
    speed = base.median_ms / r.median_ms if base and r.median_ms > 0 else float("nan")
    rows.append((r.mode, r.params_as, _accumulate_cell(r), f"{r.median_ms:.2f}",
                 f"{speed:.2f}x", f"{r.compile_s:.2f}",
                 f"{c['all-reduce']}/{c['reduce-scatter']}/{c['all-gather']}/"
                 f"{c['all-to-all']} [{r.collective_arrays}]",
                 human_bytes(r.grad_bytes, 2), human_bytes(r.opt_state_bytes, 2),
                 human_bytes(r.state_bytes, 2), f"{r.final_loss:.4f}",
                 f"{r.test_accuracy:.3f}"))
  widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

  def line(cells):
    return " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(cells, widths)))

  sep = "-+-".join("-" * w for w in widths)
  notes = ("step ms: median wall time per step, first (compiling) step excluded; "
           "compile s: the first step.\n"
           f"speed-up: {base.mode if base else BASELINE}'s step ms / this mode's "
           "(above 1x: faster).\n"
           "collectives: ops in the compiled step (all-reduce / reduce-scatter / all-gather / "
           "all-to-all), loss mean included;\n  [arrays]: how many arrays they move (XLA may merge "
           "several collectives into one op on a tuple); those in a micro-batch loop count "
           "once.\n"
           "params: kept in bfloat16 with float32 masters in the optimizer state "
           "(jpack packed and sharded), float32 masters only, gathered in bfloat16 (fsdp), or "
           "float32, cast for the loss (the other modes).\n"
           "accumulate: micro-batches per step, one update of the whole batch; "
           "MultiSteps (optax) reduces every micro-batch's gradients, jpack once per step.\n"
           "params+opt/device: bytes of params + optimizer state (masters and moments) on "
           "one device.")
  return "\n".join([line(header), sep, *(line(r) for r in rows), "", notes])


def _accumulate_cell(r: ModeResult) -> str:
  if r.accumulate == 1:
    return "1"
  return f"{r.accumulate} MultiSteps" if r.mode in PLAIN_MODES else str(r.accumulate)


# -- progress and plot -----------------------------------------------------------------


class _Progress:
  def __init__(self, total, mode, enabled, say):
    self.total, self.mode, self.say = total, mode, say
    self.bar = None
    self.every = max(1, total // 10)
    if not enabled:
      self.every = 0
      return
    try:
      from tqdm.auto import tqdm
    except ImportError:
      tqdm = None
    if tqdm is not None:
      self.bar = tqdm(total=total, desc=f"{mode:>9}", unit="step", leave=True,
                      dynamic_ncols=True, file=sys.stderr)

  def update(self, step, loss, ms):
    if self.bar is not None:
      self.bar.set_postfix(loss=f"{loss:.4f}", ms=f"{ms:.1f}", refresh=False)
      self.bar.update(1)
    elif self.every and ((step + 1) % self.every == 0 or step == 0):
      self.say(f"{self.mode:>9} step {step + 1:>5}/{self.total}  loss {loss:.4f}  "
               f"{ms:8.1f} ms")

  def close(self):
    if self.bar is not None:
      self.bar.close()


def _progress(total, mode, enabled, say):
  return _Progress(total, mode, enabled, say)


def _check_plot_deps():
  try:
    import matplotlib  # noqa: F401
  except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("The jpack demo needs scikit-learn, matplotlib and tqdm: "
                      "pip install 'jpack[demo]'") from e


def plot(results: Sequence[ModeResult], path: pathlib.Path, title: str = "") -> pathlib.Path:
  """Loss curves per mode (left) and median step time per mode (right) as a PNG."""
  import matplotlib

  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt
  import numpy as np

  fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5))
  styles = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)))
  for i, r in enumerate(results):
    losses = np.asarray(r.losses)
    k = max(1, len(losses) // 25)
    smooth = np.convolve(losses, np.ones(k) / k, mode="valid") if len(losses) >= k else losses
    ax_loss.plot(np.arange(len(smooth)) + k, smooth, label=r.mode, lw=2.0,
                 ls=styles[i % len(styles)], color=f"C{i}")
  ax_loss.set_yscale("log")
  ax_loss.set_xlabel("step")
  ax_loss.set_ylabel("training loss (moving average)")
  ax_loss.set_title("loss (same data and math: the curves should coincide)")
  ax_loss.legend()
  ax_loss.grid(alpha=0.3)

  names = [r.mode for r in results]
  medians = [r.median_ms for r in results]
  bars = ax_time.bar(names, medians, color=[f"C{i}" for i in range(len(results))])
  for b, v in zip(bars, medians):
    ax_time.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center",
                     va="bottom", fontsize=9)
  ax_time.set_ylabel("median step time (ms)")
  ax_time.set_title("step time (lower is better)")
  ax_time.grid(axis="y", alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
