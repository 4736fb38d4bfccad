"""Optimization levels of ActNN (L0-L5) and GACT (L0, L1, L2, CB1, CB2) as presets.

The public names of `jact._planning.levels` (an internal module).
"""

from jact._planning.levels import (
    Level as Level,
    LEVELS as LEVELS,
    get as get,
    compress_convolutions as compress_convolutions,
)

__all__ = [
    "Level",
    "LEVELS",
    "get",
    "compress_convolutions",
]
