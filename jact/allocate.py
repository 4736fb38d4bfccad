"""Bit allocation: which width each tensor (or sample) gets under a bit budget.

The public names of `jact._core.allocate` (an internal module).
"""

from jact._core.allocate import (
  UNCOMPRESSED as UNCOMPRESSED,
  variance_factor as variance_factor,
  greedy_allocate as greedy_allocate,
  optimal_allocate as optimal_allocate,
  total_variance as total_variance,
  total_bits as total_bits,
  allocate_per_sample as allocate_per_sample,
  allocate_layers_and_samples as allocate_layers_and_samples,
  ACTNN_WIDTHS as ACTNN_WIDTHS,
)

__all__ = [
  "UNCOMPRESSED",
  "variance_factor",
  "greedy_allocate",
  "optimal_allocate",
  "total_variance",
  "total_bits",
  "allocate_per_sample",
  "allocate_layers_and_samples",
  "ACTNN_WIDTHS",
]
