"""Edge cases of the backward pass: non-finite cotangents and the order of
differentiation.

1. The ordering device of every backward rule (a select of the packed
   residuals by a predicate on one element of the incoming cotangent) must
   never change values: a NaN or an infinity in one sample's cotangent leaves
   every other sample's gradient exactly as it is, and a non-finite gradient
   that plain JAX shows stays non-finite.
2. A lossy-compressed residual does not depend on the input it was made from,
   so a second derivative through it would be silently wrong: it raises at
   trace time, naming jact and the fix. Exact residuals (bits=None, ReLU's
   mask) give the second derivatives of plain JAX. Forward mode is not
   available through a custom backward rule: it raises an error naming the
   jact op and the fix (not JAX's generic custom_vjp text).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax.linen as nn
from flax import nnx

import jact
from jact import ops
from jact import nn as jnn
from jact import nnx as jnnx

N = 4  # samples
KEY = jax.random.key(7)
BAD_POSITIONS = (0, N // 2, N - 1)  # first, middle and last sample
BAD_VALUES = (np.nan, np.inf, -np.inf)


def _normal(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape)


def _block(w, x):
  return jnp.tanh(x @ w) * jax.nn.sigmoid(x @ w)


def _ln(x, scale, bias):  # flax.linen.LayerNorm, fast variance
  mu = x.mean(-1, keepdims=True)
  var = jnp.maximum(0.0, jnp.mean(x * x, -1, keepdims=True) - mu * mu)
  return (x - mu) * jax.lax.rsqrt(var + 1e-6) * scale + bias


def _conv(x, w):
  return jax.lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


_compressed_block = jact.compressed(_block, bits=4, min_size=64, name="edge_block")

# name: (jact op, the same function in plain JAX, arguments); the gradient is
# taken with respect to every argument.
CASES = {
  "dense": (
    lambda x, w: ops.dense(x, w, key=KEY),
    lambda x, w: x @ w,
    (_normal(0, (N, 64)), _normal(1, (64, 16), 0.1)),
  ),
  "conv": (
    lambda x, w: ops.conv(x, w, key=KEY),
    _conv,
    (_normal(2, (N, 6, 6, 8)), _normal(3, (3, 3, 8, 8), 0.2)),
  ),
  "relu": (ops.relu, jax.nn.relu, (_normal(4, (N, 64)),)),
  "tanh": (lambda x: ops.tanh(x, key=KEY), jnp.tanh, (_normal(5, (N, 256)),)),
  "gelu": (lambda x: ops.gelu(x, key=KEY), jax.nn.gelu, (_normal(6, (N, 256)),)),
  "layer_norm": (
    lambda x, s, b: ops.layer_norm(x, s, b, key=KEY),
    _ln,
    (_normal(7, (N, 64)), 1.0 + _normal(8, (64,), 0.1), _normal(9, (64,), 0.1)),
  ),
  "compressed": (
    lambda w, x: _compressed_block(w, x, key=KEY),
    _block,
    (_normal(10, (64, 32), 0.1), _normal(11, (N, 64))),
  ),
}


FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""XLA:CPU options for the programs compared below: unoptimized, they compile
faster. Each comparison is within one compiled program (the same one for the
bad and the clean cotangent) or within float32 tolerances."""


@functools.cache
def _vjp(name: str, plain: bool):
  """jit(cotangent -> gradients of every argument) for one case."""
  op = CASES[name][1 if plain else 0]
  args = CASES[name][2]
  return jax.jit(lambda ct: jax.vjp(op, *args)[1](ct), compiler_options=FAST_COMPILE)


def _cotangent(name: str, position: int, value: float) -> jax.Array:
  """A generic cotangent whose sample `position` starts with `value`."""
  op, _, args = CASES[name]
  shape = jax.eval_shape(op, *args).shape
  ct = _normal(100, shape)
  return ct.at[(position,) + (0,) * (len(shape) - 1)].set(value)


