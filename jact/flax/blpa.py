"""Flax layers for BLPA's pre-activation block: BatchNorm -> ReLU -> Conv.

`LinenBLPABlock` (flax.linen) and `NnxBLPABlock` (flax.nnx) compute
relu(batch_norm(x)) followed by a channels-last convolution (a dense layer
for a rank-2 input, kernel_size=()). In training mode they call
`jact.ops._blpa.blpa_block` (exact forward; the backward keeps K-bit BLPA codes
of the pre-ReLU value and the per-channel 1/std, residuals "<name>.a2" and
"<name>.inv") and update the running statistics as Flax's BatchNorm does
(running = momentum * running + (1 - momentum) * batch; the batch variance
is the biased one). In eval mode (`use_running_average`) they run the plain
exact block with the running statistics. Deterministic: no RNG stream.

Variables (those of a `BatchNorm` named "norm" followed by a `Conv` named
"conv", so plain checkpoints of that pair load):

  linen: params {'norm': {'scale', 'bias'}, 'conv': {'kernel'[, 'bias']}},
         batch_stats {'norm': {'mean', 'var'}}
  nnx:   block.norm.scale / .bias (nnx.Param), block.norm.mean / .var
         (nnx.BatchStat), block.conv.kernel[ / .bias] (nnx.Param)

`kernel_size`: a tuple ((3, 3) for 2-D), () for a dense layer; an int k
means (k,), a 1-D window, in both twins, as in `flax.linen.Conv` and
`flax.nnx.Conv`.

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> x = jnp.ones((2, 4, 4, 3))
>>> block = LinenBLPABlock(features=5, kernel_size=(3, 3), use_running_average=False)
>>> v = jax.jit(block.init)(jax.random.key(0), x)
>>> y, upd = jax.jit(lambda v, x: block.apply(v, x, mutable=["batch_stats"]))(v, x)
>>> y.shape, sorted(v["params"]), sorted(upd["batch_stats"]["norm"])
((2, 4, 4, 5), ['conv', 'norm'], ['mean', 'var'])
>>> m = NnxBLPABlock(3, 5, (3, 3), rngs=nnx.Rngs(0))
>>> nnx.jit(lambda m, x: m(x))(m, x).shape
(2, 4, 4, 5)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx

from jact.compressors._blpa import check_blpa_bits
from jact.ops._blpa import blpa_block, blpa_block_reference
from jact.ops._norm import update_running_stats

__all__ = ["LinenBLPABlock", "NnxBLPABlock"]

_F32 = jnp.float32
_KERNEL_INIT = nn.initializers.lecun_normal()  # Flax's Conv default


def _kernel_size(kernel_size) -> tuple[int, ...]:
  """The window as a tuple; an int k is (k,), as flax.linen.Conv and flax.nnx.Conv read it."""
  if isinstance(kernel_size, int):
    return (kernel_size,)
  return tuple(int(k) for k in kernel_size)


def _check_fits(kernel_size: tuple[int, ...], shape: tuple[int, ...], layer: str) -> None:
  spatial = len(shape) - 2
  if len(kernel_size) != spatial:
    raise ValueError(
        f"{layer}: kernel_size {kernel_size} has {len(kernel_size)} axes but the input of shape "
        f"{shape} has {spatial} spatial axes (N, spatial..., C); pass a {spatial}-tuple, e.g. "
        f"{(3,) * spatial} (an int k means (k,), a 1-D window, as in flax's Conv; () for a "
        f"rank-2 input: a dense layer).")


# ----------------------------------------------------------------------------- linen


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
    mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, _F32), shape)
    var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, _F32), shape)
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
    bias = (self.param("bias", self.bias_init, self.kernel_shape[-1:], self.param_dtype)
            if self.use_bias else None)
    return kernel, bias


class LinenBLPABlock(nn.Module):
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
  kernel_init: Callable = _KERNEL_INIT
  conv_bias_init: Callable = nn.initializers.zeros
  param_dtype: Any = _F32

  def _residual_name(self) -> str:
    path = self.path
    return "/".join(path) if path else type(self).__name__

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None):
    use_running_average = nn.merge_param(
        "use_running_average", self.use_running_average, use_running_average)
    check_blpa_bits(self.bits)
    layer = f"jact BLPABlock {self._residual_name()!r}"
    x = jnp.asarray(x)
    if x.ndim < 2:
      raise ValueError(f"{layer}: needs a batched input (N, ..., C), got shape {x.shape}")
    ksize = _kernel_size(self.kernel_size)
    _check_fits(ksize, x.shape, layer)
    scale, bias, ra_mean, ra_var = _LinenNorm(x.shape[-1], self.scale_init, self.bias_init,
                                              self.param_dtype, name="norm")()
    kernel, conv_bias = _LinenConv(ksize + (x.shape[-1], self.features), self.use_bias,
                                   self.kernel_init, self.conv_bias_init, self.param_dtype,
                                   name="conv")()
    conv = dict(strides=self.strides, padding=self.padding, dilation=self.kernel_dilation)
    if use_running_average:
      return blpa_block_reference(x, scale, bias, kernel, conv_bias, mean=ra_mean.value,
                                  var=ra_var.value, epsilon=self.epsilon, **conv)
    y, mean, var = blpa_block(x, scale, bias, kernel, conv_bias, bits=self.bits,
                              epsilon=self.epsilon, name=self._residual_name(), **conv)
    if not self.is_initializing():
      ra_mean.value, ra_var.value = update_running_stats(
          ra_mean.value, ra_var.value, mean, var, self.momentum)
    return y


# ----------------------------------------------------------------------------- nnx


class _NnxNorm(nnx.Module):
  """The BatchNorm state of a block (nnx.Param scale, bias; nnx.BatchStat mean, var)."""

  def __init__(self, features: int, scale_init, bias_init, param_dtype, rngs: nnx.Rngs):
    shape = (features,)
    self.scale = nnx.Param(scale_init(rngs.params(), shape, param_dtype))
    self.bias = nnx.Param(bias_init(rngs.params(), shape, param_dtype))
    self.mean = nnx.BatchStat(jnp.zeros(shape, _F32))
    self.var = nnx.BatchStat(jnp.ones(shape, _F32))


class _NnxConv(nnx.Module):
  """The Conv state of a block (nnx.Param kernel[, bias])."""

  def __init__(self, kernel_shape, use_bias: bool, kernel_init, bias_init, param_dtype,
               rngs: nnx.Rngs):
    self.kernel = nnx.Param(kernel_init(rngs.params(), kernel_shape, param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), kernel_shape[-1:], param_dtype))
                 if use_bias else nnx.data(None))


class NnxBLPABlock(nnx.Module):
  """relu(BatchNorm(x)) -> Conv, storing BLPA codes in training mode (flax.nnx).

  `model.eval()` / `model.train()` toggle `use_running_average`, as for
  `nnx.BatchNorm`. Arguments as `LinenBLPABlock`'s attributes, plus
  `in_features` (channels of x) and `name` (residual name; default the class
  name). An int kernel_size k means (k,), a 1-D window, as in `nnx.Conv`; pass
  a tuple for 2-D/3-D, () for dense.

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> m = NnxBLPABlock(4, 2, (), rngs=nnx.Rngs(0))   # dense
  >>> nnx.jit(lambda m, x: m(x))(m, jnp.ones((8, 4))).shape, m.conv.kernel.shape
  ((8, 2), (4, 2))
  """

  def __init__(self, in_features: int, features: int, kernel_size: int | Sequence[int],
               strides: int | Sequence[int] = 1, *, padding: Any = "SAME",
               kernel_dilation: int | Sequence[int] = 1, use_bias: bool = False,
               bits: int = 4, momentum: float = 0.99, epsilon: float = 1e-5,
               use_running_average: bool = False,
               scale_init=nnx.initializers.ones, bias_init=nnx.initializers.zeros,
               kernel_init=_KERNEL_INIT, conv_bias_init=nnx.initializers.zeros,
               param_dtype: Any = _F32, name: str | None = None, rngs: nnx.Rngs):
    self.bits = check_blpa_bits(bits)
    self.residual_name = name or type(self).__name__
    ksize = _kernel_size(kernel_size)
    self.in_features, self.features, self.kernel_size = in_features, features, ksize
    self.strides, self.padding, self.kernel_dilation = strides, padding, kernel_dilation
    self.use_bias, self.momentum, self.epsilon = use_bias, momentum, epsilon
    self.use_running_average = use_running_average
    self.norm = _NnxNorm(in_features, scale_init, bias_init, param_dtype, rngs)
    self.conv = _NnxConv(ksize + (in_features, features), use_bias, kernel_init,
                         conv_bias_init, param_dtype, rngs)

  def __call__(self, x, use_running_average: bool | None = None):
    if use_running_average is None:
      use_running_average = self.use_running_average
    x = jnp.asarray(x)
    _check_fits(self.kernel_size, x.shape, f"jact BLPABlock {self.residual_name!r}")
    scale, bias = self.norm.scale[...], self.norm.bias[...]
    kernel = self.conv.kernel[...]
    conv_bias = None if self.conv.bias is None else self.conv.bias[...]
    conv = dict(strides=self.strides, padding=self.padding, dilation=self.kernel_dilation)
    if use_running_average:
      return blpa_block_reference(x, scale, bias, kernel, conv_bias, mean=self.norm.mean[...],
                                  var=self.norm.var[...], epsilon=self.epsilon, **conv)
    y, mean, var = blpa_block(x, scale, bias, kernel, conv_bias, bits=self.bits,
                              epsilon=self.epsilon, name=self.residual_name, **conv)
    self.norm.mean[...], self.norm.var[...] = update_running_stats(
        self.norm.mean[...], self.norm.var[...], mean, var, self.momentum)
    return y

