"""Chunked (flash-style) attention against flax.linen.dot_product_attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact.compressors import PerGroup
from jact.ops._chunked_attention import chunked_attention as attn
from jact.kernels._quantize.api import dequantize, quantize
from stats import DRAWS, assert_unbiased, over_keys, residual_bytes, saved_under_names

K = DRAWS  # draws per statistical test: enough to see a bias of 1% of a rounding step (stats.py)
_RNG = np.random.default_rng(0)  # test data from NumPy: nothing to compile


def normal(*shape):
  return jnp.asarray(_RNG.standard_normal(shape), jnp.float32)


# Lengths that are not multiples of the chunks (13 = 3*4 + 1, 11 = 3*3 + 2),
# two batch dims, value depth != key depth.
BATCH, LQ, LK, H, D, DV = (2, 3), 13, 11, 2, 8, 5
Q, KT, V = normal(*BATCH, LQ, H, D), normal(*BATCH, LK, H, D), normal(*BATCH, LK, H, DV)
COT = normal(*BATCH, LQ, H, DV)
BIAS = normal(3, 1, LQ, LK)  # broadcast over batch[0] and heads
# Random mask broadcast over batch, keys 0..2 always visible, and query row 5
# of head 1 fully masked (flax then averages all values; so must we).
_mask = (_RNG.random((1, 1, H, LQ, LK)) < 0.6) | (np.arange(LK) < 3)
_mask[..., 1, 5, :] = False
MASK = jnp.asarray(_mask)
CAUSAL = jnp.asarray(np.tril(np.ones((LQ, LK), bool)))
CHUNKS = dict(query_chunk=4, key_chunk=3)


def reference(q, k, v, bias=None, mask=None, causal=False):
  if causal:
    mask = CAUSAL if mask is None else mask & CAUSAL
  return nn.dot_product_attention(q, k, v, bias=bias, mask=mask)


def value_and_grads(fn, q, k, v, bias):
  """(fn(q, k, v, bias), gradients of <fn(...), COT> in q, k, v and bias)."""
  y, vjp = jax.vjp(fn, q, k, v, bias)
  return y, vjp(COT.astype(y.dtype))


@jax.jit
def flax_value_and_grads(q, k, v, bias, mask):
  """Reference (float32); one compilation shared by the tests below."""
  return value_and_grads(
    lambda q, k, v, b: nn.dot_product_attention(q, k, v, b, mask), q, k, v, bias
  )


FULL = (1, 1, H, LQ, LK)  # every reference mask has this shape (one compilation)

# Both configs have lengths that are not multiples of the chunks, two batch
# dims and a bias broadcast over batch[0] and heads (its gradient is checked).
# "causal_bias" skips the blocks in the future; "all" adds the mask (with a
# fully hidden row), so it cannot skip, and stores only q, k, v
# (recompute=True re-runs the forward in the backward pass: same numbers).
CONFIGS = {
  "causal_bias": (dict(causal=True), jnp.broadcast_to(CAUSAL, FULL)),
  "all": (dict(mask=MASK, causal=True, recompute=True), MASK & CAUSAL),
}


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_uncompressed_forward_and_gradients_match_flax(config):
  kw, full_mask = CONFIGS[config]
  run = jax.jit(lambda *a: value_and_grads(lambda q, k, v, b: attn(q, k, v, b, **kw, **CHUNKS), *a))
  y, got = run(Q, KT, V, BIAS)
  want_y, want = flax_value_and_grads(Q, KT, V, BIAS, full_mask)
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=2e-6)
  for a, b in zip(got, want):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_no_batch_axis_and_extreme_chunks():
  # Forward only: [length, heads, depth] inputs, one query row per block and a
  # key block larger than the keys (clipped to one block), mask and causal.
  q, k, v, mask = Q[0, 0], KT[0, 0], V[0, 0], MASK[0, 0]
  got = jax.jit(lambda q, k, v: attn(q, k, v, mask=mask, causal=True, query_chunk=1, key_chunk=64))(
    q, k, v
  )
  np.testing.assert_allclose(got, reference(q, k, v, mask=mask, causal=True), rtol=1e-5, atol=2e-6)


@pytest.mark.slow
def test_bf16_in_bf16_out_with_float32_accumulation():
  # Compared with float32 attention of the same (bf16-rounded) inputs: the
  # bf16 roundings are the output, the weights fed to the p·v product and
  # the gradients, each ~2**-9 relative: 2% relative L2 bounds.
  q, k, v = (a.astype(jnp.bfloat16) for a in (Q, KT, V))
  run = jax.jit(
    lambda *a: value_and_grads(lambda q, k, v, b: attn(q, k, v, b, MASK, causal=True, **CHUNKS), *a)
  )
  y, got = run(q, k, v, BIAS)
  want_y, want = flax_value_and_grads(
    *(a.astype(jnp.float32) for a in (q, k, v)), BIAS, MASK & CAUSAL
  )
  assert y.dtype == jnp.bfloat16
  assert [g.dtype for g in got[:3]] == [jnp.bfloat16] * 3
  for a, b in zip((y, *got), (want_y, *want)):
    a = np.asarray(a.astype(jnp.float32))
    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


# ----------------------------------------------------------------------------- compressed gradients

SHAPE = (2, 12, 2, 16)  # batch, length, heads, depth
SQ, SK, SV, SCOT = (normal(*SHAPE) for _ in range(4))
SCHUNKS = dict(query_chunk=5, key_chunk=5, causal=True)


@jax.jit
def exact(q, k, v):
  """Plain attention's (output, gradients), compiled once for all tests."""
  causal = jnp.tril(jnp.ones((SHAPE[1], SHAPE[1]), bool))
  y, vjp = jax.vjp(lambda q, k, v: nn.dot_product_attention(q, k, v, mask=causal), q, k, v)
  return y, vjp(SCOT)


