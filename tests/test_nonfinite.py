"""Non-finite values propagate exactly as in plain JAX (issue 31, item 1).

For every case the gradient of every leaf must be non-finite exactly where
plain JAX's is (the same `jnp.isfinite` pattern, element for element), every
op and model at every width (1, 2, 4, 8 bits and bits=None; see `REPEATS`
for cases that repeat an op), and its finite entries close to
plain's at 8 bits and equal-ish at bits=None. A NaN in one sample never
reaches another sample's gradient unless plain JAX's does too (batch norm's
statistics mix samples in plain JAX as well).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact import ops
from jact.kernels._quantize.reference import quantize_reference, dequantize_reference

KEY = jax.random.key(3, impl="rbg")
N = 4
WIDTHS = (1, 2, 4, 8, None)
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _normal(shape, seed, scale=1.0, dtype=jnp.float32):
  x = scale * np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def _set(x, index, value):
  a = np.asarray(x, np.float32).copy()
  a[index] = value
  return jnp.asarray(a).astype(x.dtype)


def _probe(f, args):
  out = jax.eval_shape(f, *args)
  return _normal(out.shape, 99, dtype=jnp.float32)


def _output_and_grads(f, args, probe):
  """f's output (as float32) and the gradients of sum(output * probe) with respect to
  every argument, from one compiled program."""

  def both(*a):
    y, vjp = jax.vjp(lambda *a: f(*a).astype(jnp.float32), *a)
    return y, vjp(probe)

  return _jit(both)(*args)


def assert_same_pattern(got, want, *, rtol=None, what=""):
  """Equal finite patterns leaf by leaf; with `rtol`, the finite entries within
  rtol (relative L2 over the finite entries of each leaf, plus 1e-3 of the
  leaf's largest finite magnitude as a floor for ~0 leaves)."""
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves), what
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert g.shape == w.shape, (what, i)
    np.testing.assert_array_equal(
      np.isfinite(g), np.isfinite(w), err_msg=f"{what}: finite pattern of gradient leaf {i}"
    )
    finite = np.isfinite(w)
    if rtol is not None and finite.any():
      err = np.linalg.norm(g[finite] - w[finite])
      norm = np.linalg.norm(w[finite])
      assert err <= rtol * norm + 1e-3 * np.abs(w[finite]).max() * np.sqrt(finite.sum()), (
        what,
        i,
        err / max(norm, 1e-30),
      )


_PLAIN: dict = {}


def _plain(name, plain_fn, args):
  """(probe, plain gradients, plain output) of a case, compiled once for all its widths."""
  if name not in _PLAIN:
    probe = _probe(plain_fn, args)
    y, grads = _output_and_grads(plain_fn, args, probe)
    _PLAIN[name] = probe, grads, y
  return _PLAIN[name]


def _check(name, jact_fn, plain_fn, args, bits, *, rtol8=0.05, rtol_exact=1e-4, must_be_bad=True):
  probe, want, y_plain = _plain(name, plain_fn, args)
  if must_be_bad:  # the case really has non-finite gradients (else the check is empty)
    assert any(not np.isfinite(np.asarray(w, np.float32)).all() for w in jax.tree.leaves(want))
  y, got = _output_and_grads(functools.partial(jact_fn, bits), args, probe)
  rtol = {8: rtol8, None: rtol_exact}.get(bits)
  assert_same_pattern(got, want, rtol=rtol, what=f"bits={bits}")
  # The forward is exact (non-finite where plain's is, too): under differentiation at
  # every width, and alone at 8 bits and bits=None. Alone, the program does not depend
  # on the width (the bits only enter the custom_vjp's forward and backward rules: the
  # jaxprs at 1, 2, 4 and 8 bits are equal), so 8 bits stands for 1, 2 and 4; converted
  # models at bits=None are another program.
  outputs = [y] + ([_jit(functools.partial(jact_fn, bits))(*args)] if bits in (8, None) else [])
  for y in outputs:
    np.testing.assert_array_equal(
      np.isfinite(np.asarray(y, np.float32)), np.isfinite(np.asarray(y_plain, np.float32))
    )


