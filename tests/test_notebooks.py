"""The tutorial notebooks in notebooks/: committed with their outputs, executed by CI.

The notebooks are committed executed, so that GitHub and the documentation site (which
renders them with mkdocs-jupyter, without executing them, through the docs/notebooks
symlink) show their tables and plots.
The tests:

* `test_committed_outputs_are_current` (no execution): every code cell carries the
  SHA-256 of the source it was executed from (``cell.metadata["jpack"]["source_sha256"]``)
  and an execution count, in one top-to-bottom run. A cell edited without re-running the
  notebook fails it. Sources are compared, never outputs (timings differ on every run).
* `test_notebook_structure` (no execution): a commented-out `%pip install` cell first,
  then the cell that asks for 8 simulated CPU devices, after a markdown cell explaining
  it; no `assert` in any cell.
* `test_notebook_runs`: every notebook runs top to bottom in a fresh Jupyter kernel (a
  separate process, cwd notebooks/, which sets up its own simulated devices: this
  process's JAX set-up in conftest.py does not reach it). Then, in the same kernel, the
  cells of `CHECKS` verify what the notebook shows against references computed
  independently with numpy or plain JAX: the notebooks stay tutorial prose.

After editing a notebook (or changing what it prints), re-execute it and write its outputs
and source hashes back, running the same checks first (nothing is written if they fail):

    python tests/test_notebooks.py --execute              # every notebook
    python tests/test_notebooks.py --execute zero1        # some of them

`--devices 4` runs the notebooks and their checks with another number of simulated devices
and writes nothing: nothing in a notebook may assume 8 devices.

The "python3" kernel must be this interpreter (ipykernel installed in the same
environment), which `test_kernel_is_this_python` checks.
"""

import argparse
import ast
import hashlib
import os
import re
import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
KERNEL = "python3"
CELL_TIMEOUT = 600
DEVICES_LINE = 'jax.config.update("jax_num_cpu_devices", 8)'
MAX_NOTEBOOK_BYTES = 600_000  # text outputs and a few PNG plots; no huge dumps
MAX_TEXT_OUTPUT_LINES = 200


def source_sha256(source: str) -> str:
  return hashlib.sha256(source.encode("utf-8")).hexdigest()


def _code_cells(nb):
  return [c for c in nb.cells if c.cell_type == "code"]


def _is_comment_only(source: str) -> bool:
  return all(not line.strip() or line.lstrip().startswith("#") for line in source.splitlines())


# -- checks run in the notebook's kernel after its last cell ---------------------------
# Each entry: code cells appended to the executed notebook. They use the notebook's
# variables, and compare with references computed here with numpy or plain JAX (not with
# jpack). Names start with an underscore so that they cannot shadow the notebook's.

_COMMON = """
import numpy as _np

def _bits(x):
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  a = _np.asarray(x)
  return a.dtype.str, a.shape, a.tobytes()

def _same_bits(a, b):
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      _bits(x) == _bits(y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

def _max_abs_diff(a, b):
  sa, sb = jax.tree.structure(a), jax.tree.structure(b)
  assert sa == sb, (sa, sb)
  return max(float(_np.max(_np.abs(_np.asarray(x, _np.float64) - _np.asarray(y, _np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

_n = jax.device_count()
"""

