"""BLPA (Chakrabarti & Moseley 2019): the compressor, the fused BN-ReLU-conv op, the Flax blocks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jact
from jact.compressors import from_dict
from jact.compressors._blpa import BLPA, blpa_dequantize, blpa_quantize
from jact.nn import BLPABlock as LinenBLPABlock
from jact.nnx import BLPABlock as NnxBLPABlock
from jact.ops._blpa import blpa_block, blpa_block_reference, block_conv

SHAPE = (4, 8, 8, 16)
C = SHAPE[-1]
O = 8
_rng = np.random.default_rng(0)  # numpy fixtures: no jax compilation at import
X = jnp.asarray(2.0 * _rng.standard_normal(SHAPE) + 0.5, jnp.float32)
# gamma: mixed magnitudes and signs; beta: channels 0/1 far outside +-3 gamma on both sides
_gamma = (0.5 + _rng.uniform(size=C)) * np.where(np.arange(C) % 5 == 4, -1, 1)
_beta = 0.3 * _rng.standard_normal(C)
_beta[0], _beta[1] = 10 * abs(_gamma[0]), -10 * abs(_gamma[1])
GAMMA, BETA = jnp.asarray(_gamma, jnp.float32), jnp.asarray(_beta, jnp.float32)
KERNEL = jnp.asarray(0.1 * _rng.standard_normal((3, 3, C, O)), jnp.float32)
G = jnp.asarray(_rng.standard_normal(SHAPE[:-1] + (O,)), jnp.float32)  # cotangent of y
XS = X[:2, :4, :4]  # (2, 4, 4, 16) for the Flax layers


def roundtrip(a, beta, gamma, bits):
  return _roundtrip(a, beta, gamma, bits=bits)


@jax.jit(static_argnums=0)
def _compress(c, x):
  return c.compress(x, None)


_decompress = jax.jit(lambda stored: stored.decompress())
_roundtrip = jax.jit(
  lambda a, beta, gamma, bits: blpa_dequantize(blpa_quantize(a, beta, gamma, bits)),
  static_argnames="bits",
)


def rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def exact_a2(x, gamma, beta, eps=1e-5):
  red = tuple(range(x.ndim - 1))
  mu, var = x.mean(red), x.var(red)
  inv = jax.lax.rsqrt(var + eps)
  a1 = (x - mu) * inv
  return a1, gamma * a1 + beta, inv


# ----------------------------------------------------------------------------- compressor


@pytest.mark.slow
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_compressor_stored_bytes(bits):
  c = BLPA(bits)
  stored = _compress(c, X)
  n = X.size
  assert stored.nbytes == c.stored_bytes(SHAPE, X.dtype) == n * bits // 8 + 8 * C
  assert stored.nbytes == X.nbytes * bits // 32 + 8 * C  # K/32 of float32 + step & start
  odd = jnp.ones((3, 5, 7))  # 3 rows of 35 values: each row's codes padded to whole bytes
  assert (
    _compress(c, odd).nbytes
    == c.stored_bytes(odd.shape, odd.dtype)
    == 3 * -(-35 * bits // 8) + 8 * 7
  )
  rec = _decompress(stored)
  assert rec.shape == SHAPE and rec.dtype == X.dtype
  assert not c.unbiased and not c.needs_key and c.bits == bits and c.average_bits == bits
  assert c.with_bits(8) == BLPA(8) and from_dict(c.to_dict()) == c and c.method == "blpa"


@pytest.mark.slow
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_relu_mask_exact(bits):
  # A2 = gamma * z + beta with |z| up to ~8: many values outside beta +- 3 gamma,
  # channels 0/1 with beta = +-10 gamma (the paper's window would not straddle 0), exact zeros.
  z = 2.5 * np.random.default_rng(5).standard_normal(SHAPE)
  z[..., :2] *= 4.0  # channels 0/1 (beta = +-10 gamma) reach the other sign
  a2 = GAMMA * jnp.asarray(z, jnp.float32) + BETA
  a2 = a2.at[0, 0, 0].set(0.0)
  a2_t = roundtrip(a2, BETA, GAMMA, bits)
  np.testing.assert_array_equal(np.asarray(a2_t > 0), np.asarray(a2 > 0))
  clipped = jnp.abs(a2 - BETA) > 3 * jnp.abs(GAMMA)
  assert int(clipped.sum()) > 100 and bool((a2[..., 0] < 0).any()) and bool((a2[..., 1] > 0).any())
  # the generic compressor (the tensor's own statistics), and a constant channel (gamma = 0)
  a = a2.at[..., 2].set(0.7).at[..., 3].set(-0.2)
  rec = _decompress(_compress(BLPA(bits), a))
  np.testing.assert_array_equal(np.asarray(rec > 0), np.asarray(a > 0))
  np.testing.assert_allclose(rec[..., 2:4], a[..., 2:4], rtol=1e-5)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_sign_exact_sweep(bits):
  # beta from -12 gamma to 12 gamma in fine steps: every window case (straddling 0,
  # all positive, all negative, and the boundaries between them); values on a fine
  # grid over [-20, 20] gamma that includes exact bin boundaries k * h and 0.
  levels = 2**bits
  beta = jnp.linspace(-12.0, 12.0, 193)
  h = 6.0 / levels
  a = jnp.concatenate([jnp.linspace(-20.0, 20.0, 801), h * jnp.arange(-40.0, 41.0)])
  a = jnp.broadcast_to(a[:, None], (a.size, beta.size))
  rec = roundtrip(a, beta, jnp.ones_like(beta), bits)
  np.testing.assert_array_equal(np.asarray(rec > 0), np.asarray(a > 0))
  inside = jnp.abs(a - beta) < 3.0 - h
  assert bool(jnp.all(jnp.where(inside, jnp.abs(rec - a) <= h / 2 + 1e-5, True)))


@pytest.mark.parametrize("bits", [4, 8])
def test_unclipped_error_bound(bits):
  z = jnp.asarray(np.random.default_rng(6).standard_normal(SHAPE), jnp.float32)
  a2 = GAMMA * z + BETA
  a2_t = roundtrip(a2, BETA, GAMMA, bits)
  g = jnp.abs(GAMMA)
  step = 6 * g / 2**bits
  inside = jnp.abs(a2 - BETA) < 3 * g - step
  err = jnp.abs(a2_t - a2)
  assert int(inside.sum()) > 0.9 * inside.size  # incl. channels 0/1: beta = +-10 gamma
  bound = 3 * g / 2**bits * (1 + 1e-5) + 1e-6 * (1 + jnp.abs(a2))  # + float32 rounding
  assert bool(jnp.all(jnp.where(inside, err <= bound, True)))


# ----------------------------------------------------------------------------- fused op


def loss_blpa(x, scale, bias, kernel, bits=4):
  return jnp.sum(blpa_block(x, scale, bias, kernel, bits=bits)[0] * G)


def loss_exact(x, scale, bias, kernel):
  """BN -> relu -> conv written out with plain jnp, differentiated by jax."""
  a1, a2, _ = exact_a2(x, scale, bias)
  y = jax.lax.conv_general_dilated(
    jax.nn.relu(a2), kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  return jnp.sum(y * G)


ARGS = (X, GAMMA, BETA, KERNEL)
GRAD = jax.jit(jax.grad(loss_blpa, argnums=(0, 1, 2, 3)), static_argnames="bits")
EXACT = jax.jit(jax.grad(loss_exact, argnums=(0, 1, 2, 3)))


@pytest.mark.parametrize("bits", [4, 8])
def test_block_residual_bytes(bits):
  r = jact.residual_report(lambda x, s, b, k: blpa_block(x, s, b, k, bits=bits)[0].sum(), *ARGS)
  assert r.total_bytes == X.size * bits // 8 + 4 * C  # codes + float32 1/std per channel
  groups = r.by_name()
  assert set(groups) == {"blpa.a2", "blpa.inv"}
  assert groups["blpa.a2"].bytes == X.size * bits // 8 and groups["blpa.inv"].bytes == 4 * C
  cb = jnp.ones(O)
  r2 = jact.residual_report(
    lambda x, s, b, k, cb: blpa_block(x, s, b, k, cb, bits=bits, name="b")[0].sum(), *ARGS, cb
  )
  assert r2.total_bytes == X.size * bits // 8 + 4 * C


def test_block_forward_exact():
  y, mean, var = blpa_block(*ARGS, bits=4)
  x = X
  a1, a2, _ = exact_a2(x, GAMMA, BETA)
  y_ref = block_conv(jax.nn.relu(a2), KERNEL)
  np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(mean, X.mean((0, 1, 2)), atol=1e-5)
  np.testing.assert_allclose(var, X.var((0, 1, 2)), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_block_gradient_only_variance_term_differs(bits):
  dx, dg, db, dw = GRAD(*ARGS, bits=bits)
  ex, eg, eb, ew = EXACT(*ARGS)
  # by hand, from the exact forward
  red = (0, 1, 2)
  a1, a2, inv = exact_a2(X, GAMMA, BETA)
  _, conv_vjp = jax.vjp(lambda a: block_conv(a, KERNEL), jax.nn.relu(a2))
  (d_a3,) = conv_vjp(G)
  d_a1 = GAMMA * jnp.where(a2 > 0, d_a3, 0.0)  # exact
  a2_t = roundtrip(a2, BETA, GAMMA, bits)
  a1_t = (a2_t - BETA) / GAMMA
  term_exact = inv * a1 * jnp.mean(a1 * d_a1, red)
  term_blpa = inv * a1_t * jnp.mean(a1_t * d_a1, red)
  scale = float(jnp.abs(ex).max())
  np.testing.assert_allclose(dx - ex, -(term_blpa - term_exact), atol=1e-5 * scale)
  assert float(jnp.abs(term_blpa - term_exact).max()) > 0  # the approximation is there
  np.testing.assert_allclose(db, eb, rtol=1e-5, atol=1e-5 * float(jnp.abs(eb).max()))
  # d_gamma and dW are the exact formulas evaluated at the reconstruction
  np.testing.assert_allclose(dg, jnp.sum(a1_t * d_a1 / GAMMA, red), rtol=1e-4, atol=1e-4)
  _, w_vjp = jax.vjp(lambda w: block_conv(jax.nn.relu(a2_t), w), KERNEL)
  np.testing.assert_allclose(dw, w_vjp(G)[0], rtol=1e-4, atol=1e-4)
  assert not np.allclose(dg, eg, rtol=1e-6, atol=0) and not np.allclose(dw, ew, rtol=1e-6, atol=0)
  if bits == 8:  # d_gamma's error is mostly the +-3 gamma clipping of a few outliers (0.2%)
    assert rel(dw, ew) < 0.02 and rel(dg, eg) < 0.05


@pytest.mark.slow
def test_block_gradient_error_decreases_with_bits():
  exact = EXACT(*ARGS)
  errs = {b: [rel(a, e) for a, e in zip(GRAD(*ARGS, bits=b), exact)] for b in (4, 8)}
  # relative errors of (dx, d_gamma, d_beta, dW) measured on these fixtures:
  # K=8 0.17%, 2.4%, 0, 0.35%; K=4 0.73%, 8.6%, 0, 2.6%; K=2 3.5%, 41%, 0, 11%
  assert errs[8][0] < 0.005 and errs[8][3] < 0.01 and errs[8][1] < 0.05 and errs[8][2] < 1e-5
  assert errs[4][0] > errs[8][0] and errs[4][1] > errs[8][1] and errs[4][3] > errs[8][3]
  assert max(errs[4]) < 0.2


@pytest.mark.slow
def test_block_dense_and_conv_bias():
  x = jax.random.normal(jax.random.key(7), (32, 16)) * 1.5 - 0.3
  w = 0.2 * jax.random.normal(jax.random.key(8), (16, 5))
  cb = jnp.arange(5.0)
  f = lambda *a: jnp.sum(blpa_block(*a, bits=8)[0] ** 2)
  r = lambda *a: jnp.sum(blpa_block_reference(*a) ** 2)
  got = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(x, GAMMA, BETA, w, cb)
  ref = jax.jit(jax.grad(r, argnums=(0, 1, 2, 3, 4)))(x, GAMMA, BETA, w, cb)
  np.testing.assert_allclose(
    jax.jit(blpa_block)(x, GAMMA, BETA, w, cb)[0],
    jax.jit(blpa_block_reference)(x, GAMMA, BETA, w, cb),
    atol=1e-5,
  )
  for a, e in zip(got, ref):
    assert rel(a, e) < 0.02
  np.testing.assert_allclose(got[4], ref[4], rtol=1e-5)  # conv bias: exact


# ----------------------------------------------------------------------------- flax


class _PlainLinen(nn.Module):
  """Flax's own BatchNorm -> relu -> Conv with the block's variable names."""

  use_running_average: bool

  @nn.compact
  def __call__(self, x):
    x = nn.BatchNorm(
      use_running_average=self.use_running_average, use_fast_variance=False, name="norm"
    )(x)
    return nn.Conv(O, (3, 3), use_bias=False, name="conv")(nn.relu(x))


@pytest.mark.slow
def test_linen_block():
  block = LinenBLPABlock(O, (3, 3), bits=4)
  v = jax.jit(lambda x: block.init(jax.random.key(0), x, use_running_average=False))(XS)
  assert jax.tree.map(jnp.shape, v) == {
    "params": {"norm": {"scale": (C,), "bias": (C,)}, "conv": {"kernel": (3, 3, C, O)}},
    "batch_stats": {"norm": {"mean": (C,), "var": (C,)}},
  }
  v = {
    "params": {"norm": {"scale": GAMMA, "bias": BETA}, "conv": {"kernel": KERNEL}},
    "batch_stats": v["batch_stats"],
  }
  g = G[:2, :4, :4]

  @jax.jit
  def train(v):
    (y, upd), grads = jax.value_and_grad(
      lambda p: (lambda o: (jnp.sum(o[0] * g), o))(
        block.apply(
          {"params": p, "batch_stats": v["batch_stats"]},
          XS,
          use_running_average=False,
          mutable=["batch_stats"],
        )
      ),
      has_aux=True,
    )(v["params"])
    (ref_y, ref_upd), ref_grads = jax.value_and_grad(
      lambda p: (lambda o: (jnp.sum(o[0] * g), o))(
        _PlainLinen(False).apply(
          {"params": p, "batch_stats": v["batch_stats"]}, XS, mutable=["batch_stats"]
        )
      ),
      has_aux=True,
    )(v["params"])
    return upd, grads, ref_upd, ref_grads

  (y, upd), grads, (y_plain, upd_plain), ref = train(v)
  np.testing.assert_allclose(y, y_plain, atol=1e-5, rtol=1e-5)  # train forward: exact
  np.testing.assert_allclose(
    upd["batch_stats"]["norm"]["mean"], 0.01 * XS.mean((0, 1, 2)), atol=1e-6
  )
  for k in ("mean", "var"):
    np.testing.assert_allclose(
      upd["batch_stats"]["norm"][k], upd_plain["batch_stats"]["norm"][k], atol=1e-6, rtol=1e-5
    )
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(grads))
  assert rel(grads["conv"]["kernel"], ref["conv"]["kernel"]) < 0.1
  np.testing.assert_allclose(grads["norm"]["bias"], ref["norm"]["bias"], rtol=1e-4, atol=1e-4)
  v2 = {"params": v["params"], **upd}
  y_eval = jax.jit(LinenBLPABlock(O, (3, 3), use_running_average=True).apply)(v2, XS)
  np.testing.assert_allclose(y_eval, jax.jit(_PlainLinen(True).apply)(v2, XS), atol=1e-5, rtol=1e-5)


class _PlainNnx(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.BatchNorm(C, use_fast_variance=False, rngs=rngs)
    self.conv = nnx.Conv(C, O, (3, 3), use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.conv(nnx.relu(self.norm(x)))


@pytest.mark.slow
def test_nnx_block():
  block = NnxBLPABlock(C, O, (3, 3), bits=4, rngs=nnx.Rngs(0))
  plain = _PlainNnx(nnx.Rngs(1))
  nnx.update(plain, nnx.state(block))  # same state paths: norm/{scale,bias,mean,var}, conv/kernel
  np.testing.assert_allclose(plain.conv.kernel[...], block.conv.kernel[...])
  call = nnx.jit(lambda m, x: m(x))
  y, y_plain = call(block, XS), call(plain, XS)
  np.testing.assert_allclose(y, y_plain, atol=1e-5, rtol=1e-5)  # train forward: exact
  np.testing.assert_allclose(block.norm.mean[...], 0.01 * XS.mean((0, 1, 2)), atol=1e-6)
  np.testing.assert_allclose(block.norm.var[...], plain.norm.var[...], rtol=1e-5)
  block.eval(), plain.eval()
  assert block.use_running_average
  np.testing.assert_allclose(call(block, XS), call(plain, XS), atol=1e-5, rtol=1e-5)
  block.train()
  assert not block.use_running_average
  mean_before = block.norm.mean[...]

  @nnx.jit
  def grad(m):
    return nnx.grad(lambda m: jnp.sum(m(XS) * G[:2, :4, :4]))(m)

  grads = grad(block)
  leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
  assert len(leaves) == 3 and all(bool(jnp.isfinite(g).all()) for g in leaves)
  assert not np.allclose(block.norm.mean[...], mean_before)  # the train step updated the stats


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_an_int_kernel_size_is_read_like_flax_conv_by_both_twins(k):
  """An int k is the 1-D window (k,) in both twins, as flax.linen.Conv and
  flax.nnx.Conv read it; on a 2-D input it is a clear error, not a square."""
  x1 = XS[:, 0]  # (N, L, C): one spatial axis
  linen = LinenBLPABlock(O, k, use_running_average=False).init(jax.random.key(0), x1)
  twin = NnxBLPABlock(C, O, k, rngs=nnx.Rngs(0))
  flax_linen = nn.Conv(O, k).init(jax.random.key(0), x1)
  flax_nnx = nnx.Conv(C, O, k, rngs=nnx.Rngs(0))
  shape = linen["params"]["conv"]["kernel"].shape
  assert shape == twin.conv.kernel.shape == flax_linen["params"]["kernel"].shape
  assert shape == flax_nnx.kernel.shape == (k, C, O)
  assert nnx.jit(lambda m, x: m(x))(twin, x1).shape == (2, 4, O)
  with pytest.raises(ValueError, match=r"kernel_size \(3,\) has 1 axes .* 2 spatial axes"):
    LinenBLPABlock(O, 3, use_running_average=False).init(jax.random.key(0), XS)
  with pytest.raises(ValueError, match=r"kernel_size \(3,\) has 1 axes .* 2 spatial axes"):
    NnxBLPABlock(C, O, 3, rngs=nnx.Rngs(0))(XS)


# ----------------------------------------------------------------------------- errors


def test_errors():
  with pytest.raises(ValueError, match="BLPA needs bits in .*only the sign"):
    BLPA(1)
  with pytest.raises(ValueError, match="BLPA needs bits"):
    blpa_block(*ARGS, bits=3)
  with pytest.raises(ValueError, match="BLPA needs bits"):
    LinenBLPABlock(O, (3, 3), bits=1, use_running_average=False).init(jax.random.key(0), XS)
  with pytest.raises(ValueError, match="BLPA needs bits"):
    NnxBLPABlock(C, O, (3, 3), bits=1, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="floating-point input.*cast it first"):
    blpa_block(X.astype(jnp.int32), GAMMA, BETA, KERNEL)
  with pytest.raises(TypeError, match="cast it first"):
    BLPA(4).compress(jnp.ones((4, 4), jnp.int32), None)
  with pytest.raises(ValueError, match=r"scale has shape \(8,\), expected \(16,\)"):
    blpa_block(X, GAMMA[:8], BETA, KERNEL)
  with pytest.raises(ValueError, match="kernel has shape .* C = 16 input channels"):
    blpa_block(X, GAMMA, BETA, KERNEL[:, :, :8])
  with pytest.raises(ValueError, match="one value per channel"):
    blpa_quantize(X, BETA[:4], GAMMA, 4)