@jax.jit
def uncompressed(q, k, v):
  return attn(q, k, v, **SCHUNKS)


def sampled(keys, q, k, v, **kw):
  """(outputs, gradients) of the compressed op, one draw per key."""

  def one(key):
    y, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, key=key, **SCHUNKS, **kw), q, k, v)
    return y, vjp(SCOT)

  return over_keys(one, keys)


def assert_forward_exact(ys, q, k, v):
  """Compression only changes what the backward keeps: every draw's output is
  bit-identical to the uncompressed op's."""
  np.testing.assert_array_equal(ys, np.broadcast_to(uncompressed(q, k, v), ys.shape))


def rel(a, b):
  return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))


@pytest.mark.slow
def test_gradients_at_8_bits_are_close_and_unbiased():
  # One draw: q, k, v carry ~0.1% rounding noise each (step/sqrt(12) of a
  # range-~6 group at 8 bits), amplified through the softmax: relative L2
  # error below 3% (measured ~1.5%).
  # Over K draws: the second-order bias from quantizing q and k (softmax is
  # nonlinear in them) scales with the squared step, ~(15/255)^2 ~ 0.35% of
  # the 4-bit bias (see the 4-bit test), far below the standard error of K
  # draws: default assert_unbiased tolerances.
  ys, got = sampled(jax.random.split(jax.random.key(1), K), SQ, SK, SV, bits=8)
  assert_forward_exact(ys, SQ, SK, SV)
  want = exact(SQ, SK, SV)[1]
  for a, b in zip(got, want):
    assert rel(a[0], b) <= 0.03
    assert_unbiased(a, b)


def _on_2_bit_grid():
  """Values in {-1.5, -0.5, 0.5, 1.5}: every quantization group holds both
  extremes, so 2-bit quantization (min -1.5, step 1) reproduces them exactly."""
  return jnp.asarray(_RNG.choice(np.array([-1.5, -0.5, 0.5, 1.5], np.float32), SHAPE))


@pytest.mark.slow
def test_gradients_at_2_bits_are_unbiased_when_q_and_k_are_exact():
  # recompute=False (stored float32 lse, 2-bit output). With q and k
  # reproduced exactly the recomputed weights P = exp(s - lse) are exact, and
  # every gradient is linear in the noisy v_hat and out_hat (dv = P^T g does
  # not depend on them at all; dq and dk through dP = g v_hat^T and
  # D = rowsum(g * out_hat)): unbiased at any bit width. Default
  # assert_unbiased tolerances; dv is deterministic and must equal the exact
  # one (atol 1e-5).
  q, k = _on_2_bit_grid(), _on_2_bit_grid()
  roundtrip = jax.jit(lambda x: dequantize(quantize(x, jax.random.key(0), bits=2)))
  for x in (q, k):
    np.testing.assert_array_equal(roundtrip(x), x)
  ys, got = sampled(jax.random.split(jax.random.key(2), K), q, k, SV, bits=2, recompute=False)
  assert_forward_exact(ys, q, k, SV)
  want = exact(q, k, SV)[1]
  for a, b in zip(got, want):
    assert_unbiased(a, b)
  assert rel(got[0][0], want[0]) > 0.1  # the noise is real: one draw is far off


@pytest.mark.slow
def test_qk_bias_at_4_bits_is_bounded():
  # q_hat and k_hat enter through the softmax, so E[grad] != grad at second
  # order in the rounding step: not unbiased, but bounded. At 4 bits (step
  # ~range/15) the mean over 384 draws is within 5% (relative L2) of the
  # exact gradient (measured ~2%, ~2 standard errors), while one draw is
  # ~24% off; the bias shrinks with the squared step (see the 8-bit test).
  got = sampled(jax.random.split(jax.random.key(3), 384), SQ, SK, SV, bits=4)[1]
  for a, b in zip(got, exact(SQ, SK, SV)[1]):
    assert rel(a.mean(0), b) <= 0.05
    assert rel(a[0], b) >= 0.05  # the per-draw noise is much larger than the bias


