"""jpack: pack JAX pytrees into a few aligned, per-dtype flat buckets."""

from jpack import checkpoint as checkpoint
from jpack import optax as optax
from jpack._collectives import Shards as Shards
from jpack._collectives import all_gather as all_gather
from jpack._collectives import assert_same_layout as assert_same_layout
from jpack._collectives import broadcast as broadcast
from jpack._collectives import pmean as pmean
from jpack._collectives import psum as psum
from jpack._collectives import reduce_scatter as reduce_scatter
from jpack._collectives import shard as shard
from jpack._collectives import vary as vary
from jpack._fsdp import fsdp as fsdp
from jpack._layout import Bucket as Bucket
from jpack._layout import Layout as Layout
from jpack._layout import Slot as Slot
from jpack._layout import plan as plan
from jpack._pack import Packed as Packed
from jpack._pack import pack as pack
from jpack._pack import unpack as unpack
from jpack._precision import Precision as Precision
from jpack._precision import cast_params as cast_params
from jpack._train import DataParallel as DataParallel
from jpack._train import Mode as Mode
from jpack._train import TrainState as TrainState
from jpack._train import data_parallel as data_parallel
from jpack._train import step_options as step_options

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "Layout",
    "Mode",
    "Packed",
    "Precision",
    "Shards",
    "Slot",
    "all_gather",
    "assert_same_layout",
    "DataParallel",
    "TrainState",
    "broadcast",
    "cast_params",
    "checkpoint",
    "data_parallel",
    "fsdp",
    "optax",
    "pack",
    "plan",
    "pmean",
    "psum",
    "reduce_scatter",
    "shard",
    "step_options",
    "unpack",
    "vary",
]
