"""Compressed dot-product attention, built from the compressed pieces.

Layout and forward as `flax.linen.dot_product_attention`: query, keys and
value are [batch..., length, num_heads, depth]. The q·k and p·v products are
`jact.ops._linear.einsum` with both operands stored compressed, the softmax is
`jact.ops._activation.softmax` (quantized output) and attention dropout is
`jact.ops._dropout.dropout` (a seed). Each piece gets its own key split from
`key`. Residual names: `name.qk.lhs/rhs`, `name.softmax.y`,
`name.dropout.seed`, `name.pv.lhs/rhs`.

The PRNG keyword is `key`, so the key *tensor* is called `keys`.

>>> import jax, jax.numpy as jnp
>>> q = k = v = jnp.ones((2, 8, 2, 16))
>>> out = dot_product_attention(q, k, v, key=jax.random.key(0))
>>> out.shape, bool(jnp.allclose(out, 1.0))
((2, 8, 2, 16), True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jact.compressors import Compressor
from jact._engine.rounding import check_float, compressor_keywords, resolve_compressor
from jact._engine.names import check_name
from jact.ops._activation import softmax
from jact.ops._dropout import check_rate, dropout
from jact.ops._linear import einsum

__all__ = ["dot_product_attention"]


def dot_product_attention(
  query: jax.Array,
  keys: jax.Array,
  value: jax.Array,
  bias: jax.Array | None = None,
  mask: jax.Array | None = None,
  *,
  dropout_rate: float = 0.0,
  deterministic: bool = True,
  key=None,
  dropout_key=None,
  broadcast_dropout: bool = False,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  precision=None,
  name: str = "attention",
) -> jax.Array:
  """softmax(q·k / sqrt(depth) + bias, masked) · v with compressed residuals.

  Args:
    query: [batch..., q_length, num_heads, depth].
    keys: [batch..., kv_length, num_heads, depth] (the key tensor).
    value: [batch..., kv_length, num_heads, v_depth].
    bias: optional, broadcastable to [batch..., num_heads, q_length, kv_length].
    mask: optional boolean, same broadcasting; False entries are masked out.
    dropout_rate: attention-weight dropout probability in [0, 1) (an
      independent mask per weight; flax broadcasts it over batch and heads by
      default).
    deterministic: if True, no dropout.
    key: PRNG key for the rounding noise and the dropout mask.
    dropout_key: a PRNG key for the dropout mask instead, drawn and applied
      as Flax's attention does (`jax.random.bernoulli`; the weights are then
      bit-identical to `flax.linen.dot_product_attention_weights`'s for the
      same key); the key's data is the dropout's residual.
    broadcast_dropout: with `dropout_key`, one mask shared over the batch
      and head axes (Flax's default).
    bits: width of every residual (1 to 8, 16, or None: exact).
    compressor: a `jact.compressors` object for every residual instead of
      `bits` (e.g. `PerGroup(4, group_size=128, stochastic=False)`).
    precision: einsum precision.
    name: prefix of the residual names.

  Returns:
    [batch..., q_length, num_heads, v_depth], the dtype of the promoted inputs.
  """
  compressor = resolve_compressor(bits, compressor, "jact.ops.dot_product_attention")
  name = check_name(name)
  rate = check_rate(dropout_rate)
  use_dropout = not deterministic and rate > 0.0
  query = check_float(query, "dot_product_attention")
  keys = check_float(keys, "dot_product_attention")
  value = check_float(value, "dot_product_attention")
  dtype = jnp.result_type(query, keys, value)
  query, keys, value = (a.astype(dtype) for a in (query, keys, value))
  if not query.ndim == keys.ndim == value.ndim or query.ndim < 3:
    raise ValueError(
      "query, keys and value must have the same rank >= 3: [batch..., length, num_heads, depth]"
    )
  needs_key = compressor is not None and compressor.needs_key
  if key is None and (needs_key or (use_dropout and dropout_key is None)):
    raise ValueError(
      "jact.ops.dot_product_attention needs a PRNG key (rounding noise"
      f"{' and dropout' if use_dropout else ''}): pass key=jax.random.key(...) (a fresh "
      "key per step), or round to nearest (compressor=jact.compressors.PerGroup(bits, "
      "stochastic=False)) or bits=None, with deterministic=True."
    )
  k_qk, k_sm, k_drop, k_pv = (None,) * 4 if key is None else jax.random.split(key, 4)
  opts = compressor_keywords(compressor)

  depth = query.shape[-1]
  query = query / jnp.sqrt(depth).astype(dtype)
  w = einsum(
    "...qhd,...khd->...hqk", query, keys, key=k_qk, precision=precision, name=f"{name}.qk", **opts
  )
  if bias is not None:
    w = w + jnp.asarray(bias).astype(dtype)
  if mask is not None:
    w = jnp.where(mask, w, jnp.finfo(dtype).min)
  p = softmax(w, key=k_sm, name=f"{name}.softmax", **opts).astype(dtype)
  if use_dropout and dropout_key is not None:
    shared = tuple(range(p.ndim - 2)) if broadcast_dropout else ()
    p = dropout(
      p, rate, key=dropout_key, broadcast_dims=shared, name=f"{name}.dropout", draw="flax_attention"
    )
  elif use_dropout:
    p = dropout(p, rate, key=k_drop, name=f"{name}.dropout")
  return einsum(
    "...hqk,...khd->...qhd", p, value, key=k_pv, precision=precision, name=f"{name}.pv", **opts
  )
