"""Tests of the compressed matmuls and convolutions (jact/ops/_linear.py).

Properties checked, with stated tolerances:
  * forward equals the lax/jnp op bit for bit (the forward is exact);
  * at 2 bits, gradients averaged over many keys are unbiased
    (`stats.assert_unbiased` defaults: |pooled z| < 4, mean z^2 < 1.6, and
    gradients that do not depend on a compressed operand exact to 1e-5);
  * at 8 bits, gradients are close to exact (relative L2 error < 2e-2);
  * low-precision inputs keep their dtype through forward and backward;
  * residual bytes, residual names and checkpoint-policy composition;
  * clear errors for bad settings.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jact.compressors import PerGroup
from jact.ops import _linear as L
from stats import DRAWS, assert_unbiased

from jact._compat.testing import saved_residuals

N_DRAWS = DRAWS  # enough to see a bias of 1% of a rounding step (tests/stats.py)
BITS = 2


def _normal(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _linear_loss(f, out_shape, seed=99):
  """sum(f(a, b) * C) for a fixed random C, so every output has its own cotangent."""
  c = _normal(seed, out_shape)
  return lambda a, b, *rest: jnp.sum(f(a, b, *rest).astype(jnp.float32) * c)


def _grad_draws(op_loss, a, b, n=N_DRAWS, seed=0):
  """Gradients (d/da, d/db) for n independent keys, vmapped and jitted."""
  keys = jax.random.split(jax.random.key(seed), n)
  grad = jax.grad(op_loss, argnums=(0, 1))
  return jax.jit(jax.vmap(lambda k: grad(a, b, k)))(keys)


def _check_unbiased(op, plain, a, b, seed=0):
  """Forward exact, both gradients unbiased at BITS bits."""
  np.testing.assert_array_equal(jax.jit(op)(a, b, jax.random.key(7)), jax.jit(plain)(a, b))
  out_shape = jax.eval_shape(plain, a, b).shape
  exact = jax.jit(jax.grad(_linear_loss(plain, out_shape), argnums=(0, 1)))(a, b)
  draws = _grad_draws(_linear_loss(op, out_shape), a, b, seed=seed)
  stats = [assert_unbiased(d, e) for d, e in zip(draws, exact)]
  return stats


# ----------------------------------------------------------------------------- matmuls


def test_dot_general_both_operands_unbiased():
  a, b = _normal(0, (16, 24)), _normal(1, (24, 8))
  dims = (((1,), (0,)), ((), ()))
  op = lambda a, b, k: L.dot_general(a, b, dims, key=k, bits=BITS)
  plain = lambda a, b: lax.dot_general(a, b, dims)
  stats = _check_unbiased(op, plain, a, b)
  # Both operands compressed: both gradients are noisy.
  assert all(s["noisy_fraction"] > 0.99 for s in stats), stats


def test_dot_general_batched_contraction():
  a, b = _normal(2, (3, 8, 16)), _normal(3, (3, 16, 4))
  dims = (((2,), (1,)), ((0,), (0,)))
  op = lambda a, b, k: L.dot_general(a, b, dims, key=k, bits=BITS)
  _check_unbiased(op, lambda a, b: lax.dot_general(a, b, dims), a, b)


def test_dense_weight_grad_unbiased_input_grad_exact():
  x, w = _normal(4, (4, 8, 32)), _normal(5, (32, 8))
  op = lambda x, w, k: L.dense(x, w, key=k, bits=BITS)
  stats = _check_unbiased(op, lambda x, w: x @ w, x, w)
  # d/dx = g @ w.T never reads the compressed x: exact, no noise at all.
  assert stats[0]["noisy_fraction"] == 0.0 and stats[0]["deterministic_max_err"] <= 1e-5
  assert stats[1]["noisy_fraction"] > 0.99


def test_dense_bias_forward():
  x, w, b = _normal(6, (8, 16)), _normal(7, (16, 4)), _normal(8, (4,))
  y = L.dense(x, w, b, key=jax.random.key(0), bits=BITS)
  np.testing.assert_array_equal(y, x @ w + b)


@pytest.mark.parametrize(
  "subscripts, shapes",
  [
    ("bqhd,bkhd->bhqk", ((2, 8, 2, 16), (2, 8, 2, 16))),  # attention scores q.k
    ("bhqk,bkhd->bqhd", ((2, 2, 8, 8), (2, 8, 2, 16))),  # probabilities times values
  ],
)
@pytest.mark.slow
def test_einsum_attention_forms_unbiased(subscripts, shapes):
  a, b = _normal(10, shapes[0]), _normal(11, shapes[1])
  op = lambda a, b, k: L.einsum(subscripts, a, b, key=k, bits=BITS)
  _check_unbiased(op, lambda a, b: jnp.einsum(subscripts, a, b), a, b)


def test_stochastic_false_is_detected_as_biased():
  """The statistical check can fail: round-to-nearest at 2 bits is biased."""
  x, w = _normal(4, (16, 32)), _normal(5, (32, 8))
  op = lambda x, w, k: L.dense(x, w, key=k, compressor=PerGroup(BITS, stochastic=False))
  out_shape = (16, 8)
  exact = jax.grad(_linear_loss(lambda x, w: x @ w, out_shape), argnums=1)(x, w)
  draws = _grad_draws(_linear_loss(op, out_shape), x, w, n=16)
  with pytest.raises(AssertionError, match="deterministic elements differ"):
    assert_unbiased(draws[1], exact)


# ----------------------------------------------------------------------------- convolutions

CONV_CASES = {
  # name: (x shape, kernel shape, conv keywords)
  "1d_stride2_same": ((2, 16, 3), (3, 3, 4), dict(strides=2, padding="SAME")),
  "2d_valid_dilated": ((2, 9, 9, 3), (3, 3, 3, 4), dict(padding="VALID", dilation=2)),
  "2d_explicit_stride": (
    (2, 8, 8, 3),
    (3, 3, 3, 4),
    dict(strides=(2, 1), padding=((1, 2), (0, 1))),
  ),
  "2d_depthwise": ((2, 8, 8, 4), (3, 3, 1, 8), dict(padding="SAME", feature_group_count=4)),
  "3d_stride_same": ((1, 5, 6, 6, 2), (3, 3, 3, 2, 3), dict(strides=2, padding="SAME")),
}


def _plain_conv(x, kernel, strides=1, padding="SAME", dilation=1, feature_group_count=1):
  n = x.ndim - 2
  t = lambda v: (v,) * n if isinstance(v, int) else tuple(v)
  sp = "DHW"[3 - n :]
  return lax.conv_general_dilated(
    x,
    kernel,
    t(strides),
    padding,
    rhs_dilation=t(dilation),
    dimension_numbers=("N" + sp + "C", sp + "IO", "N" + sp + "C"),
    feature_group_count=feature_group_count,
  )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_forward_exact_kernel_grad_unbiased(case):
  xs, ks, kw = CONV_CASES[case]
  x, kernel = _normal(20, xs), _normal(21, ks)
  op = lambda x, w, k: L.conv(x, w, key=k, bits=BITS, **kw)
  stats = _check_unbiased(op, functools.partial(_plain_conv, **kw), x, kernel)
  # The input gradient (a transposed convolution of g with the kernel) is exact.
  assert stats[0]["noisy_fraction"] == 0.0
  assert stats[1]["noisy_fraction"] > 0.9


def test_conv_general_dilated_lhs_dilation_forward_exact():
  x, kernel = _normal(22, (2, 3, 7, 7)), _normal(23, (4, 3, 3, 3))  # NCHW / OIHW
  kw = dict(window_strides=(1, 1), padding=((1, 1), (1, 1)), lhs_dilation=(2, 2))
  y = jax.jit(lambda x, w: L.conv_general_dilated(x, w, key=jax.random.key(0), bits=BITS, **kw))(
    x, kernel
  )  # one compile
  np.testing.assert_array_equal(
    y, jax.jit(lambda x, w: lax.conv_general_dilated(x, w, **kw))(x, kernel)
  )


def test_conv_transpose_unbiased():
  x, kernel = _normal(24, (2, 5, 5, 3)), _normal(25, (3, 3, 3, 4))
  kw = dict(strides=(2, 2), padding="SAME")
  op = lambda x, w, k: L.conv_transpose(x, w, key=k, bits=BITS, **kw)
  plain = lambda x, w: lax.conv_transpose(x, w, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw)
  stats = _check_unbiased(op, plain, x, kernel)
  assert stats[0]["noisy_fraction"] == 0.0 and stats[1]["noisy_fraction"] > 0.9


# ----------------------------------------------------------------------------- 8 bits, dtypes

# Relative L2 error of a gradient at 8 bits. Expected ~0.9% for normal data:
# a 256-value group spans ~5.5 sigma, so the step is ~0.022 sigma and the
# stochastic-rounding noise has std ~step/sqrt(6) ~0.009 sigma per element,
# which carries over to the relative error of x_hat^T g. Measured 0.6-0.96%.
EIGHT_BIT_RTOL = 2e-2


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dot_general", "einsum", "conv", "conv_transpose"])
def test_eight_bit_gradients_close_to_exact(which):
  if which == "dot_general":
    a, b = _normal(30, (32, 64)), _normal(31, (64, 16))
    dims = (((1,), (0,)), ((), ()))
    op = lambda a, b, k: L.dot_general(a, b, dims, key=k, bits=8)
    plain = lambda a, b: lax.dot_general(a, b, dims)
  elif which == "einsum":
    a, b = _normal(32, (2, 16, 2, 32)), _normal(33, (2, 16, 2, 32))
    op = lambda a, b, k: L.einsum("bqhd,bkhd->bhqk", a, b, key=k, bits=8)
    plain = lambda a, b: jnp.einsum("bqhd,bkhd->bhqk", a, b)
  elif which == "conv":
    a, b = _normal(34, (2, 12, 12, 8)), _normal(35, (3, 3, 8, 8))
    op = lambda a, b, k: L.conv(a, b, key=k, bits=8, strides=2)
    plain = lambda a, b: _plain_conv(a, b, strides=2)
  else:
    a, b = _normal(36, (2, 6, 6, 8)), _normal(37, (3, 3, 8, 4))
    op = lambda a, b, k: L.conv_transpose(a, b, (2, 2), "SAME", key=k, bits=8)
    plain = lambda a, b: lax.conv_transpose(
      a, b, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
  out_shape = jax.eval_shape(plain, a, b).shape
  # Unoptimized: compiles faster, and the comparison is a relative tolerance.
  fast = dict(compiler_options={"xla_backend_optimization_level": 0})
  exact = jax.jit(jax.grad(_linear_loss(plain, out_shape), argnums=(0, 1)), **fast)(a, b)
  got = jax.jit(jax.grad(_linear_loss(op, out_shape), argnums=(0, 1)), **fast)(
    a, b, jax.random.key(3)
  )
  for g, e in zip(got, exact):
    assert _rel_err(g, e) < EIGHT_BIT_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_dtypes_preserved(dtype):
  k = jax.random.key(0)
  x, w = _normal(40, (8, 32), dtype), _normal(41, (32, 16), dtype)
  img, kern = _normal(42, (2, 8, 8, 4), dtype), _normal(43, (3, 3, 4, 8), dtype)
  q, kk = _normal(44, (2, 8, 2, 16), dtype), _normal(45, (2, 8, 2, 16), dtype)
  cases = [
    (lambda a, b: L.dense(a, b, key=k, bits=BITS), lambda a, b: a @ b, x, w),
    (lambda a, b: L.conv(a, b, key=k, bits=BITS), _plain_conv, img, kern),
    (
      lambda a, b: L.einsum("bqhd,bkhd->bhqk", a, b, key=k, bits=BITS),
      lambda a, b: jnp.einsum("bqhd,bkhd->bhqk", a, b),
      q,
      kk,
    ),
    (
      lambda a, b: L.conv_transpose(a, b, (2, 2), "SAME", key=k, bits=BITS),
      lambda a, b: lax.conv_transpose(
        a, b, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
      ),
      img,
      kern,
    ),
  ]

  def run(op, a, b):
    y, vjp = jax.vjp(op, a, b)
    return y, vjp(jnp.ones_like(y))

  if dtype == jnp.float16:  # float16 shares bfloat16's code path; two ops suffice
    cases = cases[:2]
  for op, plain, a, b in cases:
    y, (ga, gb) = jax.jit(functools.partial(run, op))(a, b)
    assert y.dtype == dtype
    np.testing.assert_array_equal(y, jax.jit(plain)(a, b))
    assert ga.dtype == dtype and gb.dtype == dtype
    assert bool(
      jnp.isfinite(ga.astype(jnp.float32)).all() & jnp.isfinite(gb.astype(jnp.float32)).all()
    )


# ----------------------------------------------------------------------------- residuals


def _nbytes(aval):
  return int(np.prod(aval.shape)) * aval.dtype.itemsize


def _saved(fn, *args):
  """(aval, description) of saved residuals that are not arguments, constants or literals."""
  outside = ("from the argument", "from a constant", "from a literal")
  return [(a, d) for a, d in saved_residuals(fn, *args) if not d.startswith(outside)]


def _activation_bytes(fn, names, *args):
  """Residual bytes (excluding arguments) when only residuals named `names` may be saved."""
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  return sum(_nbytes(a) for a, _ in _saved(jax.checkpoint(fn, policy=policy), *args))


def _plain_activation_bytes(fn, *args):
  """Residual bytes (excluding arguments) of a plain op, everything saveable."""
  policy = jax.checkpoint_policies.everything_saveable
  return sum(_nbytes(a) for a, _ in _saved(jax.checkpoint(fn, policy=policy), *args))


RESIDUAL_CASES = {
  # op name: (jact op with the activation computed inside, plain op, args, residual names)
  "dense": (
    lambda x, w: L.dense(2.0 * x, w, key=jax.random.key(0), bits=BITS),
    lambda x, w: (2.0 * x) @ w,
    ((64, 512), (512, 8)),
    ("dense.lhs",),
  ),
  "conv": (
    lambda x, w: L.conv(2.0 * x, w, key=jax.random.key(0), bits=BITS),
    lambda x, w: _plain_conv(2.0 * x, w),
    ((4, 16, 16, 16), (3, 3, 16, 4)),
    ("conv.lhs",),
  ),
  "einsum": (
    lambda a, b: L.einsum("bqhd,bkhd->bhqk", 2.0 * a, 2.0 * b, key=jax.random.key(0), bits=BITS),
    lambda a, b: jnp.einsum("bqhd,bkhd->bhqk", 2.0 * a, 2.0 * b),
    ((2, 64, 2, 64), (2, 64, 2, 64)),
    ("einsum.lhs", "einsum.rhs"),
  ),
}


@pytest.mark.parametrize("case", list(RESIDUAL_CASES))
def test_residual_bytes_at_two_bits(case):
  op, plain, shapes, names = RESIDUAL_CASES[case]
  args = [_normal(50 + i, s) for i, s in enumerate(shapes)]
  compressed = _activation_bytes(op, names, *args)
  full = _plain_activation_bytes(plain, *args)
  activation = sum(_nbytes(a) for a in args[: len(names)])  # what the plain op keeps
  assert full == activation
  assert 0 < compressed <= full / 8, (compressed, full)


@pytest.mark.parametrize("case", list(RESIDUAL_CASES))
def test_every_residual_piece_is_named(case):
  op, _, shapes, names = RESIDUAL_CASES[case]
  args = [_normal(60 + i, s) for i, s in enumerate(shapes)]
  # Without a policy the compressed pieces (codes, minimum, scale) are what is saved,
  # plus a kept weight (an argument, alive anyway).
  plain_saved = _saved(op, *args)
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  kept = _saved(jax.checkpoint(op, policy=policy), *args)
  # Everything kept under the policy carries one of the documented names ...
  assert kept and all(any(f"named '{n}'" in d for n in names) for _, d in kept), kept
  for n in names:  # ... each name covers the codes, minimum and scale of its operand ...
    dtypes = sorted(str(a.dtype) for a, d in kept if f"named '{n}'" in d)
    assert dtypes == ["bfloat16", "bfloat16", "uint8"], (n, dtypes)
  # ... and no float32 tensor (the matmul output or a recomputed operand) is among them.
  assert not any(a.dtype == jnp.float32 for a, _ in kept)
  compressed = sum(_nbytes(a) for a, d in plain_saved if a.dtype != jnp.float32)
  assert sum(_nbytes(a) for a, _ in kept) == compressed


def test_checkpoint_policy_keeps_gradients():
  """Under save_only_these_names the backward uses the saved (same) rounding: same gradients."""
  x, w = _normal(70, (32, 64)), _normal(71, (64, 8))
  k = jax.random.key(5)
  f = lambda x, w, k: jnp.sum(jnp.tanh(L.dense(jnp.sin(x), w, key=k, bits=BITS)))
  g = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w, k)
  policy = jax.checkpoint_policies.save_only_these_names("dense.lhs")
  gc = jax.jit(jax.grad(jax.checkpoint(f, policy=policy), argnums=(0, 1)))(x, w, k)
  for a, b in zip(g, gc):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  # With no name saved, remat recomputes everything and keeps only the arguments.
  none = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("other"))
  assert _saved(none, x, w, k) == []


def test_custom_name_prefix():
  x, w = _normal(72, (16, 64)), _normal(73, (64, 8))
  f = lambda x, w: L.dense(2.0 * x, w, key=jax.random.key(0), bits=BITS, name="block1.fc")
  policy = jax.checkpoint_policies.save_only_these_names("block1.fc.lhs")
  kept = _saved(jax.checkpoint(f, policy=policy), x, w)
  assert len(kept) == 3 and all("named 'block1.fc.lhs'" in d for _, d in kept)


def test_bits_none_stores_plain_input():
  x, w = _normal(74, (16, 64)), _normal(75, (64, 8))
  f = lambda x, w: L.dense(2.0 * x, w, bits=None)
  saved = _saved(f, x, w)
  shapes = sorted((tuple(a.shape), str(a.dtype)) for a, _ in saved)
  assert shapes == [((16, 64), "float32")]
  # the kernel is kept by reference: the argument itself, not a copy of it
  assert [
    tuple(a.shape) for a, d in saved_residuals(f, x, w) if d.startswith("from the argument")
  ] == [(64, 8)]
  # and the gradient is exact up to float32 reassociation (small entries are
  # sums of cancelling terms, so the bound is relative to the gradient's scale)
  g = jax.jit(jax.grad(lambda w: jnp.sum(f(x, w) ** 2)))(w)
  ge = jax.jit(jax.grad(lambda w: jnp.sum(((2.0 * x) @ w) ** 2)))(w)
  np.testing.assert_allclose(g, ge, rtol=1e-6, atol=1e-6 * float(jnp.abs(ge).max()))


# ----------------------------------------------------------------------------- errors


def test_bad_bits_and_group_size():
  x, w = _normal(80, (4, 16)), _normal(81, (16, 4))
  k = jax.random.key(0)
  with pytest.raises(ValueError, match="bits must be one of"):
    L.dense(x, w, key=k, bits=9)
  with pytest.raises(ValueError, match="bits must be one of"):
    L.dense(x, w, key=k, bits=True)
  with pytest.raises(ValueError, match="group_size must be a positive multiple of 8"):
    L.conv(x[None], w[None], key=k, compressor=PerGroup(4, group_size=12))


def test_integer_input_error_names_the_fix():
  x, w = jnp.ones((4, 16), jnp.int32), _normal(82, (16, 4))
  with pytest.raises(TypeError, match=r"got int32.*astype\(jnp.float32\)"):
    jax.grad(lambda w: L.dense(x, w, key=jax.random.key(0)).sum())(w)


def test_missing_key():
  x, w = _normal(83, (4, 16)), _normal(84, (16, 4))
  with pytest.raises(ValueError, match=r"needs a PRNG key.*stochastic=False.*bits=None"):
    L.dense(x, w)
  with pytest.raises(ValueError, match="jact.ops.einsum"):
    L.einsum("ij,jk->ik", x, w)
  # Round-to-nearest needs no key and ignores one: the same gradient with or without.
  nearest = PerGroup(4, stochastic=False)
  g1 = jax.jit(jax.grad(lambda w: L.dense(x, w, compressor=nearest).sum()))(w)
  g2 = jax.jit(jax.grad(lambda w: L.dense(x, w, key=jax.random.key(5), compressor=nearest).sum()))(
    w
  )
  np.testing.assert_array_equal(g1, g2)
  # d/dw sum(x @ w) = column sums of the 4-bit x_hat: each of the 4 rows is off
  # by at most half a step, step <= 1.01 * range(x) / 15 (bf16 step rounded up).
  exact = np.asarray(x, np.float64).sum(0)[:, None] * np.ones((1, 4))
  half_step = 1.01 * float(x.max() - x.min()) / 15 / 2
  err = np.abs(np.asarray(g1, np.float64) - exact)
  assert err.max() <= 4 * half_step + 1e-6 and err.max() > 0  # rounded, within the bound
