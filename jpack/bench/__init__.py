"""Benchmarks for jpack: ``python -m jpack.bench <name> [options]``.

Each benchmark is a module ``jpack.bench.<name>`` with a ``main(argv) -> int`` function:

- ``pack``: pack / unpack / plan against per-leaf and single-array baselines (1 device).
- ``collectives``: packed pmean vs per-leaf pmean vs the single-array floor (8 CPU devices).
- ``step``: a whole data-parallel training step (when present).

``python -m jpack.bench all`` runs each in its own process (each sets up its own devices).
"""

BENCHMARKS = ("pack", "collectives", "step")
