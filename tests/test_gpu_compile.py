"""jpack's data-parallel steps compiled for 8 simulated H100s, checked from the scheduled
GPU program (no GPU needed: the CUDA plugin compiles for a target config).

`tests/test_gpu_path.py` checks what jpack lowers for CUDA; this checks what XLA:GPU
makes of it: the collectives in each bucket's dtype and overlapped with the backward
pass, no all-to-all and no conditional, and no more bytes copied than one gradient above
a step without any reduction. The reference programs (the floor and XLA's own per-leaf
step) are compiled the same way, from plain JAX.
"""

import os
import re
import sys

import pytest

# No GPU and no driver here: the plugin must not check for them.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
if sys.platform != "linux":  # JAX's CUDA plugin has Linux wheels only
  pytest.skip("compiling for GPUs needs JAX's CUDA plugin (Linux only)",
              allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import gpu_compile, models  # noqa: E402
from jpack._reference import analyze_program, count_collectives  # noqa: E402

# Small enough to compile in seconds, with what matters in real models: tied embeddings,
# bf16 weights next to float32 norms, many small leaves next to big ones.
SMALL = {
    "gpt2": lambda: models.gpt2(layers=2, width=64, vocab=512, positions=64, heads=4, seq=16,
                                abstract=True),
    "llama_bf16": lambda: models.llama(layers=2, width=64, hidden=176, vocab=512, heads=4,
                                       seq=16, abstract=True),
}


@pytest.fixture(scope="module")
def mesh():
  return gpu_compile.gpu_mesh()


@pytest.fixture(scope="module", params=sorted(SMALL))
def compiled(request, mesh):
  model = SMALL[request.param]()
  keys = ("floor", "per_leaf", "per_leaf_no_concat", "hand_pmean", "hand_pmean_options",
          "packed", "sharded")
  return model, {k: gpu_compile.compile_variant(k, model, mesh, rows=2) for k in keys}


def _grad_bytes(model):
  return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(model.params))


def test_mesh_is_eight_h100s(mesh):
  assert mesh.devices.size == 8
  assert all("H100" in d.device_kind for d in mesh.devices.flat)


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_collectives_in_bucket_dtypes_without_all_to_all_or_conditionals(compiled, mode):
  model, results = compiled
  r = results[mode]
  dtypes = {str(jnp.dtype(x.dtype)) for x in jax.tree.leaves(model.params)}
  hlo_dtypes = {"float32": "f32", "bfloat16": "bf16"}
  ops = {c.op for c in r.program.collectives}
  assert "all-to-all" not in ops
  assert "conditional(" not in r.hlo and " case(" not in r.hlo
  # Every gradient dtype travels in its own dtype: bf16 weights are reduced as bf16,
  # never widened to f32 (the f32 all-reduces left are the norm's and the loss's).
  grads = [c for c in r.program.collectives if c.op != "all-reduce" or c.bytes > 64]
  assert {c.dtype for c in grads} == {hlo_dtypes[d] for d in dtypes}
  if mode == "packed":
    assert ops == {"all-reduce"}
  else:
    assert {"reduce-scatter", "all-gather"} <= ops


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_copies_at_most_one_gradient_above_the_floor(compiled, mode):
  model, results = compiled
  extra = results[mode].program.copy_bytes - results["floor"].program.copy_bytes
  assert extra <= _grad_bytes(model), (extra, _grad_bytes(model))


@pytest.mark.parametrize("mode", ["packed", "sharded"])
def test_every_gradient_collective_overlaps_compute(compiled, mode):
  _, results = compiled
  colls = [c for c in results[mode].program.collectives
           if c.op in ("all-reduce", "reduce-scatter") and c.bytes > 64]
  assert colls and all(c.overlapped for c in colls), colls


# per_leaf_no_concat: XLA's own step at its best, its merged all-reduces in place. ZeRO-1
# launches a reduce-scatter per matrix, which on the small bf16 model is more than that.
@pytest.mark.parametrize("mode,baseline", [("packed", "per_leaf"), ("sharded", "per_leaf"),
                                           ("packed", "per_leaf_no_concat")])
