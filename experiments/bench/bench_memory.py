"""Memory benchmark (compile-only): plain Flax vs jact twins at 8/4/2 bits.

For ResNet-18 and ResNet-50 (CIFAR 32x32 and ImageNet 224x224 inputs) and a
transformer encoder stack, prints and records

* bytes saved for backward (`jact.residual_report`, excluding parameters and
  inputs), and
* XLA's compiled temp memory of the jitted train step (loss gradient, SGD
  update of the parameters, BatchNorm statistics updated), never run,

with ratios to plain float32 training in the same run.

    python -m experiments.bench.bench_memory [--models resnet18_cifar ...] [--json PATH]

With `--stack`, it instead compares ways of training a stack of 8 pre-LN
transformer blocks written in plain JAX (`experiments.bench.memory_scaling`'s
block, 16x256x256 tokens): plain, plain `jax.checkpoint` per block,
`jact.compressed` per block and `jact.checkpoint` per block (4 and 2 bits),
and the same block written with `jact.ops`:

    python -m experiments.bench.bench_memory --stack --json experiments/results/bench_stack.json
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax

from experiments.lib import blocks, metadata, models
from jact import compiled_memory, residual_report

__all__ = ["MODELS", "measure", "main"]

MODELS = {
  # name: (constructor, input shape, label count)
  "resnet18_cifar": (
    lambda L: models.ResNet18(num_classes=10, stem="cifar", layers=L),
    (128, 32, 32, 3),
    10,
  ),
  "resnet50_cifar": (
    lambda L: models.ResNet50(num_classes=10, stem="cifar", layers=L),
    (128, 32, 32, 3),
    10,
  ),
  "resnet18_224": (
    lambda L: models.ResNet18(num_classes=1000, stem="imagenet", layers=L),
    (32, 224, 224, 3),
    1000,
  ),
  "resnet50_224": (
    lambda L: models.ResNet50(num_classes=1000, stem="imagenet", layers=L),
    (32, 224, 224, 3),
    1000,
  ),
  "transformer": (
    lambda L: models.TransformerEncoder(
      num_layers=8, dim=256, heads=4, mlp_dim=1024, num_classes=10, layers=L
    ),
    (16, 256, 256),
    10,
  ),
}


def _loss_fn(model, variables, x, y, key):
  def loss(params):
    out, updates = model.apply(
      {**variables, "params": params},
      x,
      train=True,
      rngs={"jact": key, "dropout": key},
      mutable=["batch_stats"],
    )
    logits = out.reshape(out.shape[0], -1) if out.ndim > 2 else out
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

  return loss


def measure(name: str, bits) -> dict:
  """Residual bytes and compiled temp memory of one model at one bit width (None = plain)."""
  make, x_shape, classes = MODELS[name]
  layers = models.plain_layers() if bits is None else models.jact_layers(bits)
  model = make(layers)
  x = jnp.zeros(x_shape, jnp.float32)
  y = jnp.zeros((x_shape[0],), jnp.int32)
  key = jax.random.key(0, impl="rbg")
  variables = jax.eval_shape(
    lambda: make(models.plain_layers()).init({"params": key, "dropout": key}, x, train=False)
  )
  concrete = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables)
  loss = _loss_fn(model, concrete, x, y, key)
  t0 = time.perf_counter()
  residual = residual_report(lambda p: loss(p)[0], concrete["params"]).total_bytes

  def step(variables, x, y, key):
    # A whole train step: gradients are consumed by an SGD update, as in training
    # (returning raw gradients would add their layout copies to the temp memory).
    grads, updates = jax.grad(_loss_fn(model, variables, x, y, key), has_aux=True)(
      variables["params"]
    )
    params = jax.tree.map(lambda p, g: p - 0.01 * g, variables["params"], grads)
    return {**variables, **updates, "params": params}

  temp = compiled_memory(
    step,
    variables,
    jax.ShapeDtypeStruct(x_shape, jnp.float32),
    jax.ShapeDtypeStruct(y.shape, y.dtype),
    key,
  ).temp_bytes
  return {
    "model": name,
    "bits": bits,
    "input_shape": list(x_shape),
    "residual_bytes": residual,
    "temp_bytes": temp,
    "seconds": round(time.perf_counter() - t0, 1),
  }


STACK_MODES = (
  ("ops", None),
  ("remat", None),
  ("compressed", 4),
  ("compressed", 2),
  ("checkpoint", 4),
  ("checkpoint", 2),
  ("ops", 4),
  ("ops", 2),
)


def measure_stack(mode: str, bits, depth: int = 8, x_shape=(16, 256, 256)) -> dict:
  """Residual bytes and compiled temp memory of the train step (gradient) of a
  stack of `depth` transformer blocks in one mode (see `blocks.MODES`)."""
  block, make_params, _ = blocks.BLOCKS["transformer"]
  loss = lambda params, x, key: blocks.stack_loss(
    params, x, key, block=blocks.wrap_block(block, bits, mode)
  )
  params = [make_params()] * depth
  key = jax.random.key(0, impl="rbg")
  t0 = time.perf_counter()
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
  residual = residual_report(loss, zeros, jnp.zeros(x_shape, jnp.float32), key).total_bytes
  temp = compiled_memory(
    jax.grad(loss), params, jax.ShapeDtypeStruct(x_shape, jnp.float32), key
  ).temp_bytes
  return {
    "stack": f"transformer x{depth}",
    "mode": mode,
    "bits": bits,
    "input_shape": list(x_shape),
    "residual_bytes": residual,
    "temp_bytes": temp,
    "seconds": round(time.perf_counter() - t0, 1),
  }


def stack_rows() -> list[dict]:
  rows, mib = [], 2.0**20
  print(
    f"{'mode':12s} {'bits':>5s} {'saved for bwd':>14s} {'ratio':>7s} {'temp':>10s} {'ratio':>7s}"
  )
  base = remat = None
  for mode, bits in STACK_MODES:
    row = measure_stack(mode, bits)
    base = base or row
    remat = row if mode == "remat" else remat
    row["residual_reduction"] = base["residual_bytes"] / row["residual_bytes"]
    row["temp_reduction"] = base["temp_bytes"] / row["temp_bytes"]
    if mode == "checkpoint":
      row["residual_reduction_vs_remat"] = remat["residual_bytes"] / row["residual_bytes"]
      row["temp_reduction_vs_remat"] = remat["temp_bytes"] / row["temp_bytes"]
    rows.append(row)
    print(
      f"{mode:12s} {str(bits or 'plain'):>5s} {row['residual_bytes'] / mib:11.1f} MiB "
      f"{row['residual_reduction']:6.1f}x {row['temp_bytes'] / mib:7.1f} MiB "
      f"{row['temp_reduction']:6.1f}x",
      flush=True,
    )
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  parser.add_argument("--bits", nargs="+", type=int, default=[8, 4, 2])
  parser.add_argument("--json", default="experiments/results/bench_memory.json")
  parser.add_argument(
    "--stack",
    action="store_true",
    help="compare plain / remat / jact.compressed / jact.checkpoint on a transformer stack",
  )
  args = parser.parse_args(argv)
  rows = []
  mib = 2.0**20
  if args.stack:
    rows = stack_rows()
    args.models = []
  else:
    print(
      f"{'model':16s} {'bits':>5s} {'saved for bwd':>14s} {'ratio':>7s} {'temp':>10s} {'ratio':>7s}"
    )
  for name in args.models:
    base = None
    for bits in [None, *args.bits]:
      row = measure(name, bits)
      base = base or row
      row["residual_reduction"] = base["residual_bytes"] / row["residual_bytes"]
      row["temp_reduction"] = base["temp_bytes"] / row["temp_bytes"]
      rows.append(row)
      print(
        f"{name:16s} {str(bits or 'plain'):>5s} {row['residual_bytes'] / mib:11.1f} MiB "
        f"{row['residual_reduction']:6.1f}x {row['temp_bytes'] / mib:7.1f} MiB "
        f"{row['temp_reduction']:6.1f}x",
        flush=True,
      )
  meta = metadata.run_metadata(
    "experiments.bench.bench_memory",
    argv,
    note="compile-only: residual bytes from the traced VJP, temp bytes from XLA's memory analysis",
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