CHECKS = {
    "quickstart": [_COMMON, """
# 2, 3, 5: bit-exact round trips (bytes compared with numpy), eagerly, under jit, and with
# a layout restored from JSON.
assert _same_bits(tree, back)
assert _same_bits(tree, unpack_jit(packed_jit))
assert _same_bits(tree, jpack.unpack(jpack.pack(tree, restored)))
assert restored == layout and restored.fingerprint == layout.fingerprint
assert jpack.plan(tree).fingerprint == layout.fingerprint
assert jpack.plan(tree, align_bytes=64).fingerprint != layout.fingerprint

# 1: one dtype per bucket, leaves at 256-byte aligned offsets, their bytes in the bucket.
_buckets = [_np.asarray(b) for b in packed.buckets]
for _slot, _leaf in zip(layout.slots, jax.tree.leaves(tree)):
  if jax.dtypes.issubdtype(_leaf.dtype, jax.dtypes.prng_key):
    _leaf = jax.random.key_data(_leaf)
  _leaf = _np.asarray(_leaf).reshape(-1)
  _bucket = _buckets[_slot.bucket]
  assert _bucket.dtype == _leaf.dtype, (_slot.path, _bucket.dtype, _leaf.dtype)
  assert (_slot.offset * _bucket.dtype.itemsize) % 256 == 0, _slot
  assert _bucket[_slot.offset:_slot.offset + _leaf.size].tobytes() == _leaf.tobytes(), _slot.path
assert len(layout.buckets) == len({str(x.dtype) for x in jax.tree.leaves(tree)})

# 4: the packed gradient is plain JAX's gradient of the tree; the backward pass of unpack
# is one concatenate (one float32 bucket), without pads.
_reference = jax.grad(loss)(params, x)
assert _max_abs_diff(jpack.unpack(grads), _reference) < 1e-6
assert primitives.count("concatenate") == 1 and primitives.count("pad") == 0, primitives

# 6: ResNet-50 planned from the workload's shapes: every leaf, its bytes, even shards.
_doc_leaves = doc["leaves"]
assert resnet.num_leaves == len(_doc_leaves)
assert resnet.leaf_nbytes == sum(
    int(_np.prod(l["shape"], dtype=int)) * _np.dtype(l["dtype"]).itemsize for l in _doc_leaves)
assert all(b.size % _n == 0 for b in resnet.buckets)

# 7: wrong dtype -> TypeError, wrong shape -> ValueError.
for _tree, _error in [(wrong_dtype, TypeError), (wrong_shape, ValueError)]:
  try:
    jpack.pack(_tree, layout)
  except _error:
    pass
  else:
    raise AssertionError(f"expected {_error.__name__}")
"""],
    "data_parallel": [_COMMON, """
# 1: jpack.pmean is the mean over devices (numpy, in float64), with the input dtypes, and
# equals per-leaf lax.pmean.
_host = jax.tree.map(_np.asarray, per_device_grads)
assert jax.tree.structure(ours) == jax.tree.structure(_host)
for _o, _t, _h in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), jax.tree.leaves(_host)):
  assert _o.dtype == _t.dtype == _h.dtype
  assert _o.shape == _h.shape[1:]
  _tol = 2e-2 if _o.dtype == jnp.bfloat16 else 1e-5
  _np.testing.assert_allclose(_np.asarray(_o, _np.float64), _h.astype(_np.float64).mean(0),
                              rtol=_tol, atol=_tol)
assert _max_abs_diff(ours, theirs) < 1e-5

# Per-leaf issues one all-reduce per leaf.
assert count_collectives(per_leaf)["all_reduce"] == len(jax.tree.leaves(per_device_grads))

# 2: both chains follow single-device, full-batch Adam (plain optax, no shard_map): the
# mean of the devices' gradients over equal shards is the full batch's gradient.
_xs, _ys = _np.asarray(xs), _np.asarray(ys)
_p = {"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}
_opt = optax.adam(1e-1)
_s = _opt.init(_p)
_grad = jax.jit(jax.grad(linear_loss))
for _ in range(30):
  _u, _s = _opt.update(_grad(_p, _xs, _ys), _s, _p)
  _p = optax.apply_updates(_p, _u)
assert _max_abs_diff(results["jpack allreduce"][0], results["per-leaf pmean"][0]) < 1e-5
for _name, (_params, _losses) in results.items():
  assert _max_abs_diff(_params, _p) < 1e-4, _name
  assert _losses[-1] < 0.1 * _losses[0], (_name, _losses)

# The gradient w.r.t. a replicated input is the sum of the devices' own gradients; their
# mean is the full batch's gradient.
_full = jax.grad(linear_loss)(jax.tree.map(_np.asarray, params), _xs, _ys)
assert _max_abs_diff(summed, jax.tree.map(lambda g: g.sum(0), stacked)) < 1e-4
assert _max_abs_diff(jax.tree.map(lambda g: g.mean(0), stacked), _full) < 1e-5

# 3: every mode trains like single-device, full-batch Adam on the same batches.
@jax.jit
def _reference_step(p, s, x, y):
  g = jax.grad(loss_fn)(p, (x, y))
  u, s = optimizer.update(g, s, p)
  return optax.apply_updates(p, u), s

_p, _s = mlp_params, optimizer.init(mlp_params)
for _i in range(STEPS):
  _x, _y = batches[_i % len(batches)]
  _p, _s = _reference_step(_p, _s, _np.asarray(_x), _np.asarray(_y))
assert set(runs) == {"per-leaf", "allreduce", "packed"}
for _mode, _run in runs.items():
  assert len(_run["losses"]) == STEPS and _run["losses"][-1] < 0.5 * _run["losses"][0], _mode
  assert _max_abs_diff(_run["params"], runs["per-leaf"]["params"]) < 1e-5, _mode
  assert _max_abs_diff(_run["params"], _p) < 1e-4, _mode
"""],
    "zero1": [_COMMON, """
# The reference: single-device, full-batch optax (no shard_map, no jpack).
def _reference(optimizer, steps):
  @jax.jit
  def step(p, s, x, y):
    g = jax.grad(loss_fn)(p, (x, y))
    u, s = optimizer.update(g, s, p)
    return optax.apply_updates(p, u), s, optax.global_norm(g)
  p, s = params, optimizer.init(params)
  for i in range(steps):
    x, y = batches[i % len(batches)]
    p, s, norm = step(p, s, _np.asarray(x), _np.asarray(y))
  return p, s, norm

# jpack's runs equal the notebook's per-leaf step (plain JAX: shard_map and lax.pmean) up
# to float rounding, and both follow single-device optax: more loosely, since Adam's first
# steps amplify the rounding of gradient elements near zero (20 steps of 1e-3 move a
# parameter by up to 2e-2).
_SAME, _CLOSE = 1e-5, 1e-4

# 1: mode="sharded".
_p, _s, _ = _reference(optax.adamw(1e-3, weight_decay=0.1), STEPS)
assert _max_abs_diff(dp_sharded.unpack(state_sharded), params_ref) < _SAME
assert _max_abs_diff(params_ref, _p) < _CLOSE

# 2: a device holds 1/N of the moments: count the bytes of device 0's shards.
_leaves = jax.tree.leaves(state_sharded.opt_state)
_on_device_0 = sum(x.addressable_shards[0].data.nbytes for x in _leaves)
assert per_device == _on_device_0, (per_device, _on_device_0)
_replicated = sum(x.nbytes for x in jax.tree.leaves(_s))
assert replicated == _replicated
_moments = sum(x.nbytes for x in jax.tree.leaves(_s) if x.ndim)
assert _moments / _n <= per_device <= _moments / _n * 1.1 + 1024, (per_device, _moments, _n)

# 3: the gathered state is optax's own state of the full tree; scatter_state inverts it.
assert jax.tree.structure(full_state) == jax.tree.structure(_s)
assert _max_abs_diff(full_state, opt_state_ref) < _SAME
assert _max_abs_diff(full_state, _s) < _CLOSE
assert _same_bits(back.inner_state, state_sharded.opt_state.inner_state)

# 4: optax.clip_by_global_norm in mode="sharded" clips by the global norm of the whole
# gradient, as optax does on one device.
_p, _, _norm = _reference(optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3)), STEPS)
assert abs(float(m_c["grad_norm"]) - float(_norm)) <= 1e-5 * float(_norm)
assert _max_abs_diff(dp_c.unpack(state_c), params_r) < _SAME
assert _max_abs_diff(params_r, _p) < _CLOSE

# 5: jpack.optax.partition in jpack.optax.sharded behaves like optax.multi_transform.
_p, _, _ = _reference(optax.multi_transform(transforms(), label_fn), STEPS)
assert _max_abs_diff(p, params_m) < _SAME
assert _max_abs_diff(params_m, _p) < _CLOSE

# 6: a transformation that needs the whole update is refused.
try:
  jpack.data_parallel(loss_fn, optax.apply_if_finite(optax.adamw(1e-3), 3), params, mesh,
                      mode="sharded")
except TypeError:
  pass
else:
  raise AssertionError("expected a TypeError")

# 7: mode="fsdp" trains as the per-leaf step does; device 0 holds 1/N of the params'
# buckets (and their alignment padding).
assert _max_abs_diff(dp_fsdp.unpack(state_fsdp), params_ref) < _SAME
_param_bytes = sum(_np.asarray(x).nbytes for x in jax.tree.leaves(params))
assert full == _param_bytes
assert _param_bytes / _n <= resident <= _param_bytes / _n * 1.1 + 1024, (resident, _n)
"""],
    "benchmarks": [_COMMON, """
# 1: every variant computes the mean over devices (numpy, float64).
assert N_DEVICES == _n
assert set(outputs) == {(v, n) for v in VARIANTS for n in NS}
for _n_leaves in NS:
  _means = [h.astype(_np.float64).mean(0) for h in jax.tree.leaves(hosts[_n_leaves])]
  assert len(_means) == _n_leaves
  _tree = jax.tree.leaves(outputs["per-leaf", _n_leaves])
  _jtree = jax.tree.leaves(outputs["jpack (tree)", _n_leaves])
  _buckets = [_np.asarray(b) for b in outputs["jpack (packed)", _n_leaves].buckets]
  _slots = layouts[_n_leaves].slots
  _packed = [_buckets[s.bucket][s.offset:s.offset + s.size] for s in _slots]
  for _got in (_tree, _jtree, _packed):
    assert len(_got) == _n_leaves
    for _g, _m in zip(_got, _means):
      _np.testing.assert_allclose(_np.asarray(_g, _np.float64), _m, rtol=1e-5, atol=1e-6)
  _np.testing.assert_array_equal(_np.asarray(outputs["floor", _n_leaves]),
                                 _np.ones(sum(s.size for s in _slots), _np.float32))
  assert all(ms[v, _n_leaves] > 0 for v in VARIANTS)

# 2: what the notebook plots is the committed results file.
import json as _json
_file = pathlib.Path.cwd().parent / "benchmarks" / "results" / "step.json"
_doc = _json.loads(_file.read_text())
_rows = [r for r in _doc["tables"][0]["rows"] if "step_s" in r["values"]]
assert names == [r["cells"]["variant"] for r in _rows]
assert _np.allclose(step_ms, [1e3 * r["values"]["step_s"] for r in _rows])
"""],
    "flax_cnn": [_COMMON, """
from sklearn.datasets import load_digits as _load_digits
from sklearn.model_selection import train_test_split as _train_test_split

# 1: the data is scikit-learn's digits, split here with the notebook's seed into 1437
# training and 360 test images; the batches are training images only, and every epoch
# visits distinct images.
_digits = _load_digits()
_x = (_digits.images / 16.0).astype(_np.float32)[..., None]
_xtr, _xte, _ytr, _yte = _train_test_split(_x, _digits.target, test_size=360,
                                           random_state=SEED, stratify=_digits.target)
assert (len(_xtr), len(_xte)) == (1437, 360)
for _a, _b in [(x_train, _xtr), (y_train, _ytr), (x_test, _xte), (y_test, _yte)]:
  assert _np.array_equal(_a, _b)
assert BATCH % _n == 0 and len(batches) == len(order) == STEPS
_per_epoch = len(_xtr) // BATCH
assert STEPS == EPOCHS * _per_epoch
for _e in range(EPOCHS):
  _idx = _np.asarray(order[_e * _per_epoch:(_e + 1) * _per_epoch]).reshape(-1)
  assert _idx.size == _per_epoch * BATCH == len(set(_idx.tolist())), _e
for _batch, _idx in zip(batches, order):
  assert _np.array_equal(_batch["image"], _xtr[_idx])
  assert _np.array_equal(_batch["label"], _ytr[_idx])

# 2: the reference, computed here: the notebook's CNN on one device with plain Flax and
# optax (jax.jit, BatchNorm on the whole batch, no axis_name), from the same initial
# variables, on the same batches; test accuracy with the running averages, in numpy.
_variables = CNN().init(jax.random.key(SEED), jnp.zeros((1, 8, 8, 1)), train=False)
assert _same_bits(_variables["params"], params)
assert _same_bits(_variables["batch_stats"], batch_stats)
_opt = optax.adam(LR)

def _loss(p, s, batch):
  logits, updates = CNN().apply({"params": p, "batch_stats": s}, batch["image"],
                                mutable=["batch_stats"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, updates["batch_stats"]

@jax.jit
def _step(p, s, o, batch):
  (loss, s), g = jax.value_and_grad(_loss, has_aux=True)(p, s, batch)
  u, o = _opt.update(g, o, p)
  return optax.apply_updates(p, u), s, o, loss

_p, _s, _o = jax.device_put((_variables["params"], _variables["batch_stats"],
                              _opt.init(_variables["params"])), jax.devices()[0])
_losses = []
for _batch in batches:
  _p, _s, _o, _l = _step(_p, _s, _o, _batch)
  _losses.append(float(_l))

def _predictions(p, s):
  logits = jax.jit(lambda p, s: CNN().apply({"params": p, "batch_stats": s}, _xte, train=False))(p, s)
  return _np.argmax(_np.asarray(logits), -1)

_reference_predictions = _predictions(_p, _s)
_reference = float(_np.mean(_reference_predictions == _yte))
assert _reference >= 0.97, _reference
# The notebook's own one-device run is this one.
assert one_device["accuracy"] == _reference
assert _max_abs_diff(one_device["params"], _p) < 1e-5
assert _max_abs_diff(one_device["batch_stats"], _s) < 1e-5
_np.testing.assert_allclose(one_device["losses"], _losses, rtol=1e-5, atol=1e-6)

# 3: jpack's runs reach 0.97, within 0.5 points of the reference, and follow it: the
# same first loss (same params, same batch), the same loss curve up to float rounding,
# parameters and running statistics that Adam's amplified rounding moves only slightly
# (measured with seeds 0 to 5: params up to 1.2e-2 apart, 3e-3 of their norm with seed 0,
# statistics up to 2.3e-2 apart), while the statistics did move away from their initial
# values (by 1.2).
_norm = float(_np.sqrt(sum(float(_np.sum(_np.square(x))) for x in jax.tree.leaves(_p))))
assert set(runs) == {"sharded", "packed"}
for _mode, _run in runs.items():
  _pred = _predictions(_run["params"], _run["batch_stats"])
  _accuracy = float(_np.mean(_pred == _yte))
  assert _accuracy == _run["accuracy"], (_mode, _accuracy, _run["accuracy"])
  assert _accuracy >= 0.97, (_mode, _accuracy)
  assert abs(_accuracy - _reference) <= 0.005, (_mode, _accuracy, _reference)
  assert _np.sum(_pred != _reference_predictions) <= 3, _mode
  assert len(_run["losses"]) == STEPS
  assert abs(_run["losses"][0] - _losses[0]) < 1e-5, _mode
  assert _np.max(_np.abs(_np.subtract(_run["losses"], _losses))) < 5e-3, _mode
  assert _run["losses"][-1] < 0.05 * _run["losses"][0], _mode
  _delta = [_np.asarray(a, _np.float64) - _np.asarray(b, _np.float64)
            for a, b in zip(jax.tree.leaves(_run["params"]), jax.tree.leaves(_p))]
  assert jax.tree.structure(_run["params"]) == jax.tree.structure(_p)
  _relative = float(_np.sqrt(sum(_np.sum(d * d) for d in _delta))) / _norm
  assert _relative < 1e-2, (_mode, _relative)
  assert _max_abs_diff(_run["params"], _p) < 5e-2, _mode
  assert _max_abs_diff(_run["batch_stats"], _s) < 1e-1, _mode
  assert _max_abs_diff(_run["batch_stats"], batch_stats) > 0.1, _mode
"""],
}


