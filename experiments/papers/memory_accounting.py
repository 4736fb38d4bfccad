"""The papers' memory baseline for the CIFAR ResNet-20: one float32 copy per layer input.

ActNN and BLPA compare compressed activations with what a framework keeps when
every layer stores its input once in float32 (a conv its input, a batch norm
its input, a ReLU's output shared with the next conv). Plain JAX keeps more
(it saves intermediates of the batch-norm and the ReLU separately), so "fewer
bytes than plain JAX" overstates the factor next to the papers'. This counts
that baseline for `experiments.papers.actnn_cifar`'s ResNet-20 at batch 128 from the
shapes alone: every unit's batch-norm input and conv input (the residuals
jact compresses, `jact.sensitivity.find_residuals`), plus the stem conv's input
and the head's batch-norm, pooling and dense inputs (exact in every variant).

    python -m experiments.papers.memory_accounting
"""

from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp

import jact
from experiments.lib import metadata, paths, preact, resumable

__all__ = ["layer_inputs", "main"]


def layer_inputs(
  batch: int = 128, widths=(16, 32, 64), blocks: int = 3, image=(32, 32, 3)
) -> dict[str, int]:
  """name -> number of values of each layer's input (one stored copy per layer)."""
  params = preact.init(jax.random.key(0), widths=widths, blocks=blocks)
  x = jax.ShapeDtypeStruct((batch, *image), jnp.float32)
  y = jax.ShapeDtypeStruct((batch,), jnp.int32)
  loss = functools.partial(preact.loss, form="layers", bits=2)
  sites = jact.sensitivity.find_residuals(loss, params, (x, y), jax.random.key(0))
  values = {name: site.size for name, site in sites.items()}
  side = image[0] // 2 ** (len(widths) - 1)
  head = batch * side * side * widths[-1]
  values.update(
    {
      "stem.lhs": math.prod(x.shape),
      "head.bn.input": head,
      "head.pool.input": head,
      "head.dense.lhs": batch * widths[-1],
    }
  )
  return values


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(
    prog="python -m experiments.papers.memory_accounting", description=__doc__.split("\n")[0]
  )
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--results", type=Path, default=paths.RESULTS)
  a = p.parse_args(argv)
  values = layer_inputs(a.batch)
  result = dict(
    meta=metadata.run_metadata("experiments.papers.memory_accounting", argv),
    batch=a.batch,
    model="pre-activation ResNet-20 (16/32/64, 3 blocks a stage)",
    layer_inputs=values,
    float32_layer_input_bytes=4 * sum(values.values()),
  )
  resumable.write_json(a.results / "memory_accounting.json", result)
  print(
    f"{len(values)} layer inputs, {result['float32_layer_input_bytes'] / 2**20:.1f} MiB in float32"
  )
  return result


if __name__ == "__main__":
  main()