def test_fewer_kernels_than_xlas_per_leaf_step(compiled, mode, baseline):
  _, results = compiled
  assert results[mode].program.kernels < results[baseline].program.kernels


def test_merged_all_reduces_reduce_the_buckets_in_place(compiled):
  # The default mode lets XLA merge its buckets' all-reduces (one grouped launch) but
  # not concatenate them into one buffer: a merged all-reduce returns a tuple of buckets.
  # Per-leaf's merged all-reduces each reduce one concatenated buffer.
  _, results = compiled
  packed, per_leaf = (count_collectives(results[k].hlo) for k in ("packed", "per_leaf"))
  assert packed.arrays > packed.count["all-reduce"], packed
  assert per_leaf.arrays == per_leaf.count["all-reduce"], per_leaf


def test_step_options_on_gpus_keep_the_users_disabled_passes(mesh, monkeypatch):
  import jpack

  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_disable_hlo_passes=foo,bar")
  plan_options, options = jpack.step_options(mesh)
  assert options["xla_disable_hlo_passes"] == "foo,bar,all-reduce-contiguous"
  assert plan_options == {"num_shards": 1, "align_bytes": 16, "solo_ndim": 2}
  monkeypatch.delenv("XLA_FLAGS")
  plan_options, options = jpack.step_options(mesh, "sharded")
  assert options["xla_disable_hlo_passes"] == "all-reduce-contiguous"
  assert options["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 0
  assert plan_options["num_shards"] == 8
  assert jpack.step_options(mesh, jpack.Mode("sharded")) == (plan_options, options)
  assert jpack.step_options(mesh, "allreduce")[0]["num_shards"] == 1
  with pytest.raises(ValueError, match="mode must be one of .*, got 'data'"):
    jpack.step_options(mesh, "data")


def test_hand_written_step_with_step_options_copies_no_more_than_one_gradient(compiled):
  # The README's jpack.pmean step under a plain jax.jit: XLA concatenates its buckets
  # again and slices them back; with jpack.step_options it reduces them in place.
  model, results = compiled
  floor = results["floor"].program.copy_bytes
  plain, tuned = results["hand_pmean"].program, results["hand_pmean_options"].program
  assert tuned.copy_bytes - floor <= _grad_bytes(model)
  assert tuned.copy_bytes < plain.copy_bytes and tuned.hbm_bytes < plain.hbm_bytes


def test_analyze_program_reads_a_scheduled_module():
  # A hand-written scheduled module: two fusions, one of them copy-only, an async
  # all-reduce with a fusion between its start and done, and one slice-only read.
  hlo = """
HloModule m, is_scheduled=true

%copy_comp (p0: f32[4], p1: f32[4]) -> f32[8] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  ROOT %c = f32[8]{0} concatenate(%p0, %p1), dimensions={0}
}

%mul_comp (q0: f32[8]) -> f32[1] {
  %q0 = f32[8]{0} parameter(0)
  %m = f32[8]{0} multiply(%q0, %q0)
  ROOT %s = f32[1]{0} slice(%m), slice={[0:1]}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %z = f32[] add(%x, %y)
}

ENTRY %main (a: f32[4], b: f32[4]) -> f32[8] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %cat = f32[8]{0} fusion(%a, %b), kind=kLoop, calls=%copy_comp
  %ars = f32[8]{0} all-reduce-start(%cat), replica_groups={}, to_apply=%add
  %one = f32[1]{0} fusion(%cat), kind=kLoop, calls=%mul_comp
  ROOT %ard = f32[8]{0} all-reduce-done(%ars)
}
"""
  p = analyze_program(hlo)
  assert p.kernels == 3
  assert p.copy_kernels == 1 and p.copy_bytes == 32
  # cat: 32 written + 32 read; all-reduce: 32 + 32; the sliced read: 4 + 4 written
  assert p.hbm_bytes == 64 + 64 + 8
  (ar,) = p.collectives
  assert (ar.op, ar.dtype, ar.bytes, ar.overlapped) == ("all-reduce", "f32", 32, True)


@pytest.mark.parametrize("mode,shards", [("packed", 1), ("allreduce", 1), ("sharded", 8)])
def test_gpu_layout_keeps_matrices_whole_and_pads_only_for_zero1(mesh, mode, shards):
  import optax

  import jpack

  model = SMALL["llama_bf16"]()
  dp = jpack.data_parallel(model.loss, optax.adamw(1e-3), model.params, mesh, mode=mode)
  layout = dp.layout
  assert layout.num_shards == shards
  for slot in layout.slots:
    bucket = layout.buckets[slot.bucket]
    if len(slot.shape) >= 2:  # read back as a bitcast, never copied out for a matmul
      assert len(bucket.slots) == 1 and slot.offset == 0
      assert bucket.size == np.prod(slot.shape)


def test_your_own_model_in_one_command(tmp_path, monkeypatch, capsys):
  # docs/gpu.md: PYTHONPATH=docs/examples python -m benchmarks gpu_compile --model ...
  import json
  import pathlib

  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / "docs" / "examples"))
  out = tmp_path / "mine.json"
  from benchmarks.__main__ import main
  assert main(["gpu_compile", "--model", "gpu_model:model", "--variants",
               "floor,per_leaf,packed", "--json", str(out)]) == 0
  rows = [r["values"] for t in json.loads(out.read_text())["tables"] for r in t["rows"]
          if "kernels" in r["values"]]
  assert [r["key"] for r in rows] == ["floor", "per_leaf", "packed"]
  assert rows[2]["kernels"] < rows[1]["kernels"]
  assert "gpu_model:model" in capsys.readouterr().out


