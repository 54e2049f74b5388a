"""Benchmarks for jpack (not installed): ``python -m benchmarks <name> [options]`` from
the repository root. They use jpack's API and ``jpack._reference`` (steps without jpack,
reading compiled programs)."""

# The GPU benchmarks only compile (JAX's CUDA plugin, a target config): no GPU needed.
_COMPILE_ONLY = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
# Each benchmark, and the environment it needs before JAX's backend starts.
BENCHMARKS = {"pack": {}, "collectives": {}, "step": {},
              "optimizer": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},  # torch shares the GPU
              "checkpoint": {}, "gpu_compile": _COMPILE_ONLY, "multinode": _COMPILE_ONLY,
              "fits": _COMPILE_ONLY, "startup": {}, "compare": {}}
