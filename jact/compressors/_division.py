"""DIVISION (dual activation precision, Wang et al. 2022, Sec. 4) as a `Compressor`.

A channels-last map is split into its block-average-pooled low-frequency part
(LFC, stored in `lfc_dtype`) and the high-frequency residual x - upsample(LFC),
stored with per-group stochastic rounding at Q bits; the reconstruction is
unbiased. Rank-2 inputs have no LFC and are stored per group. Blocks,
non-finite values and stored bytes: docs/design.md, "DIVISION".

>>> import jax, jax.numpy as jnp
>>> from jact.compressors._division import Division
>>> c = Division(block=4, bits=2)
>>> x = jnp.linspace(-1.0, 1.0, 2 * 8 * 8 * 16).reshape(2, 8, 8, 16)
>>> stored = jax.jit(c.compress)(x, jnp.uint32(3))
>>> stored.arrays["lfc"].shape, jax.jit(c.decompress)(stored).shape
((2, 2, 2, 16), (2, 8, 8, 16))
>>> stored.nbytes == c.stored_bytes(x.shape, x.dtype), c.unbiased
(True, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jact.compressors._base import Compressed, Compressor, check_implementation
from jact.compressors._pergroup import PerGroup
from jact._core.quantize import FLOAT_DTYPES, check_group_size, finite_clamp
from jact._core.packing import check_bits
from jact._core.division import check_rank, pool_blocks, stored_lfc, upsample
from jact.kernels._division.api import division_compress
from jact.kernels._division.reference import division_compress_reference
from jact.kernels._quantize.api import dequantize

__all__ = ["Division", "division_compress_reference"]


def _nan_where_not_finite(x: jax.Array, blocks: tuple[int, ...], lfc: jax.Array) -> jax.Array:
  """`lfc` with NaN for every block of x holding a non-finite value."""
  bad = (~jnp.isfinite(x)).astype(jnp.float32)
  spatial = x.shape[1:-1]
  window = (1, *blocks, 1)
  pads = ((0, 0), *((0, -s % b) for s, b in zip(spatial, blocks)), (0, 0))
  count = jax.lax.reduce_window(bad, 0.0, jax.lax.add, window, window, pads)
  return jnp.where(count > 0, jnp.array(jnp.nan, lfc.dtype), lfc)


@dataclasses.dataclass(frozen=True)
class Division(Compressor):
  """DIVISION: average-pooled LFC kept in `lfc_dtype`, HFC quantized to `bits`.

  Attributes:
    block: pooling block and stride B over each spatial axis (positive int).
    bits: HFC width Q: an integer 1 to 8, or 16.
    group_size: HFC values per quantization group (multiple of 8).
    lfc_dtype: LFC storage dtype: bfloat16 (default), float32 or float16.
    keep: "both" (DIVISION); "lfc" or "hfc" store and reconstruct only that
      part -- the paper's ablations "w/o HFC" and "w/o LFC" (biased).
    implementation: the "division_compress" kernel ("xla", "jax_triton", "pallas_triton";
      see `jact.kernels`), or None for the best one on the backend. Every
      kernel stores the same bits.
  """

  block: int = 8
  bits: int = 2
  group_size: int = 256
  lfc_dtype: Any = jnp.bfloat16
  keep: str = "both"
  implementation: str | None = None

  method = "division"

  def __post_init__(self):
    if (
      isinstance(self.block, bool)
      or not isinstance(self.block, (int, np.integer))
      or self.block <= 0
    ):
      raise ValueError(
        f"block must be a positive int (the pooling block and stride, e.g. 8), got {self.block!r}."
      )
    if self.block < 2:
      raise ValueError(
        f"block must be a positive int of at least 2, got block={self.block!r}: with B=1 the "
        f"low-frequency part is the whole map, so DIVISION would store more bytes than the "
        f"input (compression rate (B^-2 + Q/32)^-1 < 1). Use block=8 (the paper's setting) "
        f"or 4, or PerGroup(bits) for plain quantization."
      )
    check_bits(self.bits)
    check_group_size(self.group_size)
    if self.keep not in ("both", "lfc", "hfc"):
      raise ValueError(
        f"keep must be 'both' (DIVISION), 'lfc' or 'hfc' (ablations), got {self.keep!r}."
      )
    try:
      dtype = jnp.dtype(self.lfc_dtype)
    except TypeError:
      dtype = None
    if dtype not in FLOAT_DTYPES:
      raise ValueError(
        f"lfc_dtype must be float32, bfloat16 or float16, got "
        f"{self.lfc_dtype!r}; use jnp.bfloat16 (default) or jnp.float32."
      )
    check_implementation(self.implementation, "division_compress")
    object.__setattr__(self, "block", int(self.block))
    object.__setattr__(self, "lfc_dtype", dtype)  # compares equal after to_dict/from_dict

  @property
  def unbiased(self) -> bool:
    return self.keep == "both"

  @property
  def needs_key(self) -> bool:
    return self.keep != "lfc"

  @property
  def average_bits(self) -> float:
    """Q + group statistics + LFC bits per value, nominal for 2-D maps (B^2 blocks)."""
    return self.bits + 32.0 / self.group_size + self.lfc_dtype.itemsize * 8.0 / self.block**2

  def with_bits(self, bits: int) -> "Division":
    return dataclasses.replace(self, bits=bits)

  def _hfc_quantizer(self) -> PerGroup:
    return PerGroup(self.bits, self.group_size, True)

  def compress(self, x: jax.Array, seed) -> Compressed:
    self.check_input(x)
    shape = tuple(x.shape)
    self._check_keep(shape)
    if x.ndim == 2:  # no spatial axes: no LFC, plain per-group quantization of x
      return Compressed({"hfc": self._hfc_quantizer().compress(x, seed)}, self, shape, x.dtype)
    arrays = {}
    if self.keep == "lfc":  # no HFC: the pooled map alone
      spatial = shape[1:-1]
      blocks = pool_blocks(spatial, self.block)
      arrays["lfc"] = _nan_where_not_finite(x, blocks, stored_lfc(x, blocks, self.lfc_dtype))
    else:
      lfc, hfc = division_compress(
        x,
        seed,
        block=self.block,
        bits=self.bits,
        group_size=self.group_size,
        lfc_dtype=self.lfc_dtype,
        implementation=self.implementation,
      )
      if self.keep == "both":
        arrays["lfc"] = lfc
      arrays["hfc"] = hfc
    return Compressed(arrays, self, shape, x.dtype)

  def _check_keep(self, shape) -> None:
    check_rank(shape)
    if len(shape) == 2 and self.keep == "lfc":
      raise ValueError(
        f"Division(keep='lfc') needs spatial axes (rank 3 to 5); a rank-2 "
        f"input of shape {tuple(shape)} has no low-frequency part: use "
        f"keep='both' (stored as per-group quantization) or PerGroup(bits)."
      )

  def decompress(self, stored: Compressed, dtype=None) -> jax.Array:
    if "hfc" in stored.arrays:
      out = dequantize(stored.arrays["hfc"], jnp.float32)
    else:
      out = jnp.zeros(stored.shape, jnp.float32)
    if "lfc" in stored.arrays:
      spatial = tuple(stored.shape[1:-1])
      out = out + upsample(stored.arrays["lfc"], pool_blocks(spatial, self.block), spatial)
    dtype = jnp.dtype(dtype or stored.dtype)
    out = jnp.where(jnp.isinf(out), out, finite_clamp(out, dtype))  # infinities stay
    return out.reshape(stored.shape).astype(dtype)

  def stored_bytes(self, shape: tuple[int, ...], dtype: Any = None) -> int:
    """LFC: N * prod(ceil(S_i / B_i)) * C * itemsize(lfc_dtype) (none for rank 2);
    HFC: `PerGroup(bits, group_size).stored_bytes(shape)`."""
    shape = tuple(int(s) for s in shape)
    self._check_keep(shape)
    hfc = self._hfc_quantizer().stored_bytes(shape) if self.keep != "lfc" else 0
    if len(shape) == 2 or self.keep == "hfc":
      return hfc
    spatial = shape[1:-1]
    pooled = math.prod(-(-s // b) for s, b in zip(spatial, pool_blocks(spatial, self.block)))
    return hfc + shape[0] * pooled * shape[-1] * self.lfc_dtype.itemsize
