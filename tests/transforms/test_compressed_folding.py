"""Elementwise chains of one tensor inside `jact.compressed` store one
derivative (`jact._transforms._folding`): same forward values and exact
gradients without compression, fewer stored tensors, less gradient noise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact._transforms import _folding


def _mlp(w1, w2, x):
  return jax.nn.gelu(x @ w1) @ w2


def _params(hidden=256):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  w1 = jax.random.normal(k1, (64, hidden)) / 8
  w2 = jax.random.normal(k2, (hidden, 32)) / 16
  x = jax.random.normal(k3, (64, 64))
  return w1, w2, x


def _no_folding(monkeypatch):
  monkeypatch.setattr(_folding, "MIN_NONLINEAR", 10**9)


def _loss(fn, bits, key=1):
  block = jact.compressed(fn, bits=bits)
  return lambda *a: (block(*a, key=jax.random.key(key)) ** 2).sum()


CHAINS = {
  "gelu": lambda x: jax.nn.gelu(x),
  "swish by hand": lambda x: x / (1.0 + jnp.exp(-x)),
  "tanh times exp": lambda x: jnp.tanh(x) * jnp.exp(-0.5 * x * x) + x,
  "erf gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_folded_chain_is_exact_without_compression(chain):
  f = CHAINS[chain]
  x = jax.random.normal(jax.random.key(1), (16, 128)) * 2
  closed = jax.make_jaxpr(f)(x)
  assert _folding.unary_regions(closed.jaxpr), "the chain should be folded"
  loss = _loss(f, bits=None)
  plain = lambda x: (f(x) ** 2).sum()
  np.testing.assert_allclose(loss(x), plain(x), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(loss)(x), jax.grad(plain)(x), rtol=2e-5, atol=1e-6)


def test_gelu_stores_one_derivative(monkeypatch):
  w1, w2, x = _params()
  hidden = (x.shape[0], w1.shape[1])

  def stored_hidden(loss):
    report = jact.residual_report(loss, w1, w2, x)
    return {
      r.name
      for r in report.residuals
      if r.name
      and r.shape[:1] == (hidden[0],)
      and not r.is_argument
      and r.bytes >= hidden[0] * hidden[1] // 2
    }

  folded = stored_hidden(_loss(_mlp, bits=4))
  _no_folding(monkeypatch)
  unfolded = stored_hidden(_loss(_mlp, bits=4))
  # the derivative and gelu's output (the second matmul's input), not one tensor per step
  assert len(folded) == 2 and len(unfolded) > 2, (folded, unfolded)


@pytest.mark.slow
def test_folding_lowers_gradient_noise_and_stays_unbiased(monkeypatch):
  w1, w2, x = _params()
  exact = jax.grad(lambda w1: (_mlp(w1, w2, x) ** 2).sum())(w1)

  def errors(draws):
    block = jact.compressed(_mlp, bits=2)
    grad = jax.jit(jax.grad(lambda w1, k: (block(w1, w2, x, key=jax.random.key(k)) ** 2).sum()))
    grads = [grad(w1, k) for k in range(draws)]
    rel = lambda g: float(jnp.linalg.norm(g - exact) / jnp.linalg.norm(exact))
    return np.mean([rel(g) for g in grads]), rel(sum(grads) / draws)

  single, mean = errors(8)
  _no_folding(monkeypatch)
  single_unfolded, _ = errors(8)
  assert single < 0.8 * single_unfolded, (single, single_unfolded)
  # unbiased: averaging 8 draws shrinks the error like 1/sqrt(8) (pure variance)
  assert mean < 0.5 * single, (mean, single)


def test_chain_read_twice_is_not_folded():
  # tanh(x) is read by the chain and by the output: two values leave the chain
  f = lambda x: (jnp.tanh(x) * jnp.exp(x), jnp.tanh(x))
  closed = jax.make_jaxpr(f)(jnp.ones((4, 4)))
  regions = _folding.unary_regions(closed.jaxpr)
  assert all(r.output is not closed.jaxpr.outvars[1] for r in regions.values())
  assert not regions
  x = jax.random.normal(jax.random.key(2), (8, 128))
  block = jact.compressed(f, bits=None)
  plain = lambda x: sum((y**2).sum() for y in f(x))
  ours = lambda x: sum((y**2).sum() for y in block(x))
  np.testing.assert_allclose(jax.grad(ours)(x), jax.grad(plain)(x), rtol=1e-6)


def test_linear_chain_is_not_folded():
  closed = jax.make_jaxpr(lambda x: (x * 2.0 + 1.0) / 3.0 - x)(jnp.ones(8))
  assert _folding.unary_regions(closed.jaxpr) == {}


@pytest.mark.parametrize("dtype,scale", [(jnp.float32, 1e20), (jnp.float16, 1e3)])
def test_folded_derivative_of_a_saturated_overflow_is_plain(dtype, scale):
  """tanh(inf) = 1 and exp(-inf) = 0 have derivative 0: plain reverse mode gives 0
  (the 0 comes first), a forward-mode tangent overflowed first (0 * inf = NaN)."""
  x = (jnp.linspace(-2.0, 2.0, 64) * jnp.ones((4, 1))).astype(dtype)
  for f in (lambda x: jnp.tanh((x * scale) ** 2), lambda x: jnp.exp(-((x * scale) ** 2))):
    closed = jax.make_jaxpr(f)(x)
    [region] = _folding.unary_regions(closed.jaxpr).values()
    folded = _folding.folded_chain(closed.jaxpr, region)
    assert not jnp.isfinite((x * scale) ** 2).all()  # the chain really overflows
    probe = jnp.asarray(np.random.default_rng(0).standard_normal(x.shape), dtype)
    got = jax.vjp(folded, x)[1](probe)[0]
    want = jax.vjp(f, x)[1](probe)[0]
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=0
    )
