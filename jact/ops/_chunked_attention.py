"""Memory-efficient (flash-style) attention with optionally compressed residuals.

`chunked_attention` computes `flax.linen.dot_product_attention`'s result
without materializing the logits: an online softmax over key chunks forward,
the flash-attention backward from the row log-sum-exp. Saved memory is
O(length). With `bits` set, q, k and v are stored quantized and, by default,
the backward re-runs the forward on their reconstructions, so the gradient is
exact at (q_hat, k_hat, v_hat). Use bits >= 4. Residuals, the bias of
compressing q and k, and measured errors: docs/design.md, "Chunked attention".

>>> import jax, jax.numpy as jnp
>>> x = jnp.sin(jnp.arange(2 * 100 * 4 * 16.0)).reshape(2, 100, 4, 16)
>>> @jax.jit
... def out_and_grads(q, k, v):  # 8-bit q, k, v residuals
...   attend = lambda q, k, v: chunked_attention(q, k, v, causal=True, query_chunk=32,
...                                              key_chunk=32, bits=8, key=jax.random.key(1))
...   out, vjp = jax.vjp(attend, q, k, v)
...   return out, vjp(out)
>>> out, (dq, dk, dv) = out_and_grads(x, x, x)
>>> out.shape, dq.shape
((2, 100, 4, 16), (2, 100, 4, 16))
>>> bool(jnp.allclose(out[:, 0], x[:, 0]))  # causal: query 0 sees only key 0
True
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jact.compressors import Compressor
from jact._engine.op import Keep, Save, Store, compressed_op
from jact.ops._attention_backend import (
  IMPLEMENTATIONS,
  cudnn_attention,
  cudnn_refusal,
  lowering_for_cuda,
  platform_choice,
)
from jact._engine.rounding import check_float, resolve_compressor

__all__ = ["chunked_attention"]

_F32 = jnp.float32
_OP = "chunked_attention"


def _check_chunk(c: Any, what: str) -> int:
  if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
    raise ValueError(
      f"jact.ops.chunked_attention: {what} must be a positive int (rows per block, "
      f"e.g. 128), got {c!r}."
    )
  return int(c)


def _canonical(x, full: tuple[int, ...], what: str) -> jax.Array:
  """x reshaped to rank len(full), every axis 1 or the full size (not broadcast)."""
  x = jnp.asarray(x)
  shape = (1,) * (len(full) - x.ndim) + tuple(x.shape)
  if x.ndim > len(full) or any(s not in (1, f) for s, f in zip(shape, full)):
    raise ValueError(
      f"jact.ops.chunked_attention: {what} of shape {tuple(x.shape)} does not broadcast to "
      f"[batch..., num_heads, q_length, kv_length] = {list(full)}; give it size 1 or the "
      f"full size on every axis."
    )
  return x.reshape(shape)


def _pad_axis(x: jax.Array, axis: int, to: int, value) -> jax.Array:
  extra = to - x.shape[axis]
  if extra <= 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _block(x: jax.Array | None, axis: int, start, size: int):
  """x[..., start:start + size, ...] on `axis`, or x itself where that axis is broadcast (1)."""
  if x is None or x.shape[axis] == 1:
    return x
  return lax.dynamic_slice_in_dim(x, start, size, axis)


def chunked_attention(
  query: jax.Array,
  keys: jax.Array,
  value: jax.Array,
  bias: jax.Array | None = None,
  mask: jax.Array | None = None,
  *,
  causal: bool = False,
  query_chunk: int = 128,
  key_chunk: int = 128,
  bits: int | None = None,
  compressor: Compressor | None = None,
  key=None,
  recompute: bool | None = None,
  precision=None,
  implementation: str | None = None,
  name: str = "chunked_attention",
) -> jax.Array:
  """Attention in O(length) memory (forward and saved residuals), flash-attention style.

  Args:
    query: [batch..., q_length, num_heads, depth].
    keys: [batch..., kv_length, num_heads, depth] (the key tensor; the PRNG
      keyword is `key`).
    value: [batch..., kv_length, num_heads, v_depth].
    bias: optional additive bias, broadcastable to [batch..., num_heads,
      q_length, kv_length] (each axis 1 or full size). It is sliced per block,
      never broadcast; it receives a gradient (of the bias's own shape).
    mask: optional boolean, same broadcasting; False entries are masked out
      (as in flax, a masked logit becomes the most negative float, so a fully
      masked row averages all values).
    causal: mask key position j for query position i when j > i (flax's
      `make_causal_mask` convention: positions aligned at the start). Blocks
      that are entirely in the future are skipped when no `mask` is given.
    query_chunk, key_chunk: block sizes (positive ints; clipped to the
      lengths). Lengths that are not a multiple are padded inside; padded
      keys are excluded exactly. Peak temporary memory is
      O(batch * heads * query_chunk * key_chunk) per block.
    bits: None (default: residuals uncompressed, still O(length)) or a width 1
      to 8 or 16: q, k and v (and the output unless recomputed) are stored quantized
      (see the module note on the bias this puts in the gradient; prefer >= 4).
    compressor: a `jact.compressors` object storing q, k and v (and the
      output) instead of `bits` (leave `bits` at None), e.g.
      `PerGroup(8, group_size=128, stochastic=False)`.
    key: PRNG key for the rounding noise (required when the residuals are
      rounded stochastically: `bits` set, or a stochastic compressor).
    recompute: if True, keep only q, k, v and re-run the forward in the
      backward pass to get the output and log-sum-exp (one extra forward's
      compute, less memory); if False, also keep the output and the float32
      log-sum-exp. None (default): True exactly when bits is set (see the
      module note: without it compressed gradients are far noisier).
    precision: precision of the block einsums.
    implementation: None (default): cuDNN's fused attention where the program is lowered
      for cuda (an NVIDIA GPU, `jact.compile_for`) and the call is one it takes (bfloat16
      or float16, head dim a multiple of 8 up to 128, no bias or mask beyond `causal`,
      `recompute` not False), the chunked XLA loops elsewhere; "xla": the chunked loops
      always; "cudnn": the fused kernel, or a ValueError saying why it cannot run. On the
      fused path q, k and v are the residuals (compressed when `bits` is set) and the
      backward re-runs the fused forward on their reconstructions before cuDNN's backward;
      with bits=None the fused kernel keeps what JAX's own attention keeps.
    name: prefix of the residual names (`name.q`, `.k`, `.v`, and `.out`,
      `.lse` unless recomputed).

  Returns:
    [batch..., q_length, num_heads, v_depth] in the promoted input dtype.
    Logits, softmax statistics and accumulators are float32 for every input dtype.
  """
  compressor = resolve_compressor(bits, compressor, "jact.ops.chunked_attention", default_bits=None)
  query_chunk = _check_chunk(query_chunk, "query_chunk")
  key_chunk = _check_chunk(key_chunk, "key_chunk")
  query, keys, value = (check_float(a, _OP) for a in (query, keys, value))
  dtype = jnp.result_type(query, keys, value)
  query, keys, value = (a.astype(dtype) for a in (query, keys, value))
  if not query.ndim == keys.ndim == value.ndim or query.ndim < 3:
    raise ValueError(
      "jact.ops.chunked_attention: query, keys and value must have the same rank >= 3 "
      f"([batch..., length, num_heads, depth]), got shapes {query.shape}, {keys.shape}, "
      f"{value.shape}."
    )
  *batch, lq, heads, depth = query.shape
  lk = keys.shape[-3]
  if (
    tuple(keys.shape[:-3]) != tuple(batch)
    or tuple(value.shape[:-3]) != tuple(batch)
    or keys.shape[-2] != heads
    or value.shape[-2] != heads
    or keys.shape[-1] != depth
    or value.shape[-3] != lk
  ):
    raise ValueError(
      "jact.ops.chunked_attention: mismatched shapes: query [batch..., q_length, heads, "
      "depth], keys [batch..., kv_length, heads, depth] and value [batch..., kv_length, "
      f"heads, v_depth] must agree on batch, heads, depth and kv_length; got {query.shape}, "
      f"{keys.shape}, {value.shape}."
    )
  if lq == 0 or lk == 0:
    raise ValueError(f"jact.ops.chunked_attention: empty sequence (q_length={lq}, kv_length={lk}).")
  full = (*batch, heads, lq, lk)
  if bias is not None:
    bias_in = check_float(bias, _OP)
    bias = _canonical(bias_in, full, "bias")
  if mask is not None:
    mask_in = jnp.asarray(mask)
    if mask_in.dtype != jnp.bool_:
      raise TypeError(
        f"jact.ops.chunked_attention: mask must be boolean (True = attend), got "
        f"{mask_in.dtype}; pass mask.astype(bool) or use an additive bias."
      )
    mask = _canonical(mask_in, full, "mask")

  recompute_asked = recompute

  def _fused_refusal(query, keys, value, bias, mask):
    if recompute_asked is False:
      return "recompute=False (cuDNN's softmax statistics are not exposed to store)"
    if not lowering_for_cuda():
      return (
        "the program is not lowered for cuda (run it on an NVIDIA GPU, or compile it with "
        "jact.compile_for / inside jact.kernels.lowering_for('cuda'))"
      )
    return cudnn_refusal(query, keys, value, bias=bias, mask=mask, causal=causal)

  if recompute is None:
    recompute = compressor is not None
  elif not isinstance(recompute, (bool, np.bool_)):
    raise TypeError(
      f"jact.ops.chunked_attention: recompute must be True, False or None, got {recompute!r}."
    )

  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"jact.ops.chunked_attention: implementation must be None, 'cudnn' or 'xla', got "
      f"{implementation!r}."
    )
  refusal = None if implementation == "xla" else _fused_refusal(query, keys, value, bias, mask)
  fused = implementation != "xla" and refusal is None
  if implementation == "cudnn" and not fused:
    raise ValueError(
      f"jact.ops.chunked_attention: implementation='cudnn' cannot run this call: {refusal}. "
      "Pass implementation=None to fall back to the chunked path where cuDNN does not apply."
    )

  nb = len(batch)
  cq, ck = min(query_chunk, lq), min(key_chunk, lk)
  nq, nk = -(-lq // cq), -(-lk // ck)
  lq_p, lk_p = nq * cq, nk * ck
  scale = 1.0 / math.sqrt(depth)
  big_neg = float(jnp.finfo(_F32).min)
  skip_future = causal and mask is None
  ein = lambda spec, a, b: jnp.einsum(spec, a, b, precision=precision, preferred_element_type=_F32)

  def pad_mask_bias(bias, mask):
    if bias is not None and bias.shape[-2] == lq:
      bias = _pad_axis(bias, -2, lq_p, 0)
    if bias is not None and bias.shape[-1] == lk:
      bias = _pad_axis(bias, -1, lk_p, 0)
    if mask is not None and mask.shape[-2] == lq:
      mask = _pad_axis(mask, -2, lq_p, False)
    if mask is not None and mask.shape[-1] == lk:
      mask = _pad_axis(mask, -1, lk_p, False)
    return bias, mask

  def logits(qi, kj, bias_i, mask_i, i, j):
    """float32 [batch..., heads, cq, ck] logits of block (i, j), masked, and
    the user mask (and causal) of the block, or None without a user mask."""
    s = ein("...qhd,...khd->...hqk", qi, kj) * scale
    if bias_i is not None:
      s = s + _block(bias_i, -1, j * ck, ck).astype(_F32)
    kpos = j * ck + jnp.arange(ck)
    visible = None if mask_i is None else _block(mask_i, -1, j * ck, ck)
    if causal:
      qpos = i * cq + jnp.arange(cq)
      past = qpos[:, None] >= kpos[None, :]
      visible = past if visible is None else visible & past
    if visible is not None:
      s = jnp.where(visible, s, big_neg)
    if lk_p != lk:
      s = jnp.where(kpos < lk, s, -jnp.inf)  # padded keys: excluded exactly
    return s, (None if mask_i is None else visible)

  def needed(i, j):
    """False for a block entirely in the causal future (skipped when no mask)."""
    return j * ck <= i * cq + cq - 1

  def maybe(i, j, fn, carry, *args):
    if not skip_future:
      return fn(carry, *args)
    return lax.cond(needed(i, j), fn, lambda c, *_: c, carry, *args)

  def forward(q, k, v, bias, mask):
    qp = _pad_axis(q, nb, lq_p, 0)
    kp, vp = _pad_axis(k, nb, lk_p, 0), _pad_axis(v, nb, lk_p, 0)
    bias_p, mask_p = pad_mask_bias(bias, mask)

    def q_step(_, i):
      qi = lax.dynamic_slice_in_dim(qp, i * cq, cq, nb)
      bias_i, mask_i = _block(bias_p, -2, i * cq, cq), _block(mask_p, -2, i * cq, cq)

      def k_block(carry, j):
        m, l, acc = carry
        kj = lax.dynamic_slice_in_dim(kp, j * ck, ck, nb)
        vj = lax.dynamic_slice_in_dim(vp, j * ck, ck, nb)
        s, _ = logits(qi, kj, bias_i, mask_i, i, j)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + ein("...hqk,...khd->...hqd", p.astype(dtype), vj)
        return m_new, l, acc

      init = (
        jnp.full((*batch, heads, cq), -jnp.inf, _F32),
        jnp.zeros((*batch, heads, cq), _F32),
        jnp.zeros((*batch, heads, cq, value.shape[-1]), _F32),
      )
      (m, l, acc), _ = lax.scan(
        lambda c, j: (maybe(i, j, k_block, c, j), None), init, jnp.arange(nk)
      )
      out_i = jnp.moveaxis(acc / l[..., None], -3, -2).astype(dtype)  # [batch..., cq, heads, dv]
      return None, (out_i, m + jnp.log(l))

    _, (outs, lses) = lax.scan(q_step, None, jnp.arange(nq))
    out = jnp.moveaxis(outs, 0, nb).reshape(*batch, lq_p, heads, value.shape[-1])[..., :lq, :, :]
    lse = jnp.moveaxis(lses, 0, -2).reshape(*batch, heads, lq_p)[..., :lq]
    return out, lse

  def backward(q, k, v, out, lse, bias, mask, g):
    dv_depth = v.shape[-1]
    # D = rowsum(dO * O), [batch..., heads, lq]; the output dies here.
    d_row = jnp.moveaxis(jnp.sum(g.astype(_F32) * out.astype(_F32), -1), -1, -2)
    qp, gp = _pad_axis(q, nb, lq_p, 0), _pad_axis(g, nb, lq_p, 0)
    kp, vp = _pad_axis(k, nb, lk_p, 0), _pad_axis(v, nb, lk_p, 0)
    lse_p = _pad_axis(lse, -1, lq_p, jnp.inf)  # padded rows: P = 0
    d_p = _pad_axis(d_row, -1, lq_p, 0)
    bias_p, mask_p = pad_mask_bias(bias, mask)
    bias_grad = bias_p is not None
    # Bias axes (batch and heads) that are broadcast: the gradient sums over them.
    db_axes = (
      ()
      if not bias_grad
      else tuple(a for a, n in enumerate((*batch, heads)) if bias_p.shape[a] == 1 and n != 1)
    )

    def q_step(carry, i):
      qi = lax.dynamic_slice_in_dim(qp, i * cq, cq, nb)
      gi = lax.dynamic_slice_in_dim(gp, i * cq, cq, nb)
      lse_i = lax.dynamic_slice_in_dim(lse_p, i * cq, cq, -1)
      d_i = lax.dynamic_slice_in_dim(d_p, i * cq, cq, -1)
      bias_i, mask_i = _block(bias_p, -2, i * cq, cq), _block(mask_p, -2, i * cq, cq)

      def k_block(c, j):
        dq_i, dk, dv, db = c
        kj = lax.dynamic_slice_in_dim(kp, j * ck, ck, nb)
        vj = lax.dynamic_slice_in_dim(vp, j * ck, ck, nb)
        s, visible = logits(qi, kj, bias_i, mask_i, i, j)
        kpos = j * ck + jnp.arange(ck)
        p = jnp.exp(s - lse_i[..., None])
        if mask_i is not None:
          # A row the mask hides entirely has uniform weights over the keys (as
          # in flax); its lse, big_neg + log(kv_length), rounds to big_neg.
          hidden = (lse_i == big_neg)[..., None]
          p = jnp.where(hidden, jnp.where(kpos < lk, 1.0 / lk, 0.0), p)
        dv_j = ein("...hqk,...qhd->...khd", p.astype(dtype), gi)
        dp = ein("...qhd,...khd->...hqk", gi, vj)
        ds = p * (dp - d_i[..., None])
        if visible is not None:
          # Masked logits are constants: no gradient flows into q, k or bias
          # (matters for the uniform weights of a fully hidden row).
          ds = jnp.where(visible, ds, 0.0)
        dq_i = dq_i + ein("...hqk,...khd->...qhd", ds.astype(dtype), kj) * scale
        dk_j = ein("...hqk,...qhd->...khd", ds.astype(dtype), qi) * scale
        dk = lax.dynamic_update_slice_in_dim(
          dk, lax.dynamic_slice_in_dim(dk, j * ck, ck, nb) + dk_j, j * ck, nb
        )
        dv = lax.dynamic_update_slice_in_dim(
          dv, lax.dynamic_slice_in_dim(dv, j * ck, ck, nb) + dv_j, j * ck, nb
        )
        if bias_grad:
          red = ds
          if bias_p.shape[-2] == 1:
            red = red.sum(-2, keepdims=True)
          if bias_p.shape[-1] == 1:
            red = red.sum(-1, keepdims=True)
          red = red.sum(db_axes, keepdims=True) if db_axes else red
          start = [0] * db.ndim
          if db.shape[-2] != 1:
            start[-2] = i * cq
          if db.shape[-1] != 1:
            start[-1] = j * ck
          db = lax.dynamic_update_slice(db, lax.dynamic_slice(db, start, red.shape) + red, start)
        return dq_i, dk, dv, db

      dq0 = jnp.zeros((*batch, cq, heads, depth), _F32)
      (dq_i, dk, dv, db), _ = lax.scan(
        lambda c, j: (maybe(i, j, k_block, c, j), None), (dq0, *carry), jnp.arange(nk)
      )
      return (dk, dv, db), dq_i

    acc0 = (
      jnp.zeros((*batch, lk_p, heads, depth), _F32),
      jnp.zeros((*batch, lk_p, heads, dv_depth), _F32),
      None if not bias_grad else jnp.zeros(bias_p.shape, _F32),
    )
    (dk, dv, db), dqs = lax.scan(q_step, acc0, jnp.arange(nq))
    dq = jnp.moveaxis(dqs, 0, nb).reshape(*batch, lq_p, heads, depth)[..., :lq, :, :]
    dk, dv = dk[..., :lk, :, :], dv[..., :lk, :, :]
    if bias_grad:
      db = db[..., : bias.shape[-2], : bias.shape[-1]]
    return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype), db

  def storing(q, k, v, bias, mask):
    out, lse = forward(q, k, v, bias, mask)
    residuals = {"q": Store(q), "k": Store(k), "v": Store(v)}
    if not recompute:
      residuals.update(out=Store(out), lse=Save(lse))
    return out, {**residuals, "bias": Keep(bias), "mask": Keep(mask)}

  def stored_backward(res, g):
    q, k, v, bias, mask = (res[r] for r in ("q", "k", "v", "bias", "mask"))
    out, lse = forward(q, k, v, bias, mask) if recompute else (res["out"], res["lse"])
    dq, dk, dv, db = backward(q, k, v, out, lse, bias, mask, g)
    if bias is not None:
      db = db.astype(bias.dtype)
    return dq, dk, dv, db, None

  chunked = lambda q, k, v: forward(q, k, v, None, None)[0]
  on_cudnn = functools.partial(cudnn_attention, causal=causal)
  if fused and compressor is None:  # JAX's own fused attention, its own residuals
    uncompressed = compressed_op(
      storing,
      stored_backward,
      op=_OP,
      name=name,
      compressor=None,
      key=key,
      primal=lambda q, k, v, bias, mask: chunked(q, k, v),
    )
    return platform_choice(
      (query, keys, value),
      cuda=on_cudnn,
      default=lambda q, k, v: uncompressed(q, k, v, None, None),
    )
  if fused:
    return compressed_op(
      lambda q, k, v, bias, mask: (
        platform_choice((q, k, v), cuda=on_cudnn, default=chunked),
        {"q": Store(q), "k": Store(k), "v": Store(v)},
      ),
      functools.partial(_fused_backward, on_cudnn, forward, backward),
      op=_OP,
      name=name,
      compressor=compressor,
      key=key,
      primal=lambda q, k, v, bias, mask: platform_choice((q, k, v), cuda=on_cudnn, default=chunked),
    )(query, keys, value, None, None)

  # bias and mask enter in the canonical rank (a differentiable reshape of the
  # caller's bias, so its gradient comes back in the caller's shape).
  return compressed_op(
    storing,
    stored_backward,
    op=_OP,
    name=name,
    compressor=compressor,
    key=key,
    primal=lambda *args: forward(*args)[0],
  )(query, keys, value, bias, mask)


def _fused_backward(on_cudnn, forward, backward, res, g):
  """The fused path's backward from reconstructed q, k, v: cuDNN's forward re-run and its
  backward where lowered for cuda, the chunked recompute elsewhere."""

  def cuda(q, k, v, g):
    _, vjp = jax.vjp(on_cudnn, q, k, v)
    return vjp(g)

  def default(q, k, v, g):
    out, lse = forward(q, k, v, None, None)
    return backward(q, k, v, out, lse, None, None, g)[:3]

  dq, dk, dv = platform_choice((res["q"], res["k"], res["v"], g), cuda=cuda, default=default)
  return dq, dk, dv, None, None
