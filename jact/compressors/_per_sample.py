"""ActNN's per-sample mixed precision (L3) as a `Compressor`.

Each sample gets its own width from `widths` (default 1, 2, 4 or 8 bits;
ActNN's integer widths 1..8 with `widths=jact.allocate.ACTNN_WIDTHS`), chosen
inside the step from its group ranges (per-sample sensitivity ||R_n||^2) so
that the widths average `avg_bits`; the codes are packed into one buffer
sized for that average. A plan's per-sample budget
(`jact.BitPlan(budgets=...)`) stores a residual with
`PerGroup(...).with_budget(avg_bits)`, this compressor at the default widths;
the ActNN L3 controller gives its residuals `PerSample` entries at 1..8.

>>> import jax, jax.numpy as jnp
>>> c = PerSample(avg_bits=2.5)
>>> x = jnp.linspace(-1.0, 1.0, 8 * 256).reshape(8, 256) * jnp.arange(1, 9)[:, None]
>>> stored = c.compress(x, jnp.uint32(7))
>>> c.decompress(stored).shape, stored.nbytes == c.stored_bytes(x.shape), c.unbiased
((8, 256), True, True)
>>> PerSample(2.5, widths=range(1, 9)).compress(x, jnp.uint32(7)).bits.tolist()
[1, 2, 2, 3, 3, 3, 3, 3]
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
    avg_bits: average bits per value over the samples, in [min(widths), 8].
    group_size: values per group (multiple of 8), as in `PerGroup`.
    stochastic: unbiased stochastic rounding, or round-to-nearest.
    widths: the widths a sample may get, from 1..8 (stored sorted).
  """

  avg_bits: float = 4.0
  group_size: int = 256
  stochastic: bool = True
  widths: tuple[int, ...] = (1, 2, 4, 8)

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
    try:
      widths = tuple(self.widths)
    except TypeError:
      widths = ()
    if not widths or any(
      isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 1 <= b <= 8 for b in widths
    ):
      raise ValueError(
        f"PerSample widths must be a non-empty sequence of widths from 1..8, got "
        f"{self.widths!r}; e.g. widths=(1, 2, 3, 4, 5, 6, 7, 8)."
      )
    widths = tuple(sorted({int(b) for b in widths}))
    if avg < widths[0]:
      raise ValueError(
        f"PerSample avg_bits={avg!r} is below the narrowest width {widths[0]} of "
        f"widths={widths}: raise avg_bits or allow narrower widths."
      )
    object.__setattr__(self, "avg_bits", float(avg))
    object.__setattr__(self, "widths", widths)

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

  def to_dict(self) -> dict[str, Any]:
    """JSON-able description (`widths` as a list); `from_dict` inverts it."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    return {"method": self.method, **fields, "widths": list(self.widths)}

  def with_budget(self, avg_bits: float) -> "PerSample":
    """The same widths, group size and rounding at another average."""
    return dataclasses.replace(self, avg_bits=avg_bits)

  def compress(self, x: jax.Array, seed) -> PackedPerSample:
    self.check_input(x)
    shape = tuple(x.shape)
    rows = x.reshape(as_rows(shape, self.group_size))
    ranges_sq, _, _ = group_ranges_sq(rows, self.group_size)
    widths = allocate_per_sample(ranges_sq, self.avg_bits, self.widths)
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
