"""Execute every notebook in notebooks/ top to bottom, so they cannot rot.

Each notebook runs in its own Jupyter kernel (a separate process): the notebook's first
cell asks for 8 CPU devices itself; this process's JAX set-up (conftest.py) does not reach
it. The "python3" kernel must be this interpreter (ipykernel installed in the same
environment), which `test_kernel_is_this_python` checks.
"""

import os
import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
KERNEL = "python3"
CELL_TIMEOUT = 600


def _execute(nb):
  client = nbclient.NotebookClient(
      nb, timeout=CELL_TIMEOUT, kernel_name=KERNEL,
      resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})  # cwd of the kernel
  client.execute()
  return nb


def _errors(nb):
  return [(i, out.get("ename"), out.get("evalue"))
          for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
          for out in cell.get("outputs", []) if out.get("output_type") == "error"]


def test_notebooks_exist():
  assert {p.name for p in NOTEBOOKS} >= {
      "quickstart.ipynb", "data_parallel.ipynb", "zero1.ipynb", "benchmarks.ipynb"}


def test_kernel_is_this_python():
  nb = nbformat.v4.new_notebook()
  nb.cells.append(nbformat.v4.new_code_cell(
      "import os, sys\nprint(sys.executable)\nprint(os.getcwd())"))
  _execute(nb)
  executable, cwd = nb.cells[0].outputs[0]["text"].splitlines()
  assert os.path.realpath(executable) == os.path.realpath(sys.executable)
  assert os.path.realpath(cwd) == os.path.realpath(NOTEBOOKS_DIR)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code, f"{path.name} has no code cells"
  # Committed without outputs, so they stay small and diff cleanly.
  assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), (
      f"{path.name} was committed with outputs; clear them before committing.")
  # The device count must be set before any array exists, i.e. in the first code cell.
  assert 'jax.config.update("jax_num_cpu_devices", 8)' in code[0].source

  start = time.perf_counter()
  try:
    _execute(nb)
  except nbclient.exceptions.CellExecutionError as e:
    pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
  elapsed = time.perf_counter() - start
  print(f"{path.name}: {elapsed:.1f} s")
  assert not _errors(nb)
