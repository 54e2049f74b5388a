"""optax integration: all-reduce in a chain, optimizers on flat buckets, ZeRO-1."""

from jpack._sharded import ShardedState as ShardedState
from jpack._sharded import sharded as sharded
from jpack._sharded import state_bytes_per_device as state_bytes_per_device
from jpack._transforms import AllReduceState as AllReduceState
from jpack._transforms import FlatState as FlatState
from jpack._transforms import allreduce as allreduce
from jpack._transforms import flat as flat
from jpack._labels import partition as partition

__all__ = [
    "AllReduceState",
    "FlatState",
    "ShardedState",
    "allreduce",
    "flat",
    "partition",
    "sharded",
    "state_bytes_per_device",
]
