"""The linen twins of BatchNorm, LayerNorm and RMSNorm: the normalized input stored compressed."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jact._flax import hooks as _hooks
from jact._flax.conversion import Conversion
from jact.compressors import Compressor
from jact.nn._twin import _norm_options_supported, _output_dtype, _Twin
from jact.ops import _norm as norm


def _norm_check(module, a, *, axes: bool, cross_device: bool = False) -> str | None:
  """Why `jact.convert` leaves a linen norm layer's call (arguments `a`) plain, or None."""
  if a.get("mask") is not None:
    return "mask= is not supported"
  if not cross_device and (module.axis_name is not None or module.axis_index_groups is not None):
    return "axis_name/axis_index_groups (cross-device statistics) are not supported"
  if not module.force_float32_reductions:
    return "force_float32_reductions=False is not supported"
  if axes:
    ndim = getattr(a.get("x"), "ndim", 0)
    if not (
      ndim
      and _hooks.last_axis_only(module.reduction_axes, ndim)
      and _hooks.last_axis_only(module.feature_axes, ndim)
    ):
      return "only normalization over the last axis is supported"
  return None


def _batch_norm_training(module, a) -> bool:
  call = a.get("use_running_average")
  use_ra = module.use_running_average if call is None else call
  return use_ra is not None and not use_ra  # None: the twin raises Flax's own error


def _batch_norm_check(module, a) -> str | None:
  if not _batch_norm_training(module, a):
    return None  # the twin runs Flax's inference path
  axes = (module.axis,) if isinstance(module.axis, int) else tuple(module.axis)
  if len(axes) != 1:
    return "only a single feature axis is supported"
  return _norm_check(module, a, axes=False, cross_device=True)


def _last_axis_check(module, a) -> str | None:
  return _norm_check(module, a, axes=True)


class BatchNorm(_Twin, nn.BatchNorm):
  """`flax.linen.BatchNorm`; in training mode the normalized input is stored compressed.

  `use_running_average=True` runs Flax's own inference path. Same variables
  ('params': scale, bias; 'batch_stats': mean, var); running statistics are
  updated exactly as Flax does. `axis_name` / `axis_index_groups` average the
  statistics over devices as Flax does (and the backward over the same devices).
  Single feature axis only; no mask.
  """

  bits: int | None = 4
  compressor: Compressor | None = None
  conversion = Conversion((nn.BatchNorm,), check=_batch_norm_check, draws_key=_batch_norm_training)

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    call_arg = use_running_average
    use_running_average = nn.merge_param(
      "use_running_average", self.use_running_average, use_running_average
    )
    if use_running_average:
      return super().__call__(x, call_arg, mask=mask)
    compress, key = self._key()
    if not compress:
      return self._keyless(super().__call__)(x, call_arg, mask=mask)
    _norm_options_supported(self, mask, "BatchNorm", cross_device=True)
    axes = (self.axis,) if isinstance(self.axis, int) else tuple(self.axis)
    if len(axes) != 1:
      raise ValueError("jact.nn.BatchNorm supports a single feature axis.")
    axis = axes[0] % x.ndim
    feature_shape = [x.shape[axis]]
    ra_mean = self.variable(
      "batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), feature_shape
    )
    ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), feature_shape)
    scale = (
      self.param("scale", self.scale_init, feature_shape, self.param_dtype)
      if self.use_scale
      else None
    )
    bias = (
      self.param("bias", self.bias_init, feature_shape, self.param_dtype) if self.use_bias else None
    )
    out_dtype = _output_dtype(x, (scale, bias), self.dtype)
    compute = jnp.promote_types(x.dtype, out_dtype)
    y, mean, var = norm.batch_norm(
      x.astype(compute),
      scale,
      bias,
      axis=axis,
      epsilon=self.epsilon,
      use_fast_variance=self.use_fast_variance,
      key=key,
      name=self._residual_name(),
      axis_name=self.axis_name,
      axis_index_groups=self.axis_index_groups,
      **self._rounding(),
    )
    if not self.is_initializing():
      ra_mean.value, ra_var.value = norm.update_running_stats(
        ra_mean.value, ra_var.value, mean, var, self.momentum
      )
    return y.astype(out_dtype)


class LayerNorm(_Twin, nn.LayerNorm):
  """`flax.linen.LayerNorm` (last-axis normalization) storing the normalized input compressed."""

  bits: int | None = 4
  compressor: Compressor | None = None
  conversion = Conversion((nn.LayerNorm,), check=_last_axis_check)

  @nn.compact
  def __call__(self, x, *, mask=None):
    compress, key = self._key()
    if not compress:
      return self._keyless(super().__call__)(x, mask=mask)
    _norm_options_supported(self, mask, "LayerNorm")
    if not (
      _hooks.last_axis_only(self.reduction_axes, x.ndim)
      and _hooks.last_axis_only(self.feature_axes, x.ndim)
    ):
      raise ValueError(
        "jact.nn.LayerNorm normalizes over the last axis only (reduction_axes=-1, feature_axes=-1)."
      )
    feature_shape = [x.shape[-1]]
    scale = (
      self.param("scale", self.scale_init, feature_shape, self.param_dtype)
      if self.use_scale
      else None
    )
    bias = (
      self.param("bias", self.bias_init, feature_shape, self.param_dtype) if self.use_bias else None
    )
    out_dtype = _output_dtype(x, (scale, bias), self.dtype)
    y = norm.layer_norm(
      x.astype(jnp.promote_types(x.dtype, out_dtype)),
      scale,
      bias,
      epsilon=self.epsilon,
      use_fast_variance=self.use_fast_variance,
      key=key,
      name=self._residual_name(),
      **self._rounding(),
    )
    return y.astype(out_dtype)


class RMSNorm(_Twin, nn.RMSNorm):
  """`flax.linen.RMSNorm` (last-axis normalization) storing the normalized input compressed."""

  bits: int | None = 4
  compressor: Compressor | None = None
  conversion = Conversion((nn.RMSNorm,), check=_last_axis_check)

  @nn.compact
  def __call__(self, x, *, mask=None):
    compress, key = self._key()
    if not compress:
      return self._keyless(super().__call__)(x, mask=mask)
    _norm_options_supported(self, mask, "RMSNorm")
    if not (
      _hooks.last_axis_only(self.reduction_axes, x.ndim)
      and _hooks.last_axis_only(self.feature_axes, x.ndim)
    ):
      raise ValueError(
        "jact.nn.RMSNorm normalizes over the last axis only (reduction_axes=-1, feature_axes=-1)."
      )
    scale = (
      self.param("scale", self.scale_init, [x.shape[-1]], self.param_dtype)
      if self.use_scale
      else None
    )
    out_dtype = _output_dtype(x, (scale,), self.dtype)
    y = norm.rms_norm(
      x.astype(jnp.promote_types(x.dtype, out_dtype)),
      scale,
      epsilon=self.epsilon,
      key=key,
      name=self._residual_name(),
      **self._rounding(),
    )
    return y.astype(out_dtype)
