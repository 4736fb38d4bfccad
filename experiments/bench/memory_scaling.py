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

import jax
import jax.numpy as jnp

from experiments.lib import blocks, metadata
from jact import compiled_memory, residual_report

__all__ = ["scaling", "main"]


def _zeros(tree):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def scaling(
  name: str, bits, sizes=(1, 2, 4, 8, 16), x_shape=None, mode: str = "ops", **param_kwargs
) -> dict:
  """Compiled temp memory of the train step for each stack size, and the
  residual bytes of one block (measured on a 2-block stack minus a 1-block
  stack, so the loss's own residuals cancel).

  `x_shape` and `param_kwargs` (channels=, or dim=/mlp=) shrink the block for tests.
  """
  block, make_params, default_shape = blocks.BLOCKS[name]
  x_shape = tuple(x_shape or default_shape)
  if param_kwargs:
    make_params = functools.partial(make_params, **param_kwargs)
  loss = functools.partial(blocks.stack_loss, block=blocks.wrap_block(block, bits, mode))
  step = jax.grad(loss)
  x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
  key = jax.random.key(0)
  temps = [compiled_memory(step, [make_params()] * n, x, key).temp_bytes for n in sizes]
  x0 = jnp.zeros(x_shape, jnp.float32)
  res = [residual_report(loss, _zeros([make_params()] * n), x0, key).total_bytes for n in (1, 2)]
  per_block_residual = res[1] - res[0]
  slope = (temps[-1] - temps[-2]) / (sizes[-1] - sizes[-2])
  return {
    "block": name,
    "mode": mode,
    "bits": bits,
    "sizes": list(sizes),
    "temp_bytes": temps,
    "temp_per_block": slope,
    "residual_per_block": per_block_residual,
    "slope_over_residual": slope / per_block_residual,
    "fixed_overhead": temps[0],
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="write the rows to this file")
  parser.add_argument("--bits", type=int, nargs="+", default=[2, 4])
  parser.add_argument("--modes", nargs="+", default=list(blocks.MODES), choices=blocks.MODES)
  parser.add_argument(
    "--blocks", nargs="+", default=list(blocks.BLOCKS), choices=list(blocks.BLOCKS)
  )
  parser.add_argument(
    "--sizes",
    type=int,
    nargs="+",
    default=[1, 2, 4, 8, 16],
    help="stack sizes (>= 2 of them; the slope is taken between the last two)",
  )
  args = parser.parse_args(argv)
  if len(args.sizes) < 2:
    parser.error("--sizes needs at least two stack sizes")
  rows = []
  mib = 2.0**20
  runs = [
    (m, b)
    for m in args.modes
    for b in ([None, *args.bits] if m == "ops" else [None] if m == "remat" else args.bits)
  ]
  for name in args.blocks:
    for mode, bits in runs:
      r = scaling(name, bits, sizes=tuple(args.sizes), mode=mode)
      rows.append(r)
      temps = " ".join(f"{t / mib:7.1f}" for t in r["temp_bytes"])
      print(
        f"{name:12s} {mode:10s} bits={str(bits):4s} temp MiB [{temps}]  per block: temp "
        f"{r['temp_per_block'] / mib:6.2f} MiB, residual {r['residual_per_block'] / mib:6.2f} MiB, "
        f"ratio {r['slope_over_residual']:.2f}",
        flush=True,
      )
  if args.json:
    meta = metadata.run_metadata("experiments.bench.memory_scaling", argv, compile_only=True)
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
