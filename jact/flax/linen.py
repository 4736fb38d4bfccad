"""Drop-in `flax.linen` layers that save compressed activations.

Every twin has exactly the variables (names, shapes, dtypes, initializers) of
the Flax layer it replaces, so a plain model's checkpoint loads into its
compressed twin, and its forward is Flax's. What differs is what is kept for
the backward pass: a stochastically rounded low-bit copy (`bits`, default 4,
or a `jact.compressors` object as `compressor`) instead of the
full-precision activation. Rounding noise comes from an RNG
stream named 'jact'. Without that stream (`init`, inference, evaluation,
decoding) a twin runs the plain Flax computation, which gives the same output
and saves nothing as long as nothing differentiates it; differentiating it
(`jax.grad`, `jax.vjp`, `jax.jvp`) raises a ValueError naming the fix.
Residuals are tagged with the layer's module path (e.g. "Dense_0.lhs"), or
the class name for a top-level layer.

>>> import jax, jax.numpy as jnp
>>> import flax.linen as nn
>>> from jact.flax import linen as jnn
>>> class MLP(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return jnn.Dense(2, bits=2)(jnn.ReLU()(jnn.Dense(8, bits=2)(x)))
>>> x = jnp.ones((4, 3))
>>> variables = MLP().init(jax.random.key(0), x)
>>> y = MLP().apply(variables, x, rngs={'jact': jax.random.key(1)})
>>> y.shape
(4, 2)
>>> bool(jnp.allclose(MLP().apply(variables, x), y))   # inference needs no key
True
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jact.compressors import Compressor
from jact.engine.op import REMOVED_KEYWORDS, reject_removed_keywords
from jact._compat import flax as _compat
from jact.flax import _hooks
from jact.ops import activation, embedding, linear, norm, pooling
from jact.ops.dropout import dropout as dropout_op
from jact.flax._hooks import Hook

__all__ = [
    "Dense", "Conv", "BatchNorm", "LayerNorm", "RMSNorm", "Dropout", "Embed",
    "MultiHeadDotProductAttention", "SelfAttention", "ReLU", "LeakyReLU", "GELU", "SiLU",
    "Tanh", "Sigmoid", "Softmax", "MaxPool", "AvgPool", "BLPABlock",
]


class _Twin:
  """Mixin: RNG stream, settings and residual name of a linen twin. A
  rounding twin (one with `bits` / `compressor` fields) built with the
  removed `group_size=` / `stochastic=` raises the ops' TypeError naming
  `compressor=jact.compressors.PerGroup(...)`."""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)  # Flax makes the dataclass (its __init__) here
    if "compressor" in getattr(cls, "__dataclass_fields__", {}):
      cls.__init__ = _rejecting_removed(cls.__init__)

  def _api(self) -> str:
    return f"jact.nn.{type(self).__name__}"

  def _rounding(self) -> dict:
    return _hooks.rounding_kwargs(self.bits, self.compressor, self._api())

  def _residual_name(self) -> str:
    path = self.path
    return "/".join(path) if path else type(self).__name__

  def _key(self) -> tuple[bool, Any]:
    """(compress?, key): the 'jact' key when rounding needs one; without the
    stream, (False, None): run the plain computation through `_keyless`."""
    if not _hooks.needs_key(self.bits, self.compressor, self._api()):
      return True, None
    if self.has_rng("jact"):
      return True, self.make_rng("jact")
    return False, None

  def _keyless(self, fn: Callable) -> Callable:
    """`fn`, the layer's plain computation run without a key: differentiating it raises."""
    what = f"{self._api()} {self._residual_name()!r}"
    return _hooks.keyless(fn, _hooks.linen_keyless_message(what))

  def _check_hook(self, field: str) -> None:
    if not isinstance(getattr(self, field), Hook) or getattr(self, f"{field}_cls") is not None:
      raise TypeError(f"jact.nn.{type(self).__name__} installs its own {field!r}; do not pass "
                      f"{field} or {field}_cls.")

  def _provide(self, slot: str, op: Callable, plain: Callable, **static):
    self._check_hook(slot)
    compress, key = self._key()
    if not compress:
      return _hooks.provide(**{slot: self._keyless(plain)})
    calls = _hooks.Calls(op, key, (self._residual_name(),), slot, plain=plain, **self._rounding(),
                          **static)
    return _hooks.provide(**{slot: calls})


def _rejecting_removed(init: Callable) -> Callable:
  """A twin's dataclass `__init__` raising the TypeError of `takes_compressor`
  for `group_size=` / `stochastic=`."""
  if getattr(init, "_jact_rejects_removed", False):
    return init

  signature = inspect.signature(init)

  @functools.wraps(init)
  def checked(self, *args, **kwargs):
    api = f"jact.nn.{type(self).__name__}"
    if args and any(k in kwargs for k in REMOVED_KEYWORDS):  # bits= may be positional
      kwargs_given = {**signature.bind_partial(self, *args).arguments, **kwargs}
      reject_removed_keywords(api, kwargs_given)
    reject_removed_keywords(api, kwargs)
    init(self, *args, **kwargs)

  checked._jact_rejects_removed = True
  return checked


