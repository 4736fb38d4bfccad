"""The kernel entry points that jact's public API exposes, gathered from their op
packages (each validates its arguments, then runs the implementation
`jact.kernels` picks for its op, or the one named by `implementation=`):

* `quantize`, `dequantize`: `jact.kernels._quantize.api` (`jact.quantize`);
* `quantize_per_sample`, `dequantize_per_sample`: `jact.kernels._per_sample.api`;
* `relu_mask`: `jact.kernels._relu_mask.api`;
* `division_compress`: `jact.kernels._division.api`.

>>> import jax, jax.numpy as jnp
>>> x = jnp.linspace(-1.0, 1.0, 2 * 320).reshape(2, 320)
>>> p = quantize(x, jax.random.key(0), bits=4)
>>> bool(jnp.abs(dequantize(p) - x).max() <= 2 / 15)
True
"""

from __future__ import annotations

from jact.kernels._division.api import division_compress
from jact.kernels._per_sample.api import dequantize_per_sample, quantize_per_sample
from jact.kernels._quantize.api import dequantize, quantize
from jact.kernels._relu_mask.api import relu_mask

__all__ = [
  "quantize",
  "dequantize",
  "quantize_per_sample",
  "dequantize_per_sample",
  "relu_mask",
  "division_compress",
]
