"""Per-sample mixed precision (ActNN L3): one width per sample, one static buffer.

Each sample is quantized per group like `jact.quantize` but at its own width
in 1..8, chosen at run time; the samples' codes lie back to back in one uint8
buffer of static length, so shapes never depend on the widths. A sample of
b bits takes b units of Dp / 8 bytes (Dp: its padded size): planar for 1, 2,
4, 8, bit planes for 3, 5, 6, 7 (`jact._core.packing.pack_bits`' layouts).
This module holds the layout (`PackedPerSample`, `per_sample_capacity`); the
kernels are in `jact.kernels._per_sample`. The layout and the overflow rule:
docs/design.md, "Per-sample widths".

>>> import jax, jax.numpy as jnp
>>> from jact.kernels._per_sample.api import dequantize_per_sample, quantize_per_sample
>>> x = jnp.linspace(-1.0, 1.0, 4 * 64).reshape(4, 64)
>>> cap = per_sample_capacity(x.shape, avg_bits=3.0)  # 12 bits per value in all
>>> @jax.jit
... def roundtrip(x, bits, key):
...   p = quantize_per_sample(x, bits, capacity_bytes=cap, key=key)
...   return p, dequantize_per_sample(p)
>>> p, y = roundtrip(x, jnp.array([1, 2, 4, 4]), jax.random.key(0))
>>> p.data.shape, p.nbytes, p.bits.tolist()
((96,), 116, [1, 2, 4, 4])
>>> bool(jnp.all(jnp.abs(y - x) <= p.scale.astype(jnp.float32)))
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jact._core.allocate import floor_bits
from jact._core.quantize import check_group_size, effective_group_size
from jact._core.stored import Stored, decoder

__all__ = ["PackedPerSample", "per_sample_capacity"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedPerSample(Stored):
  """A tensor quantized with one width per sample, packed into one buffer.

  Attributes:
    data: uint8[capacity] packed codes, samples back to back.
    bits: uint8[N] width used for each sample (after any fallback).
    minimum: bfloat16[N, groups] group minimum (rounded down).
    scale: bfloat16[N, groups] quantization step (rounded up).
    shape, dtype, group_size: static description of the quantized tensor.
    view_shape: shape `decompress` returns when the tensor was quantized as a
      reshaped view (small samples as one row), else None.
  """

  data: jax.Array
  bits: jax.Array
  minimum: jax.Array
  scale: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))
  group_size: int = dataclasses.field(metadata=dict(static=True))
  view_shape: tuple[int, ...] | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    """Bytes stored (buffer + widths + bf16 group statistics); static."""
    return int(self.data.size + self.bits.size + 2 * self.minimum.size + 2 * self.scale.size)

  def decompress(self, dtype=None) -> jax.Array:
    """`dequantize_per_sample(self, dtype)` (the kernel for the backend), in
    `view_shape` when set."""
    out = decoder(PackedPerSample)(self, dtype)
    return out if self.view_shape is None else out.reshape(self.view_shape)

  def map_ordered(self, fn) -> "PackedPerSample":
    """The buffer waits for the cotangent."""
    return dataclasses.replace(self, data=fn(self.data))


def _layout(shape: tuple[int, ...], group_size: int) -> tuple[int, int, int]:
  """(N, effective group size, padded values per sample Dp) for a tensor shape."""
  if len(shape) < 1:
    raise ValueError("per-sample quantization needs a leading sample axis; got a scalar.")
  d = math.prod(shape[1:])
  g = effective_group_size(d, check_group_size(group_size))
  return shape[0], g, -(-d // g) * g


def per_sample_capacity(shape: tuple[int, ...], avg_bits: float, group_size: int = 256) -> int:
  """Static buffer bytes for `shape` at `avg_bits` bits per value on average.

  ceil(floor_bits(avg_bits, N) * Dp / 8), with Dp the per-sample size padded to
  whole groups (as in `jact.quantize`); averages above 8 count as 8. Widths
  from `allocate_per_sample(w, avg_bits)` always fit it.

  >>> per_sample_capacity((16, 28, 28), 2.5), per_sample_capacity((16, 28, 28), 9.0)
  (3920, 12544)
  """
  n, _, dp = _layout(tuple(shape), group_size)
  if (
    isinstance(avg_bits, bool)
    or not isinstance(avg_bits, (int, float, np.integer, np.floating))
    or not math.isfinite(avg_bits)
    or avg_bits < 1
  ):
    raise ValueError(
      f"avg_bits must be a finite number >= 1 (every value needs at least 1 bit), got {avg_bits!r}."
    )
  return -(-min(floor_bits(avg_bits, n), 8 * n) * dp // 8)
