"""`jact.nn.BLPABlock`: BLPA's pre-activation block, BatchNorm -> ReLU -> Conv, for linen.

In training mode it calls `jact.ops.blpa_block` (exact forward; the backward
keeps K-bit codes of the pre-ReLU value and the per-channel 1/std, residuals
"<name>.a2" and "<name>.inv") and updates the running statistics as Flax's
BatchNorm does; in eval mode (`use_running_average`) it runs the plain block.
Its variables are those of a `BatchNorm` named "norm" followed by a `Conv`
named "conv", so plain checkpoints of that pair load. No RNG stream.

>>> import jax, jax.numpy as jnp
>>> x = jnp.ones((2, 4, 4, 3))
>>> block = BLPABlock(features=5, kernel_size=(3, 3), use_running_average=False)
>>> v = jax.jit(block.init)(jax.random.key(0), x)
>>> y, upd = jax.jit(lambda v, x: block.apply(v, x, mutable=["batch_stats"]))(v, x)
>>> y.shape, sorted(v["params"]), sorted(upd["batch_stats"]["norm"])
((2, 4, 4, 5), ['conv', 'norm'], ['mean', 'var'])
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from jact._flax.blpa import F32, KERNEL_INIT, check_fits, kernel_size_tuple
from jact.compressors._blpa import check_blpa_bits
from jact.ops._blpa import blpa_block, blpa_block_reference
from jact.ops._norm import update_running_stats


class _LinenNorm(nn.Module):
  """The BatchNorm variables of a block ('params': scale, bias; 'batch_stats': mean, var)."""

  features: int
  scale_init: Callable
  bias_init: Callable
  param_dtype: Any

  @nn.compact
  def __call__(self):
    shape = (self.features,)
    scale = self.param("scale", self.scale_init, shape, self.param_dtype)
    bias = self.param("bias", self.bias_init, shape, self.param_dtype)
    mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, F32), shape)
    var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, F32), shape)
    return scale, bias, mean, var


class _LinenConv(nn.Module):
  """The Conv variables of a block ('params': kernel[, bias])."""

  kernel_shape: tuple[int, ...]
  use_bias: bool
  kernel_init: Callable
  bias_init: Callable
  param_dtype: Any

  @nn.compact
  def __call__(self):
    kernel = self.param("kernel", self.kernel_init, self.kernel_shape, self.param_dtype)
    bias = (
      self.param("bias", self.bias_init, self.kernel_shape[-1:], self.param_dtype)
      if self.use_bias
      else None
    )
    return kernel, bias


class BLPABlock(nn.Module):
  """relu(BatchNorm(x)) -> Conv, storing BLPA codes in training mode (flax.linen).

  Attributes:
    features: output features of the convolution.
    kernel_size: convolution window (a tuple; an int k is (k,), as in flax.linen.Conv;
      () dense).
    strides, padding, kernel_dilation: of the convolution.
    use_bias: add a convolution bias (default False: BN precedes it).
    bits: 2, 4 or 8 bits per stored pre-ReLU value.
    momentum, epsilon: of the batch norm (Flax's defaults).
    use_running_average: eval mode (running statistics); may also be passed to __call__.
    scale_init, bias_init, kernel_init, conv_bias_init, param_dtype: initializers and dtype.
  """

  features: int
  kernel_size: int | Sequence[int]
  strides: int | Sequence[int] = 1
  padding: Any = "SAME"
  kernel_dilation: int | Sequence[int] = 1
  use_bias: bool = False
  bits: int = 4
  momentum: float = 0.99
  epsilon: float = 1e-5
  use_running_average: bool | None = None
  scale_init: Callable = nn.initializers.ones
  bias_init: Callable = nn.initializers.zeros
  kernel_init: Callable = KERNEL_INIT
  conv_bias_init: Callable = nn.initializers.zeros
  param_dtype: Any = F32

  def _residual_name(self) -> str:
    path = self.path
    return "/".join(path) if path else type(self).__name__

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None):
    use_running_average = nn.merge_param(
      "use_running_average", self.use_running_average, use_running_average
    )
    check_blpa_bits(self.bits)
    layer = f"jact BLPABlock {self._residual_name()!r}"
    x = jnp.asarray(x)
    if x.ndim < 2:
      raise ValueError(f"{layer}: needs a batched input (N, ..., C), got shape {x.shape}")
    ksize = kernel_size_tuple(self.kernel_size)
    check_fits(ksize, x.shape, layer)
    scale, bias, ra_mean, ra_var = _LinenNorm(
      x.shape[-1], self.scale_init, self.bias_init, self.param_dtype, name="norm"
    )()
    kernel, conv_bias = _LinenConv(
      ksize + (x.shape[-1], self.features),
      self.use_bias,
      self.kernel_init,
      self.conv_bias_init,
      self.param_dtype,
      name="conv",
    )()
    conv = dict(strides=self.strides, padding=self.padding, dilation=self.kernel_dilation)
    if use_running_average:
      return blpa_block_reference(
        x,
        scale,
        bias,
        kernel,
        conv_bias,
        mean=ra_mean.value,
        var=ra_var.value,
        epsilon=self.epsilon,
        **conv,
      )
    y, mean, var = blpa_block(
      x,
      scale,
      bias,
      kernel,
      conv_bias,
      bits=self.bits,
      epsilon=self.epsilon,
      name=self._residual_name(),
      **conv,
    )
    if not self.is_initializing():
      ra_mean.value, ra_var.value = update_running_stats(
        ra_mean.value, ra_var.value, mean, var, self.momentum
      )
    return y
