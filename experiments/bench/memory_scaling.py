"""Compiled memory per block: does XLA's temp memory follow the residual bytes?

For a stack of n identical blocks (n = 1, 2, 4, 8, 16), compiles the train
step (gradient of a loss) without running it and reads XLA's temp memory; the
slope between the last two sizes is the memory *added per block*, to compare
with the bytes saved for backward per block. Two blocks, written directly with
`jact.ops` (bits=None gives the plain jax equivalents):

* `relu_cnn`: conv3x3 -> ReLU -> conv3x3, residual add, ReLU (CIFAR-sized maps);
* `transformer`: pre-LN encoder block (LayerNorm, 4-head self-attention,
  LayerNorm, GELU MLP), residual adds.

Each block is measured in one of four modes: `ops` (the block written with
`jact.ops` at `bits`; bits=None is plain jax), `compressed` (the plain block
wrapped in `jact.compressed(bits=...)`, one call per block), `checkpoint`
(each block in `jact.checkpoint(bits=...)`) and `remat` (each plain block in
`jax.checkpoint`, bits ignored).

    python -m experiments.bench.memory_scaling [--json PATH] [--blocks relu_cnn transformer]
        [--modes ops compressed checkpoint remat] [--bits 2 4] [--sizes 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import jax
import jax.numpy as jnp

from experiments.lib import metadata
from jact import ops
from jact.report import compiled_memory, residual_report
from jact.transforms.checkpoint import checkpoint
from jact.transforms.compressed import compressed

__all__ = ["BLOCKS", "scaling", "main"]

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
    ln = lambda h, sc: (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-6) * sc
    dense = lambda h, w, k: h @ w
    attn = lambda q, kk, v, k: _plain_attention(q, kk, v)
    gelu = lambda h, k: jax.nn.gelu(h)
  else:
    ln = None
    dense = lambda h, w, k: ops.dense(h, w, key=k, bits=bits)
    attn = lambda q, kk, v, k: ops.dot_product_attention(q, kk, v, key=k, bits=bits)
    gelu = lambda h, k: ops.gelu(h, key=k, bits=bits)
  norm = (lambda h, sc, k: ln(h, sc)) if bits is None else (
      lambda h, sc, k: ops.layer_norm(h, sc, key=k, bits=bits))
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
  return {"ln1": f(dim), "ln2": f(dim), "wqkv": f(dim, 3 * dim), "wo": f(dim, dim),
          "w1": f(dim, mlp), "w2": f(mlp, dim)}


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


def _loss(params, x, key, *, block):
  for i, p in enumerate(params):
    x = block(p, x, jax.random.fold_in(key, i))
  return jnp.mean(x)


def _zeros(tree):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def scaling(name: str, bits, sizes=(1, 2, 4, 8, 16), x_shape=None, mode: str = "ops",
            **param_kwargs) -> dict:
  """Compiled temp memory of the train step for each stack size, and the
  residual bytes of one block (measured on a 2-block stack minus a 1-block
  stack, so the loss's own residuals cancel).

  `x_shape` and `param_kwargs` (channels=, or dim=/mlp=) shrink the block for tests.
  """
  block, make_params, default_shape = BLOCKS[name]
  x_shape = tuple(x_shape or default_shape)
  if param_kwargs:
    make_params = functools.partial(make_params, **param_kwargs)
  loss = functools.partial(_loss, block=wrap_block(block, bits, mode))
  step = jax.grad(loss)
  x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
  key = jax.random.key(0)
  temps = [compiled_memory(step, [make_params()] * n, x, key).temp_bytes for n in sizes]
  x0 = jnp.zeros(x_shape, jnp.float32)
  res = [residual_report(loss, _zeros([make_params()] * n), x0, key).total_bytes for n in (1, 2)]
  per_block_residual = res[1] - res[0]
  slope = (temps[-1] - temps[-2]) / (sizes[-1] - sizes[-2])
  return {
      "block": name, "mode": mode, "bits": bits, "sizes": list(sizes), "temp_bytes": temps,
      "temp_per_block": slope, "residual_per_block": per_block_residual,
      "slope_over_residual": slope / per_block_residual, "fixed_overhead": temps[0],
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="write the rows to this file")
  parser.add_argument("--bits", type=int, nargs="+", default=[2, 4])
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  parser.add_argument("--blocks", nargs="+", default=list(BLOCKS), choices=list(BLOCKS))
  parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                      help="stack sizes (>= 2 of them; the slope is taken between the last two)")
  args = parser.parse_args(argv)
  if len(args.sizes) < 2:
    parser.error("--sizes needs at least two stack sizes")
  rows = []
  mib = 2.0 ** 20
  runs = [(m, b) for m in args.modes for b in ([None, *args.bits] if m == "ops" else
                                                [None] if m == "remat" else args.bits)]
  for name in args.blocks:
    for mode, bits in runs:
      r = scaling(name, bits, sizes=tuple(args.sizes), mode=mode)
      rows.append(r)
      temps = " ".join(f"{t / mib:7.1f}" for t in r["temp_bytes"])
      print(f"{name:12s} {mode:10s} bits={str(bits):4s} temp MiB [{temps}]  per block: temp "
            f"{r['temp_per_block'] / mib:6.2f} MiB, residual {r['residual_per_block'] / mib:6.2f} MiB, "
            f"ratio {r['slope_over_residual']:.2f}", flush=True)
  if args.json:
    meta = metadata.run_metadata("experiments.bench.memory_scaling", argv, compile_only=True)
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
