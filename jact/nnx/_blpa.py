"""`jact.nnx.BLPABlock`: BLPA's pre-activation block, BatchNorm -> ReLU -> Conv, for nnx.

The nnx form of `jact.nn.BLPABlock`: the same computation and residuals; its
state is `block.norm.scale / .bias` (nnx.Param), `block.norm.mean / .var`
(nnx.BatchStat) and `block.conv.kernel[ / .bias]` (nnx.Param).

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> m = BLPABlock(3, 5, (3, 3), rngs=nnx.Rngs(0))
>>> nnx.jit(lambda m, x: m(x))(m, jnp.ones((2, 4, 4, 3))).shape
(2, 4, 4, 5)
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
from flax import nnx

from jact._flax.blpa import F32, KERNEL_INIT, check_fits, kernel_size_tuple
from jact.compressors._blpa import check_blpa_bits
from jact.ops._blpa import blpa_block, blpa_block_reference
from jact.ops._norm import update_running_stats


class _NnxNorm(nnx.Module):
  """The BatchNorm state of a block (nnx.Param scale, bias; nnx.BatchStat mean, var)."""

  def __init__(self, features: int, scale_init, bias_init, param_dtype, rngs: nnx.Rngs):
    shape = (features,)
    self.scale = nnx.Param(scale_init(rngs.params(), shape, param_dtype))
    self.bias = nnx.Param(bias_init(rngs.params(), shape, param_dtype))
    self.mean = nnx.BatchStat(jnp.zeros(shape, F32))
    self.var = nnx.BatchStat(jnp.ones(shape, F32))


class _NnxConv(nnx.Module):
  """The Conv state of a block (nnx.Param kernel[, bias])."""

  def __init__(
    self, kernel_shape, use_bias: bool, kernel_init, bias_init, param_dtype, rngs: nnx.Rngs
  ):
    self.kernel = nnx.Param(kernel_init(rngs.params(), kernel_shape, param_dtype))
    self.bias = (
      nnx.Param(bias_init(rngs.params(), kernel_shape[-1:], param_dtype))
      if use_bias
      else nnx.data(None)
    )


class BLPABlock(nnx.Module):
  """relu(BatchNorm(x)) -> Conv, storing BLPA codes in training mode (flax.nnx).

  `model.eval()` / `model.train()` toggle `use_running_average`, as for
  `nnx.BatchNorm`. Arguments as `jact.nn.BLPABlock`'s attributes, plus
  `in_features` (channels of x) and `name` (residual name; default the class
  name). An int kernel_size k means (k,), a 1-D window, as in `nnx.Conv`; pass
  a tuple for 2-D/3-D, () for dense.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> m = BLPABlock(4, 2, (), rngs=nnx.Rngs(0))   # dense
  >>> nnx.jit(lambda m, x: m(x))(m, jnp.ones((8, 4))).shape, m.conv.kernel.shape
  ((8, 2), (4, 2))
  """

  def __init__(
    self,
    in_features: int,
    features: int,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] = 1,
    *,
    padding: Any = "SAME",
    kernel_dilation: int | Sequence[int] = 1,
    use_bias: bool = False,
    bits: int = 4,
    momentum: float = 0.99,
    epsilon: float = 1e-5,
    use_running_average: bool = False,
    scale_init=nnx.initializers.ones,
    bias_init=nnx.initializers.zeros,
    kernel_init=KERNEL_INIT,
    conv_bias_init=nnx.initializers.zeros,
    param_dtype: Any = F32,
    name: str | None = None,
    rngs: nnx.Rngs,
  ):
    self.bits = check_blpa_bits(bits)
    self.residual_name = name or type(self).__name__
    ksize = kernel_size_tuple(kernel_size)
    self.in_features, self.features, self.kernel_size = in_features, features, ksize
    self.strides, self.padding, self.kernel_dilation = strides, padding, kernel_dilation
    self.use_bias, self.momentum, self.epsilon = use_bias, momentum, epsilon
    self.use_running_average = use_running_average
    self.norm = _NnxNorm(in_features, scale_init, bias_init, param_dtype, rngs)
    self.conv = _NnxConv(
      ksize + (in_features, features), use_bias, kernel_init, conv_bias_init, param_dtype, rngs
    )

  def __call__(self, x, use_running_average: bool | None = None):
    if use_running_average is None:
      use_running_average = self.use_running_average
    x = jnp.asarray(x)
    check_fits(self.kernel_size, x.shape, f"jact BLPABlock {self.residual_name!r}")
    scale, bias = self.norm.scale[...], self.norm.bias[...]
    kernel = self.conv.kernel[...]
    conv_bias = None if self.conv.bias is None else self.conv.bias[...]
    conv = dict(strides=self.strides, padding=self.padding, dilation=self.kernel_dilation)
    if use_running_average:
      return blpa_block_reference(
        x,
        scale,
        bias,
        kernel,
        conv_bias,
        mean=self.norm.mean[...],
        var=self.norm.var[...],
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
      name=self.residual_name,
      **conv,
    )
    self.norm.mean[...], self.norm.var[...] = update_running_stats(
      self.norm.mean[...], self.norm.var[...], mean, var, self.momentum
    )
    return y