@pytest.mark.slow
@pytest.mark.parametrize("value", BAD_VALUES, ids=("nan", "inf", "-inf"))
@pytest.mark.parametrize("name", CASES)
def test_one_non_finite_cotangent_leaves_other_gradients_unchanged(name, value):
  reached_any = False
  for position in BAD_POSITIONS:
    bad = _cotangent(name, position, value)
    clean = _cotangent(name, position, 0.0)
    got, ref = _vjp(name, False)(bad), _vjp(name, False)(clean)
    plain = _vjp(name, True)(bad)
    for g, r, p in zip(got, ref, plain):
      g, r, p = np.asarray(g), np.asarray(r), np.asarray(p)
      reached = ~np.isfinite(p)  # the entries the bad value reaches in plain JAX
      assert not reached.all(), (name, position)
      reached_any |= reached.any()
      # Gradients the bad value does not reach: bit for bit those of the clean run.
      np.testing.assert_array_equal(g[~reached], r[~reached], err_msg=f"{name} at {position}")
      assert np.abs(r[~reached]).max() > 0, (name, position)
      # Gradients it reaches: non-finite, as in plain JAX (not silently zero).
      assert not np.isfinite(g[reached]).any(), (name, position)
  assert reached_any, name  # the bad value reached some gradient (else the check is empty)


def _normalized_mlp(dense, relu, w1, w2, x):
  """ReLU, then L2 normalisation of each sample (floored norm): a sample whose
  ReLU output is all zero has a finite output and a NaN cotangent at the ReLU
  (0 * inf in the norm's derivative), which the ReLU's mask then drops."""
  h = relu(dense(x, w1, 0))
  h = h / jnp.maximum(jnp.linalg.norm(h, axis=-1, keepdims=True), 1e-6)
  return jnp.sum(dense(h, w2, 1) ** 2)


@pytest.mark.slow
def test_relu_then_l2_normalisation_with_a_dead_sample_matches_plain_jax():
  w1, w2 = _normal(20, (32, 64), 0.2), _normal(21, (64, 8), 0.2)
  x = _normal(22, (N, 32)).at[0].set(0.0)  # sample 0: ReLU output all zero
  jact_dense = lambda x, w, i: ops.dense(x, w, key=jax.random.fold_in(KEY, i), bits=8)
  f_jact = functools.partial(_normalized_mlp, jact_dense, ops.relu)
  f_plain = functools.partial(_normalized_mlp, lambda x, w, i: x @ w, jax.nn.relu)
  loss, plain_loss = jax.jit(f_jact)(w1, w2, x), jax.jit(f_plain)(w1, w2, x)
  assert np.isfinite(plain_loss) and loss == plain_loss
  g = jax.jit(jax.grad(f_jact, (0, 1)))(w1, w2, x)
  p = jax.jit(jax.grad(f_plain, (0, 1)))(w1, w2, x)
  for a, b in zip(g, p):
    assert np.isfinite(b).all() and np.abs(b).max() > 0
    # 8-bit stochastic rounding of the dense inputs: a few tenths of a percent.
    assert np.linalg.norm(a - b) <= 0.02 * np.linalg.norm(b)


@pytest.mark.slow
def test_overflowing_sample_keeps_healthy_input_gradients():
  """Sample 0 overflows to inf in the first dense layer; the layer norm turns it
  into NaN. Every other sample's input gradient is still that of plain JAX."""
  w1, w2 = _normal(30, (32, 64), 0.2), _normal(31, (64, 8), 0.2)
  x = _normal(32, (N, 32)).at[0].set(3e38)
  s, b = jnp.ones(64), jnp.zeros(64)

  def f(dense, ln, relu, x):
    h = relu(ln(dense(x, w1, 0), s, b))
    return jnp.sum(dense(h, w2, 1) ** 2, axis=-1)

  jact_dense = lambda x, w, i: ops.dense(x, w, key=jax.random.fold_in(KEY, i), bits=8)
  jact_ln = lambda x, s, b: ops.layer_norm(x, s, b, key=jax.random.fold_in(KEY, 2), bits=8)
  per_sample = lambda fn: jax.jit(lambda x: jax.vjp(fn, x)[1](jnp.ones(N))[0])
  got = np.asarray(per_sample(functools.partial(f, jact_dense, jact_ln, ops.relu))(x))
  ref = np.asarray(per_sample(functools.partial(f, lambda x, w, i: x @ w, _ln, jax.nn.relu))(x))
  assert not np.isfinite(ref[0]).all() and not np.isfinite(got[0]).all()
  assert np.isfinite(ref[1:]).all() and np.abs(ref[1:]).max() > 0
  np.testing.assert_allclose(got[1:], ref[1:], rtol=0.05, atol=0.02 * np.abs(ref[1:]).max())


