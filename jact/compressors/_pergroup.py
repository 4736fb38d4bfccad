"""ActNN / GACT per-group quantization as a `Compressor`.

`bits=2` on an op is shorthand for `PerGroup(2, group_size, stochastic)`.

>>> import jax, jax.numpy as jnp
>>> from jact.compressors import PerGroup
>>> c = PerGroup(bits=2)
>>> x = jnp.linspace(-1.0, 1.0, 8 * 256).reshape(8, 256)
>>> stored = c.compress(x, jnp.uint32(7))
>>> c.decompress(stored).shape, stored.nbytes == c.stored_bytes(x.shape, x.dtype), c.unbiased
((8, 256), True, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jact.compressors._base import Compressor, check_implementation
from jact.compressors._per_sample import PerSample
from jact._core.quantize import Packed, as_rows, check_group_size, effective_group_size
from jact._core.packing import check_bits
from jact.kernels._quantize.api import dequantize, quantize

__all__ = ["PerGroup"]


@dataclasses.dataclass(frozen=True)
class PerGroup(Compressor):
  """Per-sample, per-group min/step quantization (ActNN Sec. 4.1, GACT).

  Attributes:
    bits: bits per value, an integer 1 to 8 or 16.
    group_size: values per group (multiple of 8; bf16 minimum and step per group).
    stochastic: unbiased stochastic rounding, or round-to-nearest.
    implementation: the kernel ("xla", "jax_triton", "pallas_triton"; see `jact.kernels`),
      or None for the best one on the backend. Every kernel stores the same bits.
  """

  bits: int = 4
  group_size: int = 256
  stochastic: bool = True
  implementation: str | None = None

  method = "per_group"

  def __post_init__(self):
    check_bits(self.bits)
    check_group_size(self.group_size)
    if not isinstance(self.stochastic, (bool, np.bool_)):
      raise TypeError(
        f"stochastic must be True (unbiased stochastic rounding, needs a key) or False "
        f"(round-to-nearest), got {type(self.stochastic).__name__} {self.stochastic!r}."
      )
    for op in ("quantize", "dequantize"):  # the kernel runs both ways
      check_implementation(self.implementation, op)

  @property
  def unbiased(self) -> bool:
    return bool(self.stochastic)

  @property
  def needs_key(self) -> bool:
    return bool(self.stochastic)

  @property
  def average_bits(self) -> float:
    return self.bits + 32.0 / self.group_size

  def with_bits(self, bits: int) -> "PerGroup":
    return dataclasses.replace(self, bits=bits)

  def with_budget(self, avg_bits: float) -> PerSample:
    """Per-sample widths averaging `avg_bits`, with this group size and rounding."""
    return PerSample(avg_bits, self.group_size, self.stochastic)

  def compress(self, x: jax.Array, seed) -> Packed:
    self.check_input(x)
    rows = as_rows(tuple(x.shape), self.group_size)
    packed = quantize(
      x.reshape(rows),
      bits=self.bits,
      group_size=self.group_size,
      stochastic=self.stochastic,
      seed=seed,
      implementation=self.implementation,
    )
    if rows != tuple(x.shape):
      packed = dataclasses.replace(packed, view_shape=tuple(x.shape))
    return packed

  def decompress(self, stored: Packed, dtype=None) -> jax.Array:
    return dequantize(stored, dtype, implementation=self.implementation)

  def stored_bytes(self, shape: tuple[int, ...], dtype: Any = None) -> int:
    rows = as_rows(tuple(shape), self.group_size)
    n, d = rows[0], math.prod(rows[1:])
    g = effective_group_size(d, self.group_size)
    groups = -(-d // g)
    return n * groups * (g * self.bits // 8 + 4)
