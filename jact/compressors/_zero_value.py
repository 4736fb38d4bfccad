"""Zero-value compression (ZVC) as a real stored format (AC-GC's AutoQuantZ).

A 1-bit non-zero mask plus only the non-zero values (exact, or fixed-point
codes with `inner=Fixpoint(b)`) in one uint8 buffer of static size; a tensor
denser than the capacity is stored as dense fixed point in the same buffer.
Deterministic. The format and the fallback: docs/design.md, "Zero-value
compression".

>>> import jax.numpy as jnp
>>> from jact.compressors import ZeroValue
>>> x = jnp.array([[0.0, 1.5, 0.0, 0.0], [2.0, 0.0, 0.0, -1.0]])
>>> c = ZeroValue(capacity=0.5)
>>> stored = c.compress(x, None)
>>> bool((c.decompress(stored) == x).all()), int(stored.arrays["nonzeros"])
(True, 3)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jact.compressors._base import Compressed, Compressor, channels
from jact.compressors._fixed_point import (
  Fixpoint,
  fixpoint_codes_bytes,
  fixpoint_fields,
  pack_fixpoint_codes,
  unpack_fixpoint_codes,
)
from jact._core.packing import PackedBits, pack_codes, unpack_bits

# Widths of the dense fallback (the widest that fits the buffer): those whose
# codes pack whole into bytes, as before widths 3, 5-7 and 9-16 existed.
_FALLBACK_BITS = (8, 4, 2)

__all__ = ["ZeroValue", "nonzeros"]


def nonzeros(stored: Compressed) -> jax.Array:
  """The number of non-zero values of a ZVC-stored tensor (above the capacity:
  it was stored in the fixed-point fallback)."""
  return stored.arrays["nonzeros"]


@dataclasses.dataclass(frozen=True)
class ZeroValue(Compressor):
  """Zero-value compression: non-zero mask + non-zero values, static capacity.

  Attributes:
    inner: None (non-zeros kept exactly, in x's dtype) or a `Fixpoint`
      (non-zero fixed-point codes kept, AutoQuantZ).
    capacity: fraction of values the buffer has room for, in (0, 1].
  """

  inner: Fixpoint | None = None
  capacity: float = 0.5

  method = "zero_value"

  def __post_init__(self):
    if self.inner is not None and not isinstance(self.inner, Fixpoint):
      raise TypeError(
        f"ZeroValue's inner must be None (lossless) or a Fixpoint, got {self.inner!r}"
      )
    if (
      isinstance(self.capacity, bool)
      or not isinstance(self.capacity, (int, float))
      or not (0 < self.capacity <= 1)
    ):
      raise ValueError(
        f"capacity must be a fraction of the values in (0, 1], got "
        f"{self.capacity!r}; set it above the expected density of non-zeros."
      )
    object.__setattr__(self, "capacity", float(self.capacity))

  @property
  def unbiased(self) -> bool:
    return False

  @property
  def bits(self) -> int:
    return self.inner.bits if self.inner is not None else 32

  @property
  def average_bits(self) -> float:
    return 1.0 + self.capacity * self.bits

  def with_bits(self, bits: int) -> "ZeroValue":
    inner = Fixpoint(bits) if self.inner is None else self.inner.with_bits(bits)
    return dataclasses.replace(self, inner=inner)

  # ------------------------------------------------------------------ layout

  def _layout(self, shape, dtype):
    """(n, C, K, mask bytes, value bytes, fallback width)."""
    n = max(math.prod(shape), 1)
    c = channels(shape)
    k = math.ceil(self.capacity * n)
    mask_bytes = -(-n // 8)
    if self.inner is None:
      value_bytes = k * jnp.dtype(dtype).itemsize
    else:
      value_bytes = fixpoint_codes_bytes((k,), self.inner.bits)
    total = mask_bytes + value_bytes
    fallback = next((b for b in _FALLBACK_BITS if -(-n // (8 // b)) <= total), None)
    return n, c, k, mask_bytes, value_bytes, fallback

  def stored_bytes(self, shape: tuple[int, ...], dtype: Any = jnp.float32) -> int:
    """ceil(n / 8) mask + K values (itemsize each, or ceil(K * b / 8) codes)
    + 4 * C scales + 4 (the non-zero count)."""
    n, c, _, mask_bytes, value_bytes, _ = self._layout(tuple(shape), dtype)
    return mask_bytes + value_bytes + 4 * c + 4

  # ------------------------------------------------------------------ codec

  def compress(self, x: jax.Array, seed=None) -> Compressed:
    self.check_input(x)
    shape, dtype = tuple(x.shape), x.dtype
    n, c, k, mask_bytes, value_bytes, fallback = self._layout(shape, dtype)
    if fallback is None:
      raise ValueError(
        f"ZeroValue(capacity={self.capacity}) leaves {mask_bytes + value_bytes} bytes for "
        f"{n} values: too few for the 2-bit fallback used when a tensor is denser than the "
        "capacity; raise the capacity."
      )
    fixpoint = self.inner or Fixpoint(8)
    scale = fixpoint.scales(x)
    values = (x if self.inner is None else self.inner.codes(x, scale)).reshape(-1)
    mask = values != 0
    count = jnp.sum(mask, dtype=jnp.int32)

    def sparse(_):
      (index,) = jnp.nonzero(mask, size=k, fill_value=0)
      kept = jnp.where(jnp.arange(k) < count, values[index], jnp.zeros((), values.dtype))
      if self.inner is None:
        payload = lax.bitcast_convert_type(kept, jnp.uint8).reshape(-1)
      else:
        fields = pack_fixpoint_codes(kept + self.inner.levels, self.inner.bits)
        payload = jnp.concatenate([_as_bytes(f.data) for f in fields])
      return jnp.concatenate([pack_codes(mask, 1).data, payload])

    def dense(_):
      f = Fixpoint(fallback)
      data = pack_codes(jnp.ravel(f.codes(x, scale) + f.levels), fallback).data  # one flat row
      return jnp.pad(data, (0, mask_bytes + value_bytes - data.size))

    if not x.size:  # no values: an all-zero buffer of the layout's size
      buffer = jnp.zeros((mask_bytes + value_bytes,), jnp.uint8)
    else:
      buffer = lax.cond(count <= k, sparse, dense, None)
    return Compressed({"buffer": buffer, "scale": scale, "nonzeros": count}, self, shape, dtype)

  def decompress(self, stored: Compressed, dtype=None) -> jax.Array:
    shape = stored.shape
    if not math.prod(shape):
      return jnp.zeros(shape, dtype or stored.dtype)
    n, c, k, mask_bytes, value_bytes, fallback = self._layout(shape, stored.dtype)
    buffer, scale = stored.arrays["buffer"], stored.arrays["scale"]

    def sparse(_):
      mask = unpack_bits(buffer[:mask_bytes], 1)[:n].astype(jnp.bool_)
      slot = jnp.clip(jnp.cumsum(mask) - 1, 0, k - 1)
      payload = buffer[mask_bytes:]
      if self.inner is None:
        itemsize = jnp.dtype(stored.dtype).itemsize
        kept = lax.bitcast_convert_type(payload.reshape(k, itemsize), stored.dtype)
        return jnp.where(mask, kept[slot], 0).astype(jnp.float32).reshape(-1, c)
      fields, start = [], 0
      for w, _ in fixpoint_fields(self.inner.bits):
        data = _packed_struct(k, w)
        size = data.size * data.dtype.itemsize
        fields.append(PackedBits(_from_bytes(payload[start : start + size], data), (k,), w))
        start += size
      codes = unpack_fixpoint_codes(fields) - self.inner.levels
      return self.inner.values(jnp.where(mask, codes[slot], 0).reshape(-1, c), scale)

    def dense(_):
      f = Fixpoint(fallback)
      q = unpack_bits(buffer[: -(-n // (8 // fallback))], fallback)[:n].astype(jnp.int32)
      return f.values((q - f.levels).reshape(-1, c), scale)

    out = lax.cond(stored.arrays["nonzeros"] <= k, sparse, dense, None)
    return out.reshape(shape).astype(dtype or stored.dtype)


def _packed_struct(k: int, bits: int) -> jax.ShapeDtypeStruct:
  """Shape and dtype of `pack_codes`'s data for k flat `bits`-wide codes."""
  codes = jax.ShapeDtypeStruct((k,), jnp.uint16 if bits > 8 else jnp.uint8)
  return jax.eval_shape(lambda c: pack_codes(c, bits).data, codes)


def _as_bytes(data: jax.Array) -> jax.Array:
  """Packed data as flat uint8 bytes."""
  if data.dtype != jnp.uint8:
    data = lax.bitcast_convert_type(data, jnp.uint8)
  return data.reshape(-1)


def _from_bytes(buffer: jax.Array, struct: jax.ShapeDtypeStruct) -> jax.Array:
  """Inverse of `_as_bytes` for data of `struct`'s shape and dtype."""
  itemsize = jnp.dtype(struct.dtype).itemsize
  if itemsize == 1:
    return buffer.reshape(struct.shape)
  return lax.bitcast_convert_type(buffer.reshape(*struct.shape, itemsize), struct.dtype)