# -- executing --------------------------------------------------------------------------


def _execute(nb, cwd=NOTEBOOKS_DIR):
  client = nbclient.NotebookClient(
      nb, timeout=CELL_TIMEOUT, kernel_name=KERNEL, record_timing=False, coalesce_streams=True,
      resources={"metadata": {"path": str(cwd)}})  # cwd of the kernel
  client.execute()
  return nb


def run_notebook(path, devices=None):
  """Execute the notebook at `path` in a fresh kernel, then its `CHECKS` in the same kernel.

  Returns the executed notebook without the check cells. `devices`: replace the 8 of the
  device cell (to check that nothing else assumes 8 devices).
  """
  nb = nbformat.read(path, as_version=4)
  for cell in _code_cells(nb):
    cell.outputs, cell.execution_count = [], None
    if devices is not None and DEVICES_LINE in cell.source:
      cell.source = cell.source.replace(DEVICES_LINE, DEVICES_LINE.replace("8", str(devices)))
  num_cells = len(nb.cells)
  nb.cells.extend(nbformat.v4.new_code_cell(code) for code in CHECKS[path.stem])
  _execute(nb)
  del nb.cells[num_cells:]
  return nb


def _errors(nb):
  return [(i, out.get("ename"), out.get("evalue"))
          for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
          for out in cell.get("outputs", []) if out.get("output_type") == "error"]


