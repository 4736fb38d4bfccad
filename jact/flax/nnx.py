"""Drop-in `flax.nnx` layers that save compressed activations.

Each twin subclasses the Flax layer, so its `nnx.Param` / `nnx.BatchStat`
state is exactly the plain layer's and `nnx.update(twin, nnx.state(plain,
nnx.Param))` loads plain weights. Layers that round stochastically fork an RNG
stream named 'jact' (falling back to 'default', as nnx streams do) at
construction, like `nnx.Dropout` does with 'dropout', and draw a fresh key on
every call. Inside a `use_key` block they draw from that block's key instead;
a twin built from `rngs` without such a stream (or converted by
`jact.convert(model)` without `rngs=`) holds no stream and no RNG state, and
takes its keys only from `use_key`. A layer with no key runs the plain Flax
computation: the same output, fine for inference, and a ValueError naming the
fix if differentiated. Residual names default to the class name;
`name_residuals(model)` sets every twin's name to its attribute path in the model.

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> from jact.flax import nnx as jnnx
>>> layer = jnnx.Linear(3, 4, bits=2, rngs=nnx.Rngs(params=0, jact=1))
>>> layer(jnp.ones((2, 3))).shape
(2, 4)
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jact.compressors import Compressor
from jact._engine.op import reject_removed_keywords
from jact.flax import _hooks
from jact.flax._convert_generic import record
from jact.flax._hooks import Hook, use_key
from jact.ops import _activation as activation, _embedding as embedding, _linear as linear, _norm as norm, _pooling as pooling
from jact.ops._dropout import dropout as dropout_op

__all__ = [
    "Linear", "Conv", "BatchNorm", "LayerNorm", "RMSNorm", "Dropout", "Embed",
    "MultiHeadAttention", "ReLU", "LeakyReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax",
    "MaxPool", "AvgPool", "BLPABlock", "name_residuals", "use_key",
]


class _Twin:
  """Mixin: settings, RNG stream and residual name of an nnx twin. Each call
  of a twin is recorded for `jact.conversion_report` (a 'twin' row)."""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    call = cls.__dict__.get("__call__")
    if call is not None:
      cls.__call__ = _recorded(call)
    init = cls.__dict__.get("__init__")
    if init is not None and "compressor" in inspect.signature(init).parameters:
      cls.__init__ = _rejecting_removed(init)

  @classmethod
  def _check_settings(cls, rngs, bits, compressor=None) -> None:
    """Fails fast (before any parameter is initialized) on bad settings."""
    _hooks.rounding_kwargs(bits, compressor, f"jact.nnx.{cls.__name__}")

  def _init_jact(self, rngs, bits=4, name=None, compressor=None):
    """Settings, residual name and the layer's own 'jact' stream, forked from
    `rngs` ('jact', else 'default') when rounding needs a key; without such a
    stream in `rngs` none (keys from `use_key` only)."""
    self._check_settings(rngs, bits, compressor)
    self.bits, self.compressor = bits, compressor
    self.residual_name = name or type(self).__name__
    stream = None
    if self._needs_key() and isinstance(rngs, nnx.RngStream):
      stream = rngs.fork()
    elif self._needs_key() and isinstance(rngs, nnx.Rngs) and ("jact" in rngs
                                                               or "default" in rngs):
      stream = rngs["jact"].fork()
    self.jact_rngs = stream if stream is not None else nnx.data(None)

  def _rounding(self) -> dict:
    return _hooks.rounding_kwargs(self.bits, self.compressor, f"jact.nnx.{type(self).__name__}")

  def _needs_key(self) -> bool:
    return _hooks.needs_key(self.bits, self.compressor, f"jact.nnx.{type(self).__name__}")

  def _key(self) -> tuple[bool, Any]:
    """(compress?, key): a `use_key` block's key, else the layer's stream; (False,
    None) where a key is needed and there is none: run plain through `_keyless`."""
    if not self._needs_key():
      return True, None
    key = _hooks.context_key(self.residual_name)
    if key is not None:
      return True, key
    if self.jact_rngs is None:
      return False, None
    return True, _hooks.draw(self.jact_rngs, f"jact.nnx.{type(self).__name__} "
                                              f"{self.residual_name!r}")

  def _keyless(self, fn):
    """`fn`, the layer's plain computation run without a key: differentiating it raises."""
    return _hooks.keyless(fn, _hooks.nnx_keyless_message(
        f"jact.nnx.{type(self).__name__} {self.residual_name!r}",
        "give the layers their own streams: jact.convert(model, rngs=nnx.Rngs(jact=0)), or "
        "build the twins with rngs=nnx.Rngs(params=0, jact=1)"))

  def _provide(self, slot: str, op, plain, **static):
    compress, key = self._key()
    if not compress:
      return _hooks.provide(**{slot: self._keyless(plain)})
    calls = _hooks.Calls(op, key, (self.residual_name,), slot, plain=plain, **self._rounding(),
                          **static)
    return _hooks.provide(**{slot: calls})


