"""The Pallas DIVISION kernel: bit-exact with the XLA reference (interpret mode on CPU),
the `Division(implementation=...)` dispatch, and the kernels' GPU lowering from CPU."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact.compressors._base import from_dict
from jact.compressors._division import Division
from jact._core.division import pool_blocks, pool
from jact.kernels._division import pallas_triton as division
from jact.kernels._division import jax_triton as division_jt
from jact.kernels import _jax_triton
from jact.kernels._division.reference import division_compress_reference
from jact import _compat
from kernel_checks import assert_same_bits, assert_same_packed, ptx_facts

FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""XLA:CPU options for the interpret-mode kernels and their references, compiled
alike: unoptimized, they compile a third faster. (The kernels compute in float32
and integers; tests/kernels/test_kernel_contract.py checks their unoptimized bits against
the reference compiled as users compile it.)"""


def activation(shape, dtype=jnp.float32, seed=0, specials=False):
  """Host-made normals; with `specials`, inf/NaN/+-0 and a whole block of -0.0."""
  x = 3 * np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  if specials:
    x[(-1,) + (slice(0, 2),) * (len(shape) - 2)] = -0.0  # an all -0.0 pooling block
    flat = x.reshape(-1)
    flat[[1, 5, 7, 2, 3]] = [np.inf, np.nan, -np.inf, 0.0, -0.0]
  return jnp.asarray(x).astype(dtype)


