"""Whole-model `jact.compressed` against per-block wrapping: compiled memory.

For an 8-block stack (the `relu_cnn` and `transformer` blocks of
`experiments.bench.memory_scaling`, plain JAX inside), compiles the gradient of a
mean loss three ways and reads XLA's temp memory (compile-only, nothing runs):

* `plain`: the stack as it is;
* `whole`: `jact.compressed(stack, bits=b)` around the whole stack;
* `per_block`: each block in its own `jact.compressed(..., compress_argnums=(1,))`.

Each stack is measured twice: unrolled (a Python loop over the blocks) and
scanned (`lax.scan` over the stacked block parameters, as `nn.scan` and
`nnx.scan` run a layer stack; the per-block wrap then sits in the scan's
body). A whole-model wrap stores the residuals the scan produces per layer
inside the loop (`jact/_transforms/_scan.py`).

Targets (issue 16): whole within 1.3x of per_block, and at least 3x below
plain at 2 bits.

    python -m experiments.bench.bench_whole_model [--bits 2] [--stacks relu_cnn] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

import jact
from experiments.lib import blocks, metadata
from jact._transforms.compressed import compressed

__all__ = ["measure", "main"]

SHAPES = {
  "relu_cnn": ((8, 16, 16, 32), dict(channels=32)),
  "transformer": ((4, 128, 128), dict(dim=128, mlp=512)),
}


def _losses(name: str, bits: int, depth: int, scanned: bool = False):
  block, _, _ = blocks.BLOCKS[name]
  plain_block = lambda p, x: block(p, x, jax.random.key(0), None)
  per_block = blocks.wrap_block(block, bits, "compressed")

  if scanned:  # params: one pytree with the layers stacked in front

    def stack(params, x):
      return jax.lax.scan(lambda x, p: (plain_block(p, x), None), x, params)[0]

    def loss_per_block(params, x, key):
      step = lambda x, pi: (per_block(pi[0], x, jax.random.fold_in(key, pi[1])), None)
      return jnp.mean(jax.lax.scan(step, x, (params, jnp.arange(depth)))[0])
  else:

    def stack(params, x):
      for p in params:
        x = plain_block(p, x)
      return x

    def loss_per_block(params, x, key):
      for i, p in enumerate(params):
        x = per_block(p, x, jax.random.fold_in(key, i))
      return jnp.mean(x)

  whole = compressed(stack, bits=bits, name="model")

  return {
    "plain": lambda params, x, key: jnp.mean(stack(params, x)),
    "whole": lambda params, x, key: jnp.mean(whole(params, x, key=key)),
    "per_block": loss_per_block,
  }


def measure(name: str, bits: int = 2, depth: int = 8, scanned: bool = False) -> list[dict]:
  """One row per wrapping of the `name` stack (`scanned`: run by `lax.scan`):
  temp bytes and compile seconds."""
  x_shape, kwargs = SHAPES[name]
  params = [blocks.BLOCKS[name][1](**kwargs) for _ in range(depth)]
  if scanned:
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct((depth, *s.shape), s.dtype), params[0])
  x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
  key = jax.random.key(0)
  rows = []
  for mode, loss in _losses(name, bits, depth, scanned).items():
    start = time.perf_counter()
    temp_bytes = jact.compiled_memory(jax.grad(loss), params, x, key).temp_bytes
    rows.append(
      {
        "stack": f"{name} {'scan' if scanned else 'x'}{depth}",
        "mode": mode,
        "bits": None if mode == "plain" else bits,
        "input_shape": list(x_shape),
        "temp_bytes": temp_bytes,
        "compile_seconds": round(time.perf_counter() - start, 1),
      }
    )
  by_mode = {r["mode"]: r["temp_bytes"] for r in rows}
  for r in rows:
    r["temp_reduction_vs_plain"] = round(by_mode["plain"] / max(r["temp_bytes"], 1), 2)
    r["temp_vs_per_block"] = round(r["temp_bytes"] / max(by_mode["per_block"], 1), 2)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--bits", type=int, default=2)
  parser.add_argument("--stacks", nargs="+", default=list(SHAPES))
  parser.add_argument("--json", default=None)
  parser.add_argument(
    "--layouts", nargs="+", default=["unrolled", "scanned"], choices=["unrolled", "scanned"]
  )
  args = parser.parse_args(argv)
  rows = []
  for name in args.stacks:
    for row in (
      r for layout in args.layouts for r in measure(name, args.bits, scanned=layout == "scanned")
    ):
      print(
        f"{row['stack']:16s} {row['mode']:10s} temp {row['temp_bytes'] / 2**20:8.2f} MiB  "
        f"x{row['temp_reduction_vs_plain']:5.2f} below plain  "
        f"{row['temp_vs_per_block']:5.2f}x per-block  compile {row['compile_seconds']} s",
        flush=True,
      )
      rows.append(row)
  if args.json:
    meta = metadata.run_metadata(
      "experiments.bench.bench_whole_model",
      argv,
      note="compile-only: temp bytes from XLA's memory analysis",
    )
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