def _recorded(call):
  """`call` (a twin's `__call__`) noting the call in a conversion report being taken."""
  @functools.wraps(call)
  def recorded(self, *args, **kwargs):
    record(self.residual_name, type(self).__name__, "twin")
    return call(self, *args, **kwargs)

  return recorded


def _rejecting_removed(init):
  """A rounding twin's `__init__` raising the TypeError of `takes_compressor`
  for `group_size=` / `stochastic=` (before Flax's constructor sees them)."""
  @functools.wraps(init)
  def checked(self, *args, **kwargs):
    reject_removed_keywords(f"jact.nnx.{type(self).__name__}", kwargs)
    init(self, *args, **kwargs)

  return checked


def _first_not_none(*values, error_msg: str):
  """The first value that is not None (a call-time option, then the constructor's)."""
  for value in values:
    if value is not None:
      return value
  raise ValueError(error_msg)


def _no_hook(kwargs: dict, *hooks: str) -> None:
  for h in hooks:
    if kwargs.get(h) is not None:
      raise TypeError(f"a jact twin installs its own {h!r}; do not pass one.")
    kwargs.pop(h, None)


def name_residuals(model: nnx.Module) -> nnx.Module:
  """Names every twin's residuals after its attribute path ("encoder/layers/0"); in place.

  >>> from flax import nnx
  >>> class Net(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.fc = Linear(2, 2, rngs=rngs)
  >>> name_residuals(Net(nnx.Rngs(0))).fc.residual_name
  'fc'
  """
  for path, module in nnx.iter_modules(model):
    if isinstance(module, (_Twin, BLPABlock)) and path:
      module.residual_name = "/".join(str(p) for p in path)
  return model


# ----------------------------------------------------------------------------- linear


class Linear(_Twin, nnx.Linear):
  """`nnx.Linear` storing its input compressed (residual "<name>.lhs").

  Extra keywords: bits (1, 2, 4, 8 or None) or compressor (a
  `jact.compressors` object, e.g. `PerGroup(4, group_size=64,
  stochastic=False)`), and name; the other rounding twins take the same.
  """

  def __init__(self, in_features: int, out_features: int, *, bits: int | None = 4,
               compressor: Compressor | None = None, name: str | None = None, rngs: nnx.Rngs, **kwargs):
    _no_hook(kwargs, "dot_general")
    self._check_settings(rngs, bits, compressor)
    super().__init__(in_features, out_features, dot_general=Hook("dot_general"), rngs=rngs,
                     **kwargs)
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, inputs, out_sharding=None):
    with self._provide("dot_general", linear.dot_general, lax.dot_general,
                       compress=(True, False)):
      return super().__call__(inputs, out_sharding=out_sharding)


class Conv(_Twin, nnx.Conv):
  """`nnx.Conv` storing its input compressed (residual "<name>.lhs")."""

  def __init__(self, in_features: int, out_features: int, kernel_size: int | Sequence[int],
               strides: int | Sequence[int] | None = 1, *, bits: int | None = 4,
               compressor: Compressor | None = None, name: str | None = None, rngs: nnx.Rngs, **kwargs):
    _no_hook(kwargs, "conv_general_dilated")
    self._check_settings(rngs, bits, compressor)
    super().__init__(in_features, out_features, kernel_size, strides,
                     conv_general_dilated=Hook("conv_general_dilated"), rngs=rngs, **kwargs)
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, inputs, out_sharding=None):
    with self._provide("conv_general_dilated", linear.conv_general_dilated,
                       lax.conv_general_dilated, compress=(True, False)):
      return super().__call__(inputs, out_sharding=out_sharding)


