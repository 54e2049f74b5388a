"""One adam update on one device, per workload: ``optax.adam`` on the tree (per-leaf),
``jpack.optax.flat(optax.adam)`` on packed params and gradients (jpack; and "jpack, one
bucket": one bucket per dtype, the fewest buffers a call passes), and
``torch.optim.Adam`` (fused on CUDA, else foreach on CPU, labelled so; "n/a" without
torch). Times: one call's wall time, the median of interleaved rounds.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jpack
from benchmarks import harness as h

TITLE = "jpack optimizer update benchmark"
MERGE_KEY = "workload"
LEARNING_RATE = 1e-3
MODELS = h.workload_names()
VARIANTS = ("per_leaf", "jpack", "jpack_one", "torch")
# XLA:CPU takes minutes to compile per-leaf adam over 4000 leaves: a quick run skips it.
DEFAULTS = dict(rounds=10, scale=1.0,
                models=["gpt2_small", "bert_base", "resnet50", "many_small_4000"])
QUICK = dict(rounds=3, scale=0.05, models=["gpt2_small", "bert_base", "resnet50"])
GOAL_VS_PER_LEAF = GOAL_VS_TORCH = 1.0  # jpack's time < per-leaf's, <= torch fused Adam's


def scaled(w: h.Workload, scale: float) -> h.Workload:
  """``w`` with every leaf's largest dimension times ``scale`` (at least 1)."""
  if scale == 1:
    return w
  shapes = {}
  for path, s in w.shapes.items():
    shape = list(s.shape)
    if shape:
      i = int(np.argmax(shape))
      shape[i] = max(1, round(shape[i] * scale))
    shapes[path] = jax.ShapeDtypeStruct(tuple(shape), s.dtype)
  return dataclasses.replace(w, shapes=shapes)


class _Update:
  """A compiled update donating its params and state; each call continues from the last."""

  def __init__(self, tx: optax.GradientTransformation, grads: Any, params: Any):
    def update(g, s, p):
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s

    self.grads, self.params = grads, params
    self.state = jax.block_until_ready(tx.init(params))
    self.compiled = h.compile_fn(jax.jit(update, donate_argnums=(1, 2)), grads, self.state,
                                 params)

  def __call__(self) -> Any:
    self.params, self.state = self.compiled.fn(self.grads, self.state, self.params)
    return self.params


class _TorchAdam:
  """``torch.optim.Adam`` over tensors holding ``params``, with ``grads`` set once."""

  def __init__(self, torch: Any, params: dict[str, Any], grads: dict[str, Any]):
    self.torch = torch
    self.cuda = torch.cuda.is_available()
    self.label, device, kind = (("fused (CUDA)", "cuda", {"fused": True}) if self.cuda
                                else ("foreach (CPU)", "cpu", {"foreach": True}))
    self.tensors = {k: self._tensor(v, device) for k, v in params.items()}
    for k, t in self.tensors.items():
      t.requires_grad_(True)
      t.grad = self._tensor(grads[k], device)
    self.opt = torch.optim.Adam(list(self.tensors.values()), lr=LEARNING_RATE, **kind)

  def _tensor(self, x: Any, device: str) -> Any:
    dtype = getattr(self.torch, np.dtype(x.dtype).name)  # float32, bfloat16, ...
    # A copy (``x`` may be a read-only JAX buffer); narrow floats cross as float32.
    host = np.array(x, np.float32 if x.dtype.itemsize < 4 else x.dtype)
    return self.torch.from_numpy(host).to(device=device, dtype=dtype)

  def __call__(self) -> None:
    self.opt.step()
    if self.cuda:
      self.torch.cuda.synchronize()

  def params(self) -> dict[str, np.ndarray]:
    return {k: t.detach().float().cpu().numpy() for k, t in self.tensors.items()}


def _import_torch() -> Any:
  """torch, or None. Imported after JAX's backend started: a JAX that finds torch's older
  CUDA libraries loaded refuses its GPU."""
  try:
    import torch
  except (ImportError, OSError) as e:
    print(f"torch: n/a ({type(e).__name__}: {e})", flush=True)
    return None
  print(f"torch: {torch.__version__}, CUDA {'' if torch.cuda.is_available() else 'not '}"
        "available", flush=True)
  return torch


@dataclasses.dataclass
class Result:
  workload: h.Workload
  buckets: int
  timings: dict[str, h.Timing]
  compile_s: dict[str, float]
  torch_label: str
  max_diff: dict[str, float]


def bench_workload(w: h.Workload, torch: Any, *, runs: int) -> Result:
  """Build every variant from the same values, check their first update, time them."""
  print(f"\n{w.describe()}", flush=True)
  params = h.random_tree(w.shapes, seed=0)
  grads = h.random_tree(w.shapes, seed=1)
  layout = jpack.plan(params)
  print(f"  {len(layout.buckets)} buckets", flush=True)
  # jpack's inputs are packed first: the per-leaf update donates ``params``.
  one = jpack.plan(params, bucket_bytes=1 << 62, max_leaves=None, solo_bytes=None)
  calls: dict[str, Any] = {k: _Update(jpack.optax.flat(optax.adam(LEARNING_RATE)),
                                      jpack.pack(grads, lay), jpack.pack(params, lay))
                           for k, lay in (("jpack", layout), ("jpack_one", one))}
  torch_adam = _TorchAdam(torch, params, grads) if torch is not None else None
  calls["per_leaf"] = _Update(optax.adam(LEARNING_RATE), grads, params)
  del params, grads
  compile_s = {k: calls[k].compiled.total_s for k in ("per_leaf", "jpack", "jpack_one")}
  print("  compile: " + ", ".join(f"{k} {h.fmt_s(s)} s" for k, s in compile_s.items()),
        flush=True)

  reference = {k: np.asarray(v, np.float64) for k, v in calls["per_leaf"]().items()}
  max_diff = {k: h.max_diff(reference, jpack.unpack(calls[k]())) for k in ("jpack", "jpack_one")}
  if torch_adam is not None:
    torch_adam()
    max_diff["torch"] = h.max_diff(reference, torch_adam.params())
    calls["torch"] = torch_adam
  del reference
  h.release_host_memory()

  timings = h.time_rounds({k: calls[k] for k in VARIANTS if k in calls}, runs)
  print("  " + ", ".join(f"{k} {h.fmt_ms(t.median_s)} ms" for k, t in timings.items()),
        flush=True)
  return Result(w, len(layout.buckets), timings, compile_s,
                torch_adam.label if torch_adam else "n/a", max_diff)


