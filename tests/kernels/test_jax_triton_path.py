"""jact's GPU path through jax-triton, checked from this host (no GPU needed).

A training step lowered for cuda launches the kernels written in Triton's language through
jax-triton, which compiles each one for sm_90 while lowering (its PTX travels in the custom
call); where the installed jax has deprecated Pallas' Triton backend (jax >= 0.11), the step
holds no Pallas Triton call at all. The test extras install jax-triton, so these tests run in
CI (`pip install -e ".[test]"`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jact
from jact import _compat, kernels
from jact.kernels import _jax_triton
from kernel_checks import ptx_facts

PALLAS_OPS = {
  "jact_quantize": "quantize",
  "jact_dequantize": "dequantize",
  "jact_relu_mask": "relu_mask",
  "jact_per_sample_stats": "quantize_per_sample",
  "jact_per_sample_pack": "quantize_per_sample",
  "jact_per_sample_unpack": "dequantize_per_sample",
  "jact_division": "division_compress",
  "jact_division_pool": "division_compress",
  "jact_division_residual": "division_compress",
  "jact_float8_compress": "float8_compress",
}
"""The Pallas kernels' launch names -> their op."""


def _require_jax_triton():
  if not _compat.has_jax_triton():
    pytest.fail("jax-triton is not installed: pip install -e '.[test]'", pytrace=False)


def _step():
  """A two-layer MLP's gradient through jact's ops: dense (quantize, dequantize) and relu (its
  1-bit mask), at 2 bits and at 3 bits (a bit-plane width)."""

  def loss(params, x, key):
    k1, k2 = jax.random.split(key)
    h = jact.ops.relu(jact.ops.dense(x, params["w1"], bits=2, key=k1))
    y = jact.ops.dense(h, params["w2"], bits=3, key=k2)
    return jnp.mean(y**2)

  params = {"w1": jnp.ones((256, 512)) * 0.01, "w2": jnp.ones((512, 128)) * 0.01}
  return jax.grad(loss), (params, jnp.ones((64, 256)), jax.random.key(0))


def _lowered_text():
  step, args = _step()
  with kernels.lowering_for("cuda"):
    return _compat.lower_for_cuda(step, *args).as_text()


def _pallas_launches(text: str) -> list[str]:
  calls = [line for line in text.splitlines() if "@__gpu$xla.gpu.triton" in line]
  return [m for c in calls for m in re.findall(r'\bname = "(jact_[a-z0-9_]+)"', c)]


def test_jax_triton_kernels_are_chosen_above_pallas_where_installed():
  _require_jax_triton()
  for op in {op for op, _, _ in kernels.JAX_TRITON_KERNELS}:
    assert kernels.select(op, platform="gpu").name == "jax_triton", op


def test_a_cuda_lowered_step_launches_the_jax_triton_kernels():
  _require_jax_triton()
  text = _lowered_text()
  launches = _jax_triton.lowered_kernels(text)
  names = sorted({name for name, _ in launches})
  assert "jact_quantize_jax_triton" in names, names
  covered = {op for op, _, _ in kernels.JAX_TRITON_KERNELS}
  pallas = _pallas_launches(text)
  still_pallas = sorted({PALLAS_OPS.get(n, n) for n in pallas} & covered)
  assert not still_pallas, f"ops with a jax-triton kernel still launched through Pallas: {pallas}"
  if _compat.pallas_triton_deprecated():
    assert not pallas, (
      f"jax {jax.__version__} deprecates Pallas' Triton backend, yet the step launches {pallas}"
    )


def test_the_ptx_jax_triton_compiled_has_no_contraction_nor_approximate_division():
  """jax-triton's own compile (the one that runs on a GPU), not only ours: a fused
  multiply-add or an approximate division would change codes against the XLA reference."""
  _require_jax_triton()
  launches = _jax_triton.lowered_kernels(_lowered_text())
  assert launches
  for name, ptx in launches:
    facts = ptx_facts(ptx)
    assert ".target sm_90" in ptx, name
    assert facts["loads"] and facts["stores"], (name, facts)
    assert facts["fused_multiply_adds"] == 0 and facts["approximate_divisions"] == 0, (name, facts)


def test_xla_gpu_compiles_the_step_with_its_jax_triton_launches():
  """The deviceless XLA:GPU compile takes jax-triton's custom calls."""
  _require_jax_triton()
  step, args = _step()
  compiled = jact.compile_for(step, *args, target="h200")
  assert 'custom_call_target="triton_kernel_call"' in compiled.as_text()
