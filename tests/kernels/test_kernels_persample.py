"""The Pallas per-sample mixed-precision kernels (`jact.kernels._per_sample.pallas_triton`).

They run in interpret mode on CPU (slow: small inputs, few grid steps, every
call jitted) and must be bit-exact with the XLA reference for the same seed:
packed buffer (including the unused tail), bf16 statistics, widths and
dequantized values. Their GPU lowering is checked from CPU.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact import _compat, kernels
from jact.kernels._per_sample import pallas_triton as persample
from jact.kernels._per_sample.api import dequantize_per_sample, quantize_per_sample
from jact.kernels._per_sample.reference import (
  dequantize_per_sample_reference,
  quantize_per_sample_reference,
)
from jact._core.persample import per_sample_capacity
from jact._core.quantize import effective_group_size
from kernel_checks import assert_lowers_for_cuda, assert_same_bits, poisoned_call


def assert_same_packed(p, r):
  for field in ("data", "bits", "minimum", "scale"):
    assert_same_bits(getattr(p, field), getattr(r, field))
  assert (p.shape, p.dtype, p.group_size) == (r.shape, r.dtype, r.group_size)


def _activation(shape, dtype, seed=0):
  """Normal values with per-sample ranges, +-inf, NaN, +-0 and one sample
  (the second) entirely non-finite; built in numpy (eager jax ops compile)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.arange(1, shape[0] + 1).reshape(
    (-1,) + (1,) * (len(shape) - 1)
  )
  flat = x.reshape(shape[0], -1)
  flat[0, [1, 5, 7]] = np.inf, np.nan, -np.inf
  flat[0, [2, 3]] = 0.0, -0.0
  flat[1] = np.where(np.arange(flat.shape[1]) % 2, np.inf, np.nan)
  flat[2, -1] = np.inf
  return jnp.asarray(x.astype(dtype))


