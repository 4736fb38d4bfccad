"""Optimization levels of ActNN (L0-L5) and GACT (L0, L1, L2, CB1, CB2) as presets.

The public names of `jact._planning.levels` (an internal module).
"""

from jact._planning.levels import (
  Level as Level,
  get as get,
  compress_convolutions as compress_convolutions,
)

from jact._planning import levels as _levels

#: The presets by name: ActNN's L0-L5 (`actnn:L3` ...) and GACT's L0/L1/L2/CB1/CB2 (`gact:L1` ...).
LEVELS = _levels.LEVELS

__all__ = [
  "Level",
  "LEVELS",
  "get",
  "compress_convolutions",
]
