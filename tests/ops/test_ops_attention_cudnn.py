"""`jact.ops.chunked_attention` on cuDNN's fused attention where a program is lowered for
cuda (compiled here for an H200 without a GPU); the chunked loops elsewhere."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact import kernels
from jact.ops import _attention_backend

needs_plugin = pytest.mark.skipif(
  importlib.util.find_spec("jax_plugins.xla_cuda12") is None
  and importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
  reason="no CUDA PJRT plugin to compile for a GPU: pip install -e '.[test]'",
)

B, L, HEADS, DEPTH = 2, 512, 4, 64
EMBED = HEADS * DEPTH


def _attention_grad(bits, implementation=None, dtype=jnp.bfloat16):
  def loss(q, k, v):
    key = jax.random.key(0) if bits else None
    out = jact.ops.chunked_attention(
      q, k, v, causal=True, bits=bits, key=key, implementation=implementation
    )
    return jnp.sum(out.astype(jnp.float32) ** 2)

  qkv = [jax.ShapeDtypeStruct((B, L, HEADS, DEPTH), dtype)] * 3
  return jax.grad(loss, argnums=(0, 1, 2)), qkv


def _fmha_calls(text: str) -> int:
  return text.count('custom_call_target="__cudnn$fmha')


@needs_plugin
@pytest.mark.parametrize("bits", [None, 4])
def test_lowered_for_cuda_it_runs_cudnn_fused_attention(bits):
  grad, qkv = _attention_grad(bits)
  text = jact.compile_for(grad, *qkv, target="h200").as_text()
  assert _fmha_calls(text) >= 2, "no cuDNN forward and backward in the program"
  if bits:  # q, k and v stored by jact's kernels
    assert kernels.kernel_launches(text) >= 6, kernels.kernel_launches(text)


@needs_plugin
def test_implementation_xla_keeps_the_chunked_loops_on_cuda():
  grad, qkv = _attention_grad(4, implementation="xla")
  assert _fmha_calls(jact.compile_for(grad, *qkv, target="h200").as_text()) == 0


@needs_plugin
def test_float32_falls_back_to_the_chunked_loops_and_cudnn_says_why():
  grad, qkv = _attention_grad(4, dtype=jnp.float32)
  assert _fmha_calls(jact.compile_for(grad, *qkv, target="h200").as_text()) == 0
  grad, qkv = _attention_grad(4, implementation="cudnn", dtype=jnp.float32)
  with pytest.raises(ValueError, match="bfloat16 or float16, not float32.*implementation=None"):
    jact.compile_for(grad, *qkv, target="h200")


@needs_plugin
def test_in_a_model_fused_compressed_attention_keeps_less_than_plain_cudnn():
  """Four attention blocks (q/k/v/out projections, residual adds), bfloat16: jact's fused
  path (projection inputs and q, k, v stored at 2 bits) against the same blocks with JAX's
  own cuDNN attention and plain matmuls, and against jact's chunked loops. Compile-only."""
  blocks = 4

  def make(kind):
    def loss(params, x, key):
      h = x
      for i in range(blocks):
        keys = jax.random.split(jax.random.fold_in(key, i), 5)
        if kind == "plain":
          proj = lambda a, w, k: a @ w
        else:
          proj = lambda a, w, k: jact.ops.dense(a, w, bits=2, key=k)
        q, k, v = (
          proj(h, params[n], keys[j]).reshape(B, L, HEADS, DEPTH)
          for j, n in enumerate(("wq", "wk", "wv"))
        )
        if kind == "plain":
          o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        else:
          implementation = "xla" if kind == "chunked" else None
          o = jact.ops.chunked_attention(
            q, k, v, causal=True, bits=2, key=keys[3], implementation=implementation
          )
        h = h + proj(o.reshape(B, L, EMBED), params["wo"], keys[4])
      return jnp.sum(h.astype(jnp.float32) ** 2)

    return jax.grad(loss)

  params = {n: jax.ShapeDtypeStruct((EMBED, EMBED), jnp.bfloat16) for n in ("wq", "wk", "wv", "wo")}
  x = jax.ShapeDtypeStruct((B, L, EMBED), jnp.bfloat16)
  temp = {
    kind: jact.compile_for(make(kind), params, x, jax.random.key(0), target="h200")
    .memory_analysis()
    .temp_size_in_bytes
    for kind in ("plain", "fused", "chunked")
  }
  assert temp["fused"] < temp["plain"], temp
  assert temp["fused"] < temp["chunked"], temp


def test_off_cuda_the_chunked_path_runs_unchanged():
  """On this CPU, implementation=None traces the chunked loops alone (no platform switch)
  and gives the bits implementation="xla" gives."""
  x = jax.random.normal(jax.random.key(1), (B, 64, HEADS, DEPTH), jnp.bfloat16)

  def run(implementation):
    f = lambda q: jact.ops.chunked_attention(
      q, q, q, causal=True, bits=4, key=jax.random.key(2), implementation=implementation
    )
    return jax.jit(jax.value_and_grad(lambda q: jnp.sum(f(q).astype(jnp.float32))))(x)

  assert "platform_index" not in str(
    jax.make_jaxpr(lambda q: jact.ops.chunked_attention(q, q, q, bits=4, key=jax.random.key(2)))(x)
  )
  for a, b in zip(jax.tree.leaves(run(None)), jax.tree.leaves(run("xla"))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_cudnn_asked_for_off_cuda_names_the_fix():
  q = jnp.ones((1, 16, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="not lowered for cuda.*jact.compile_for"):
    jact.ops.chunked_attention(q, q, q, implementation="cudnn")
  with pytest.raises(ValueError, match="implementation must be None, 'cudnn' or 'xla'"):
    jact.ops.chunked_attention(q, q, q, implementation="flash")


def test_refusals_name_what_cudnn_does_not_take():
  q = jnp.ones((1, 16, 2, 16), jnp.bfloat16)
  refusal = _attention_backend.cudnn_refusal
  assert refusal(q, q, q, bias=None, mask=None, causal=True) is None
  assert "head dim" in refusal(
    q[..., :12], q[..., :12], q[..., :12], bias=None, mask=None, causal=False
  )
  assert "bias or mask" in refusal(q, q, q, bias=jnp.zeros((16, 16)), mask=None, causal=False)
  assert "q_length != kv_length" in refusal(q[:, :8], q, q, bias=None, mask=None, causal=True)
