"""Benchmarks for jpack: ``python -m benchmarks <name> [options]`` from the repository root.

Not part of the installed package: they use only jpack's public API, and the parameter
shape tables they run on live in ``benchmarks/workloads/``. Each benchmark is a module
``benchmarks.<name>`` with a ``main(argv) -> int`` function, also runnable as
``python -m benchmarks.<name>``; each prints its tables and writes them, with the
machine and the command line, to ``benchmarks/results/<name>.json`` (``--json PATH``):

- ``pack``: pack / unpack / plan against per-leaf and single-array baselines (1 device).
- ``collectives``: packed pmean vs per-leaf pmean vs the single-array floor (8 CPU devices).
- ``step``: a whole data-parallel training step, jpack against plain shard_map steps.
- ``checkpoint``: step time with an Orbax checkpoint every 10 steps against none.
- ``gpu_compile``: steps compiled for 8 simulated H100s (needs the CUDA plugin, no GPU).

``python -m benchmarks all`` runs each in its own process (each sets up its own devices);
a name in `BENCHMARKS` whose module is absent is skipped.
"""

BENCHMARKS = (
    "pack",
    "collectives",
    "step",
    "optimizer",
    "checkpoint",
    "gpu_compile",
    "startup",
)