@pytest.mark.parametrize("name", models.FULL_SIZE)
def test_full_size_models_have_exactly_the_workload_tables_leaves(name):
  # The compiled table's models are real models with the shape tables' leaves: same key
  # paths, shapes and dtypes, and a loss that traces on a batch (shapes only).
  from benchmarks import harness

  model = models.full_size(name)
  want = {leaf["path"]: (tuple(leaf["shape"]), leaf["dtype"])
          for leaf in harness.load_workload_doc(name)["leaves"]}
  got = {"/".join(str(k.key) for k in path): (tuple(x.shape), str(x.dtype))
         for path, x in jax.tree_util.tree_leaves_with_path(model.params)}
  assert got == want
  loss = jax.eval_shape(model.loss, model.params, model.batch_like(2))
  assert loss.shape == () and loss.dtype == jnp.float32


def test_update_keeps_what_is_not_compiled_again():
  # --update: a slow workload, or one variant, compiled on its own joins the earlier
  # results in benchmarks/results/gpu_compile.json: tables in the workloads' order, rows
  # in the variants' order, and the commands listed that made the rows still there.
  def doc(command, workloads, keys):
    def table(n, kind):
      return {"title": f"{n} {command}", "columns": [kind], "rows": [
          {"cells": {}, "values": {"workload": n, "key": k, "run": command}, "command": command}
          for k in keys]}
    return {"command": command,
            "tables": [table(n, kind) for n in workloads for kind in ("variants", "goals")]}

  earlier = doc("all", ["gpt2_small", "bert_base", "many_small_4000"], ["floor", "packed"])
  now = doc("one", ["many_small_4000", "resnet50"], ["hand_pmean", "floor"])
  from benchmarks import harness
  merged = lambda a, b: harness.merged(a, b, "workload", list(gpu_compile.VARIANTS),
                                       list(gpu_compile.MODELS))
  got = merged(earlier, now)
  assert [t["title"] for t in got["tables"]] == [
      "gpt2_small all", "gpt2_small all", "bert_base all", "bert_base all",
      "resnet50 one", "resnet50 one", "many_small_4000 one", "many_small_4000 one"]
  rows = [(r["values"]["key"], r["values"]["run"]) for r in got["tables"][-1]["rows"]]
  assert rows == [("floor", "one"), ("hand_pmean", "one"), ("packed", "all")]
  assert got["commands"] == ["all", "one"]
  assert merged(got, doc("two", [], []))["commands"] == ["all", "one", "two"]
  again = doc("three", ["many_small_4000", "resnet50"], ["hand_pmean", "floor"])
  assert merged(got, again)["commands"] == ["all", "three"]  # every row of "one" made again