# ----------------------------------------------------------------------------- quantizer


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_reconstruction_is_non_finite_exactly_where_the_input_is(bits, dtype):
  x = np.array(_normal((3, 80), bits, 2.0), np.float32)
  x[0, 3], x[0, 40] = np.nan, np.inf  # sample 0: NaN and +inf in one group of 80
  x[1, 7] = -np.inf  # sample 1: one -inf
  x[2, :] = 1.25  # sample 2: constant, then +inf
  x[2, 79] = np.inf
  x = jnp.asarray(x).astype(dtype)
  p = quantize_reference(x, jnp.uint32(11), bits=bits, group_size=80)
  y = np.asarray(dequantize_reference(p), np.float32)
  np.testing.assert_array_equal(np.isfinite(y), np.isfinite(np.asarray(x, np.float32)))
  assert np.isnan(y[0, [3, 40]]).all() and y[1, 7] == -np.inf and y[2, 79] == np.inf
  finite = np.isfinite(np.asarray(x, np.float32))
  step = np.float32(np.abs(np.asarray(p.scale, np.float32)))[:, :1]
  if bits > 1:  # the flagged grid covers the finite values: error below one step
    assert (
      np.abs(y - np.asarray(x, np.float32))[finite] <= np.broadcast_to(step, y.shape)[finite] * 1.01
    ).all()
  np.testing.assert_array_equal(y[2, :79], 1.25)  # a constant group stays exact


# ----------------------------------------------------------------------------- ops


def _conv(x, w):
  return jax.lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def _ln(x, s, b):  # flax.linen.LayerNorm (fast variance)
  mu = x.mean(-1, keepdims=True)
  var = jnp.maximum(0.0, jnp.mean(x * x, -1, keepdims=True) - mu * mu)
  return (x - mu) * jax.lax.rsqrt(var + 1e-6) * s + b


def _attention(q, k, v):
  return nn.dot_product_attention(q, k, v)


X = _normal((N, 64), 0)
W = _normal((64, 16), 1, 0.1)
NAN_X = _set(X, (1, 5), np.nan)  # one NaN in sample 1