def _norm_options_supported(module, mask, layer: str, cross_device: bool = False) -> None:
  if mask is not None:
    raise ValueError(f"jact.nn.{layer} does not support mask=; use flax.linen.{layer}.")
  if not cross_device and (module.axis_name is not None or module.axis_index_groups is not None):
    raise ValueError(
        f"jact.nn.{layer} does not support axis_name/axis_index_groups (pmap statistics); "
        f"use flax.linen.{layer}, or jit with sharded inputs.")
  if not module.force_float32_reductions:
    raise ValueError(f"jact.nn.{layer} needs force_float32_reductions=True.")


def _output_dtype(x, params, dtype):
  return _compat.canonicalize_dtype(x, *[p for p in params if p is not None], dtype=dtype)


# ----------------------------------------------------------------------------- linear


class Dense(_Twin, nn.Dense):
  """`flax.linen.Dense` storing its input compressed (residual "<path>.lhs").

  Attributes (besides Flax's): bits (1, 2, 4, 8 or None) or compressor (a
  `jact.compressors` object, e.g. `PerGroup(4, group_size=64,
  stochastic=False)`); the other rounding twins take the same two.
  """
  bits: int | None = 4
  compressor: Compressor | None = None
  dot_general: Any = Hook("dot_general")

  @nn.compact
  def __call__(self, inputs):
    with self._provide("dot_general", linear.dot_general, lax.dot_general,
                       compress=(True, False)):
      return super().__call__(inputs)


class Conv(_Twin, nn.Conv):
  """`flax.linen.Conv` storing its input compressed (residual "<path>.lhs")."""
  bits: int | None = 4
  compressor: Compressor | None = None
  conv_general_dilated: Any = Hook("conv_general_dilated")

  @nn.compact
  def __call__(self, inputs):
    with self._provide("conv_general_dilated", linear.conv_general_dilated,
                       lax.conv_general_dilated, compress=(True, False)):
      return super().__call__(inputs)


class Embed(_Twin, nn.Embed):
  """`flax.linen.Embed` whose backward keeps only the integer ids (no key needed)."""

  def __call__(self, inputs):
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    (table,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
    if self.num_embeddings == 1:
      return jnp.broadcast_to(table, inputs.shape + (self.features,))
    return embedding.embed(inputs, table, name=self._residual_name())


# ----------------------------------------------------------------------------- normalization


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

  @nn.compact
  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    call_arg = use_running_average
    use_running_average = nn.merge_param(
        "use_running_average", self.use_running_average, use_running_average)
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
    ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32),
                            feature_shape)
    ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32),
                           feature_shape)
    scale = (self.param("scale", self.scale_init, feature_shape, self.param_dtype)
             if self.use_scale else None)
    bias = (self.param("bias", self.bias_init, feature_shape, self.param_dtype)
            if self.use_bias else None)
    out_dtype = _output_dtype(x, (scale, bias), self.dtype)
    compute = jnp.promote_types(x.dtype, out_dtype)
    y, mean, var = norm.batch_norm(
        x.astype(compute), scale, bias, axis=axis, epsilon=self.epsilon,
        use_fast_variance=self.use_fast_variance, key=key, name=self._residual_name(),
        axis_name=self.axis_name, axis_index_groups=self.axis_index_groups, **self._rounding())
    if not self.is_initializing():
      ra_mean.value, ra_var.value = norm.update_running_stats(
          ra_mean.value, ra_var.value, mean, var, self.momentum)
    return y.astype(out_dtype)


class LayerNorm(_Twin, nn.LayerNorm):
  """`flax.linen.LayerNorm` (last-axis normalization) storing the normalized input compressed."""
  bits: int | None = 4
  compressor: Compressor | None = None

  @nn.compact
  def __call__(self, x, *, mask=None):
    compress, key = self._key()
    if not compress:
      return self._keyless(super().__call__)(x, mask=mask)
    _norm_options_supported(self, mask, "LayerNorm")
    if not (_hooks.last_axis_only(self.reduction_axes, x.ndim)
            and _hooks.last_axis_only(self.feature_axes, x.ndim)):
      raise ValueError(
          "jact.nn.LayerNorm normalizes over the last axis only (reduction_axes=-1, "
          "feature_axes=-1).")
    feature_shape = [x.shape[-1]]
    scale = (self.param("scale", self.scale_init, feature_shape, self.param_dtype)
             if self.use_scale else None)
    bias = (self.param("bias", self.bias_init, feature_shape, self.param_dtype)
            if self.use_bias else None)
    out_dtype = _output_dtype(x, (scale, bias), self.dtype)
    y = norm.layer_norm(x.astype(jnp.promote_types(x.dtype, out_dtype)), scale, bias,
                        epsilon=self.epsilon, use_fast_variance=self.use_fast_variance, key=key,
                        name=self._residual_name(), **self._rounding())
    return y.astype(out_dtype)


