"""Activation layers for nnx: a 1-bit mask (ReLU, LeakyReLU) or a quantized derivative."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jact.compressors import Compressor
from jact.nnx._twin import _Twin
from jact.ops import _activation as activation


class ReLU(_Twin, nnx.Module):
  """ReLU keeping a 1-bit mask (exact gradient, no key needed)."""

  def __init__(self, *, name: str | None = None):
    self._init_jact(None, None, name)

  def __call__(self, x):
    return activation.relu(x, name=self.residual_name)


class LeakyReLU(_Twin, nnx.Module):
  """Leaky ReLU keeping a 1-bit mask (exact gradient, no key needed)."""

  def __init__(self, negative_slope: float = 0.01, *, name: str | None = None):
    self.negative_slope = negative_slope
    self._init_jact(None, None, name)

  def __call__(self, x):
    return activation.leaky_relu(x, self.negative_slope, name=self.residual_name)


class _StoredDerivative(_Twin, nnx.Module):
  def __init__(
    self,
    *,
    bits: int | None = 4,
    compressor: Compressor | None = None,
    name: str | None = None,
    rngs: nnx.Rngs | nnx.RngStream | None = None,
  ):
    self._init_jact(rngs, bits, name, compressor)

  def _apply(self, op, plain, x, **extra):
    compress, key = self._key()
    if not compress:
      return self._keyless(plain)(x, **extra)
    return op(x, **extra, key=key, name=self.residual_name, **self._rounding())


class GELU(_StoredDerivative):
  """GELU storing its quantized derivative (unbiased input gradient)."""

  def __init__(self, approximate: bool = True, **kwargs):
    super().__init__(**kwargs)
    self.approximate = approximate

  def __call__(self, x):
    return self._apply(activation.gelu, jax.nn.gelu, x, approximate=self.approximate)


class SiLU(_StoredDerivative):
  """SiLU (swish) storing its quantized derivative (unbiased input gradient)."""

  def __call__(self, x):
    return self._apply(activation.silu, jax.nn.silu, x)


class Tanh(_StoredDerivative):
  """tanh storing its quantized derivative (unbiased input gradient)."""

  def __call__(self, x):
    return self._apply(activation.tanh, jnp.tanh, x)


class Sigmoid(_StoredDerivative):
  """Sigmoid storing its quantized derivative (unbiased input gradient)."""

  def __call__(self, x):
    return self._apply(activation.sigmoid, jax.nn.sigmoid, x)


class Softmax(_StoredDerivative):
  """Softmax over `axis` storing its quantized output (nearly unbiased gradient)."""

  def __init__(self, axis: int = -1, **kwargs):
    super().__init__(**kwargs)
    self.axis = axis

  def __call__(self, x):
    return self._apply(activation.softmax, jax.nn.softmax, x, axis=self.axis)