def _geometry(shape):
  """(effective group size, padded values per sample) for the default group size."""
  d = math.prod(shape[1:])
  g = effective_group_size(d, 256)
  return g, -(-d // g) * g


# Each kernel and reference is jitted on its own: XLA:CPU compiles the
# interpreted kernels much faster as separate modules than as one. Kernels and
# references are compiled alike, unoptimized (FAST_COMPILE): a third faster.
# (The kernels compute in float32 and integers; tests/kernels/test_kernel_contract.py
# checks their unoptimized bits against the reference compiled as users do.)
FAST_COMPILE = {"xla_backend_optimization_level": 0}
_jit = functools.partial(jax.jit, compiler_options=FAST_COMPILE)
_quantize_reference = _jit(
  quantize_per_sample_reference, static_argnames=("capacity_bytes", "group_size")
)
_dequantize_kernel = _jit(
  persample.dequantize_per_sample, static_argnames=("dtype", "interpret", "rows")
)
_dequantize_reference = _jit(dequantize_per_sample_reference, static_argnames=("dtype",))


# (shape, dtype, widths, stochastic, capacity in bytes per value, rows, output dtype):
# all four widths in one batch; 300 values per sample (no multiple of the
# group size: padded to 2 x 256); 7 x 13 values (one group of 96) with a
# buffer so large that extra programs only write zeros; 784 values (7 groups
# of 112, not a power of two) with round-to-nearest. On these three cases
# (same shape, dtype, widths, capacity, group size, rounding and rows)
# tests/kernels/test_kernel_contract.py's per-sample cases "widths-1248-f32-partial-group",
# "bf16-zero-only-programs" and "f16-nearest-group112" compare the quantize
# kernel and the dequantize kernel (to float32, float32 and float16) bit for bit,
# with outputs pre-filled; interpret mode compiles each kernel for seconds, so
# here the quantizer is the reference and only the dequantizations to the other
# output dtype (the input's, or float32) run.
CONTRACT_CASES = [
  ((4, 300), jnp.float32, [1, 2, 4, 8], True, 1.0, 2, jnp.float32),
  ((5, 7, 13), jnp.bfloat16, [8, 1, 2, 4, 1], True, 64.0, 1, jnp.float32),
  ((6, 784), jnp.float16, [2, 8, 1, 4, 4, 1], False, 0.5, 4, jnp.float16),
]
CASES = [
  ((5, 7, 13), jnp.bfloat16, [8, 1, 2, 4, 1], True, 64.0, 1, jnp.bfloat16),
  ((6, 784), jnp.float16, [2, 8, 1, 4, 4, 1], False, 0.5, 4, jnp.float32),
]


def test_the_kernel_contract_runs_the_other_cases():
  """The cases above not run here are tests/kernels/test_kernel_contract.py's (kept in step)."""
  import test_kernel_contract as contract

  assert (
    [case.name for case in contract.quantize_per_sample_cases()]
    == [case.name for case in contract.dequantize_per_sample_cases()]
    == [c[0] for c in contract.PER_SAMPLE]
  )
  ran = {
    (shape, jnp.dtype(dtype), tuple(widths), stochastic, per_value, rows, jnp.dtype(out or dtype))
    for (_, shape, dtype, widths, per_value, group_size, stochastic, rows), out in zip(
      contract.PER_SAMPLE, contract.PER_SAMPLE_OUTS
    )
    if group_size == 256
  }
  for shape, dtype, widths, stochastic, per_value, rows, out in CONTRACT_CASES:
    assert (
      shape,
      jnp.dtype(dtype),
      tuple(widths),
      stochastic,
      per_value,
      rows,
      jnp.dtype(out),
    ) in ran


@pytest.mark.slow
@pytest.mark.parametrize("shape,dtype,widths,stochastic,per_value,rows,out", CASES)
def test_dequantize_is_bit_exact(shape, dtype, widths, stochastic, per_value, rows, out):
  x = _activation(shape, dtype)
  g, dp = _geometry(shape)
  capacity = int(per_value * shape[0] * dp)
  bits = jnp.asarray(widths, jnp.int32)
  assert int(bits.sum()) * dp // 8 <= capacity
  seed = jnp.uint32(1234) if stochastic else None
  r = _quantize_reference(x, bits, capacity_bytes=capacity, group_size=g, seed=seed)
  assert_same_bits(
    _dequantize_kernel(r, out, interpret=True, rows=rows), _dequantize_reference(r, out)
  )


@pytest.mark.slow
def test_every_byte_and_value_is_written(monkeypatch):
  """The buffer's tail past the used bytes included (some programs only write zeros)."""
  monkeypatch.setattr(persample.T, "call", poisoned_call)
  x = _activation((3, 40), jnp.float32, seed=2)
  bits, seed = jnp.array([1, 8, 2], jnp.int32), jnp.uint32(7)
  args = dict(capacity_bytes=13000, group_size=40, seed=seed)
  p = _jit(functools.partial(persample.quantize_per_sample, interpret=True, rows=1, **args))(
    x, bits
  )
  assert_same_packed(p, _quantize_reference(x, bits, **args))
  y = _jit(functools.partial(persample.dequantize_per_sample, interpret=True, rows=1))(p)
  assert_same_bits(y, _dequantize_reference(p, jnp.float32))


_TRACES = []


@functools.partial(_jit, static_argnames=("capacity", "implementation"))
def _dispatch_quantize(x, bits, seed, *, capacity, implementation):
  _TRACES.append(implementation)
  return quantize_per_sample(
    x, bits, capacity_bytes=capacity, seed=seed, implementation=implementation
  )


_dispatch_dequantize = _jit(dequantize_per_sample, static_argnames=("dtype", "implementation"))


def _dispatch(x, bits, seed, *, capacity, implementation):
  p = _dispatch_quantize(x, bits, seed, capacity=capacity, implementation=implementation)
  return p, _dispatch_dequantize(p, jnp.float32, implementation=implementation)


@pytest.mark.slow
def test_dispatch_with_traced_widths_and_the_capacity_fallback():
  shape = (8, 1000)  # groups of 200, default grid
  x = _activation(shape, jnp.float32, seed=1)
  capacity = per_sample_capacity(shape, avg_bits=2.0)
  seed = jnp.uint32(99)
  # Fits (0 clipped to 1; 3 and 5 as bit planes); then too wide: all fall back to 1 bit.
  for widths in ([3, 0, 1, 2, 5, 1, 1, 2], [8] * 8):
    bits = jnp.asarray(widths, jnp.int32)
    p, y = _dispatch(x, bits, seed, capacity=capacity, implementation="pallas_triton")
    r, y_ref = _dispatch(x, bits, seed, capacity=capacity, implementation="xla")
    assert_same_packed(p, r)
    assert_same_bits(y, y_ref)
  assert p.bits.tolist() == [1] * 8
  assert sorted(_TRACES) == ["pallas_triton", "xla"]  # traced once each: widths are traced


def test_registry_picks_the_kernel_only_when_asked_on_cpu():
  for op in ("quantize_per_sample", "dequantize_per_sample"):
    assert kernels.select(op).name == "xla"
    # jax-triton above Pallas' Triton backend where jax-triton is installed
    gpu = "jax_triton" if _compat.has_jax_triton() else "pallas_triton"
    assert kernels.select(op, platform="gpu").name == gpu
    for name in ("pallas_triton", "jax_triton"):
      with kernels.use(**{op: name}):
        assert kernels.select(op).name == name
      assert kernels.select(op, name, size=0).name == "xla"  # empty: the reference


# --------------------------------------------------------------------------- GPU lowering from CPU


@pytest.mark.slow
@pytest.mark.parametrize(
  "shape,dtype", [((64, 4096), jnp.float32), ((8, 784), jnp.bfloat16), ((5, 7, 13), jnp.float16)]
)
def test_kernels_lower_for_cuda(shape, dtype):
  # Quantize: the statistics pass then the packing pass; dequantize: one
  # unpacking call; outputs shaped and typed like the XLA references'.
  g, dp = _geometry(shape)
  capacity = shape[0] * dp // 2
  x = jax.ShapeDtypeStruct(shape, dtype)
  bits = jax.ShapeDtypeStruct(shape[:1], jnp.int32)  # every width: chosen at run time
  seed = jax.ShapeDtypeStruct((), jnp.uint32)
  kw = dict(capacity_bytes=capacity, group_size=g)
  two_passes = ["jact_per_sample_stats", "jact_per_sample_pack"]
  assert_lowers_for_cuda(
    lambda x, b, s: persample.quantize_per_sample(x, b, seed=s, **kw, interpret=False),
    lambda x, b, s: quantize_per_sample_reference(x, b, seed=s, **kw),
    x,
    bits,
    seed,
    kernels=two_passes,
  )
  assert_lowers_for_cuda(
    lambda x, b: persample.quantize_per_sample(x, b, seed=None, **kw, interpret=False),
    lambda x, b: quantize_per_sample_reference(x, b, seed=None, **kw),
    x,
    bits,
    kernels=two_passes,
  )
  packed = jax.eval_shape(
    lambda x, b: quantize_per_sample_reference(x, b, seed=None, **kw), x, bits
  )
  for out in dict.fromkeys((jnp.float32, dtype)):  # float32 once
    assert_lowers_for_cuda(
      lambda p: persample.dequantize_per_sample(p, out, interpret=False),
      lambda p: dequantize_per_sample_reference(p, out),
      packed,
      kernels=["jact_per_sample_unpack"],
    )