# ----------------------------------------------------------------------------- memory


def test_residuals_are_linear_in_length_and_named():
  heads, depth = 2, 32
  sizes = {}
  for length in (1024, 2048):
    x = jnp.ones((1, length, heads, depth))
    for bits in (None, 4):
      f = lambda q, k, v: attn(q, k, v, causal=True, bits=bits, key=jax.random.key(0))
      sizes[bits, length] = residual_bytes(f, x, x, x)
  quadratic = 2048 * 2048 * heads * 4  # one float32 [heads, L, L] tensor
  qkv = 3 * 2048 * heads * depth * 4
  # Measured: 1,056,768 -> 2,113,536 B (q, k, v, out, lse in float32) and
  # 101,376 -> 202,752 B at 4 bits (q, k, v only), vs 33,554,432 B quadratic.
  for bits in (None, 4):
    assert sizes[bits, 2048] == 2 * sizes[bits, 1024], sizes
  assert sizes[None, 2048] == 4 / 3 * qkv + 2048 * heads * 4  # q, k, v, out + lse
  assert sizes[None, 2048] < quadratic / 10
  assert sizes[4, 2048] < 0.15 * qkv  # 4/32 plus bf16 group statistics
  # Every residual is tagged.
  x = jnp.ones((1, 64, heads, depth))
  for bits, names in [
    (4, {"att.q", "att.k", "att.v"}),
    (None, {"att.q", "att.k", "att.v", "att.out", "att.lse"}),
  ]:
    f = lambda q, k, v: attn(q, k, v, bits=bits, key=jax.random.key(0), name="att")
    saved, nbytes = saved_under_names(f, names, x, x, x)
    assert saved == names
    assert nbytes == residual_bytes(f, x, x, x)


@pytest.mark.slow
def test_compiled_backward_memory_is_far_below_plain_attention():
  # Compile only. Measured on XLA:CPU at L=2048, 2 heads, depth 32:
  # chunked ~1.4 MB of temporaries, flax ~102 MB (the [2, L, L] logits and
  # weights, 33.5 MB each, and their gradients).
  length, heads, depth = 2048, 2, 32
  x = jax.ShapeDtypeStruct((1, length, heads, depth), jnp.float32)

  def temp(fn):
    loss = lambda q, k, v: fn(q, k, v).sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  chunked = temp(lambda q, k, v: attn(q, k, v, causal=True))
  plain = temp(
    lambda q, k, v: nn.dot_product_attention(
      q, k, v, mask=nn.make_causal_mask(jnp.ones((1, length), bool))
    )
  )
  assert chunked < 0.05 * plain, (chunked, plain)
  assert chunked < length * length * heads * 4 / 8, chunked


# ----------------------------------------------------------------------------- errors


def test_errors():
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="needs a PRNG key"):
    attn(Q, KT, V, bits=4)
  with pytest.raises(ValueError, match="bits must be one of"):
    attn(Q, KT, V, bits=9, key=key)
  with pytest.raises(TypeError, match="floating-point input"):
    attn(Q.astype(jnp.int32), KT, V)
  for bad in (0, -4, 2.5, True, None):
    with pytest.raises(ValueError, match="query_chunk must be a positive int"):
      attn(Q, KT, V, query_chunk=bad)
  with pytest.raises(ValueError, match="key_chunk must be a positive int"):
    attn(Q, KT, V, key_chunk=0)
  with pytest.raises(ValueError, match="same rank"):
    attn(Q, KT[0], V)
  with pytest.raises(ValueError, match="mismatched shapes"):
    attn(Q, KT, V[..., :5, :, :])  # value length != key length
  with pytest.raises(ValueError, match="mismatched shapes"):
    attn(Q, KT[..., :4], V)  # depth
  with pytest.raises(ValueError, match="does not broadcast"):
    attn(Q, KT, V, bias=jnp.zeros((LK, LQ)))
  with pytest.raises(ValueError, match="does not broadcast"):
    attn(Q, KT, V, mask=jnp.ones((1, 1, 1, 1, 1, LK), bool))
  with pytest.raises(TypeError, match="mask must be boolean"):
    attn(Q, KT, V, mask=jnp.ones((LQ, LK)))
  with pytest.raises(TypeError, match="recompute must be"):
    attn(Q, KT, V, recompute="yes")
  with pytest.raises(ValueError, match="non-empty string"):
    attn(Q, KT, V, name="")
  # No key needed when nothing is random (traced only, nothing compiles).
  grad = jax.grad(lambda q: attn(q, KT, V, compressor=PerGroup(4, stochastic=False)).sum())
  assert jax.eval_shape(grad, Q).shape == Q.shape
