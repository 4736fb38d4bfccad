"""Every integer width 1-8 and 16 in packing and the per-group quantizer: bit-exact
layouts (against an independent numpy packing and hand-computed bytes), stored
sizes, the reconstruction bound, plans and ops at the new widths, and the
errors for widths that are not supported. (The kernels at every width:
tests/kernels/test_kernel_contract.py; unbiasedness: tests/core/test_quantize.py.)"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact._core.packing import (
  SUPPORTED_BITS,
  code_dtype,
  pack_bits,
  pack_codes,
  packed_codes_bytes,
  packing_unit,
  unpack_bits,
  unpack_codes,
)
from jact.compressors import PerGroup
from jact.kernels._quantize.reference import dequantize_reference, quantize_reference

_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
_pack_bits = _jit(pack_bits, static_argnums=1)
_unpack_bits = _jit(unpack_bits, static_argnums=1)


def _numpy_pack(codes: np.ndarray, bits: int) -> np.ndarray:
  """Independent packing along the last axis, written from the layout's definition."""
  n = codes.shape[-1]
  if bits == 16:
    return np.concatenate([codes & 255, codes >> 8], axis=-1).astype(np.uint8)
  if 8 % bits == 0:  # planar: byte j holds codes j, j + q, j + 2q, ... (q = n // k)
    k = 8 // bits
    q = n // k
    out = np.zeros(codes.shape[:-1] + (q,), np.int64)
    for i in range(k):
      out |= codes[..., i * q : (i + 1) * q].astype(np.int64) << (bits * i)
    return out.astype(np.uint8)
  m = n // 8  # bit planes: byte j of plane p holds bit p of code i*m + j in its bit i
  out = np.zeros(codes.shape[:-1] + (bits, m), np.int64)
  for p in range(bits):
    for i in range(8):
      out[..., p, :] |= ((codes[..., i * m : (i + 1) * m].astype(np.int64) >> p) & 1) << i
  return out.reshape(codes.shape[:-1] + (bits * m,)).astype(np.uint8)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_bits_is_the_documented_layout_and_round_trips(bits):
  rng = np.random.default_rng(bits)
  unit = packing_unit(bits)
  shapes = [(unit,), (3, 5 * unit), (2, 3, 8 * unit)]
  codes = [rng.integers(0, 2**bits, shape).astype(code_dtype(bits)) for shape in shapes]
  # one compile for all shapes
  both = _jit(lambda cs: [(pack_bits(c, bits), unpack_bits(pack_bits(c, bits), bits)) for c in cs])
  for c, (packed, back) in zip(codes, both([jnp.asarray(c) for c in codes])):
    assert packed.dtype == np.uint8 and packed.shape == c.shape[:-1] + (c.shape[-1] * bits // 8,)
    np.testing.assert_array_equal(np.asarray(packed), _numpy_pack(c, bits))
    assert back.dtype == code_dtype(bits)
    np.testing.assert_array_equal(np.asarray(back), c)


# Bytes computed by hand from the layouts' definitions (module docstring of jact._core.packing);
# those of 1, 2, 4, 8 bits are the bytes jact stored before widths 3, 5, 6, 7 and 16 existed.
_HAND = {
  1: ([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0], [59, 50]),
  2: ([0, 1, 2, 3, 3, 2, 1, 0], [120, 45]),
  4: ([1, 2, 3, 4], [49, 66]),
  8: ([7, 200], [7, 200]),
  3: ([0, 1, 2, 3, 4, 5, 6, 7], [0b10101010, 0b11001100, 0b11110000]),
  5: ([31, 0, 0, 0, 0, 0, 0, 16], [1, 1, 1, 1, 0b10000001]),
  16: ([0x1234, 0xABCD], [0x34, 0xCD, 0x12, 0xAB]),
}


@pytest.mark.parametrize("bits", sorted(_HAND))
def test_packed_bytes_match_hand_computed_ones(bits):
  codes, expected = _HAND[bits]
  codes = jnp.asarray(codes, code_dtype(bits))
  assert np.asarray(_pack_bits(codes, bits)).tolist() == expected
  np.testing.assert_array_equal(np.asarray(_unpack_bits(_pack_bits(codes, bits), bits)), codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_codes_rows_and_ragged_shapes(bits):
  rng = np.random.default_rng(100 + bits)
  unit = packing_unit(bits)
  shapes = [(), (0,), (7,), (3, 0), (4, 3, 5), (2, 10), (5, 17), (17,)]
  codes = [rng.integers(0, 2**bits, shape) for shape in shapes]
  codes[-1] = codes[-2][1]  # a row of (5, 17) alone
  roundtrip = _jit(
    lambda cs: [(pack_codes(c, bits), unpack_codes(pack_codes(c, bits))) for c in cs]
  )
  out = roundtrip([jnp.asarray(c) for c in codes])
  for shape, c, (p, back) in zip(shapes, codes, out):
    rows, d = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))
    # ceil(n * bits / 8) bytes a row, n the row's length rounded up to the layout's unit
    per_row = -(-max(d, 1) // unit) * unit * bits // 8
    assert p.nbytes == rows * per_row == packed_codes_bytes(shape, bits), (shape, p.nbytes)
    assert back.shape == shape
    assert back.dtype == (jnp.bool_ if bits == 1 else code_dtype(bits))
    np.testing.assert_array_equal(np.asarray(back).astype(np.int64), c)
  # no byte mixes two rows: a row's bytes are those of the row packed alone
  np.testing.assert_array_equal(np.asarray(out[-2][0].data[1]), np.asarray(out[-1][0].data))


def test_sixteen_bit_codes_are_not_truncated():
  codes = jnp.asarray([[0, 255, 256, 65535]], jnp.int32)
  p = pack_codes(codes, 16)
  assert p.nbytes == 8
  back = unpack_codes(p)
  assert back.dtype == jnp.uint16 and back.tolist() == [[0, 255, 256, 65535]]


@functools.partial(_jit, static_argnames="bits")
def _quantize_both(x, seed, *, bits):
  """(Packed, dequantized) with stochastic rounding, then round-to-nearest: one compile."""
  out = []
  for stochastic in (True, False):
    p = quantize_reference(x, seed, bits=bits, group_size=64, stochastic=stochastic)
    out.append((p, dequantize_reference(p)))
  return out


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_reconstruction_within_one_step_and_nbytes(bits):
  rng = np.random.default_rng(bits)
  x = jnp.asarray(rng.standard_normal((3, 200)) * 3.0, jnp.float32)  # 3 groups of 64 and 8
  for stochastic, (p, xh) in zip((True, False), _quantize_both(x, jnp.uint32(bits), bits=bits)):
    codes = np.asarray(unpack_bits(p.data, bits), np.int64)
    assert codes.max() <= 2**bits - 1
    step = np.repeat(np.asarray(p.scale, np.float64), 64, axis=1)[:, :200]
    err = np.abs(np.asarray(xh, np.float64) - np.asarray(x, np.float64))
    bound = step * (1.0 if stochastic else 0.5) * (1 + 1e-5)
    assert (err <= bound).all(), (bits, stochastic, float((err - bound).max()))
    assert p.data.shape == (3, 4, 64 * bits // 8)
    assert p.nbytes == 3 * 4 * (64 * bits // 8 + 4)  # codes + bf16 minimum and step a group
    # more levels, smaller steps: the step shrinks 2**bits-fold (bf16 rounding: < 1% more)
    ranges = np.ptp(np.asarray(x), axis=1).max()
    assert float(p.scale.astype(jnp.float32).max()) <= 1.01 * ranges / (2**bits - 1)
  assert PerGroup(bits, 64).stored_bytes((3, 256)) == 3 * 4 * (64 * bits // 8 + 4)


@pytest.mark.parametrize("bits", [0, 9, 12, 32, True, 2.5, "4"])
def test_unsupported_widths_are_refused_naming_the_widths(bits):
  match = r"bits must be one of \(1, 2, 3, 4, 5, 6, 7, 8, 16\).*1 to 8 or 16"
  with pytest.raises(ValueError, match=match):
    jact.quantize(jnp.ones((2, 8)), jax.random.key(0), bits=bits)
  with pytest.raises(ValueError, match=match):
    pack_codes(jnp.ones((8,), jnp.uint8), bits)
  with pytest.raises(ValueError, match=match):
    PerGroup(bits)
  if bits != 32:  # 32 is a plan's alias of None (uncompressed)
    with pytest.raises(ValueError, match="1 to 8 or 16"):
      jact.BitPlan({"a.lhs": bits})


@pytest.mark.slow
def test_new_widths_are_accepted_by_plans_overrides_and_ops():
  x = jax.random.normal(jax.random.key(0), (4, 64))
  w = jax.random.normal(jax.random.key(1), (64, 8))
  exact_dense = jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)
  f = lambda w: jnp.sum(jnp.tanh(x @ w) ** 2)
  exact_f = jax.grad(f)(w)
  rel = lambda g, e: float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))
  errors = {}
  for bits in (3, 16):
    assert jact.BitPlan({"a.lhs": bits})["a.lhs"] == bits
    # the gradient uses the stored input: near the exact one, nearer at 16 bits
    dense = lambda w: jnp.sum(jact.ops.dense(x, w, bits=bits, key=jax.random.key(2)) ** 2)
    fn = jact.compressed(f, min_size=1, bits=8, overrides={"compressed.1": bits})
    errors[bits] = (
      rel(jax.grad(dense)(w), exact_dense),
      rel(jax.grad(fn)(w, key=jax.random.key(3)), exact_f),
    )
  assert errors[16][0] < 1e-3 < errors[3][0] < 0.5, errors
  assert errors[16][1] < 1e-3 < errors[3][1] < 0.5, errors


def test_bit_plan_files_keep_every_width():
  plan = jact.BitPlan({f"l{b}.lhs": b for b in SUPPORTED_BITS} | {"x.lhs": None})
  again = jact.BitPlan.from_json(plan.to_json())
  assert again == plan and again["l16.lhs"] == 16 and again["l3.lhs"] == 3