def _tables(results: list[Result]) -> tuple[h.Table, h.Table]:
  """The times of every workload, and the goals they are held to."""
  times = h.Table(["workload", "leaves", "M params", "buckets", "per-leaf ms", "jpack ms",
                   "one bucket ms", "torch ms", "torch Adam", "speed-up vs per-leaf",
                   "speed-up vs torch", "one bucket vs torch", "max |Δp| jpack",
                   "max |Δp| torch"],
                  title=f"One adam update on one {jax.devices()[0].platform} device")
  goals = h.Table(["goal", "workload", "value", "limit", "result"], title="Goals")
  for r in results:
    w, t = r.workload, r.timings
    # jpack's time / the other's, and its inverse, the speed-up: medians of per-round ratios.
    over_leaf, over_torch = (t["jpack"].over(t[k]) if k in t else None
                             for k in ("per_leaf", "torch"))
    vs_leaf, vs_torch = (None if x is None else 1 / x for x in (over_leaf, over_torch))
    one_vs_torch = t["torch"].over(t["jpack_one"]) if "torch" in t else None
    torch_s = t["torch"].median_s if "torch" in t else None
    diff_torch = r.max_diff.get("torch")
    times.add(w.name, w.num_leaves, f"{w.num_elements / 1e6:.3g}", r.buckets,
              h.fmt_ms(t["per_leaf"].median_s), h.fmt_ms(t["jpack"].median_s),
              h.fmt_ms(t["jpack_one"].median_s),
              "n/a" if torch_s is None else h.fmt_ms(torch_s), r.torch_label,
              h.fmt_ratio(vs_leaf), "n/a" if vs_torch is None else h.fmt_ratio(vs_torch),
              "n/a" if one_vs_torch is None else h.fmt_ratio(one_vs_torch),
              f"{r.max_diff['jpack']:.1e}", "-" if diff_torch is None else f"{diff_torch:.1e}",
              workload=w.name, leaves=w.num_leaves, params=w.num_elements, bytes=w.nbytes,
              buckets=r.buckets, per_leaf_s=t["per_leaf"].median_s,
              jpack_s=t["jpack"].median_s, jpack_one_s=t["jpack_one"].median_s,
              torch_s=torch_s, torch_adam=r.torch_label, one_bucket_speedup_vs_torch=one_vs_torch,
              compile_s=r.compile_s, speedup_vs_per_leaf=vs_leaf, speedup_vs_torch=vs_torch,
              jpack_over_per_leaf=over_leaf, jpack_over_torch=over_torch,
              max_param_diff_vs_per_leaf=r.max_diff)
    h.add_goal(goals, "jpack time / per-leaf optax time", w.name, value=over_leaf,
               limit=GOAL_VS_PER_LEAF, shown=f"< {GOAL_VS_PER_LEAF:.2f}x", strict=True,
               workload=w.name)
    h.add_goal(goals, "jpack time / torch fused Adam time", w.name, value=over_torch,
               limit=GOAL_VS_TORCH, shown=f"<= {GOAL_VS_TORCH:.2f}x", workload=w.name,
               skip=not r.torch_label.startswith("fused"))
  return times, goals


def run(opts: Any, report: h.Report) -> None:
  torch = _import_torch()  # after JAX's backend started: see _import_torch
  results = []
  for name in opts.models:
    w = scaled(h.load_workload(name), opts.scale)
    if bad := [p for p, s in w.shapes.items() if not jnp.issubdtype(s.dtype, jnp.floating)]:
      raise SystemExit(f"Workload {name!r} has non-floating leaves ({', '.join(bad[:3])}...): "
                       "adam needs floating parameters; choose other --workloads.")
    results.append(bench_workload(w, torch, runs=opts.rounds))
    h.release_host_memory()
    report.parts[:] = [*_tables(results), "Times: one update's wall time, dispatch included; "
                       "median of interleaved rounds. speed-up = the other's time / jpack's "
                       "(median of per-round ratios). one bucket: jpack with one bucket per "
                       "dtype (`plan(..., bucket_bytes=1 << 62, max_leaves=None, "
                       "solo_bytes=None)`). max |Δp|: largest parameter difference "
                       "from per-leaf after one update."
                       + (f" Leaves scaled by {opts.scale:g}." if opts.scale != 1 else "")]
    opts.save()  # after every workload: a run stopped by a time limit keeps it
  for part in report.parts:
    print("\n" + (part.text() if isinstance(part, h.Table) else part), flush=True)
  print("\n" + report.parts[0].markdown(), flush=True)
