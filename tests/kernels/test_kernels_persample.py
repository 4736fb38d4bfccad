"""The Pallas per-sample mixed-precision kernels (`jact.kernels._per_sample.pallas_triton`).

They run in interpret mode on CPU (slow: small inputs, few grid steps, every
call jitted) and must be bit-exact with the XLA reference for the same seed:
packed buffer (including the unused tail), bf16 statistics, widths and
dequantized values. Their GPU lowering is checked from CPU.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact import _compat, kernels
from jact.kernels._per_sample import jax_triton as jt
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


# --------------------------------------------------------------------------- the jax-triton kernels
# (`jact.kernels._per_sample.jax_triton`; tests/kernels/test_kernel_contract.py runs them on
# its per-sample cases, with outputs pre-filled, and checks their PTX)


def _imported_modules(path: str) -> set[str]:
  """The modules a source file imports (absolute names; `from a import b` gives a and a.b)."""
  import ast

  names = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
  return names


def test_jax_triton_kernels_import_no_pallas():
  """Pallas' Triton backend is deprecated (jax >= 0.11): the module and the jact modules
  it imports, transitively, name neither Pallas nor the Pallas kernels' helpers (packages
  aside: `jact.kernels` registers the Pallas kernels where jax still has them)."""
  import importlib.util

  seen, todo = set(), ["jact.kernels._per_sample.jax_triton"]
  while todo:
    module = todo.pop()
    if module in seen:
      continue
    seen.add(module)
    spec = importlib.util.find_spec(module)
    imported = _imported_modules(spec.origin)
    bad = sorted(m for m in imported if "pallas" in m or m == "jact.kernels._triton")
    assert not bad, f"{module} imports {bad}"
    todo += [m for m in imported if m.startswith("jact.") and _is_module(m)]
  assert {"jact.kernels._jax_triton", "jact.kernels._quantize.layout"} <= seen, seen


def _is_module(name: str) -> bool:
  """Whether `name` is a module, not a package nor a module's attribute."""
  import importlib.util

  try:
    spec = importlib.util.find_spec(name)
  except ModuleNotFoundError:  # `from module import function`
    return False
  return spec is not None and spec.submodule_search_locations is None


_jt_quantize = _jit(
  jt.quantize_per_sample, static_argnames=("capacity_bytes", "group_size", "interpret", "rows")
)
_jt_dequantize = _jit(jt.dequantize_per_sample, static_argnames=("dtype", "interpret", "rows"))


# (shape, dtype, widths, stochastic, capacity in bytes per value, rows): the roundings and
# widths the contract's cases leave out (bfloat16 to nearest, float16 stochastic, bit planes
# in both), over several packing programs a sample
JT_QUANTIZE = [
  ((3, 600), jnp.bfloat16, [3, 5, 7], False, 1.0, 1),
  ((4, 300), jnp.float16, [6, 8, 3, 1], True, 2.0, 1),
]


@pytest.mark.slow
@pytest.mark.parametrize("shape,dtype,widths,stochastic,per_value,rows", JT_QUANTIZE)
def test_jax_triton_quantize_is_bit_exact(shape, dtype, widths, stochastic, per_value, rows):
  x = _activation(shape, dtype, seed=3)
  g, dp = _geometry(shape)
  bits = jnp.asarray(widths, jnp.int32)
  args = dict(
    capacity_bytes=int(per_value * shape[0] * dp),
    group_size=g,
    seed=jnp.uint32(4321) if stochastic else None,
  )
  assert jt.geometry(math.prod(shape[1:]), g, rows)[4] > 1  # several programs a sample
  p = _jt_quantize(x, bits, interpret=True, rows=rows, **args)
  assert_same_packed(p, _quantize_reference(x, bits, **args))


# (shape, input dtype, widths, output dtype): every output dtype through every input dtype,
# bfloat16 outputs included (the contract's cases give float32 and float16 ones)
JT_DEQUANTIZE = [
  ((4, 300), jnp.float32, [1, 2, 4, 8], jnp.bfloat16),
  ((5, 7, 13), jnp.bfloat16, [8, 3, 2, 5, 1], jnp.bfloat16),
  ((3, 40), jnp.float16, [7, 6, 4], jnp.bfloat16),
  ((3, 40), jnp.bfloat16, [1, 6, 8], jnp.float16),
]


