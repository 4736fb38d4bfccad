"""XLA:GPU compilation without a GPU: `jact.compile_for`, `compiled_memory(target=...)`, and
kernel choice that follows the lowering platform (`jact.kernels.lowering_for`).

These compile for an H200 on this CPU machine (the CUDA PJRT plugin of the installed jax, the
`gpu-aot` extra, installed by the test extra). Without the plugin they are skipped with the reason
and the install command; on x86-64 Linux the test extra installs it, so they run in CI.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact import kernels
from jact import _gpu_target
from jact._compat import gpu_aot

needs_plugin = pytest.mark.skipif(
  importlib.util.find_spec("jax_plugins.xla_cuda12") is None
  and importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
  reason=f"no CUDA PJRT plugin to compile for a GPU: {_gpu_target.install_hint()}",
)

WIDTH, ROWS, BLOCKS = 256, 2048, 3


def _block(x, w1, w2):
  return jnp.tanh(jax.nn.gelu(x @ w1) @ w2) + x


def _weights():
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  return [(shape(WIDTH, 4 * WIDTH), shape(4 * WIDTH, WIDTH))] * BLOCKS


def _loss(block):
  def loss(ws, x, key):
    for i, (w1, w2) in enumerate(ws):
      x = block(x, w1, w2, jax.random.fold_in(key, i))
    return (x**2).mean()

  return jax.grad(loss)


_STEPS = {
  "plain": _loss(lambda x, w1, w2, key: _block(x, w1, w2)),
  "remat": _loss(lambda x, w1, w2, key: jax.checkpoint(_block)(x, w1, w2)),
  "jact2": _loss(lambda x, w1, w2, key: jact.compressed(_block, bits=2)(x, w1, w2, key=key)),
}


@pytest.fixture(scope="module")
def h200_programs():
  x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32)
  return {
    name: jact.compile_for(step, _weights(), x, jax.random.key(0), target="h200")
    for name, step in _STEPS.items()
  }


def _temp(compiled) -> int:
  return int(compiled.memory_analysis().temp_size_in_bytes)


@needs_plugin
def test_xla_gpu_realizes_remat_and_jact_lowers_temp(h200_programs):
  plain, remat, jact2 = (_temp(h200_programs[k]) for k in ("plain", "remat", "jact2"))
  # XLA:GPU keeps one block's hidden (f32[2048, 1024], 8 MiB) per block plain; remat keeps the
  # block inputs only; jact keeps 2-bit codes. (XLA:CPU gives remat no saving: finding 14.)
  assert remat < 0.6 * plain, (remat, plain)
  assert jact2 < 0.6 * plain, (jact2, plain)


@needs_plugin
def test_cuda_lowered_jact_program_holds_the_gpu_kernels(h200_programs):
  text = h200_programs["jact2"].as_text()
  kernels_called = kernels.kernel_launches(text)
  # one quantize and one dequantize per block (its input is the one compressed residual
  # here, plus the gelu's and tanh's inputs): at least 2 per block
  assert kernels_called >= 2 * BLOCKS, kernels_called
  assert "jact_quantize" in text or "quantize" in text
  assert kernels.kernel_launches(h200_programs["plain"].as_text()) == 0


@needs_plugin
def test_compiled_memory_target_matches_compile_for():
  f = lambda x: jnp.tanh(x @ x).sum()
  x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
  m = jact.compiled_memory(jax.grad(f), x, target="h100")
  assert m.argument_bytes == 512 * 512 * 4 and m.output_bytes == 512 * 512 * 4
  assert m.temp_bytes == _temp(jact.compile_for(jax.grad(f), x, target="h100"))
  with pytest.raises(ValueError, match="one GPU"):
    jact.compiled_memory(jax.grad(f), x, target="h100", in_shardings=None, out_shardings=0)


@needs_plugin
def test_a_function_traced_for_the_cpu_first_still_gets_the_kernels():
  step = _STEPS["jact2"]
  x = jax.ShapeDtypeStruct((256, WIDTH), jnp.float32)
  jax.jit(step).trace(_weights()[:1], x, jax.random.key(0))  # cached for the CPU
  text = jact.compile_for(step, _weights()[:1], x, jax.random.key(0), target="h200").as_text()
  assert kernels.kernel_launches(text) >= 2


def test_gpu_target_figures_and_unknown_name():
  h100, h200 = jact.gpu_target("h100"), jact.gpu_target("H200")
  assert h200.memory_bandwidth > h100.memory_bandwidth
  assert h200.memory_bytes > 140e9 > h100.memory_bytes
  assert "NVIDIA H200" in h200.config and "core_count: 132" in h200.config
  assert jact.gpu_target(h200) is h200
  with pytest.raises(ValueError, match="known targets: \\['h100', 'h200'\\]"):
    jact.gpu_target("a100")


def test_missing_plugin_error_names_the_install(monkeypatch):
  monkeypatch.setattr(gpu_aot, "_PLUGINS", ("jax_plugins.no_such_plugin",))
  with pytest.raises(ModuleNotFoundError):
    gpu_aot._register_plugin()

  def no_plugin(config, topology="1x1x1"):
    raise ModuleNotFoundError("no CUDA PJRT plugin installed")

  monkeypatch.setattr(_gpu_target._compat, "cuda_devices", no_plugin)
  with pytest.raises(jact.GpuCompilerMissing, match=r"'h200'.*jax\[cuda12-local\]=="):
    jact.compile_for(jnp.sin, jax.ShapeDtypeStruct((8,), jnp.float32), target="h200")


def _kernel_calls(jaxpr) -> int:
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name in ("pallas_call", "triton_kernel_call")
    for value in eqn.params.values():
      for branch in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(branch, "jaxpr") and hasattr(branch.jaxpr, "eqns"):
          count += _kernel_calls(branch.jaxpr)
  return count


def test_lowering_for_stages_the_kernels_on_a_cpu_trace():
  x = jnp.linspace(-2.0, 2.0, 8 * 512).reshape(8, 512)
  # a new function for each trace: JAX's trace cache does not see the context
  quantize = lambda: lambda x: jact.quantize(x, jax.random.key(0), bits=2)
  assert _kernel_calls(jax.make_jaxpr(quantize())(x).jaxpr) == 0
  with kernels.lowering_for("cuda"):
    staged = jax.make_jaxpr(quantize())(x).jaxpr
    on_cpu = jax.jit(quantize())(x)
  assert _kernel_calls(staged) == 1
  # lowered for this CPU, the staged program runs the reference: the same bits
  reference = quantize()(x)
  np.testing.assert_array_equal(on_cpu.data, reference.data)
  # an explicit choice is never overridden
  with kernels.lowering_for("cuda"), kernels.use(quantize="xla"):
    assert _kernel_calls(jax.make_jaxpr(quantize())(x).jaxpr) == 0


def test_lowering_for_rejects_unknown_platforms():
  with pytest.raises(ValueError, match="among"):
    with kernels.lowering_for("gpu"):
      pass


@needs_plugin
def test_cudnn_fused_attention_compiles_for_the_target():
  def attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").sum()

  qkv = [jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)] * 3
  text = jact.compile_for(jax.grad(attention, argnums=(0, 1, 2)), *qkv, target="h200").as_text()
  assert "__cudnn$fmha" in text


def test_a_report_of_the_cuda_lowered_step_names_its_kernels():
  block = jact.compressed(lambda w, x: jnp.tanh(x @ w), bits=2)
  w, x = jnp.ones((256, 256)), jnp.ones((64, 256))
  loss = lambda: lambda w, x: block(w, x, key=jax.random.key(0)).sum()
  on_cpu = jact.residual_report(loss(), w, x).kernels()
  with kernels.lowering_for("cuda"):
    for_cuda = jact.residual_report(loss(), w, x).kernels()
  assert set(on_cpu.values()) == {"xla"}
  launch = kernels.select("quantize", platform="gpu").name
  expected = {"pallas_triton": "jact_quantize", "jax_triton": "jact_quantize_jax_triton"}[launch]
  assert set(for_cuda) == set(on_cpu) and set(for_cuda.values()) == {expected}


@needs_plugin
def test_compile_for_refuses_arguments_sharded_over_several_devices():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  two = _gpu_target._compat.cuda_devices(jact.gpu_target("h200").config, "1x1x2")
  sharded = NamedSharding(Mesh(two, ("data",)), PartitionSpec("data"))
  x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=sharded)
  with pytest.raises(ValueError, match="sharded over 2 devices"):
    jact.compile_for(lambda x: x.sum(), x, target="h200")


def test_a_tensor_past_the_kernels_int32_addressing_is_dequantized_by_the_reference():
  # 2**31 values at 2 bits are 2**29 packed bytes: the choice must count the values
  big = jax.ShapeDtypeStruct((2**15, 2**16), jnp.bfloat16)

  def roundtrip(x):
    return jact.dequantize(jact.quantize(x, jax.random.key(0), bits=2))

  with kernels.lowering_for("cuda"):
    jaxpr = jax.make_jaxpr(roundtrip)(big).jaxpr
  # quantize (2**31 inputs) and dequantize (2**31 outputs) both fall back to the reference
  assert _kernel_calls(jaxpr) == 0
