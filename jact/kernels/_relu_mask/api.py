"""The entry point of the "relu_mask" op: `relu_mask` validates its arguments,
then runs the implementation the kernel table picks (the XLA reference, the
Pallas kernel on a GPU, or the one named by `implementation=` or
`jact.kernels.use(relu_mask=...)`). `jact.ops.relu` / `leaky_relu` store
its mask.

>>> import jax.numpy as jnp
>>> y, mask = relu_mask(jnp.array([[-1.0, 0.0, 2.0]]), negative_slope=0.5)
>>> y.tolist(), mask.shape, mask.bits
([[-0.5, 0.0, 2.0]], (1, 3), 1)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jact import kernels
from jact._core.packing import PackedBits
from jact._core.quantize import FLOAT_DTYPES

__all__ = ["relu_mask"]


def relu_mask(
  x: jax.Array, *, negative_slope: float | None = None, implementation: str | None = None
) -> tuple[jax.Array, PackedBits]:
  """(activation, packed 1-bit mask) of `x`: `jax.nn.relu(x)` and x > 0, or with a
  `negative_slope`, `jax.nn.leaky_relu(x, negative_slope)` and x >= 0.

  Args:
    x: float32, bfloat16 or float16 array; the mask is packed one row per
      index of axis 0 (`jact.pack_codes`).
    negative_slope: None (ReLU) or a static real number (leaky ReLU).
    implementation: the kernel ("xla", "jax_triton", "pallas_triton"; see
      `jact.kernels.available("relu_mask")`); default: the best one for the
      backend, or the one chosen with `jact.kernels.use(relu_mask=...)`.
  """
  x = jnp.asarray(x)
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
    raise TypeError(
      f"relu_mask takes a float32, bfloat16 or float16 array, got {x.dtype}; "
      f"cast it first (x.astype(jnp.float32))."
    )
  if negative_slope is not None and (
    isinstance(negative_slope, bool)
    or not isinstance(negative_slope, (int, float, np.integer, np.floating))
  ):
    raise TypeError(
      f"relu_mask: negative_slope must be None (ReLU) or a static real number "
      f"(leaky ReLU, e.g. 0.01), got {negative_slope!r}."
    )
  fn = kernels.dispatch("relu_mask", implementation, size=x.size)
  return fn(x, negative_slope=negative_slope)
