"""The XLA reference of the "relu_mask" op: a ReLU or leaky ReLU's output and
its packed 1-bit mask (`jact._core.packing.pack_codes`, one row per sample),
the oracle of the Pallas kernel (`jact.kernels._relu_mask.pallas_triton`).
The validated entry point is `jact.kernels._relu_mask.api.relu_mask`.

>>> import jax.numpy as jnp
>>> y, mask = relu_mask_reference(jnp.array([[-1.0, 0.0, 2.0]]))
>>> y.tolist(), mask.data.shape
([[0.0, 0.0, 2.0]], (1, 1))
"""

from __future__ import annotations

import jax

from jact._core.packing import pack_codes

__all__ = ["relu_mask_reference"]


def relu_mask_reference(x: jax.Array, *, negative_slope: float | None = None):
  """(activation, packed 1-bit mask): `jax.nn.relu(x)` and x > 0 without a
  slope, else `jax.nn.leaky_relu(x, negative_slope)` and x >= 0 (the XLA
  reference of the "relu_mask" kernel)."""
  if negative_slope is None:
    return jax.nn.relu(x), pack_codes(x > 0, 1)
  return jax.nn.leaky_relu(x, negative_slope), pack_codes(x >= 0, 1)
