"""AC-GC: bit widths from an allowed loss increase (AC-GC Sec. 3-5, Table 1).

The public names of `jact._planning.acgc` (an internal module).
"""

from jact._planning.acgc import (
  ACGCState as ACGCState,
  ErrorBounded as ErrorBounded,
  error_bounded as error_bounded,
  tolerance as tolerance,
  bits_for_levels as bits_for_levels,
)

__all__ = [
  "ACGCState",
  "ErrorBounded",
  "error_bounded",
  "tolerance",
  "bits_for_levels",
]