# What JAX's CUDA plugin logs on stderr when it starts on a machine without a GPU.
_PLUGIN_LOG = re.compile(r"^(WARNING: All log messages before absl::InitializeLog|"
                         r"I\d{4} .*cudart_stub\.cc)")


def _without_plugin_log(outputs):
  """The outputs without stderr streams that hold only the CUDA plugin's start-up log."""
  def noise(out):
    lines = out.get("text", "").splitlines()
    return (out.get("output_type") == "stream" and out.get("name") == "stderr" and lines
            and all(_PLUGIN_LOG.match(line) for line in lines))
  return [out for out in outputs if not noise(out)]


def write_executed(nb, path):
  """Record each code cell's source hash, drop volatile metadata and the CUDA plugin's
  start-up log, write the notebook."""
  for cell in nb.cells:
    for key in ("execution", "ExecuteTime", "collapsed", "scrolled"):
      cell.metadata.pop(key, None)
    if cell.cell_type == "code":
      cell.metadata["jpack"] = {"source_sha256": source_sha256(cell.source)}
      cell.outputs = _without_plugin_log(cell.outputs)
  language = {k: v for k, v in nb.metadata.get("language_info", {}).items() if k != "version"}
  nb.metadata = nbformat.from_dict({
      "kernelspec": {"display_name": "Python 3", "language": "python", "name": KERNEL},
      "language_info": language or {"name": "python"},
  })
  nbformat.validate(nb)
  nbformat.write(nb, path)


