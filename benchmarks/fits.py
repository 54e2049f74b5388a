"""The deepest GPT-like model (width 2048, 2048 tokens, one sequence per device) whose
adamw step, compiled for 8 H100s, fits in one H100's memory, per mode (not run).

The peak (arguments + temp of the compiled step, which donates its state) grows by the
same bytes with every layer: each variant is compiled at two depths, the depth where the
line reaches `BUDGET` is predicted, and that depth is compiled to confirm it (one layer
less until it fits; one more while it does, where the line puts one more within a
quarter of a layer of the budget).
"""

import jax
import numpy as np

from benchmarks import gpu_compile, models
from benchmarks import harness as h

TITLE = "The deepest GPT-like model that fits in an 80 GB H100, per mode (compiled, not run)"
MERGE_KEY = "model"
MODELS = ()
# 80 GB as JAX can use it with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (the default, 0.75,
# leaves a quarter of it unused).
BUDGET = int(80e9 * 0.95)
PROBES = (4, 8)  # the depths the line is drawn through
VARIANTS = {"per_leaf": "per-leaf data parallel", "packed": "jpack packed (default)",
            "sharded": "jpack ZeRO-1 (sharded)", "fsdp": "jpack ZeRO-3 (fsdp)",
            "jit_fsdp": "jax.jit FSDP (params and state split)"}
DEFAULTS: dict = {}
QUICK = dict(variants=["fsdp"])
GIB = 2**30


def gpt(layers: int) -> models.Model:
  return models.gpt2(layers=layers, width=2048, vocab=50257, positions=2048, heads=16,
                     seq=2048, abstract=True, name=f"gpt_{layers}x2048")


def peak(key: str, layers: int) -> int:
  r = gpu_compile.compile_variant(key, gpt(layers), gpu_compile.gpu_mesh(), rows=1)
  return r.arg_bytes + r.temp_bytes


def deepest(key: str) -> tuple[int, int, float]:
  """``(layers, peak bytes there, bytes per layer)``: the deepest model that fits."""
  (a, pa), (b, pb) = [(n, peak(key, n)) for n in PROBES]
  per_layer = (pb - pa) / (b - a)
  layers = a + int((BUDGET - pa) // per_layer)
  at = peak(key, layers)
  while at > BUDGET and layers > 1:
    layers -= 1
    at = peak(key, layers)
  # Deep programs take minutes to compile: one more layer only where it could fit.
  while at + 1.25 * per_layer > BUDGET >= at + 0.75 * per_layer or (
      at + per_layer <= BUDGET):
    more = peak(key, layers + 1)
    if more > BUDGET:
      break
    layers, at = layers + 1, more
  return layers, at, per_layer


def run(opts, report: h.Report) -> None:
  table = h.Table(["variant", "layers", "params (B)", "peak GiB", "GiB per layer"],
                  title=f"GPT-like, width 2048, 2048 tokens, 1 sequence per device, adamw, "
                        f"float32; 8 H100s, budget {BUDGET / GIB:.1f} GiB per device")
  for key in opts.variants or VARIANTS:
    print(f"  fitting {key} ...", flush=True)
    (layers, at, per_layer), seconds = h.timed(lambda: deepest(key))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(gpt(layers).params))
    table.add(VARIANTS[key], layers, f"{params / 1e9:.2f}", f"{at / GIB:.1f}",
              f"{per_layer / GIB:.2f}", model="gpt_x2048", key=key, layers=layers,
              params=params, peak_bytes=at, per_layer_bytes=per_layer,
              budget_bytes=BUDGET, compile_s=seconds)
    print(f"  {key}: {layers} layers, {at / GIB:.1f} GiB", flush=True)
  report.table(table)
