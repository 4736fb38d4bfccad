"""Compressed dot-product attention against flax.linen.dot_product_attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jact._compat.testing import saved_residuals

from jact.ops._attention import dot_product_attention as attn
from stats import DRAWS, assert_unbiased, over_keys, residual_bytes, tree_rel_err

K = DRAWS  # draws per statistical test: enough to see a bias of 1% of a rounding step (stats.py)
SHAPE = (2, 8, 2, 16)  # batch, length, heads, depth
Q, KT, V = (jax.random.normal(jax.random.key(i), SHAPE) for i in range(3))
COT = jax.random.normal(jax.random.key(3), SHAPE)
BIAS = 0.5 * jax.random.normal(jax.random.key(4), (1, 2, 8, 8))
MASK = jnp.tril(jnp.ones((8, 8), bool))[None, None]  # causal


def residuals(f, *args):
  return [(a, d) for a, d in saved_residuals(f, *args) if not d.startswith("from the argument")]


def grads(fn, q, k, v, cot=COT):
  loss = lambda q, k, v: jnp.vdot(fn(q, k, v).astype(jnp.float32), cot)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def flax_attn(q, k, v):
  return nn.dot_product_attention(q, k, v, bias=BIAS, mask=MASK)


def sampled_grads(keys, **kw):
  one = lambda key: grads(lambda q, k, v: attn(q, k, v, BIAS, MASK, key=key, **kw), Q, KT, V)
  return over_keys(one, keys)


@pytest.mark.slow
def test_forward_matches_flax():
  for bias, mask in [(None, None), (BIAS, None), (None, MASK), (BIAS, MASK)]:
    y = jax.jit(lambda: attn(Q, KT, V, bias, mask, key=jax.random.key(0), bits=2))()
    want = nn.dot_product_attention(Q, KT, V, bias=bias, mask=mask)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_uncompressed_backward_equals_flax_autodiff():
  got = grads(lambda q, k, v: attn(q, k, v, BIAS, MASK, bits=None), Q, KT, V)
  want = grads(flax_attn, Q, KT, V)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_value_gradient_is_unbiased_at_2_bits():
  # d_v = p_hat^T g is linear in the stored attention weights: unbiased
  # (default assert_unbiased tolerances; masked weights are exactly 0).
  dv = sampled_grads(jax.random.split(jax.random.key(2), K), bits=2)[2]
  assert_unbiased(dv, grads(flax_attn, Q, KT, V)[2])


@pytest.mark.slow
def test_gradients_at_8_bits_are_close_and_unbiased():
  # Closeness of one draw: every operand carries ~0.4% rounding noise
  # (step/sqrt(12) of a range-8 tensor), compounded through two einsums and
  # softmax: relative L2 error below 3%.
  # Unbiasedness over K draws: the only bias, the softmax's -Var(p_hat) * dp
  # <= (1/255)^2/4 |dp| at 8 bits, is far below the standard error of K draws:
  # default assert_unbiased tolerances.
  got = sampled_grads(jax.random.split(jax.random.key(3), K), bits=8)
  want = grads(flax_attn, Q, KT, V)
  for a, b in zip(got, want):
    assert np.linalg.norm(a[0] - b) <= 0.03 * np.linalg.norm(b)
    assert_unbiased(a, b)


@pytest.mark.slow
def test_attention_dropout_is_unbiased_over_keys():
  keys = jax.random.split(jax.random.key(5), K)
  run = lambda key: attn(Q, KT, V, BIAS, MASK, dropout_rate=0.3, deterministic=False, key=key)
  ys = over_keys(run, keys)
  assert not np.allclose(ys[0], flax_attn(Q, KT, V))
  assert_unbiased(ys, flax_attn(Q, KT, V))


@pytest.mark.slow
def test_residuals_are_named_and_at_2_bits_an_eighth_of_flax():
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 64, 4, 32)) for i in range(3))
  key = jax.random.key(0)
  f = lambda q, k, v: attn(q, k, v, dropout_rate=0.1, deterministic=False, key=key, bits=2)
  got = residual_bytes(f, q, k, v)
  want = residual_bytes(lambda q, k, v: nn.dot_product_attention(q, k, v), q, k, v)
  assert 0 < got <= want / 8, (got, want)
  # Every piece is tagged: a remat policy keeping the six names saves all of it
  # up to scalars (1/sqrt(depth), the closed-over PRNG key).
  names = {
    "attention.qk.lhs",
    "attention.qk.rhs",
    "attention.softmax.y",
    "attention.dropout.seed",
    "attention.pv.lhs",
    "attention.pv.rhs",
  }
  pol = jax.checkpoint_policies.save_only_these_names(*names)
  saved = residuals(jax.checkpoint(f, policy=pol), q, k, v)
  assert {d.split("'")[1] for _, d in saved if d.startswith("named")} == names
  assert abs(sum(a.size * a.dtype.itemsize for a, _ in saved) - got) <= 8


@pytest.mark.slow
def test_bf16_forward_is_flax_bf16_and_gradient_is_float32_within_bf16_rounding():
  # Forward: bit-equal to flax's attention in bf16, both jitted (bias in the
  # inputs' dtype).
  # Gradient with the residuals kept: per-leaf relative L2 error against the
  # float32 gradient at the same (bf16) inputs below two bf16 roundings
  # (2 * 2**-8: the stored softmax and the result); the default 4-bit
  # gradients stay bf16.
  q, k, v = (a.astype(jnp.bfloat16) for a in (Q, KT, V))
  fn = lambda q, k, v: attn(q, k, v, BIAS, MASK, key=jax.random.key(0))
  y = jax.jit(fn)(q, k, v)
  y_flax = jax.jit(
    lambda q, k, v: nn.dot_product_attention(q, k, v, bias=BIAS.astype(jnp.bfloat16), mask=MASK)
  )(q, k, v)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_flax, np.float32))
  assert all(g.dtype == jnp.bfloat16 for g in grads(fn, q, k, v))
  kept = grads(lambda q, k, v: attn(q, k, v, BIAS, MASK, bits=None), q, k, v)
  assert all(g.dtype == jnp.bfloat16 for g in kept)
  exact = grads(flax_attn, *(a.astype(jnp.float32) for a in (q, k, v)))
  assert tree_rel_err([g.astype(jnp.float32) for g in kept], exact) < 2 * 2.0**-8


def test_errors():
  with pytest.raises(ValueError, match="needs a PRNG key"):
    attn(Q, KT, V)
  with pytest.raises(ValueError, match="needs a PRNG key"):
    attn(Q, KT, V, bits=None, dropout_rate=0.1, deterministic=False)
  with pytest.raises(ValueError, match="bits must be one of"):
    attn(Q, KT, V, key=jax.random.key(0), bits=12)
  with pytest.raises(ValueError, match=r"rate must be in \[0, 1\)"):
    attn(Q, KT, V, key=jax.random.key(0), dropout_rate=1.0)
  with pytest.raises(ValueError, match="same rank"):
    attn(Q, KT[0], V, key=jax.random.key(0))
  # no key needed when nothing is random
  y = attn(Q, KT, V, bits=None)
  np.testing.assert_allclose(y, nn.dot_product_attention(Q, KT, V), rtol=1e-5, atol=1e-6)
