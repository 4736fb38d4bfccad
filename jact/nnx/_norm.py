"""The nnx twins of BatchNorm, LayerNorm and RMSNorm: the normalized input stored compressed."""

from __future__ import annotations

from flax import nnx

from jact._flax import hooks as _hooks
from jact._flax.conversion import Conversion
from jact.compressors import Compressor
from jact.nnx._twin import _first_not_none, _Twin
from jact.ops import _norm as norm


def _check_norm_options(module, mask, layer: str, cross_device: bool = False) -> None:
  if mask is not None:
    raise ValueError(f"jact.nnx.{layer} does not support mask=; use nnx.{layer}.")
  if not cross_device and (module.axis_name is not None or module.axis_index_groups is not None):
    raise ValueError(
      f"jact.nnx.{layer} does not support axis_name/axis_index_groups; use nnx.{layer}."
    )


def _check_last_axis(module, x, layer: str) -> None:
  if not (
    _hooks.last_axis_only(module.reduction_axes, x.ndim)
    and _hooks.last_axis_only(module.feature_axes, x.ndim)
  ):
    raise ValueError(
      f"jact.nnx.{layer} normalizes over the last axis only (reduction_axes=-1, feature_axes=-1)."
    )


def _convertible(module, *, axes: bool = True, cross_device: bool = False) -> str | None:
  """Why `jact.convert` leaves an nnx norm layer plain, or None."""
  if not cross_device and (module.axis_name is not None or module.axis_index_groups is not None):
    return "axis_name/axis_index_groups (cross-device statistics) are not supported"
  if axes and not (module.reduction_axes in (-1, (-1,)) and module.feature_axes in (-1, (-1,))):
    return "only reduction_axes=-1 and feature_axes=-1 are supported"
  return None


def _batch_norm_convertible(module) -> str | None:
  if not isinstance(module.axis, int):
    return "only a single feature axis is supported"
  return _convertible(module, axes=False, cross_device=True)


class BatchNorm(_Twin, nnx.BatchNorm):
  """`nnx.BatchNorm`; in training mode the normalized input is stored compressed.

  `use_running_average=True` runs Flax's inference path. Running statistics
  update as in Flax; `axis_name` / `axis_index_groups` average the statistics
  (and the backward) over devices as Flax does. Single feature axis; no mask.
  """

  conversion = Conversion((nnx.BatchNorm,), check=_batch_norm_convertible)

  def __init__(
    self,
    num_features: int,
    *,
    bits: int | None = 4,
    compressor: Compressor | None = None,
    name: str | None = None,
    rngs: nnx.Rngs,
    **kwargs,
  ):
    self._check_settings(rngs, bits, compressor)
    super().__init__(num_features, rngs=rngs, **kwargs)
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    use_running_average = _first_not_none(
      use_running_average,
      self.use_running_average,
      error_msg="No `use_running_average` argument was provided to jact.nnx.BatchNorm: "
      "pass it to the constructor or to __call__, or use nnx.view.",
    )
    if use_running_average:
      return super().__call__(x, True, mask=mask)
    _check_norm_options(self, mask, "BatchNorm", cross_device=True)
    if not isinstance(self.axis, int):
      raise ValueError("jact.nnx.BatchNorm supports a single feature axis.")
    compress, key = self._key()
    if not compress:
      return self._keyless(super().__call__)(x, False, mask=mask)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
    y, mean, var = norm.batch_norm(
      x,
      scale,
      bias,
      axis=self.axis,
      epsilon=self.epsilon,
      use_fast_variance=self.use_fast_variance,
      key=key,
      name=self.residual_name,
      axis_name=self.axis_name,
      axis_index_groups=self.axis_index_groups,
      **self._rounding(),
    )
    self.mean[...], self.var[...] = norm.update_running_stats(
      self.mean[...], self.var[...], mean, var, self.momentum
    )
    return y


class LayerNorm(_Twin, nnx.LayerNorm):
  """`nnx.LayerNorm` (last axis) storing the normalized input compressed."""

  conversion = Conversion((nnx.LayerNorm,), check=_convertible)

  def __init__(
    self,
    num_features: int,
    *,
    bits: int | None = 4,
    compressor: Compressor | None = None,
    name: str | None = None,
    rngs: nnx.Rngs,
    **kwargs,
  ):
    self._check_settings(rngs, bits, compressor)
    super().__init__(num_features, rngs=rngs, **kwargs)
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, x, *, mask=None):
    _check_norm_options(self, mask, "LayerNorm")
    _check_last_axis(self, x, "LayerNorm")
    compress, key = self._key()
    if not compress:
      return self._keyless(super().__call__)(x, mask=mask)
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
    return norm.layer_norm(
      x,
      scale,
      bias,
      epsilon=self.epsilon,
      use_fast_variance=self.use_fast_variance,
      key=key,
      name=self.residual_name,
      **self._rounding(),
    )


class RMSNorm(_Twin, nnx.RMSNorm):
  """`nnx.RMSNorm` (last axis) storing the normalized input compressed."""

  conversion = Conversion((nnx.RMSNorm,), check=_convertible)

  def __init__(
    self,
    num_features: int,
    *,
    bits: int | None = 4,
    compressor: Compressor | None = None,
    name: str | None = None,
    rngs: nnx.Rngs,
    **kwargs,
  ):
    self._check_settings(rngs, bits, compressor)
    super().__init__(num_features, rngs=rngs, **kwargs)
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, x, mask=None):
    _check_norm_options(self, mask, "RMSNorm")
    _check_last_axis(self, x, "RMSNorm")
    compress, key = self._key()
    if not compress:
      return self._keyless(super().__call__)(x, mask=mask)
    scale = self.scale[...] if self.scale is not None else None
    x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
    return norm.rms_norm(
      x, scale, epsilon=self.epsilon, key=key, name=self.residual_name, **self._rounding()
    )