# name: (jact function of (bits, *args), plain function, args)
OPS = {
  "dense-nan-input": (
    lambda b, x, w: ops.dense(x, w, key=KEY, bits=b),
    lambda x, w: x @ w,
    (NAN_X, W),
  ),
  "dense-inf-weight": (
    lambda b, x, w: ops.dense(x, w, key=KEY, bits=b),
    lambda x, w: x @ w,
    (X, _set(W, (3, 5), np.inf)),
  ),
  "dense-nan-weight": (
    lambda b, x, w: ops.dense(x, w, key=KEY, bits=b),
    lambda x, w: x @ w,
    (X, _set(W, (7, 2), np.nan)),
  ),
  "conv-nan-input": (
    lambda b, x, w: ops.conv(x, w, key=KEY, bits=b),
    _conv,
    (_set(_normal((N, 6, 6, 8), 2), (2, 3, 3, 1), np.nan), _normal((3, 3, 8, 8), 3, 0.2)),
  ),
  "gelu-inf": (
    lambda b, x: ops.gelu(x, key=KEY, bits=b),
    jax.nn.gelu,
    (_set(_set(_normal((N, 256), 4), (0, 3), np.inf), (2, 9), -np.inf),),
  ),
  "gelu-exact-nan": (
    lambda b, x: ops.gelu(x, False, key=KEY, bits=b),
    lambda x: jax.nn.gelu(x, approximate=False),
    (_set(_normal((N, 256), 5), (1, 0), np.nan),),
  ),
  "silu-inf": (
    lambda b, x: ops.silu(x, key=KEY, bits=b),
    jax.nn.silu,
    (_set(_set(_normal((N, 256), 6), (0, 3), np.inf), (3, 9), -np.inf),),
  ),
  "tanh-nan": (
    lambda b, x: ops.tanh(x, key=KEY, bits=b),
    jnp.tanh,
    (_set(_normal((N, 256), 7), (1, 8), np.nan),),
  ),
  "sigmoid-nan": (
    lambda b, x: ops.sigmoid(x, key=KEY, bits=b),
    jax.nn.sigmoid,
    (_set(_normal((N, 256), 8), (2, 8), np.nan),),
  ),
  "softmax-nan": (
    lambda b, x: ops.softmax(x, key=KEY, bits=b),
    jax.nn.softmax,
    (_set(_normal((N, 64), 9), (2, 8), np.nan),),
  ),
  "relu-nan-then-dense": (
    lambda b, x, w: ops.dense(ops.relu(x), w, key=KEY, bits=b),
    lambda x, w: jax.nn.relu(x) @ w,
    (NAN_X, W),
  ),
  "leaky-relu-nan": (
    lambda b, x: ops.leaky_relu(x) * x,
    lambda x: jax.nn.leaky_relu(x) * x,
    (NAN_X,),
  ),
  "layer-norm-nan": (
    lambda b, x, s, c: ops.layer_norm(x, s, c, key=KEY, bits=b),
    _ln,
    (NAN_X, 1.0 + _normal((64,), 10, 0.1), _normal((64,), 11, 0.1)),
  ),
  "rms-norm-inf": (
    lambda b, x, s: ops.rms_norm(x, s, key=KEY, bits=b),
    lambda x, s: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s,
    (_set(X, (0, 1), np.inf), 1.0 + _normal((64,), 12, 0.1)),
  ),
  "batch-norm-nan": (
    lambda b, x: ops.batch_norm(x, key=KEY, bits=b)[0],
    lambda x: nn.BatchNorm(use_running_average=False).apply(
      {
        "params": {"scale": jnp.ones(64), "bias": jnp.zeros(64)},
        "batch_stats": {"mean": jnp.zeros(64), "var": jnp.ones(64)},
      },
      x,
      mutable=["batch_stats"],
    )[0],
    (NAN_X,),
  ),
  "attention-nan-query": (
    lambda b, q, k, v: ops.dot_product_attention(q, k, v, key=KEY, bits=b),
    _attention,
    (
      _set(_normal((N, 5, 2, 8), 13), (1, 2, 0, 3), np.nan),
      _normal((N, 5, 2, 8), 14),
      _normal((N, 5, 2, 8), 15),
    ),
  ),
  "attention-inf-value": (
    lambda b, q, k, v: ops.dot_product_attention(q, k, v, key=KEY, bits=b),
    _attention,
    (
      _normal((N, 5, 2, 8), 16),
      _normal((N, 5, 2, 8), 17),
      _set(_normal((N, 5, 2, 8), 18), (2, 1, 1, 0), np.inf),
    ),
  ),
  "chunked-attention-nan-key": (
    lambda b, q, k, v: ops.chunked_attention(q, k, v, query_chunk=2, key_chunk=2, key=KEY, bits=b),
    _attention,
    (
      _normal((N, 5, 2, 8), 24),
      _set(_normal((N, 5, 2, 8), 25), (1, 3, 1, 2), np.nan),
      _normal((N, 5, 2, 8), 26),
    ),
  ),
  "max-pool-then-dense-nan": (
    lambda b, x, w: ops.dense(ops.max_pool(x, (2, 2), (2, 2)).reshape(N, -1), w, key=KEY, bits=b),
    lambda x, w: nn.max_pool(x, (2, 2), (2, 2)).reshape(N, -1) @ w,
    (_set(_normal((N, 6, 6, 3), 19), (1, 2, 3, 0), np.nan), _normal((27, 4), 23)),
  ),
  "avg-pool-then-dense-nan": (
    lambda b, x, w: ops.dense(ops.avg_pool(x, (2, 2), (2, 2)).reshape(N, -1), w, key=KEY, bits=b),
    lambda x, w: nn.avg_pool(x, (2, 2), (2, 2)).reshape(N, -1) @ w,
    (_set(_normal((N, 6, 6, 3), 20), (3, 0, 1, 2), np.nan), _normal((27, 4), 21)),
  ),
  "dropout-then-dense-nan": (
    lambda b, x, w: ops.dense(ops.dropout(x, 0.0, key=KEY), w, key=KEY, bits=b),
    lambda x, w: x @ w,
    (NAN_X, W),
  ),
  "embed-nan-row": (
    lambda b, t, w: ops.dense(
      ops.embed(jnp.array([[0, 2], [1, 1], [3, 0], [2, 2]]), t), w, key=KEY, bits=b
    ),
    lambda t, w: jnp.take(t, jnp.array([[0, 2], [1, 1], [3, 0], [2, 2]]), axis=0) @ w,
    (_set(_normal((5, 64), 22), (1, 3), np.nan), W),
  ),
}