@pytest.mark.slow
@pytest.mark.parametrize("shape,dtype,widths,out", JT_DEQUANTIZE)
def test_jax_triton_dequantize_is_bit_exact(shape, dtype, widths, out):
  """Random bytes: every code, the flagged groups' top one included."""
  x = _activation(shape, dtype, seed=len(widths))
  g, dp = _geometry(shape)
  bits = jnp.asarray(widths, jnp.int32)
  r = _quantize_reference(x, bits, capacity_bytes=shape[0] * dp, group_size=g, seed=jnp.uint32(8))
  data = np.random.default_rng(len(widths)).integers(0, 256, r.data.shape, dtype=np.uint8)
  r = dataclasses.replace(r, data=jnp.asarray(data))
  assert_same_bits(_jt_dequantize(r, out, interpret=True, rows=1), _dequantize_reference(r, out))


@functools.partial(_jit, static_argnames=("capacity", "implementation"))
def _jt_roundtrip(x, bits, seed, *, capacity, implementation):
  p = quantize_per_sample(
    x, bits, capacity_bytes=capacity, seed=seed, implementation=implementation
  )
  return p, dequantize_per_sample(p, jnp.float32, implementation=implementation)


@pytest.mark.slow
def test_jax_triton_dispatch_with_traced_widths_and_the_capacity_fallback():
  shape = (8, 1000)  # groups of 200, default grid
  x = _activation(shape, jnp.float32, seed=1)
  capacity = per_sample_capacity(shape, avg_bits=2.0)
  seed = jnp.uint32(99)
  # Fits (0 clipped to 1; 3 and 5 as bit planes); then too wide: all fall back to 1 bit.
  for widths in ([3, 0, 1, 2, 5, 1, 1, 2], [8] * 8):
    bits = jnp.asarray(widths, jnp.int32)
    p, y = _jt_roundtrip(x, bits, seed, capacity=capacity, implementation="jax_triton")
    r, y_ref = _jt_roundtrip(x, bits, seed, capacity=capacity, implementation="xla")
    assert_same_packed(p, r)
    assert_same_bits(y, y_ref)
  assert p.bits.tolist() == [1] * 8


@pytest.mark.slow
def test_jax_triton_kernels_lower_for_cuda_one_compile_a_shape_class():
  """Lowered for cuda through jax-triton (which compiles each kernel for sm_90 here): the
  statistics and packing passes, then the unpacking one, with no contraction nor
  approximate division; two call sites of one shape class (other samples, sample sizes,
  groups, buffer lengths: runtime arguments) get the same compiled kernels."""
  from jact import _compat
  from jact.kernels import _jax_triton
  from kernel_checks import ptx_facts

  def launches(shape, dtype):
    d = math.prod(shape[1:])
    kw = dict(capacity_bytes=shape[0] * d // 4, group_size=256)  # 2 bits on average
    x = jax.ShapeDtypeStruct(shape, dtype)
    bits = jax.ShapeDtypeStruct(shape[:1], jnp.int32)
    seed = jax.ShapeDtypeStruct((), jnp.uint32)
    quantize = lambda x, b, s: jt.quantize_per_sample(x, b, seed=s, interpret=False, **kw)
    packed = jax.eval_shape(
      lambda x, b, s: quantize_per_sample_reference(x, b, seed=s, **kw), x, bits, seed
    )
    dequantize = lambda p: jt.dequantize_per_sample(p, jnp.float32, interpret=False)
    texts = [
      _compat.lower_for_cuda(quantize, x, bits, seed).as_text(),
      _compat.lower_for_cuda(dequantize, packed).as_text(),
    ]
    return [launch for text in texts for launch in _jax_triton.lowered_kernels(text)]

  small = launches((16, 8192), jnp.bfloat16)  # 2 packing programs a sample
  assert [name for name, _ in small] == [
    "jact_per_sample_stats_jax_triton",
    "jact_per_sample_pack_jax_triton",
    "jact_per_sample_unpack_jax_triton",
  ]
  for name, ptx in small:
    facts = ptx_facts(ptx)
    assert ".target sm_90" in ptx and facts["loads"] and facts["stores"], (name, facts)
    assert facts["fused_multiply_adds"] == 0 and facts["approximate_divisions"] == 0, (name, facts)
  large = launches((64, 16, 1024), jnp.bfloat16)  # 4 packing programs a sample
  assert [ptx for _, ptx in large] == [ptx for _, ptx in small]
