"""The XLA reference of DIVISION compression: `division_compress_reference`
(the "division_compress" op's "xla" implementation, the Pallas kernel's
oracle): the pooled low-frequency component and the quantized high-frequency
remainder. The pooling, stored LFC and upsampling it shares with the kernel
are in `jact._core.division`; the validated entry point is
`jact.kernels._division.api.division_compress`.

>>> import jax, jax.numpy as jnp
>>> x = jax.random.normal(jax.random.key(0), (2, 8, 8, 16))
>>> lfc, hfc = division_compress_reference(x, jnp.uint32(3), block=4, bits=2, group_size=256,
...                                        lfc_dtype=jnp.bfloat16)
>>> lfc.shape, lfc.dtype, hfc.data.shape
((2, 2, 2, 16), dtype(bfloat16), (2, 4, 64))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jact._core.division import pool_blocks, stored_lfc, upsample
from jact.kernels._quantize.reference import quantize_rows_reference

__all__ = ["division_compress_reference"]


def division_compress_reference(
  x: jax.Array, seed: jax.Array, *, block: int, bits: int, group_size: int, lfc_dtype: Any
):
  """The XLA reference of the "division_compress" kernel op: (LFC, packed HFC).

  For an input of rank 3 to 5: LFC = the pooled map in `lfc_dtype`, HFC =
  x - upsample(LFC as stored), quantized as `PerGroup(bits, group_size)` stores it, with
  `seed` (samples of fewer than 8 values are quantized as one row: `as_rows`).
  """
  spatial = tuple(x.shape[1:-1])
  blocks = pool_blocks(spatial, block)
  lfc = stored_lfc(x, blocks, lfc_dtype)
  hfc = x.astype(jnp.float32) - upsample(lfc, blocks, spatial)
  return lfc, quantize_rows_reference(hfc, seed, bits=bits, group_size=group_size)