# Widths per case. Each op runs at every width (1, 2, 4, 8, None) in at least
# one case: the first case of an op takes them all. A case that repeats an op
# already run at every width (dense with a non-finite weight; dense after an op
# that stores no rounded residual: relu's 1-bit mask, leaky relu, dropout,
# pooling, embedding; attention with a second kind of non-finite value) runs at
# 8 bits (pattern and accuracy) and a share of the other widths, so that
# together they still span every width; leaky relu alone takes no width.
REPEATS = {
  "dense-inf-weight": (1, 2, 8),
  "dense-nan-weight": (4, 8, None),
  "relu-nan-then-dense": (2, 8),
  "leaky-relu-nan": (8,),
  "attention-inf-value": (4, 8, None),
  "max-pool-then-dense-nan": (1, 8),
  "avg-pool-then-dense-nan": (4, 8),
  "dropout-then-dense-nan": (8, None),
  "embed-nan-row": (2, 8),
}


@pytest.mark.parametrize(
  "name,bits",
  [pytest.param(name, b, id=f"{name}-b{b}") for name in OPS for b in REPEATS.get(name, WIDTHS)],
)
def test_op_gradients_are_non_finite_exactly_where_plain_ones_are(name, bits):
  jact_fn, plain_fn, args = OPS[name]
  _check(name, jact_fn, plain_fn, args, bits)


def test_max_pool_picks_the_position_plain_jax_picks_around_nan():
  """Windows holding NaN (and padding): the cotangent goes where XLA's select-and-scatter
  sends it (the first maximum after the last NaN), so gradients equal plain's exactly."""
  rng = np.random.default_rng(0)
  x = rng.integers(0, 4, (6, 5, 5, 2)).astype(np.float32)
  x[rng.random(x.shape) < 0.25] = np.nan
  x = jnp.asarray(x)
  for padding, strides in (("VALID", (2, 2)), ("SAME", (1, 1)), ("SAME", (2, 1))):

    def loss(pool, x):
      y = pool(x, (2, 3), strides, padding)
      return jnp.sum(y * jnp.arange(1.0, 1.0 + y.size).reshape(y.shape))

    want = _jit(jax.grad(functools.partial(loss, nn.max_pool)))(x)
    got = _jit(jax.grad(functools.partial(loss, ops.max_pool)))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=padding)


# ----------------------------------------------------------------------------- transforms, models


def _block(w, x):  # an ordinary user function: dense, layer norm, gelu, a residual
  h = x @ w
  mu = h.mean(-1, keepdims=True)
  h = (h - mu) * jax.lax.rsqrt(jnp.mean((h - mu) ** 2, -1, keepdims=True) + 1e-6)
  return x + jax.nn.gelu(h) @ w.T


class CNN(nn.Module):
  """Conv, BatchNorm, relu, Dense: plain Flax."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9)(nn.Conv(8, (3, 3))(x)))
    x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
    return nn.Dense(5)(x.reshape((x.shape[0], -1)))


class Block(nn.Module):
  """Pre-norm transformer block: LayerNorm, SelfAttention, Dense, gelu."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.SelfAttention(num_heads=2, qkv_features=16)(nn.LayerNorm()(x))
    return x + nn.Dense(16)(nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))


class GRU(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.RNN(nn.GRUCell(12))(x))


class HalfMLP(nn.Module):
  """float16 MLP whose first layer overflows to inf on a large sample."""

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(32, dtype=jnp.float16, param_dtype=jnp.float16)(x))
    return nn.Dense(4, dtype=jnp.float16, param_dtype=jnp.float16)(h)