# ----------------------------------------------------------------------------- 2. derivative order

X = _normal(40, (4, 16))
W = _normal(41, (16, 16), 0.3)
S, B = 1.0 + _normal(42, (16,), 0.1), _normal(43, (16,), 0.1)


def _attention(q, k, v, bits):
  return ops.chunked_attention(q, k, v, bits=bits, key=KEY, query_chunk=4, key_chunk=4)


def _plain_attention(q, k, v):
  w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]), -1)
  return jnp.einsum("bhqk,bkhd->bqhd", w, v)


def _mlp(w, x):
  return jnp.tanh(x @ w) @ w


# name: (x -> scalar through the jact op at `bits`, the same in plain JAX)
SECOND_ORDER = {
  "dense": (lambda x, bits: ops.dense(jnp.sin(x), W, key=KEY, bits=bits), lambda x: jnp.sin(x) @ W),
  "conv": (
    lambda x, bits: ops.conv(
      jnp.sin(x).reshape(1, 4, 4, 4), W[:4, :4].reshape(1, 1, 4, 4), key=KEY, bits=bits
    ),
    lambda x: _conv(jnp.sin(x).reshape(1, 4, 4, 4), W[:4, :4].reshape(1, 1, 4, 4)),
  ),
  "tanh": (lambda x, bits: ops.tanh(x, key=KEY, bits=bits), jnp.tanh),
  "gelu": (lambda x, bits: ops.gelu(x, key=KEY, bits=bits), jax.nn.gelu),
  "softmax": (lambda x, bits: ops.softmax(x, key=KEY, bits=bits), jax.nn.softmax),
  "layer_norm": (lambda x, bits: ops.layer_norm(x, S, B, key=KEY, bits=bits), _ln),
  "chunked_attention": (
    lambda x, bits: _attention(*(x.reshape(1, 4, 4, 4),) * 3, bits),
    lambda x: _plain_attention(*(x.reshape(1, 4, 4, 4),) * 3),
  ),
  "compressed": (
    lambda x, bits: jact.compressed(_mlp, bits=bits, min_size=16)(W, x, key=KEY),
    lambda x: _mlp(W, x),
  ),
  "checkpoint": (
    lambda x, bits: jact.checkpoint(_mlp, bits=bits, min_size=16, compress_argnums=(1,))(
      W, x, key=KEY
    ),
    lambda x: _mlp(W, x),
  ),
}
# The plain layer norm takes its scale and bias as arguments.
_PLAIN_ARGS = {"layer_norm": (S, B)}


def _scalar(f):
  """x -> a generic scalar of f(x) (so that every second derivative is nonzero)."""
  return lambda x: jnp.sum(jnp.sin(f(x)) * jnp.cos(f(x)))


SECOND_ORDER_MODES = {
  "hessian": lambda f: jax.hessian(f),
  "grad_of_grad": lambda f: jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2)),
  "jvp_of_grad": lambda f: lambda x: jax.jvp(jax.grad(f), (x,), (jnp.cos(3.0 * x),))[1],
}


