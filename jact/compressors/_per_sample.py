"""ActNN's per-sample mixed precision (L3) as a `Compressor`.

Each sample gets its own width (1, 2, 4 or 8 bits), chosen inside the step
from its group ranges (per-sample sensitivity ||R_n||^2) so that the widths
average `avg_bits`; the codes are packed into one buffer sized for that
average. A plan's per-sample budget (`jact.BitPlan(budgets=...)`) stores a
residual with `PerGroup(...).with_budget(avg_bits)`, this compressor.

>>> import jax, jax.numpy as jnp
>>> c = PerSample(avg_bits=2.5)
>>> x = jnp.linspace(-1.0, 1.0, 8 * 256).reshape(8, 256) * jnp.arange(1, 9)[:, None]
>>> stored = c.compress(x, jnp.uint32(7))
>>> c.decompress(stored).shape, stored.nbytes == c.stored_bytes(x.shape), c.unbiased
((8, 256), True, True)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jact.compressors._base import Compressor
from jact._core.allocate import allocate_per_sample
from jact._core.persample import PackedPerSample, _layout, per_sample_capacity
from jact._core.quantize import as_rows, check_group_size, group_ranges_sq
from jact.kernels._per_sample.api import quantize_per_sample

__all__ = ["PerSample"]


@dataclasses.dataclass(frozen=True)
class PerSample(Compressor):
  """Per-sample widths under an average budget (ActNN L3), per-group codes.

  Attributes:
    avg_bits: average bits per value over the samples, in [1, 8].
    group_size: values per group (multiple of 8), as in `PerGroup`.
    stochastic: unbiased stochastic rounding, or round-to-nearest.
  """

  avg_bits: float = 4.0
  group_size: int = 256
  stochastic: bool = True

  method = "per_sample"

  def __post_init__(self):
    avg = self.avg_bits
    if (
      isinstance(avg, bool)
      or not isinstance(avg, (int, float, np.integer, np.floating))
      or not 1 <= avg <= 8
    ):
      raise ValueError(
        f"PerSample avg_bits must be a number of average bits in [1, 8], got {avg!r}."
      )
    check_group_size(self.group_size)
    if not isinstance(self.stochastic, (bool, np.bool_)):
      raise TypeError(
        f"stochastic must be True (unbiased stochastic rounding, needs a key) or False "
        f"(round-to-nearest), got {type(self.stochastic).__name__} {self.stochastic!r}."
      )
    object.__setattr__(self, "avg_bits", float(avg))

  @property
  def unbiased(self) -> bool:
    return bool(self.stochastic)

  @property
  def needs_key(self) -> bool:
    return bool(self.stochastic)

  @property
  def bits(self) -> int:
    """The average width, rounded down (a sample's own width is chosen per step)."""
    return int(self.avg_bits)

  @property
  def average_bits(self) -> float:
    return self.avg_bits + 32.0 / self.group_size

  def with_bits(self, bits: int) -> "PerSample":
    return dataclasses.replace(self, avg_bits=bits)

  def compress(self, x: jax.Array, seed) -> PackedPerSample:
    self.check_input(x)
    shape = tuple(x.shape)
    rows = x.reshape(as_rows(shape, self.group_size))
    ranges_sq, _, _ = group_ranges_sq(rows, self.group_size)
    widths = allocate_per_sample(ranges_sq, self.avg_bits)
    packed = quantize_per_sample(
      rows,
      widths,
      capacity_bytes=per_sample_capacity(rows.shape, self.avg_bits, self.group_size),
      group_size=self.group_size,
      stochastic=self.stochastic,
      seed=seed,
    )
    if rows.shape != shape:
      packed = dataclasses.replace(packed, view_shape=shape)
    return packed

  def decompress(self, stored: PackedPerSample, dtype=None) -> jax.Array:
    return stored.decompress(dtype)

  def stored_bytes(self, shape: tuple[int, ...], dtype: Any = None) -> int:
    """The buffer (`per_sample_capacity`), one width byte per sample and the
    bf16 minimum and step of every group."""
    rows = as_rows(tuple(int(s) for s in shape), self.group_size)
    n, g, dp = _layout(rows, self.group_size)
    capacity = per_sample_capacity(rows, self.avg_bits, self.group_size)
    return capacity + n + 4 * n * (dp // g)