def test_shares_and_goals_are_computed_from_the_merged_rows():
  # A packed row compiled in one run, the floor and per-leaf rows in another: after the
  # merge the packed row's shares and goals compare with those, by hand here.
  def row(key, kernels, hbm, copy, temp, overlapped=True):
    colls = [] if key == "floor" else [["all-reduce", "f32", 5000, overlapped, False]]
    if key == "per_leaf":  # as files written before stored them
      colls = [{"op": "all-reduce", "dtype": "f32", "bytes": 5000, "overlapped": overlapped}]
    return {"cells": {"variant": key, "removed: kernels / HBM": "?"}, "values": {
        "workload": "w", "key": key, "kernels": kernels, "hbm_bytes": hbm,
        "copy_kernels": 1, "copy_bytes": copy, "collectives": colls, "temp_bytes": temp,
        "arg_bytes": 1, "lower_s": 0.0, "compile_s": 0.0, "grad_bytes": 50}}

  table = {"title": "w", "columns": ["variant", "kernels", "removed: kernels / HBM"],
           "rows": [row("floor", 100, 1000, 10, 80), row("per_leaf", 200, 2000, 90, 100),
                    row("packed", 110, 1500, 30, 90), row("packed_acc4", 300, 4000, 30, 90)]}
  stale = {"title": "w: goals", "columns": ["mode", "goal", "result"], "rows": [
      {"cells": {"mode": "packed", "goal": "old", "result": "MISS"},
       "values": {"workload": "w", "key": "packed", "goal": "old", "ok": False}}]}
  got = gpu_compile.finish({"command": "x", "tables": [table, stale]})
  rows = {r["values"]["key"]: r for r in got["tables"][0]["rows"]}
  assert rows["packed"]["values"]["kernels_removed"] == pytest.approx(0.9)
  assert rows["packed"]["values"]["hbm_removed"] == pytest.approx(0.5)
  assert rows["packed"]["cells"]["removed: kernels / HBM"] == "90% / 50%"
  assert rows["packed_acc4"]["cells"]["removed: kernels / HBM"] == "-"
  assert rows["per_leaf"]["values"]["kernels_removed"] is None
  goals = {r["values"]["goal"]: r["values"]["ok"] for r in got["tables"][1]["rows"]}
  assert goals == {"kernels removed >= 80%": True, "HBM removed >= 60%": False,
                   "copy-only bytes above floor <= 1 gradient": True,
                   "temp <= per-leaf": True, "every bucket's collective overlapped": True}
  assert len(got["tables"]) == 2


def test_zero3_keeps_no_gathered_layer_for_the_backward_pass(mesh):
  """ZeRO-3's temp grows with depth by what a layer saves, not by its gathered weights:
  at 16 tokens a layer's activations are a few KiB, its weights 3 MiB (which
  keep_gathered=True keeps, one layer's worth per layer)."""
  def temp(layers):
    model = models.gpt2(layers=layers, width=256, vocab=512, positions=64, heads=4, seq=16,
                        abstract=True)
    return gpu_compile.compile_variant("fsdp", model, mesh, rows=1).temp_bytes

  layer_bytes = 12 * 256 * 256 * 4
  grown = temp(4) - temp(2)
  assert grown < layer_bytes, (grown, layer_bytes)  # two layers more



def test_zero3_gathers_the_position_table_only_in_the_forward_pass(mesh):
  """The position table's rows, which only the operations before the first matmul read,
  are saved for the backward pass: recomputing the embeddings there would gather the
  table again where the backward pass starts, with nothing to overlap (docs/gpu.md).
  The token table is gathered again, for the tied output's gradient."""
  positions, width, vocab = 64, 256, 512
  model = models.gpt2(layers=2, width=width, vocab=vocab, positions=positions, heads=4,
                      seq=16, abstract=True)
  hlo = gpu_compile.compile_variant("fsdp", model, mesh, rows=1).hlo
  # The gathered bucket's length, from each "(slice, bucket) all-gather-start(...)".
  gathered = re.findall(r"= \(f32\[\d+\]\{0\}, f32\[(\d+)\]\{0\}\) all-gather-start\(", hlo)
  assert gathered.count(str(positions * width)) == 1, gathered
  assert gathered.count(str(vocab * width)) == 2, gathered
