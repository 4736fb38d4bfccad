"""Activation layers for linen: a 1-bit mask (ReLU, LeakyReLU) or a quantized derivative."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jact.compressors import Compressor
from jact.nn._twin import _Twin
from jact.ops import _activation as activation


class ReLU(_Twin, nn.Module):
  """ReLU keeping a 1-bit mask (exact gradient, no key needed)."""

  def __call__(self, x):
    return activation.relu(x, name=self._residual_name())


class LeakyReLU(_Twin, nn.Module):
  """Leaky ReLU keeping a 1-bit mask (exact gradient, no key needed)."""

  negative_slope: float = 0.01

  def __call__(self, x):
    return activation.leaky_relu(x, self.negative_slope, name=self._residual_name())


class _StoredDerivative(_Twin, nn.Module):
  # subclasses declare their own fields (op options first, then bits,
  # compressor) so that e.g. GELU(False) sets `approximate`.
  _op_name = ""
  _plain = staticmethod(lambda x: x)

  def _apply(self, x, **extra):
    compress, key = self._key()
    if not compress:
      return self._keyless(type(self)._plain)(x, **extra)
    op = getattr(activation, self._op_name)
    return op(x, **extra, key=key, name=self._residual_name(), **self._rounding())


class GELU(_StoredDerivative):
  """GELU storing its quantized derivative (unbiased input gradient)."""

  approximate: bool = True
  bits: int | None = 4
  compressor: Compressor | None = None
  _op_name = "gelu"
  _plain = staticmethod(lambda x, approximate: jax.nn.gelu(x, approximate=approximate))

  def __call__(self, x):
    return self._apply(x, approximate=self.approximate)


class SiLU(_StoredDerivative):
  """SiLU (swish) storing its quantized derivative (unbiased input gradient)."""

  bits: int | None = 4
  compressor: Compressor | None = None
  _op_name = "silu"
  _plain = staticmethod(jax.nn.silu)

  def __call__(self, x):
    return self._apply(x)


class Tanh(_StoredDerivative):
  """tanh storing its quantized derivative (unbiased input gradient)."""

  bits: int | None = 4
  compressor: Compressor | None = None
  _op_name = "tanh"
  _plain = staticmethod(jnp.tanh)

  def __call__(self, x):
    return self._apply(x)


class Sigmoid(_StoredDerivative):
  """Sigmoid storing its quantized derivative (unbiased input gradient)."""

  bits: int | None = 4
  compressor: Compressor | None = None
  _op_name = "sigmoid"
  _plain = staticmethod(jax.nn.sigmoid)

  def __call__(self, x):
    return self._apply(x)


class Softmax(_StoredDerivative):
  """Softmax over `axis` storing its quantized output (nearly unbiased gradient)."""

  axis: int = -1
  bits: int | None = 4
  compressor: Compressor | None = None
  _op_name = "softmax"
  _plain = staticmethod(lambda x, axis: jax.nn.softmax(x, axis=axis))

  def __call__(self, x):
    return self._apply(x, axis=self.axis)