class RMSNorm(_Twin, nn.RMSNorm):
  """`flax.linen.RMSNorm` (last-axis normalization) storing the normalized input compressed."""
  bits: int | None = 4
  compressor: Compressor | None = None

  @nn.compact
  def __call__(self, x, *, mask=None):
    compress, key = self._key()
    if not compress:
      return self._keyless(super().__call__)(x, mask=mask)
    _norm_options_supported(self, mask, "RMSNorm")
    if not (_hooks.last_axis_only(self.reduction_axes, x.ndim)
            and _hooks.last_axis_only(self.feature_axes, x.ndim)):
      raise ValueError(
          "jact.nn.RMSNorm normalizes over the last axis only (reduction_axes=-1, "
          "feature_axes=-1).")
    scale = (self.param("scale", self.scale_init, [x.shape[-1]], self.param_dtype)
             if self.use_scale else None)
    out_dtype = _output_dtype(x, (scale,), self.dtype)
    y = norm.rms_norm(x.astype(jnp.promote_types(x.dtype, out_dtype)), scale,
                      epsilon=self.epsilon, key=key, name=self._residual_name(),
                      **self._rounding())
    return y.astype(out_dtype)


# ----------------------------------------------------------------------------- dropout


class Dropout(_Twin, nn.Dropout):
  """`flax.linen.Dropout` whose backward keeps only the key (its 8 bytes of data).

  The mask is Flax's: `make_rng(rng_collection)` (or `rng=`), then
  `jax.random.bernoulli` with the same keep probability and broadcast shape,
  so the output is bit-identical to `flax.linen.Dropout`'s for the same rngs.
  """

  @nn.compact
  def __call__(self, inputs, deterministic: bool | None = None, rng=None):
    deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
    if self.rate == 0.0 or deterministic:
      return inputs
    if self.rate == 1.0:
      return jnp.zeros_like(inputs)
    if rng is None:
      rng = self.make_rng(self.rng_collection)
    return dropout_op(inputs, self.rate, key=rng, broadcast_dims=self.broadcast_dims,
                      name=self._residual_name(), draw="flax")


# ----------------------------------------------------------------------------- attention


class MultiHeadDotProductAttention(_Twin, nn.MultiHeadDotProductAttention):
  """`flax.linen.MultiHeadDotProductAttention` with compressed projections and attention.

  Residual names: "<path>/query", "/key", "/value", "/out" (projection inputs)
  and "<path>/attention" (jact attention). Attention dropout draws Flax's own
  masks from the 'dropout' stream (`broadcast_dropout` included). Not
  supported: sow_weights=True.
  """
  bits: int | None = 4
  compressor: Compressor | None = None
  attention_fn: Callable[..., Any] = _hooks.attention_slot
  qkv_dot_general: Any = Hook("qkv")
  out_dot_general: Any = Hook("out")

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, **kwargs):
    self._check_hook("qkv_dot_general")
    self._check_hook("out_dot_general")
    if self.attention_fn is not _hooks.attention_slot:
      raise TypeError(f"jact.nn.{type(self).__name__} installs its own attention_fn; do not "
                      f"pass one.")
    compress, key = self._key()
    if not compress:
      with _hooks.provide(qkv=lax.dot_general, out=lax.dot_general,
                          attention=_hooks.plain_attention):
        return self._keyless(super().__call__)(inputs_q, inputs_k, inputs_v, **kwargs)
    with _hooks.provide(**_hooks.attention_ops(key, self._residual_name(), self._rounding())):
      return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)


class SelfAttention(MultiHeadDotProductAttention):
  """`flax.linen.SelfAttention` (same parameters) built on the compressed attention."""

  @nn.compact
  def __call__(self, inputs_q, mask=None, deterministic: bool | None = None, dropout_rng=None,
               sow_weights: bool = False):
    return super().__call__(inputs_q, mask=mask, deterministic=deterministic,
                            dropout_rng=dropout_rng, sow_weights=sow_weights)


# ----------------------------------------------------------------------------- activations


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


# ----------------------------------------------------------------------------- pooling


class MaxPool(_Twin, nn.Module):
  """`flax.linen.max_pool` as a layer; keeps only the arg-max position per window."""
  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"

  def __call__(self, x):
    return pooling.max_pool(x, tuple(self.window_shape), self.strides, self.padding,
                            name=self._residual_name())


class AvgPool(_Twin, nn.Module):
  """`flax.linen.avg_pool` as a layer; keeps nothing for the backward."""
  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"
  count_include_pad: bool = True

  def __call__(self, x):
    return pooling.avg_pool(x, tuple(self.window_shape), self.strides, self.padding,
                            self.count_include_pad, name=self._residual_name())


from jact.flax.blpa import LinenBLPABlock as BLPABlock  # noqa: E402  (fused BN -> ReLU -> conv, BLPA)
