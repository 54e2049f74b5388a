"""Benchmarks for jpack (not installed): ``python -m benchmarks <name> [options]`` from
the repository root. They use jpack's API and ``jpack._reference`` (steps without jpack,
reading compiled programs)."""

# Each benchmark, and the environment it needs before JAX's backend starts.
BENCHMARKS = {
    "pack": {},
    "collectives": {},
    "step": {},
    "optimizer": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},  # torch shares the GPU
    "checkpoint": {},
    "gpu_compile": {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"},
    "multinode": {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"},
    "fits": {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"},
    "startup": {},
    "compare": {},
}
