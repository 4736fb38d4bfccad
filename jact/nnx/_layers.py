"""The nnx twins of Linear, Conv, Embed, Dropout and the pooling layers."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jact._flax.conversion import Conversion
from jact._flax.hooks import Hook
from jact.compressors import Compressor
from jact.nnx._twin import _first_not_none, _install, _no_hook, _Twin
from jact.ops import _embedding as embedding, _linear as linear, _pooling as pooling
from jact.ops._dropout import dropout as dropout_op


def _own_hook(module, field: str, plain) -> str | None:
  """A `Conversion.check` reason: a layer given its own `field` (the twin installs its own)."""
  return (
    None if getattr(module, field) is plain else f"a custom {field!r} (the twin installs its own)"
  )


class Linear(_Twin, nnx.Linear):
  """`nnx.Linear` storing its input compressed (residual "<name>.lhs").

  Extra keywords: bits (1 to 8, 16 or None) or compressor (a
  `jact.compressors` object, e.g. `PerGroup(4, group_size=64,
  stochastic=False)`), and name; the other rounding twins take the same.
  """

  conversion = Conversion(
    (nnx.Linear,),
    check=lambda m: _own_hook(m, "dot_general", lax.dot_general),
    patch=_install("dot_general", Hook("dot_general")),
  )

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    bits: int | None = 4,
    compressor: Compressor | None = None,
    name: str | None = None,
    rngs: nnx.Rngs,
    **kwargs,
  ):
    _no_hook(kwargs, "dot_general")
    self._check_settings(rngs, bits, compressor)
    super().__init__(
      in_features, out_features, dot_general=Hook("dot_general"), rngs=rngs, **kwargs
    )
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, inputs, out_sharding=None):
    with self._provide("dot_general", linear.dot_general, lax.dot_general, compress=(True, False)):
      return super().__call__(inputs, out_sharding=out_sharding)


class Conv(_Twin, nnx.Conv):
  """`nnx.Conv` storing its input compressed (residual "<name>.lhs")."""

  conversion = Conversion(
    (nnx.Conv,),
    check=lambda m: _own_hook(m, "conv_general_dilated", lax.conv_general_dilated),
    patch=_install("conv_general_dilated", Hook("conv_general_dilated")),
  )

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: int | Sequence[int],
    strides: int | Sequence[int] | None = 1,
    *,
    bits: int | None = 4,
    compressor: Compressor | None = None,
    name: str | None = None,
    rngs: nnx.Rngs,
    **kwargs,
  ):
    _no_hook(kwargs, "conv_general_dilated")
    self._check_settings(rngs, bits, compressor)
    super().__init__(
      in_features,
      out_features,
      kernel_size,
      strides,
      conv_general_dilated=Hook("conv_general_dilated"),
      rngs=rngs,
      **kwargs,
    )
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, inputs, out_sharding=None):
    with self._provide(
      "conv_general_dilated",
      linear.conv_general_dilated,
      lax.conv_general_dilated,
      compress=(True, False),
    ):
      return super().__call__(inputs, out_sharding=out_sharding)


class Embed(_Twin, nnx.Embed):
  """`nnx.Embed` whose backward keeps only the integer ids (no key needed)."""

  conversion = Conversion((nnx.Embed,))

  def __init__(
    self, num_embeddings: int, features: int, *, name: str | None = None, rngs: nnx.Rngs, **kwargs
  ):
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


class Dropout(_Twin, nnx.Dropout):
  """`nnx.Dropout` whose backward keeps the mask packed to 1 bit a value
  (residual "<name>.mask"; plain Flax keeps a byte a value).

  The mask is Flax's: a key from `rngs` (the 'dropout' stream, an `RngStream`
  or a key), then `jax.random.bernoulli` with the same keep probability,
  broadcast shape and sharding, so the output is bit-identical to
  `nnx.Dropout`'s for the same rngs. It is drawn once, in the forward
  (`jact.ops.dropout(saves="mask")`): drawn again in the backward, its random
  bits stayed alive in the compiled step.
  """

  conversion = Conversion((nnx.Dropout,))

  def __init__(self, rate: float, *, name: str | None = None, **kwargs):
    super().__init__(rate, **kwargs)
    self._init_jact(None, None, name)

  def __call__(self, inputs, *, deterministic: bool | None = None, rngs=None):
    deterministic = _first_not_none(
      deterministic,
      self.deterministic,
      error_msg="No `deterministic` argument was provided to jact.nnx.Dropout: pass it to "
      "the constructor or to __call__, or use nnx.view.",
    )
    if self.rate == 0.0 or deterministic:
      return inputs
    if self.rate == 1.0:
      return jnp.zeros_like(inputs)
    rngs = _first_not_none(
      rngs,
      self.rngs,
      error_msg="jact.nnx.Dropout has deterministic=False but no rngs: build it with "
      "rngs=nnx.Rngs(dropout=0) or pass rngs= at call time.",
    )
    if isinstance(rngs, nnx.Rngs):
      key = rngs[self.rng_collection]()
    elif isinstance(rngs, nnx.RngStream):
      key = rngs()
    elif isinstance(rngs, jax.Array):
      key = rngs
    else:
      raise TypeError(
        f"jact.nnx.Dropout: rngs must be an nnx.Rngs, an nnx.RngStream or a PRNG "
        f"key (jax.Array), got {type(rngs).__name__}."
      )
    return dropout_op(
      inputs,
      self.rate,
      key=key,
      broadcast_dims=self.broadcast_dims,
      name=self.residual_name,
      draw="flax",
      saves="mask",
      out_sharding=jax.typeof(inputs).sharding,
    )


class MaxPool(_Twin, nnx.Module):
  """Max pooling layer (Flax `max_pool` semantics) keeping only the arg-max per window."""

  def __init__(
    self,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: Any = "VALID",
    *,
    name: str | None = None,
  ):
    self.window_shape = tuple(window_shape)
    self.strides = None if strides is None else tuple(strides)
    self.padding = padding if isinstance(padding, str) else tuple(map(tuple, padding))
    self._init_jact(None, None, name)

  def __call__(self, x):
    return pooling.max_pool(
      x, self.window_shape, self.strides, self.padding, name=self.residual_name
    )


class AvgPool(_Twin, nnx.Module):
  """Average pooling layer (Flax `avg_pool` semantics); keeps nothing for the backward."""

  def __init__(
    self,
    window_shape: Sequence[int],
    strides: Sequence[int] | None = None,
    padding: Any = "VALID",
    count_include_pad: bool = True,
    *,
    name: str | None = None,
  ):
    self.window_shape = tuple(window_shape)
    self.strides = None if strides is None else tuple(strides)
    self.padding = padding if isinstance(padding, str) else tuple(map(tuple, padding))
    self.count_include_pad = count_include_pad
    self._init_jact(None, None, name)

  def __call__(self, x):
    return pooling.avg_pool(
      x,
      self.window_shape,
      self.strides,
      self.padding,
      self.count_include_pad,
      name=self.residual_name,
    )
