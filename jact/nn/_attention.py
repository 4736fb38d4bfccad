"""The linen twins of MultiHeadDotProductAttention and SelfAttention."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
from jax import lax

from jact._flax import hooks as _hooks
from jact._flax.conversion import Conversion
from jact._flax.hooks import Hook
from jact.compressors import Compressor
from jact.nn._twin import _custom, _Twin


def _attention_check(module, a) -> str | None:
  """Why `jact.convert` leaves a linen attention layer's call (arguments `a`) plain, or None."""
  if module.attention_fn is not nn.dot_product_attention:
    return "a custom 'attention_fn'"
  reason = _custom(
    module,
    "qkv_dot_general",
    "out_dot_general",
    "qkv_dot_general_cls",
    "out_dot_general_cls",
    "qk_attn_weights_einsum_cls",
    "attn_weights_value_einsum_cls",
  )
  if reason is not None:
    return reason
  if a.get("sow_weights"):
    return "sow_weights=True (jact attention does not return the weights)"
  return None


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
  conversion = Conversion(
    (nn.MultiHeadDotProductAttention, nn.MultiHeadAttention),
    ("attention_fn", "qkv_dot_general", "out_dot_general"),
    _attention_check,
  )

  @nn.compact
  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, **kwargs):
    self._check_hook("qkv_dot_general")
    self._check_hook("out_dot_general")
    if self.attention_fn is not _hooks.attention_slot:
      raise TypeError(
        f"jact.nn.{type(self).__name__} installs its own attention_fn; do not pass one."
      )
    compress, key = self._key()
    if not compress:
      with _hooks.provide(
        qkv=lax.dot_general, out=lax.dot_general, attention=_hooks.plain_attention
      ):
        return self._keyless(super().__call__)(inputs_q, inputs_k, inputs_v, **kwargs)
    with _hooks.provide(**_hooks.attention_ops(key, self._residual_name(), self._rounding())):
      return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)


class SelfAttention(MultiHeadDotProductAttention):
  """`flax.linen.SelfAttention` (same parameters) built on the compressed attention."""

  conversion = dataclasses.replace(
    MultiHeadDotProductAttention.conversion, replaces=(nn.SelfAttention,)
  )

  @nn.compact
  def __call__(
    self,
    inputs_q,
    mask=None,
    deterministic: bool | None = None,
    dropout_rng=None,
    sow_weights: bool = False,
  ):
    return super().__call__(
      inputs_q,
      mask=mask,
      deterministic=deterministic,
      dropout_rng=dropout_rng,
      sow_weights=sow_weights,
    )