# -- tests ------------------------------------------------------------------------------


def test_notebooks_exist():
  # The site renders them from docs/notebooks, a link to the top-level folder.
  assert (ROOT / "docs" / "notebooks").resolve() == NOTEBOOKS_DIR.resolve()
  assert {p.name for p in NOTEBOOKS} == {
      "quickstart.ipynb", "data_parallel.ipynb", "zero1.ipynb", "benchmarks.ipynb",
      "flax_cnn.ipynb"}
  assert set(CHECKS) == {p.stem for p in NOTEBOOKS}


def test_kernel_is_this_python():
  nb = nbformat.v4.new_notebook()
  nb.cells.append(nbformat.v4.new_code_cell(
      "import os, sys\nprint(sys.executable)\nprint(os.getcwd())"))
  _execute(nb)
  executable, cwd = nb.cells[0].outputs[0]["text"].splitlines()
  assert os.path.realpath(executable) == os.path.realpath(sys.executable)
  assert os.path.realpath(cwd) == os.path.realpath(NOTEBOOKS_DIR)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_outputs_are_current(path):
  """The outputs come from the cells as they are: one run, top to bottom, of these sources."""
  nb = nbformat.read(path, as_version=4)
  refresh = f"re-run it: python tests/test_notebooks.py --execute {path.stem}"
  code = _code_cells(nb)
  assert code, f"{path.name} has no code cells"
  for i, cell in enumerate(code):
    recorded = cell.metadata.get("jpack", {}).get("source_sha256")
    assert recorded is not None, (
        f"{path.name}: code cell {i} has no recorded source hash (never executed by "
        f"this script); {refresh}\n{cell.source}")
    assert recorded == source_sha256(cell.source), (
        f"{path.name}: code cell {i} was edited after the notebook was executed "
        f"(its source differs from the one its outputs come from); {refresh}\n{cell.source}")
  counts = [cell.execution_count for cell in code]
  assert counts == list(range(1, len(code) + 1)), (
      f"{path.name}: execution counts {counts} are not one top-to-bottom run; {refresh}")
  assert not _errors(nb), f"{path.name} was committed with errors: {_errors(nb)}"
  assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{path.name}: outputs too big"
  for i, cell in enumerate(code):
    for out in cell.outputs:
      text = out.get("text") or out.get("data", {}).get("text/plain") or ""
      assert len(text.splitlines()) <= MAX_TEXT_OUTPUT_LINES, (
          f"{path.name}: code cell {i} prints {len(text.splitlines())} lines")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_structure(path):
  """An optional install cell, then the simulated devices, explained; no asserts."""
  nb = nbformat.read(path, as_version=4)
  code = _code_cells(nb)
  # An install cell that runs nothing when executed: pip only in a comment.
  install = [i for i, c in enumerate(code) if "%pip install" in c.source]
  assert install == [0] and _is_comment_only(code[0].source), (
      f"{path.name}: the first code cell must be the commented-out %pip install")
  # The device count is set before anything else runs (JAX's backend must not have
  # started), in one place; a markdown cell right before explains it.
  devices = [i for i, c in enumerate(code) if "jax_num_cpu_devices" in c.source]
  assert devices == [1] and DEVICES_LINE in code[1].source, (
      f"{path.name}: the second code cell must set {DEVICES_LINE}, and no other")
  position = next(i for i, c in enumerate(nb.cells) if c is code[1])
  before = nb.cells[position - 1]
  assert before.cell_type == "markdown" and "simulated" in before.source.lower()
  assert "jax.device_count()" in before.source
  for i, cell in enumerate(code):
    tree = ast.parse(cell.source)
    assert not any(isinstance(node, ast.Assert) for node in ast.walk(tree)), (
        f"{path.name}: code cell {i} asserts; checks belong in CHECKS in {__file__}")


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
  start = time.perf_counter()
  try:
    nb = run_notebook(path)
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"{path.name} failed (or one of its CHECKS did):\n{e}", pytrace=False)
  print(f"{path.name}: {time.perf_counter() - start:.1f} s")
  assert not _errors(nb)