def _linen_case(model, x):
  """(jact function of (bits, params, x), plain function of (params, x), (params, x))."""
  variables = _jit(model.init)(jax.random.key(0), x)
  rest = {k: v for k, v in variables.items() if k != "params"}

  def apply(m, params, x, **kw):
    if rest:
      return m.apply({"params": params, **rest}, x, mutable=list(rest), **kw)[0]
    return m.apply({"params": params}, x, **kw)

  @functools.cache
  def converted(bits):
    return jact.convert(model, bits=bits)

  return (
    lambda b, p, x: apply(converted(b), p, x, rngs={"jact": KEY}),
    lambda p, x: apply(model, p, x),
    (variables["params"], x),
  )


_compressed = {
  b: jact.compressed(_block, bits=b, min_size=1, name="nf", compress_argnums=(1,)) for b in WIDTHS
}
_checkpointed = {
  b: jact.checkpoint(_block, bits=b, min_size=1, name="nfc", compress_argnums=(1,)) for b in WIDTHS
}
BIG = _set(_normal((N, 16), 30), (2, 0), 3e4).astype(jnp.float16)  # sample 2 overflows in fp16

MODELS = {
  "compressed-nan-input": (
    lambda b, w, x: _compressed[b](w, x, key=KEY),
    _block,
    (_normal((64, 64), 31, 0.1), NAN_X),
  ),
  "compressed-inf-weight": (
    lambda b, w, x: _compressed[b](w, x, key=KEY),
    _block,
    (_set(_normal((64, 64), 32, 0.1), (5, 9), np.inf), X),
  ),
  "checkpoint-nan-input": (
    lambda b, w, x: _checkpointed[b](w, x, key=KEY),
    _block,
    (_normal((64, 64), 33, 0.1), NAN_X),
  ),
  "convert-conv-bn-relu-nan": _linen_case(
    CNN(), _set(_normal((N, 6, 6, 3), 34), (1, 2, 2, 0), np.nan)
  ),
  "convert-transformer-nan": _linen_case(Block(), _set(_normal((N, 5, 16), 35), (2, 1, 3), np.nan)),
  "convert-gru-nan": _linen_case(GRU(), _set(_normal((N, 6, 4), 36), (3, 2, 1), np.nan)),
  "convert-fp16-overflow": _linen_case(HalfMLP(), BIG),
}


# Each case compiles a model's plain and compressed gradients (2-4 s on XLA:CPU): the 8-bit
# width (pattern and accuracy) runs in the quick suite, the others are marked slow.
MODEL_WIDTHS = [
  pytest.param(b, id=f"b{b}", marks=() if b == 8 else pytest.mark.slow) for b in WIDTHS
]


@pytest.mark.parametrize("bits", MODEL_WIDTHS)
@pytest.mark.parametrize("name", MODELS)
def test_model_gradients_are_non_finite_exactly_where_plain_ones_are(name, bits):
  jact_fn, plain_fn, args = MODELS[name]
  half = "fp16" in name  # plain JAX takes gelu's derivative in float16, jact in float32
  _check(
    name,
    jact_fn,
    plain_fn,
    args,
    bits,
    rtol8=0.1 if half else 0.05,
    rtol_exact=1e-2 if half else 1e-4,
  )


# ------------------------------------------------------------------- saturated float16 overflow


def _overflowed(z):
  return (z * 1e3) ** 2  # inf in float16 wherever |z| > 0.256


SATURATING = {  # saturating functions of an overflowed value: derivative 0 there, as in plain JAX
  "tanh": lambda w, x: jnp.tanh(_overflowed(x @ w)),
  "exp": lambda w, x: jnp.exp(-_overflowed(x @ w)),
}
_HALF_ARGS = (_normal((64, 32), 41, 0.125, jnp.float16), _normal((64, 64), 42, dtype=jnp.float16))


def _wrapped(kind, fn):
  wrap = {"compressed": jact.compressed, "checkpoint": jact.checkpoint}[kind]
  return {b: wrap(fn, bits=b, min_size=1, name=f"sat{kind}", compress_argnums=(1,)) for b in WIDTHS}


_SATURATING_WRAPPED = {
  (kind, name): _wrapped(kind, fn)
  for kind in ("compressed", "checkpoint")
  for name, fn in SATURATING.items()
}