class Embed(_Twin, nnx.Embed):
  """`nnx.Embed` whose backward keeps only the integer ids (no key needed)."""

  def __init__(self, num_embeddings: int, features: int, *, name: str | None = None,
               rngs: nnx.Rngs, **kwargs):
    super().__init__(num_embeddings, features, rngs=rngs, **kwargs)
    self._init_jact(None, None, name)

  def __call__(self, inputs, out_sharding=None):
    if out_sharding is not None:
      raise ValueError("jact.nnx.Embed does not support out_sharding.")
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    (table,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
    if self.num_embeddings == 1:
      return jnp.broadcast_to(table, inputs.shape + (self.features,))
    return embedding.embed(inputs, table, name=self.residual_name)


# ----------------------------------------------------------------------------- normalization


def _check_norm_options(module, mask, layer: str, cross_device: bool = False) -> None:
  if mask is not None:
    raise ValueError(f"jact.nnx.{layer} does not support mask=; use nnx.{layer}.")
  if not cross_device and (module.axis_name is not None or module.axis_index_groups is not None):
    raise ValueError(
        f"jact.nnx.{layer} does not support axis_name/axis_index_groups; use nnx.{layer}.")


def _check_last_axis(module, x, layer: str) -> None:
  if not (_hooks.last_axis_only(module.reduction_axes, x.ndim)
          and _hooks.last_axis_only(module.feature_axes, x.ndim)):
    raise ValueError(
        f"jact.nnx.{layer} normalizes over the last axis only (reduction_axes=-1, "
        f"feature_axes=-1).")


class BatchNorm(_Twin, nnx.BatchNorm):
  """`nnx.BatchNorm`; in training mode the normalized input is stored compressed.

  `use_running_average=True` runs Flax's inference path. Running statistics
  update as in Flax; `axis_name` / `axis_index_groups` average the statistics
  (and the backward) over devices as Flax does. Single feature axis; no mask.
  """

  def __init__(self, num_features: int, *, bits: int | None = 4,
               compressor: Compressor | None = None, name: str | None = None, rngs: nnx.Rngs,
               **kwargs):
    self._check_settings(rngs, bits, compressor)
    super().__init__(num_features, rngs=rngs, **kwargs)
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, x, use_running_average: bool | None = None, *, mask=None):
    use_running_average = _first_not_none(
        use_running_average, self.use_running_average,
        error_msg="No `use_running_average` argument was provided to jact.nnx.BatchNorm: "
                  "pass it to the constructor or to __call__, or use nnx.view.")
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
        x, scale, bias, axis=self.axis, epsilon=self.epsilon,
        use_fast_variance=self.use_fast_variance, key=key, name=self.residual_name,
        axis_name=self.axis_name, axis_index_groups=self.axis_index_groups, **self._rounding())
    self.mean[...], self.var[...] = norm.update_running_stats(
        self.mean[...], self.var[...], mean, var, self.momentum)
    return y


class LayerNorm(_Twin, nnx.LayerNorm):
  """`nnx.LayerNorm` (last axis) storing the normalized input compressed."""

  def __init__(self, num_features: int, *, bits: int | None = 4,
               compressor: Compressor | None = None, name: str | None = None, rngs: nnx.Rngs,
               **kwargs):
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
    return norm.layer_norm(x, scale, bias, epsilon=self.epsilon,
                           use_fast_variance=self.use_fast_variance, key=key,
                           name=self.residual_name, **self._rounding())


class RMSNorm(_Twin, nnx.RMSNorm):
  """`nnx.RMSNorm` (last axis) storing the normalized input compressed."""

  def __init__(self, num_features: int, *, bits: int | None = 4,
               compressor: Compressor | None = None, name: str | None = None, rngs: nnx.Rngs,
               **kwargs):
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
    return norm.rms_norm(x, scale, epsilon=self.epsilon, key=key,
                         name=self.residual_name, **self._rounding())


# ----------------------------------------------------------------------------- dropout