# Eager cases run the forward op by op (each operation compiled on first use)
# before the rule raises; the rule is the same for every op (`first_order_only`
# in jact/_engine/store.py) and for the transforms (jact/_transforms), and every
# name raises under jit too. So one op and the two transforms run eagerly.
LOSSY_EAGER = ("tanh", "compressed", "checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("mode", SECOND_ORDER_MODES)
@pytest.mark.parametrize(
  "name,jit",
  [(n, True) for n in SECOND_ORDER] + [(n, False) for n in LOSSY_EAGER],
  ids=[f"{n}-jit" for n in SECOND_ORDER] + [f"{n}-eager" for n in LOSSY_EAGER],
)
def test_second_order_through_a_lossy_residual_is_an_error(name, mode, jit):
  f = _scalar(functools.partial(SECOND_ORDER[name][0], bits=4))
  d2 = SECOND_ORDER_MODES[mode](f)
  d2 = jax.jit(d2) if jit else d2
  with pytest.raises(TypeError, match=r"jact cannot differentiate residual .*\(bits=None"):
    jax.eval_shape(d2, X) if jit else d2(X)


@pytest.mark.slow
def test_second_order_through_blpa_codes_is_an_error():
  x = _normal(44, (2, 4, 4, 8))
  f = lambda x: jnp.sum(
    ops.blpa_block(x, jnp.ones(8), jnp.zeros(8), W[:8, :8].reshape(1, 1, 8, 8))[0] ** 2
  )
  with pytest.raises(TypeError, match=r"jact cannot differentiate residual 'blpa.a2'"):
    jax.hessian(f)(x)


@pytest.mark.slow
def test_second_order_in_weights_the_stored_input_does_not_depend_on_is_allowed():
  """Differentiating twice with respect to the weights only: the stored input
  does not depend on them, so nothing is differentiated through it."""
  f = lambda w: jnp.sum(jnp.tanh(ops.dense(X, w, key=KEY, bits=8)) ** 2)
  h = jax.jit(jax.hessian(f))(W[:, :2])  # jitted: one compile, not op-by-op
  p = jax.jit(jax.hessian(lambda w: jnp.sum(jnp.tanh(X @ w) ** 2)))(W[:, :2])
  # 8-bit stochastic rounding of X: well under a percent.
  assert np.linalg.norm(h - p) <= 0.02 * np.linalg.norm(p)


@pytest.mark.slow
@pytest.mark.parametrize("mode", SECOND_ORDER_MODES)
@pytest.mark.parametrize("name", (*SECOND_ORDER, "relu"))
def test_second_order_through_exact_residuals_matches_plain_jax(name, mode):
  if name == "relu":  # the 1-bit mask is exact whatever the bits
    op, plain = (lambda x: ops.relu(jnp.sin(x)) ** 3), (lambda x: jax.nn.relu(jnp.sin(x)) ** 3)
  else:
    op = functools.partial(SECOND_ORDER[name][0], bits=None)
    plain = lambda x: SECOND_ORDER[name][1](x, *_PLAIN_ARGS.get(name, ()))
  got = jax.jit(SECOND_ORDER_MODES[mode](_scalar(op)), compiler_options=FAST_COMPILE)(X)
  ref = jax.jit(SECOND_ORDER_MODES[mode](_scalar(plain)), compiler_options=FAST_COMPILE)(X)
  assert np.abs(ref).max() > 0
  # float32 rounding: the backward formulas differ from JAX's in order of operations.
  np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5 * np.abs(ref).max())