# -- command line -------------------------------------------------------------------------


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--execute", action="store_true",
                      help="execute the notebooks, run their checks, write their outputs")
  parser.add_argument("--devices", type=int, default=None,
                      help="run with this many simulated devices instead of 8 (writes nothing)")
  parser.add_argument("names", nargs="*", help="notebook names (default: all), e.g. zero1")
  args = parser.parse_args(argv)
  if not args.execute and args.devices is None:
    parser.error("nothing to do: give --execute or --devices")
  by_name = {p.stem: p for p in NOTEBOOKS}
  unknown = [n for n in args.names if n.removesuffix(".ipynb") not in by_name]
  if unknown:
    parser.error(f"unknown notebook(s) {unknown}; available: {sorted(by_name)}")
  paths = [by_name[n.removesuffix(".ipynb")] for n in args.names] or NOTEBOOKS
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the committed outputs come from CPU devices
  for path in paths:
    start = time.perf_counter()
    nb = run_notebook(path, devices=args.devices)  # raises CellExecutionError on a failure
    elapsed = time.perf_counter() - start
    if args.devices is None:
      write_executed(nb, path)
      print(f"{path.relative_to(ROOT)}: executed and checked in {elapsed:.1f} s, written")
    else:
      print(f"{path.name}: ran and checked on {args.devices} devices in {elapsed:.1f} s")


if __name__ == "__main__":
  main()
