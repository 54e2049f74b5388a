"""The deepest GPT-like model (width 2048, 2048 tokens, one sequence per device) whose
adamw step, compiled for 8 H100s, fits in one H100's memory, per mode (not run).

The peak (arguments + temp of the compiled step, which donates its state) grows by about
the same bytes with every layer. Each variant is compiled at `PROBES` depths: the answer
is where the line through the shallowest and the deepest reaches `BUDGET`, compiled to
confirm it where it is no deeper than those; the middle probe shows how far from the
line a compiled peak lies. (Programs much deeper than the deepest probe take XLA:GPU
most of an hour each to compile here.)
"""

from benchmarks import gpu_compile, models
from benchmarks import harness as h

TITLE = "The deepest GPT-like model that fits in an 80 GB H100, per mode (compiled, not run)"
MERGE_KEY = "model"
MODELS = ()
# 80 GB as JAX can use it with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (the default, 0.75,
# leaves a quarter of it unused).
BUDGET = int(80e9 * 0.95)
PROBES = (8, 24, 48)  # the line through the first and last; the middle checks it
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
  return gpu_compile.compile_variant(key, gpt(layers), gpu_compile.gpu_mesh(),
                                     rows=1).peak_bytes


def deepest(key: str) -> tuple[int, float, int]:
  """``(layers, bytes per layer, the middle probe's compiled peak - the line's)``."""
  (a, pa), (m, pm), (b, pb) = [(n, peak(key, n)) for n in PROBES]
  per_layer = (pb - pa) / (b - a)
  layers = a + int((BUDGET - pa) // per_layer)
  if layers <= b:  # within the probes: compiled, one layer less until it fits
    while layers > 1 and peak(key, layers) > BUDGET:
      layers -= 1
  return layers, per_layer, int(pm - (pa + (m - a) * per_layer))


def run(opts, report: h.Report) -> None:
  table = h.Table(["variant", "layers", "params (B)", "GiB per layer",
                   f"{PROBES[1]} layers: compiled - line MiB"],
                  title=f"GPT-like, width 2048, 2048 tokens, 1 sequence per device, adamw, "
                        f"float32; 8 H100s, budget {BUDGET / GIB:.1f} GiB per device; the "
                        f"line through {PROBES[0]} and {PROBES[-1]} layers")
  for key in opts.variants or VARIANTS:
    print(f"  fitting {key} ...", flush=True)
    (layers, per_layer, off), seconds = h.timed(lambda: deepest(key))
    params = gpt(layers).num_params
    print(f"  {key}: {layers} layers; at {PROBES[1]} the compiled peak is "
          f"{off / 2**20:+,.0f} MiB from the line", flush=True)
    table.add(VARIANTS[key], layers, f"{params / 1e9:.2f}", f"{per_layer / GIB:.2f}",
              f"{off / 2**20:+,.0f}", model="gpt_x2048", key=key, layers=layers,
              params=params, per_layer_bytes=per_layer, off_bytes=off,
              budget_bytes=BUDGET, compile_s=seconds)
  report.table(table)