IDS = jnp.array([[0, 3, 1], [2, 2, 5]])
# name: a jact op (or transform) as a function of one float array
FORWARD_MODE = {
  "dense": lambda x: ops.dense(x, W, key=KEY),
  "conv": lambda x: ops.conv(x.reshape(1, 4, 4, 4), W[:4, :4].reshape(1, 1, 4, 4), key=KEY),
  "relu": ops.relu,
  "leaky_relu": ops.leaky_relu,
  "gelu": lambda x: ops.gelu(x, key=KEY),
  "tanh_exact": lambda x: ops.tanh(x, bits=None),
  "softmax": lambda x: ops.softmax(x, key=KEY),
  "layer_norm": lambda x: ops.layer_norm(x, S, B, key=KEY),
  "rms_norm": lambda x: ops.rms_norm(x, S, key=KEY),
  "batch_norm": lambda x: ops.batch_norm(x, S, B, key=KEY),
  "max_pool": lambda x: ops.max_pool(x.reshape(1, 4, 4, 4), (2, 2), (2, 2)),
  "avg_pool": lambda x: ops.avg_pool(x.reshape(1, 4, 4, 4), (2, 2), (2, 2)),
  "dropout": lambda x: ops.dropout(x, 0.5, key=KEY),
  "embed": lambda x: ops.embed(IDS, x),
  "blpa_block": lambda x: ops.blpa_block(x, S, B, W)[0],
  "chunked_attention": lambda x: _attention(*(x.reshape(1, 4, 4, 4),) * 3, None),
  "dot_product_attention": lambda x: ops.dot_product_attention(
    *(x.reshape(1, 4, 4, 4),) * 3, key=KEY
  ),
  "compressed": lambda x: jact.compressed(_mlp, bits=None)(W, x),
  "checkpoint": lambda x: jact.checkpoint(_mlp, bits=4, compress_argnums=(1,))(W, x, key=KEY),
  "linen.Dense": lambda x: jnn.Dense(3, bits=None).apply(nn.Dense(3).init(KEY, X), x),
  "linen.compressed": lambda x: jact.compressed(nn.Dense(3), bits=None).apply(
    nn.Dense(3).init(KEY, X), x
  ),
  "nnx.Linear": lambda x: jnnx.Linear(16, 3, bits=None, rngs=nnx.Rngs(0))(x),
}

FORWARD_MODES = {
  "jvp": lambda f, x: jax.jvp(f, (x,), (x,)),
  "jit_jvp": lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
  "jvp_of_jit": lambda f, x: jax.jvp(jax.jit(f), (x,), (x,)),
  "jacfwd": lambda f, x: jax.jacfwd(f)(x),
  "linearize": lambda f, x: jax.linearize(f, x)[1](x),
}


# `jax.linearize` evaluates the whole forward op by op (each operation compiled on
# first use) before its linear function raises, in the same guard for every op
# (`reverse_only` in jact/_engine/op.py); the four other modes check every name
# is guarded. So these ops, whose forwards cost seconds op by op, skip linearize.
LINEARIZE_SKIPS = (
  "dense",
  "conv",
  "blpa_block",
  "max_pool",
  "rms_norm",
  "batch_norm",
  "dropout",
  "dot_product_attention",
)


@pytest.mark.slow
@pytest.mark.parametrize(
  "name,mode",
  [
    (n, m)
    for n in FORWARD_MODE
    for m in FORWARD_MODES
    if not (m == "linearize" and n in LINEARIZE_SKIPS)
  ],
  ids=lambda v: v,
)
def test_forward_mode_names_jact_and_the_fix(name, mode):
  with pytest.raises(TypeError, match=r"jact.* reverse-mode differentiation only.*jax.jacrev"):
    FORWARD_MODES[mode](FORWARD_MODE[name], X)


@pytest.mark.slow
@pytest.mark.parametrize("name", ("dense", "gelu", "layer_norm", "compressed", "linen.Dense"))
def test_reverse_mode_still_works_where_forward_mode_is_refused(name):
  f = FORWARD_MODE[name]

  @jax.jit  # one compile, not op by op
  def run(x):
    y, vjp = jax.vjp(f, x)
    (g,) = vjp(jnp.ones_like(y))
    return y, g, jax.jacrev(f)(x)  # vmap over the transposed guard

  y, g, j = run(X)
  # The Jacobian's rows summed are the vector-Jacobian product with ones.
  np.testing.assert_allclose(j.reshape(y.size, -1).sum(0), g.reshape(-1), rtol=1e-5, atol=1e-5)
