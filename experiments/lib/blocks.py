"""Two residual blocks written with `jact.ops` (bits=None: the plain jax ops) and the four ways
a stack of them is trained (`MODES`): the subjects of `experiments.bench.memory_scaling`,
`bench_memory --stack`, `compile_time` and `experiments.gpu.gpu_measures`.

* `relu_cnn`: conv3x3 -> ReLU -> conv3x3, residual add, ReLU (CIFAR-sized maps);
* `transformer`: pre-LN encoder block (LayerNorm, 4-head self-attention,
  LayerNorm, GELU MLP), residual adds.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jact import ops
from jact._transforms.checkpoint import checkpoint
from jact._transforms.compressed import compressed

__all__ = ["BLOCKS", "MODES", "stack_loss", "transformer_block", "transformer_params", "wrap_block"]

_NHWC = ("NHWC", "HWIO", "NHWC")


def _relu(x, bits):
  return jax.nn.relu(x) if bits is None else ops.relu(x)


def relu_cnn_block(p, x, key, bits):
  k1, k2 = jax.random.split(key)
  if bits is None:
    conv = lambda h, w: jax.lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=_NHWC)
  else:
    conv = lambda h, w, k: ops.conv(h, w, key=k, bits=bits)
  h = _relu(conv(x, p["w1"]) if bits is None else conv(x, p["w1"], k1), bits)
  h = conv(h, p["w2"]) if bits is None else conv(h, p["w2"], k2)
  return _relu(h + x, bits)


def relu_cnn_params(channels=64):
  w = jax.ShapeDtypeStruct((3, 3, channels, channels), jnp.float32)
  return {"w1": w, "w2": w}


def transformer_block(p, x, key, bits, heads=4):
  b, s, d = x.shape
  ks = jax.random.split(key, 8)
  if bits is None:
    ln = lambda h, sc: (
      (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-6) * sc
    )
    dense = lambda h, w, k: h @ w
    attn = lambda q, kk, v, k: _plain_attention(q, kk, v)
    gelu = lambda h, k: jax.nn.gelu(h)
  else:
    ln = None
    dense = lambda h, w, k: ops.dense(h, w, key=k, bits=bits)
    attn = lambda q, kk, v, k: ops.dot_product_attention(q, kk, v, key=k, bits=bits)
    gelu = lambda h, k: ops.gelu(h, key=k, bits=bits)
  norm = (
    (lambda h, sc, k: ln(h, sc))
    if bits is None
    else (lambda h, sc, k: ops.layer_norm(h, sc, key=k, bits=bits))
  )
  h = norm(x, p["ln1"], ks[0])
  qkv = dense(h, p["wqkv"], ks[1]).reshape(b, s, 3, heads, d // heads)
  a = attn(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ks[2]).reshape(b, s, d)
  x = x + dense(a, p["wo"], ks[3])
  h = norm(x, p["ln2"], ks[4])
  h = gelu(dense(h, p["w1"], ks[5]), ks[6])
  return x + dense(h, p["w2"], ks[7])


def _plain_attention(q, k, v):
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def transformer_params(dim=256, mlp=1024):
  f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  return {
    "ln1": f(dim),
    "ln2": f(dim),
    "wqkv": f(dim, 3 * dim),
    "wo": f(dim, dim),
    "w1": f(dim, mlp),
    "w2": f(mlp, dim),
  }


BLOCKS = {
  "relu_cnn": (relu_cnn_block, relu_cnn_params, (32, 32, 32, 64)),
  "transformer": (transformer_block, transformer_params, (16, 256, 256)),
}


MODES = ("ops", "compressed", "checkpoint", "remat")


def wrap_block(block, bits, mode: str):
  """`(p, x, key) -> y` for one block in the given mode."""
  if mode == "ops":
    return lambda p, x, key: block(p, x, key, bits)
  plain = lambda p, x: block(p, x, jax.random.key(0), None)
  if mode == "compressed":
    c = compressed(plain, bits=bits, name="block", compress_argnums=(1,))
    return lambda p, x, key: c(p, x, key=key)
  if mode == "checkpoint":
    c = checkpoint(plain, bits=bits, name="block", compress_argnums=(1,))
    return lambda p, x, key: c(p, x, key=key)
  if mode == "remat":
    c = jax.checkpoint(plain)
    return lambda p, x, key: c(p, x)
  raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def stack_loss(params, x, key, *, block):
  for i, p in enumerate(params):
    x = block(p, x, jax.random.fold_in(key, i))
  return jnp.mean(x)
