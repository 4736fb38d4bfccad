"""What the linen and nnx BLPA blocks (`jact.nn.BLPABlock`, `jact.nnx.BLPABlock`) share:
the window's normalisation and the check that it fits the input."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

F32 = jnp.float32
KERNEL_INIT = nn.initializers.lecun_normal()  # Flax's Conv default


def kernel_size_tuple(kernel_size) -> tuple[int, ...]:
  """The window as a tuple; an int k is (k,), as flax.linen.Conv and flax.nnx.Conv read it."""
  if isinstance(kernel_size, int):
    return (kernel_size,)
  return tuple(int(k) for k in kernel_size)


def check_fits(kernel_size: tuple[int, ...], shape: tuple[int, ...], layer: str) -> None:
  spatial = len(shape) - 2
  if len(kernel_size) != spatial:
    raise ValueError(
      f"{layer}: kernel_size {kernel_size} has {len(kernel_size)} axes but the input of shape "
      f"{shape} has {spatial} spatial axes (N, spatial..., C); pass a {spatial}-tuple, e.g. "
      f"{(3,) * spatial} (an int k means (k,), a 1-D window, as in flax's Conv; () for a "
      f"rank-2 input: a dense layer)."
    )