@pytest.mark.parametrize("bits", MODEL_WIDTHS)
@pytest.mark.parametrize("kind", ["compressed", "checkpoint"])
@pytest.mark.parametrize("name", SATURATING)
def test_saturated_float16_overflow_keeps_plain_gradients(name, kind, bits):
  """An overflowed float16 value through tanh / exp(-.) has derivative 0, not NaN (a
  folded chain's derivative was a forward-mode tangent: inf before the 0).

  Finite entries are compared at bits=None, and at 8 bits for `jact.compressed`: the
  checkpoint recomputes 1000 * x @ w from its 8-bit copy of x (errors of ~10 in a value
  whose unsaturated range is ~1), so only its pattern is plain's there."""
  w, x = _HALF_ARGS
  z = np.asarray(_overflowed(x @ w), np.float32)
  assert np.isinf(z).mean() > 0.5 and np.isfinite(z).any()  # the case really overflows
  fns = _SATURATING_WRAPPED[kind, name]
  _check(
    f"saturating-{name}",
    lambda b, w, x: fns[b](w, x, key=KEY),
    SATURATING[name],
    _HALF_ARGS,
    bits,
    rtol8=0.05 if kind == "compressed" else None,
    rtol_exact=1e-2,  # float16: the folded derivative's products round in another order
    must_be_bad=False,
  )


# ----------------------------------------------------------------------------- other compressors


def _poisoned_map():
  x = np.random.default_rng(40).standard_normal((3, 8, 8, 4)).astype(np.float32)
  x[0, 1, 1, 0], x[1, 5, 5, 2], x[2, 0, 7, 3] = np.nan, np.inf, -np.inf  # one per sample
  return x


@pytest.mark.parametrize(
  "compressor",
  [
    jact.compressors.Fixpoint(2),
    jact.compressors.Fixpoint(8),
    jact.compressors.ZeroValue(jact.compressors.Fixpoint(4), 0.5),  # sparse or dense fallback
    jact.compressors.ZeroValue(None, 0.9),
    jact.compressors.Division(block=4, bits=2),
    jact.compressors.Division(block=4, bits=4, keep="hfc"),
  ],
  ids=repr,
)
def test_compressors_keep_non_finite_values_exactly(compressor):
  x = _poisoned_map()
  y = np.asarray(compressor.decompress(compressor.compress(jnp.asarray(x), jnp.uint32(5))))
  np.testing.assert_array_equal(np.isfinite(y), np.isfinite(x))
  # one kind per sample here: each comes back as itself
  assert np.isnan(y[0, 1, 1, 0]) and y[1, 5, 5, 2] == np.inf and y[2, 0, 7, 3] == -np.inf


def test_division_lfc_only_propagates_within_the_block():
  """keep='lfc' stores no per-element part: a non-finite value makes its block's LFC NaN,
  so exactly its 4 x 4 block comes back NaN, nothing else."""
  x = _poisoned_map()
  c = jact.compressors.Division(block=4, keep="lfc")
  y = np.asarray(c.decompress(c.compress(jnp.asarray(x), None)))
  blocks = ~np.isfinite(x).reshape(3, 2, 4, 2, 4, 4).all(axis=(2, 4), keepdims=True)
  want = np.broadcast_to(blocks, (3, 2, 4, 2, 4, 4)).reshape(x.shape)
  np.testing.assert_array_equal(~np.isfinite(y), want)


def test_blpa_never_spreads_a_non_finite_value_to_other_samples():
  """BLPA has no spare code (a documented limit: the value itself comes back finite); its
  per-channel statistics skip non-finite values, so the other samples are stored as well
  as without it."""
  x = _poisoned_map()
  c = jact.compressors.BLPA(4)
  y = np.asarray(c.decompress(c.compress(jnp.asarray(x), None)))
  assert np.isfinite(y).all()
  clean = np.where(np.isfinite(x), x, 0.0)
  y_clean = np.asarray(c.decompress(c.compress(jnp.asarray(clean), None)))
  err, err_clean = np.abs(y - clean)[np.isfinite(x)], np.abs(y_clean - clean)[np.isfinite(x)]
  assert err.max() <= 1.5 * err_clean.max()
