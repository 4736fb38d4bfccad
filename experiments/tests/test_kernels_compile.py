"""The Pallas kernels compiled all the way to an sm_90a cubin on the CPU (Triton + ptxas).

Lowering for cuda (the other kernel tests) stops at Triton IR; here Triton
compiles it, and the machine code is checked for what bit-exactness and speed
on the device rest on: no multiply that ptxas could fuse with an add, no
approximate division, no register spills, 16-byte vector loads where values
are contiguous.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

pytest.importorskip("triton", reason="the test extras install triton; pip install -e '.[test]'")

from experiments.bench import compile_kernels as ck  # noqa: E402
from jact.kernels import _triton as T  # noqa: E402

# Contiguous values: the global loads must be 16-byte vector accesses. Per-group planes
# of G / (8 / bits) values stay vectorized while that count is a multiple of 4 (MNIST's
# 784 values per sample give groups of 112: planes of 28); groups of 100 do not.
VECTOR = {
  "quantize 2-bit f32",
  "quantize 4-bit f32",
  "quantize 2-bit bf16",
  "quantize 2-bit f32 group 112",
  "relu mask f32",
  "relu mask bf16",
  "division fused 2-bit",
}
CHECKED = sorted(
  VECTOR
  | {
    "quantize 1-bit f32",
    "quantize 2-bit f32 group 100",
    "dequantize 2-bit f32",
    "dequantize 8-bit f32",
    "quantize per sample f32",
    "dequantize per sample f32",
    "division pool + residual 2-bit 3-D",
    "float8 e4m3 bf16",
    "float8 e5m2 f32 float scale stochastic",
  }
)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", CHECKED)
def test_kernel_compiles_to_exact_spill_free_code(kernel):
  compiled = ck.compile_kernel(kernel)
  assert compiled, "no pallas_call found"
  for c in compiled:
    assert c.fused_multiply_adds == 0, f"{c.name}: {c.fused_multiply_adds} fused multiply-adds"
    assert c.approximate_divisions == 0, c
    assert c.spill_bytes == 0, c
    assert c.registers <= 255, c
    assert c.loads, f"{c.name} loads nothing"
    if kernel in VECTOR:
      # all but scalars (the seed, a sample's width) move in 16-byte vectors
      assert c.vector_load_fraction >= 0.9 and any(".v4." in op for op in c.loads), c.loads


def test_every_catalogued_kernel_is_checked_or_named():
  # the catalogue's other entries (more widths and dtypes) run in the experiment only
  assert set(CHECKED) <= set(ck.KERNELS)


def _fma_kernel(rounded: bool):
  def kernel(a_ref, b_ref, c_ref, o_ref):
    a, b, c = a_ref[...], b_ref[...], c_ref[...]
    o_ref[...] = T.add(T.mul(a, b, False), c, False) if rounded else a * b + c

  spec = jax.ShapeDtypeStruct((1024,), jnp.float32)
  fn = pl.pallas_call(kernel, out_shape=spec, grid=(1,), compiler_params=T.compiler_params())
  return ck.triton_modules(fn, spec, spec, spec)


def test_the_fusion_check_catches_a_plain_multiply_add():
  """The check can fail: jnp's a * b + c compiles to an FMA, the explicitly
  rounded `_triton.mul`/`add` to none."""
  (plain,), (rounded,) = _fma_kernel(False), _fma_kernel(True)
  assert ck.compile_module(plain).fused_multiply_adds > 0
  assert ck.compile_module(rounded).fused_multiply_adds == 0


def test_launch_parameters_come_from_the_pallas_call():
  spec = jax.ShapeDtypeStruct((1024,), jnp.float32)

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  fn = pl.pallas_call(
    kernel,
    out_shape=spec,
    grid=(1,),
    name="eight_warps",
    compiler_params=T.compiler_params(num_warps=8, num_stages=2),
  )
  (module,) = ck.triton_modules(fn, spec)
  assert (module.name, module.num_warps, module.num_stages) == ("eight_warps", 8, 2)
  assert "tt.func" in module.ir
