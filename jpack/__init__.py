"""jpack: pack JAX pytrees into a few aligned, per-dtype flat buckets."""

from jpack._layout import Bucket as Bucket
from jpack._layout import Layout as Layout
from jpack._layout import Slot as Slot
from jpack._layout import plan as plan
from jpack._pack import Packed as Packed
from jpack._pack import pack as pack
from jpack._pack import unpack as unpack

__version__ = "0.1.0"

__all__ = [
    "Bucket",
    "Layout",
    "Packed",
    "Slot",
    "pack",
    "plan",
    "unpack",
]
