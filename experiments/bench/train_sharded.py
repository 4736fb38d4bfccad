"""Data parallel + FSDP training of the zoo's decoder LM on tiny Shakespeare, 8 devices.

The unmodified `experiments.lib.zoo.TransformerLM` (linen) is trained on a mesh of
8 devices (forced host devices on a CPU: `--xla_force_host_platform_device_count=8`,
set here before jax starts): the batch is sharded over the mesh axis "data",
and so is every parameter with a dimension divisible by 8 (FSDP: the largest
such dimension; the rest replicated). Three variants with the same
initialization, data order and optimizer: plain, `jact.convert(model, bits=4)`
and `jact.convert(model, bits=2)`, the jact ones traced inside
`jact.sharded_batch("data", mesh)`. Reported per variant: per-device compiled
memory of the training step (temp, arguments, outputs), the collectives of the
optimized HLO (count and bytes a device receives, from the result shapes: an
all-gather's result, an all-reduce's operand), time per step, and the loss
every 10 steps, with a held-out loss at the end.

    python -m experiments.bench.train_sharded [--steps 200] [--batch 64] [--json PATH]

writes `experiments/results/train_sharded.json`.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # the device count is fixed when jax starts
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

# pylint: disable=wrong-import-position
import argparse
import collections
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jact
from experiments.lib import memory, metadata, paths, zoo_data
from experiments.lib.zoo import LM_CONFIG, TransformerLM

RESULTS = paths.RESULTS
DEVICES = 8
_BYTES = {
  "f32": 4,
  "bf16": 2,
  "f16": 2,
  "s32": 4,
  "u32": 4,
  "u8": 1,
  "s8": 1,
  "pred": 1,
  "f64": 8,
  "s64": 8,
  "u64": 8,
}
_COLLECTIVE = re.compile(  # the result type (an array, or a tuple of arrays), then the kind
  r"= (\([^)]*\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\("
)
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def fsdp_spec(shape: tuple[int, ...]) -> P:
  """The parameter's largest dimension divisible by the device count sharded
  over "data"; replicated when none is."""
  dims = [d for d in range(len(shape)) if shape[d] % DEVICES == 0 and shape[d] >= DEVICES]
  if not dims:
    return P()
  d = max(dims, key=lambda i: shape[i])
  return P(*[("data" if i == d else None) for i in range(len(shape))])


def collectives(hlo: str) -> dict:
  """Per kind: how many, and the bytes of their results (one device's view;
  a combined collective's tuple counted whole).

  >>> collectives("%a = (f32[4]{0}, u8[2]{0}) all-reduce(%x, %y), to_apply=%sum")
  {'all-reduce': {'count': 1, 'bytes': 18}}
  """
  count, size = collections.Counter(), collections.Counter()
  for result, kind in _COLLECTIVE.findall(hlo):
    count[kind] += 1
    for dtype, shape in _ARRAY.findall(result):
      size[kind] += int(np.prod([int(d) for d in shape.split(",") if d])) * _BYTES[dtype]
  return {k: {"count": count[k], "bytes": size[k]} for k in sorted(count)}


def loss_fn(apply, params, batch, key):
  logits = apply(params, batch["inputs"][0], key)
  labels = jax.nn.one_hot(batch["labels"], logits.shape[-1])
  return jnp.mean(optax.softmax_cross_entropy(logits.astype(jnp.float32), labels))


def variant_apply(variant: str):
  model = TransformerLM(LM_CONFIG)
  if variant == "plain":
    return lambda params, tokens, key: model.apply({"params": params}, tokens)
  bits = int(variant.split("_")[1])
  converted = jact.convert(model, bits=bits)
  return lambda params, tokens, key: converted.apply({"params": params}, tokens, rngs={"jact": key})


def run(variant: str, steps: int, batch_size: int, mesh, lr: float = 1e-3) -> dict:
  apply = variant_apply(variant)
  # the zoo's loader in windows of 16 (its held-out windows fit the split at that size)
  windows, held = zoo_data.shakespeare_batches(0, batch_size=16)
  group = lambda batches: jax.tree.map(lambda *a: jnp.concatenate(a), *batches)  # noqa: E731
  train_it = (group([next(windows) for _ in range(batch_size // 16)]) for _ in iter(int, 1))
  test = [group(held[i : i + batch_size // 16]) for i in range(0, len(held), batch_size // 16)]
  first = next(train_it)
  params = TransformerLM(LM_CONFIG).init(jax.random.key(0), first["inputs"][0][:1])["params"]
  param_shardings = jax.tree.map(lambda p: NamedSharding(mesh, fsdp_spec(p.shape)), params)
  batch_sharding = NamedSharding(mesh, P("data"))
  opt = optax.adam(lr)
  params = jax.device_put(params, param_shardings)
  opt_state = opt.init(params)  # moments sharded like their parameters, the count replicated
  opt_shardings = jax.tree.map(
    lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else NamedSharding(mesh, P()),
    opt_state,
  )
  opt_state = jax.device_put(opt_state, opt_shardings)

  def step(params, opt_state, batch, key):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(apply, p, batch, key))(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step, out_shardings=(param_shardings, opt_shardings, None), donate_argnums=(0, 1))
  put = lambda b: jax.device_put(b, batch_sharding)  # noqa: E731
  key = jax.random.key(1000)
  with jact.sharded_batch("data", mesh):
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, put(first), key).compile()
    compile_seconds = time.perf_counter() - start
  step_memory = memory.compiled_memory_of(compiled)
  losses, batch = [], first
  for i in range(steps):
    if i == 1:
      start = time.perf_counter()  # the first step includes dispatch warm-up
    params, opt_state, loss = compiled(params, opt_state, put(batch), jax.random.fold_in(key, i))
    losses.append(float(loss))
    batch = next(train_it)
  seconds = (time.perf_counter() - start) / max(steps - 1, 1)
  evaluate = jax.jit(lambda p, b: loss_fn(variant_apply("plain"), p, b, None))
  held_out = float(np.mean([evaluate(params, put(b)) for b in test]))
  return {
    "variant": variant,
    "steps": steps,
    "batch": batch_size,
    "per_device_bytes": {
      "temp": step_memory.temp_bytes,
      "arguments": step_memory.argument_bytes,
      "outputs": step_memory.output_bytes,
    },
    "collectives": collectives(compiled.as_text()),
    "compile_seconds": compile_seconds,
    "seconds_per_step": seconds,
    "first_loss": losses[0],
    "final_loss": float(np.mean(losses[-20:])),
    "held_out_loss": held_out,
    "any_nan": bool(not np.all(np.isfinite(losses))),
    "losses_every_10": losses[::10],
  }


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--variants", nargs="+", default=["plain", "jact_4", "jact_2"])
  parser.add_argument("--json", default=str(RESULTS / "train_sharded.json"))
  args = parser.parse_args(argv)
  if args.batch % 16 or args.batch // 16 > 32:
    raise SystemExit("--batch: a multiple of 16, at most 512")
  if jax.device_count() < DEVICES:
    raise SystemExit(
      f"needs {DEVICES} devices, found {jax.device_count()}: run it as "
      "`python -m experiments.bench.train_sharded` (it sets XLA_FLAGS before jax starts)"
    )
  mesh = jax.make_mesh(
    (DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:DEVICES]
  )
  runs = []
  for variant in args.variants:
    r = run(variant, args.steps, args.batch, mesh)
    runs.append(r)
    print({k: v for k, v in r.items() if k != "losses_every_10"}, flush=True)
  plain = next((r for r in runs if r["variant"] == "plain"), None)
  summary = []
  if plain is not None:
    for r in runs:
      summary.append(
        {
          "variant": r["variant"],
          "temp_vs_plain": r["per_device_bytes"]["temp"] / plain["per_device_bytes"]["temp"],
          "collective_bytes": sum(c["bytes"] for c in r["collectives"].values()),
          "collective_bytes_plain": sum(c["bytes"] for c in plain["collectives"].values()),
          "final_loss": r["final_loss"],
          "held_out_loss": r["held_out_loss"],
          "step_time_vs_plain": r["seconds_per_step"] / plain["seconds_per_step"],
        }
      )
      print(summary[-1], flush=True)
  path = Path(args.json)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(
    json.dumps(
      {
        "meta": metadata.run_metadata("experiments.bench.train_sharded", argv),
        "summary": summary,
        "runs": runs,
      },
      indent=1,
    )
    + "\n"
  )
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