class Dropout(_Twin, nnx.Dropout):
  """`nnx.Dropout` whose backward keeps only the key (its 8 bytes of data).

  The mask is Flax's: a key from `rngs` (the 'dropout' stream, an `RngStream`
  or a key), then `jax.random.bernoulli` with the same keep probability,
  broadcast shape and sharding, so the output is bit-identical to
  `nnx.Dropout`'s for the same rngs.
  """

  def __init__(self, rate: float, *, name: str | None = None, **kwargs):
    super().__init__(rate, **kwargs)
    self._init_jact(None, None, name)

  def __call__(self, inputs, *, deterministic: bool | None = None, rngs=None):
    deterministic = _first_not_none(
        deterministic, self.deterministic,
        error_msg="No `deterministic` argument was provided to jact.nnx.Dropout: pass it to "
                  "the constructor or to __call__, or use nnx.view.")
    if self.rate == 0.0 or deterministic:
      return inputs
    if self.rate == 1.0:
      return jnp.zeros_like(inputs)
    rngs = _first_not_none(
        rngs, self.rngs,
        error_msg="jact.nnx.Dropout has deterministic=False but no rngs: build it with "
                  "rngs=nnx.Rngs(dropout=0) or pass rngs= at call time.")
    if isinstance(rngs, nnx.Rngs):
      key = rngs[self.rng_collection]()
    elif isinstance(rngs, nnx.RngStream):
      key = rngs()
    elif isinstance(rngs, jax.Array):
      key = rngs
    else:
      raise TypeError(f"jact.nnx.Dropout: rngs must be an nnx.Rngs, an nnx.RngStream or a PRNG "
                      f"key (jax.Array), got {type(rngs).__name__}.")
    return dropout_op(inputs, self.rate, key=key, broadcast_dims=self.broadcast_dims,
                      name=self.residual_name, draw="flax",
                      out_sharding=jax.typeof(inputs).sharding)


# ----------------------------------------------------------------------------- attention


class MultiHeadAttention(_Twin, nnx.MultiHeadAttention):
  """`nnx.MultiHeadAttention` with compressed projections and attention.

  Residual names: "<name>/query", "/key", "/value", "/out" and
  "<name>/attention". Attention dropout draws Flax's own masks from the
  layer's dropout key (`broadcast_dropout` included). Not supported:
  sow_weights=True.
  """

  def __init__(self, num_heads: int, in_features: int, qkv_features: int | None = None,
               out_features: int | None = None, num_kv_heads: int | None = None,
               in_kv_features: int | None = None, *, bits: int | None = 4,
               compressor: Compressor | None = None, name: str | None = None, rngs: nnx.Rngs, **kwargs):
    _no_hook(kwargs, "attention_fn", "qkv_dot_general", "out_dot_general",
             "qkv_dot_general_cls", "out_dot_general_cls")
    self._check_settings(rngs, bits, compressor)
    super().__init__(num_heads, in_features, qkv_features, out_features, num_kv_heads,
                     in_kv_features, attention_fn=_hooks.attention_slot,
                     qkv_dot_general=Hook("qkv"), out_dot_general=Hook("out"), rngs=rngs,
                     **kwargs)
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, **kwargs):
    compress, key = self._key()
    if not compress:
      with _hooks.provide(qkv=lax.dot_general, out=lax.dot_general,
                          attention=_hooks.plain_nnx_attention):
        return self._keyless(super().__call__)(inputs_q, inputs_k, inputs_v, **kwargs)
    with _hooks.provide(**_hooks.attention_ops(key, self.residual_name, self._rounding())):
      return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)


# ----------------------------------------------------------------------------- activations


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

  def __init__(self, *, bits: int | None = 4, compressor: Compressor | None = None, name: str | None = None,
               rngs: nnx.Rngs | nnx.RngStream | None = None):
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


# ----------------------------------------------------------------------------- pooling


class MaxPool(_Twin, nnx.Module):
  """Max pooling layer (Flax `max_pool` semantics) keeping only the arg-max per window."""

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None = None,
               padding: Any = "VALID", *, name: str | None = None):
    self.window_shape = tuple(window_shape)
    self.strides = None if strides is None else tuple(strides)
    self.padding = padding if isinstance(padding, str) else tuple(map(tuple, padding))
    self._init_jact(None, None, name)

  def __call__(self, x):
    return pooling.max_pool(x, self.window_shape, self.strides, self.padding,
                            name=self.residual_name)


class AvgPool(_Twin, nnx.Module):
  """Average pooling layer (Flax `avg_pool` semantics); keeps nothing for the backward."""

  def __init__(self, window_shape: Sequence[int], strides: Sequence[int] | None = None,
               padding: Any = "VALID", count_include_pad: bool = True, *,
               name: str | None = None):
    self.window_shape = tuple(window_shape)
    self.strides = None if strides is None else tuple(strides)
    self.padding = padding if isinstance(padding, str) else tuple(map(tuple, padding))
    self.count_include_pad = count_include_pad
    self._init_jact(None, None, name)

  def __call__(self, x):
    return pooling.avg_pool(x, self.window_shape, self.strides, self.padding,
                            self.count_include_pad, name=self.residual_name)


from jact.flax.blpa import NnxBLPABlock as BLPABlock  # noqa: E402  (fused BN -> ReLU -> conv, BLPA)
