"""Which attention kernel a `chunked_attention` call runs: cuDNN's fused one or jact's chunks.

On an NVIDIA GPU, `jax.nn.dot_product_attention(..., implementation="cudnn")` is a fused
flash-attention kernel that keeps only O(length) softmax statistics; jact's chunked XLA
loops took 6.4x plain attention's time on an H200. Where the program is lowered for cuda
and the call is one cuDNN takes, jact runs the fused kernel (and stores its q, k, v
compressed); elsewhere the chunked path stays.

>>> import jax.numpy as jnp
>>> q = jnp.ones((2, 64, 4, 32), jnp.bfloat16)
>>> cudnn_refusal(q, q, q, bias=None, mask=None, causal=True) is None
True
>>> cudnn_refusal(q.astype(jnp.float32), q, q, bias=None, mask=None, causal=False)
'cuDNN fused attention takes bfloat16 or float16, not float32'
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jact import _compat
from jact import kernels

__all__ = [
  "IMPLEMENTATIONS",
  "cudnn_refusal",
  "lowering_for_cuda",
  "cudnn_attention",
  "platform_choice",
]

IMPLEMENTATIONS = (None, "cudnn", "xla")
"""`chunked_attention(implementation=...)`: None chooses cuDNN where it applies, "xla" the
chunked loops always, "cudnn" the fused kernel or an error saying why not."""

MAX_HEAD_DIM = 128
"""The largest head dimension cuDNN's fused attention takes on every GPU jax supports (256
from Hopper on; 128 keeps one rule for a program compiled without a device)."""


def cudnn_refusal(query, keys, value, *, bias, mask, causal: bool) -> str | None:
  """Why cuDNN's fused attention cannot run this call, or None when it can."""
  dtype = jnp.result_type(query, keys, value)
  if dtype not in (jnp.bfloat16, jnp.float16):
    return f"cuDNN fused attention takes bfloat16 or float16, not {jnp.dtype(dtype).name}"
  depth, v_depth = query.shape[-1], value.shape[-1]
  if depth != v_depth or depth % 8 or depth > MAX_HEAD_DIM:
    return (
      f"cuDNN fused attention needs equal q/k and v head dims, a multiple of 8 and at most "
      f"{MAX_HEAD_DIM}; got {depth} and {v_depth}"
    )
  if bias is not None or mask is not None:
    return "a bias or mask (cuDNN's path here takes causal masking only)"
  if causal and query.shape[-3] != keys.shape[-3]:
    return "causal attention with q_length != kv_length (cuDNN aligns the diagonal otherwise)"
  return None


def lowering_for_cuda() -> bool:
  """The program being traced is lowered for cuda: on an NVIDIA GPU, or inside
  `jact.kernels.lowering_for("cuda")` (a deviceless XLA:GPU compile, `jact.compile_for`)."""
  return "cuda" in kernels.REGISTRY.lowering_targets() or _compat.lowering_platform() == "cuda"


def cudnn_attention(query, keys, value, *, causal: bool):
  """`jax.nn.dot_product_attention` with cuDNN, on [batch..., length, heads, depth]
  (the batch axes flattened into one, as cuDNN takes exactly one)."""
  *batch, lq, heads, depth = query.shape
  flat = lambda a: a.reshape(-1, *a.shape[-3:])
  out = jax.nn.dot_product_attention(
    flat(query), flat(keys), flat(value), is_causal=causal, implementation="cudnn"
  )
  return out.reshape(*batch, lq, heads, value.shape[-1])


def platform_choice(operands, *, cuda, default):
  """`cuda(*operands)` where the program is lowered for cuda, `default(*operands)` elsewhere
  (`lax.platform_dependent`: both are traced, one is compiled)."""
  return lax.platform_dependent(*operands, cuda=cuda, default=default)
