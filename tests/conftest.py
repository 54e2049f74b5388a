"""Test setup: 8 CPU devices before JAX starts, shared workloads, reference helpers."""

import json
import os
import pathlib
import re

# The test extra brings JAX's CUDA plugin (to compile for simulated GPUs); on a machine
# without a GPU it would log a traceback at every start of JAX's backend. The tests run on
# CPU devices, and so do the processes they start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Must happen before JAX initialises its backend; collective tests need several devices.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=40, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=15, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

WORKLOADS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "workloads"


def load_workload(name: str) -> dict:
  return json.loads((WORKLOADS / f"{name}.json").read_text())


def workload_shapes(name: str) -> dict:
  """{path: ShapeDtypeStruct} for a shared workload."""
  doc = load_workload(name)
  return {leaf["path"]: jax.ShapeDtypeStruct(tuple(leaf["shape"]), leaf["dtype"])
          for leaf in doc["leaves"]}


WORKLOAD_NAMES = ["resnet50", "gpt2_small", "bert_base", "mixed_llama_tiny", "many_small_4000"]


@pytest.fixture(params=WORKLOAD_NAMES)
def workload(request):
  return request.param, workload_shapes(request.param)


def bits(x) -> bytes:
  """The raw bytes of an array (bit-identity check that also covers NaN payloads)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  a = np.asarray(x)
  return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


def assert_sliced_at_unfoldable_offsets(hlo: str, num_leaves: int, size: int) -> None:
  """Compiled HLO of a shared-kernel unpack of ``num_leaves`` leaves of ``size``
  elements: every leaf a dynamic slice (a static or folded offset shows as a `slice`,
  one XLA:CPU kernel per leaf), offsets from one cond per 64 leaves."""
  assert hlo.count("dynamic-slice(") >= num_leaves
  assert not re.search(rf"\[{size}\]\{{0\}} slice\(", hlo)  # no leaf sliced statically
  assert hlo.count("conditional(") >= num_leaves // 64
