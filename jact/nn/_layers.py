"""The linen twins of Dense, Conv, Embed, Dropout and the pooling layers."""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp
from jax import lax

from jact._flax.conversion import Conversion
from jact._flax.hooks import Hook
from jact.compressors import Compressor
from jact.nn._twin import _custom, _Twin
from jact.ops import _embedding as embedding, _linear as linear, _pooling as pooling
from jact.ops._dropout import dropout as dropout_op


class Dense(_Twin, nn.Dense):
  """`flax.linen.Dense` storing its input compressed (residual "<path>.lhs").

  Attributes (besides Flax's): bits (1 to 8, 16 or None) or compressor (a
  `jact.compressors` object, e.g. `PerGroup(4, group_size=64,
  stochastic=False)`); the other rounding twins take the same two.
  """

  bits: int | None = 4
  compressor: Compressor | None = None
  dot_general: Any = Hook("dot_general")
  conversion = Conversion(
    (nn.Dense,), ("dot_general",), lambda m, a: _custom(m, "dot_general", "dot_general_cls")
  )

  @nn.compact
  def __call__(self, inputs):
    with self._provide("dot_general", linear.dot_general, lax.dot_general, compress=(True, False)):
      return super().__call__(inputs)


class Conv(_Twin, nn.Conv):
  """`flax.linen.Conv` storing its input compressed (residual "<path>.lhs")."""

  bits: int | None = 4
  compressor: Compressor | None = None
  conv_general_dilated: Any = Hook("conv_general_dilated")
  conversion = Conversion(
    (nn.Conv,),
    ("conv_general_dilated",),
    lambda m, a: _custom(m, "conv_general_dilated", "conv_general_dilated_cls"),
  )

  @nn.compact
  def __call__(self, inputs):
    with self._provide(
      "conv_general_dilated",
      linear.conv_general_dilated,
      lax.conv_general_dilated,
      compress=(True, False),
    ):
      return super().__call__(inputs)


class Embed(_Twin, nn.Embed):
  """`flax.linen.Embed` whose backward keeps only the integer ids (no key needed)."""

  conversion = Conversion((nn.Embed,))

  def __call__(self, inputs):
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    (table,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
    if self.num_embeddings == 1:
      return jnp.broadcast_to(table, inputs.shape + (self.features,))
    return embedding.embed(inputs, table, name=self._residual_name())


class Dropout(_Twin, nn.Dropout):
  """`flax.linen.Dropout` whose backward keeps the mask packed to 1 bit a value
  (residual "<path>.mask"; plain Flax keeps a byte a value).

  The mask is Flax's: `make_rng(rng_collection)` (or `rng=`), then
  `jax.random.bernoulli` with the same keep probability and broadcast shape,
  so the output is bit-identical to `flax.linen.Dropout`'s for the same rngs.
  It is drawn once, in the forward (`jact.ops.dropout(saves="mask")`): drawn
  again in the backward, its random bits stayed alive in the compiled step.
  """

  conversion = Conversion((nn.Dropout,))

  @nn.compact
  def __call__(self, inputs, deterministic: bool | None = None, rng=None):
    deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
    if self.rate == 0.0 or deterministic:
      return inputs
    if self.rate == 1.0:
      return jnp.zeros_like(inputs)
    if rng is None:
      rng = self.make_rng(self.rng_collection)
    return dropout_op(
      inputs,
      self.rate,
      key=rng,
      broadcast_dims=self.broadcast_dims,
      name=self._residual_name(),
      draw="flax",
      saves="mask",
    )


class MaxPool(_Twin, nn.Module):
  """`flax.linen.max_pool` as a layer; keeps only the arg-max position per window."""

  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"

  def __call__(self, x):
    return pooling.max_pool(
      x, tuple(self.window_shape), self.strides, self.padding, name=self._residual_name()
    )


class AvgPool(_Twin, nn.Module):
  """`flax.linen.avg_pool` as a layer; keeps nothing for the backward."""

  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"
  count_include_pad: bool = True

  def __call__(self, x):
    return pooling.avg_pool(
      x,
      tuple(self.window_shape),
      self.strides,
      self.padding,
      self.count_include_pad,
      name=self._residual_name(),
    )
