"""Checkpoints of a data-parallel state that restore on any mesh and in any mode.

`save` writes a `jpack.TrainState` with an Orbax ``CheckpointManager`` in a form that
does not depend on the mesh, the mode or the layout; `restore` reads it back into the
shape of a state built for the current run. `gather_state` and `scatter_state` convert
an optimizer state to and from that form without Orbax.
"""

from jpack._checkpoint import gather_state as gather_state
from jpack._checkpoint import restore_checkpoint as restore
from jpack._checkpoint import save_checkpoint as save
from jpack._checkpoint import scatter_state as scatter_state

__all__ = [
    "gather_state",
    "restore",
    "save",
    "scatter_state",
]