def sequential_pool(x, block):
  """numpy float32 emulation of the documented order: acc = offset (0, ..); acc += each
  further offset in row-major order (0.0 past a partial block's end and for a
  non-finite value); acc * (1 / count), count the block's finite values (0.0 if none)."""
  x = np.asarray(x, np.float32)
  spatial = x.shape[1:-1]
  blocks = [min(block, s) for s in spatial]
  n = [-(-s // b) for s, b in zip(spatial, blocks)]
  acc = None
  bad = np.zeros((x.shape[0], *n, x.shape[-1]), np.float32)
  for offset in itertools.product(*map(range, blocks)):
    part = np.zeros((x.shape[0], *n, x.shape[-1]), np.float32)
    sl = x[(slice(None), *(slice(o, None, b) for o, b in zip(offset, blocks)))]
    part[(slice(None), *(slice(0, k) for k in sl.shape[1:-1]))] = sl
    bad += ~np.isfinite(part)
    part = np.where(np.isfinite(part), part, np.float32(0))
    acc = part if acc is None else acc + part
  count = np.ones((), np.float32)
  for s, b, m in zip(spatial, blocks, n):
    count = np.multiply.outer(count, np.minimum(b, s - b * np.arange(m)).astype(np.float32))
  count = count[None, ..., None] - bad
  with np.errstate(divide="ignore"):
    return np.where(count > 0, acc * (np.float32(1) / count), np.float32(0))


@pytest.mark.parametrize("shape,block", [((2, 10, 10, 8), 4), ((1, 5, 3, 9, 8), 2), ((2, 7, 8), 8)])
def test_reference_pooling_sums_in_the_documented_order(shape, block):
  x = activation(shape, seed=3, specials=True)
  pooled = jax.jit(functools.partial(pool, blocks=pool_blocks(shape[1:-1], block)))(x)
  assert_same_bits(pooled, jnp.asarray(sequential_pool(x, block)))


F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
CASES = [
  # shape, x dtype, lfc dtype, block, bits, group_size, rows, one pass
  ((2, 8, 8, 16), F32, BF16, 4, 2, 256, None, True),  # B divides the map; a band = 2 groups
  ((2, 10, 10, 8), BF16, F32, 4, 4, 64, 2, True),  # partial blocks; a band = 5 groups
  ((2, 10, 10, 8), F16, BF16, 4, 1, 256, 2, False),  # groups of 200 straddle bands of 320
  ((2, 6, 5, 16), F32, F32, 8, 8, 64, None, True),  # map smaller than B: one band a sample
  ((4, 3, 3, 8), BF16, BF16, 4, 2, 256, 2, True),  # samples of 72: a group each
  ((4, 1, 1, 4), F32, BF16, 4, 2, 256, 2, False),  # samples of 4 packed in one row
  ((2, 20, 16), F32, BF16, 8, 1, 64, None, True),  # rank 3, one pass
  ((3, 13, 24), F32, F16, 4, 2, 256, 2, False),  # rank 3, groups of 104 straddle bands
  ((1, 9, 4, 10, 8), F32, BF16, 4, 8, 64, None, True),  # rank 5, H in one block: one pass
  ((2, 5, 6, 6, 8), BF16, F32, 4, 4, 256, 4, False),  # rank 5, bands not contiguous
]


@pytest.mark.slow
@pytest.mark.parametrize(
  "shape,dtype,lfc_dtype,block,bits,group_size,rows,one_pass",
  CASES,
  ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-b{c[4]}" for c in CASES],
)
def test_kernel_is_bit_exact(
  shape, dtype, lfc_dtype, block, bits, group_size, rows, one_pass, monkeypatch
):
  monkeypatch.setattr(division, "_LFC_TILE", 16)  # pooled rows of 24 or 32 take several chunks
  assert division.fused(shape, block, group_size) == one_pass
  x = activation(shape, dtype, seed=bits, specials=shape[0] > 1)
  seed = jnp.uint32(0xD1 + bits)
  args = dict(block=block, bits=bits, group_size=group_size, lfc_dtype=lfc_dtype)
  kernel = jax.jit(
    functools.partial(division.division_compress, interpret=True, rows=rows, **args),
    compiler_options=FAST_COMPILE,
  )(x, seed)
  reference = jax.jit(
    functools.partial(division_compress_reference, **args), compiler_options=FAST_COMPILE
  )(x, seed)
  assert_same_bits(kernel[0], reference[0])
  assert_same_packed(kernel[1], reference[1])


@pytest.mark.slow
def test_division_dispatches_to_the_kernel_with_the_same_bits():
  x = activation((2, 10, 10, 8), seed=7)
  seed = jnp.uint32(11)
  compressors = [
    Division(block=4, bits=2, group_size=64, implementation=name)
    for name in ("pallas_triton", "xla", None)
  ]
  compressors.append(
    Division(block=4, bits=2, group_size=64, keep="hfc", implementation="pallas_triton")
  )

  @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  def run(x, seed):
    stored = [c.compress(x, seed) for c in compressors]
    return stored, [c.decompress(s) for c, s in zip(compressors, stored)]

  stored, out = run(x, seed)
  for s in stored[1:3]:
    for a, b in zip(jax.tree.leaves(stored[0].arrays), jax.tree.leaves(s.arrays)):
      assert_same_bits(a, b)
  assert_same_bits(out[0], out[1])
  assert_same_bits(out[0], out[2])
  assert set(stored[3].arrays) == {"hfc"}
  assert_same_packed(stored[3].arrays["hfc"], stored[1].arrays["hfc"])


def test_implementation_field():
  c = Division(block=4, implementation="pallas_triton")
  assert from_dict(c.to_dict()) == c and c.to_dict()["implementation"] == "pallas_triton"
  assert from_dict(Division().to_dict()) == Division() and Division().implementation is None
  assert c != Division(block=4) and hash(c) != hash(Division(block=4, implementation="xla"))
  with pytest.raises(ValueError, match="use one of \\['jax_triton', 'pallas_triton', 'xla'\\]"):
    Division(implementation="cuda")
  with pytest.raises(ValueError, match="unknown kernel implementation"):
    Division(implementation=3)


@pytest.mark.parametrize(
  "shape,block,bits,group_size",
  [
    ((2, 8, 8, 16), 4, 2, 256),  # one pass
    ((2, 10, 10, 8), 4, 1, 256),  # pooling + residual kernels
    ((4, 3, 3, 8), 4, 8, 256),  # samples shorter than a group
    ((4, 1, 1, 4), 4, 8, 256),  # one row
    ((2, 5, 6, 6, 8), 4, 4, 256),  # rank 5, two kernels
    ((2, 20, 16), 8, 4, 64),  # rank 3, one pass
  ],
)
@pytest.mark.slow
def test_kernels_lower_for_cuda(shape, block, bits, group_size):
  f = functools.partial(
    division.division_compress,
    block=block,
    bits=bits,
    group_size=group_size,
    lfc_dtype=jnp.bfloat16,
    interpret=False,
  )
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  lowered = _compat.lower_for_cuda(f, x, jax.ShapeDtypeStruct((), jnp.uint32))
  expected = 1 if division.fused(shape, block, group_size) else 2
  assert lowered.as_text().count("__gpu$xla.gpu.triton") == expected


# ----------------------------------------------------------------------------- jax-triton kernels

JAX_TRITON_CASES = [
  # shape, x dtype, lfc dtype, block, bits, group_size, rows, huge values
  ((2, 10, 10, 8), F32, BF16, 4, 1, 64, 2, "sum"),  # a block's float32 sum overflows: LFC 0
  ((2, 8, 8, 16), BF16, F32, 4, 2, 256, None, None),
  ((3, 13, 24), F16, F16, 4, 3, 64, 2, None),  # rank 3, groups straddle bands
  ((2, 5, 6, 6, 8), F32, BF16, 4, 4, 256, 4, None),  # rank 5
  ((2, 7, 9, 8), BF16, BF16, 3, 5, 128, 2, None),  # partial blocks on both axes
  ((2, 10, 10, 8), F32, F16, 4, 6, 64, 2, "float16"),  # a mean beyond float16: LFC 0
  ((4, 3, 3, 8), F16, BF16, 4, 7, 256, 2, None),  # samples shorter than a group
  ((2, 20, 16), F32, BF16, 8, 8, 64, None, None),
  ((4, 1, 1, 4), BF16, F32, 4, 16, 256, 2, None),  # samples of 4 quantized as one row
]


def _huge(x, block, kind):
  """x with its first sample's first pooling block set to values whose float32 sum
  overflows ("sum") or whose mean has no float16 ("float16")."""
  value = {"sum": 3e38, "float16": 7e4}[kind]
  return x.at[(0,) + (slice(0, block),) * (x.ndim - 2)].set(value)


@pytest.mark.slow
@pytest.mark.parametrize(
  "shape,dtype,lfc_dtype,block,bits,group_size,rows,huge",
  JAX_TRITON_CASES,
  ids=[f"{c[0]}-{jnp.dtype(c[1]).name}-b{c[4]}" for c in JAX_TRITON_CASES],
)
def test_jax_triton_kernels_are_bit_exact_at_every_width(
  shape, dtype, lfc_dtype, block, bits, group_size, rows, huge
):
  """Triton's interpreter; every width 1-8 and 16, each input and LFC dtype, non-finite
  values, and LFC values that are not finite (stored as 0: the HFC holds x itself)."""
  x = activation(shape, dtype, seed=bits, specials=shape[0] > 1)
  if huge:
    x = _huge(x, block, huge)
  seed = jnp.uint32(0xD1 + bits)
  args = dict(block=block, bits=bits, group_size=group_size, lfc_dtype=lfc_dtype)
  kernel = jax.jit(
    functools.partial(division_jt.division_compress, interpret=True, rows=rows, tile=16, **args),
    compiler_options=FAST_COMPILE,
  )(x, seed)
  reference = jax.jit(
    functools.partial(division_compress_reference, **args), compiler_options=FAST_COMPILE
  )(x, seed)
  if huge:
    assert not np.asarray(reference[0][(0,) * reference[0].ndim], np.float32), "LFC not 0"
  assert_same_bits(kernel[0], reference[0])
  assert_same_packed(kernel[1], reference[1])


def _jax_triton_launches(shape, dtype=jnp.bfloat16, **args):
  """(name, PTX) of each jax-triton launch of `division_compress` lowered for cuda here."""
  f = functools.partial(division_jt.division_compress, interpret=False, **args)
  x = jax.ShapeDtypeStruct(shape, dtype)
  lowered = _compat.lower_for_cuda(f, x, jax.ShapeDtypeStruct((), jnp.uint32))
  return _jax_triton.lowered_kernels(lowered.as_text())


@pytest.mark.slow
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_jax_triton_kernels_lower_for_cuda_without_contraction(bits):
  """jax-triton's own sm_90 compile: the pooling and residual launches, with no fused
  multiply-add nor approximate division (either would change bits on the GPU)."""
  launches = _jax_triton_launches(
    (2, 10, 10, 8), block=4, bits=bits, group_size=64, lfc_dtype=jnp.bfloat16
  )
  names = [name for name, _ in launches]
  assert names == ["jact_division_pool_jax_triton", "jact_division_residual_jax_triton"], names
  for name, ptx in launches:
    facts = ptx_facts(ptx)
    assert facts["loads"] and facts["stores"], (name, facts)
    assert facts["fused_multiply_adds"] == 0 and facts["approximate_divisions"] == 0, (name, facts)


@pytest.mark.slow
def test_jax_triton_kernels_serve_maps_of_any_size():
  """The map's sizes are runtime arguments: two maps of different extents, samples and
  group counts (same width, group size and dtypes) run the same compiled kernels."""
  args = dict(block=4, bits=2, group_size=256, lfc_dtype=jnp.bfloat16)
  a = _jax_triton_launches((2, 8, 8, 16), **args)
  b = _jax_triton_launches((3, 8, 12, 16), **args)  # groups of 256 in both
  assert [ptx for _, ptx in a] == [ptx for _, ptx in b]
  c = _jax_triton_launches((2, 8, 8, 16), **{**args, "bits": 4})
  assert [ptx for _, ptx in a] != [ptx for _, ptx in c]  # the width is compiled in


def test_magic_division_is_exact_for_every_int32_offset():
  """The kernels divide offsets by the map's sizes as (x * m) >> shift: exact for every
  divisor and every x in [0, 2**31), checked at the extremes and where it would fail first
  (just below multiples of the divisor)."""
  rng = np.random.default_rng(0)
  divisors = [*range(1, 2049), *rng.integers(1, 2**31, 2000).tolist(), 2**31 - 1, 2**30 + 1]
  for d in divisors:
    m, shift = division_jt.magic(d)
    assert -(2**31) <= m < 2**31 and 31 <= shift <= 62
    m %= 2**32
    top = (2**31 - 1) // d * d
    xs = {0, 1, d - 1, d, 2**31 - 1, top, top - 1, *rng.integers(0, 2**31, 20).tolist()}
    xs |= {k * d - 1 for k in range(1, 4)} | {top - k * d - 1 for k in range(3)}
    for x in (x for x in xs if 0 <= x < 2**31):
      assert (x * m) >> shift == x // d, (d, x)


@pytest.mark.slow
def test_division_compressor_stores_the_reference_bits_with_the_jax_triton_kernels():
  """`Division(implementation="jax_triton")` (Triton's interpreter here) stores and
  reconstructs what the XLA reference does, at a bit-plane width."""
  x = activation((2, 10, 10, 8), jnp.bfloat16, seed=5, specials=True)
  seed = jnp.uint32(9)
  compressors = [
    Division(block=4, bits=3, group_size=64, implementation=name) for name in ("jax_triton", "xla")
  ]

  @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  def run(x, seed):
    stored = [c.compress(x, seed) for c in compressors]
    return stored, [c.decompress(s) for c, s in zip(compressors, stored)]

  stored, out = run(x, seed)
  for a, b in zip(jax.tree.leaves(stored[0].arrays), jax.tree.leaves(stored[1].arrays)):
    assert_same_bits(a, b)
  assert_same_bits(out[0], out[1])
