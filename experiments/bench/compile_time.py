"""How long the jitted gradient of a zoo model takes to trace, lower and compile.

For each model of `experiments/lib/zoo.py`, compares the plain model with
`jact.convert(model, bits=b)` and with `jact.compressed` around the whole
model (`experiments/lib/zoo_harness.variant_fns`), timing separately

* trace: `jax.jit(jax.grad(loss)).trace(...)` (Python: the model and jact);
* lower: `.lower()` (to StableHLO);
* compile: `.compile()` (XLA's passes and code generation), as wall seconds
  and as this process's CPU seconds (less sensitive to other processes on a
  shared machine; XLA:CPU compiles on several threads, so it can exceed wall);

and recording sizes that explain them: jaxpr equations (nested ones
included), lines of the lowered StableHLO and fusions in the optimized HLO
(XLA:CPU emits one kernel per fusion that is not a duplicate of another).
Each figure is the minimum over `--repeat` runs. Ratios are variant / plain.

    python -m experiments.bench.compile_time [--models NAME ...] [--bits 2] [--repeat 1] [--step]
        [--stack] [--resnet50] [--json PATH]

`--step` adds the compiled gradient's time on the zoo models' real batches
(median of 5 calls), `--stack` the 8-block transformer stack of
`experiments.bench.memory_scaling` (plain, `jact.compressed` per block and around
the stack) and `--resnet50` ResNet-50 at 224x224 (plain, `jact.convert`),
those two compile-only.

writes `experiments/results/compile_time.json` (default) with the rows and
the run's metadata (commit, versions, date, machine, load average).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments.lib import blocks, memory, metadata, paths, timing
from experiments.lib.zoo import CASES
from experiments.lib.zoo_harness import variant_fns

RESULTS = paths.RESULTS
DEFAULT_MODELS = ("mnist_cnn", "transformer_lm", "bilstm_sst2", "resnet18")


def count_eqns(jaxpr) -> int:
  """Equations of a jaxpr, those of nested jaxprs (jit, custom_vjp, scan...) included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(inner, "eqns"):
          n += count_eqns(inner)
  return n


def measure_program(fn, args, step: bool = False) -> dict:
  """Trace, lower and compile `jax.jit(fn)` at `args` (arrays or
  ShapeDtypeStructs); with `step`, also the median of 5 timed calls of the
  compiled program after one warm-up (`args` must then be arrays)."""
  jitted = jax.jit(fn)
  start = time.perf_counter()
  traced = jitted.trace(*args)
  traced_at = time.perf_counter()
  lowered = traced.lower()
  lowered_at, cpu_start = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  done, cpu_done = time.perf_counter(), time.process_time()
  hlo = compiled.as_text()
  row = {
    "trace_s": traced_at - start,
    "lower_s": lowered_at - traced_at,
    "compile_s": done - lowered_at,
    "compile_cpu_s": cpu_done - cpu_start,
    "jaxpr_eqns": count_eqns(traced.jaxpr.jaxpr),
    "stablehlo_lines": lowered.as_text().count("\n"),
    "hlo_instructions": sum(1 for line in hlo.splitlines() if " = " in line),
    "fusions": hlo.count(" fusion("),
    "temp_bytes": memory.compiled_memory_of(compiled).temp_bytes,
  }
  if step:
    row["step_s"] = timing.median_seconds(compiled, *args, calls=5)
  return row


def measure_once(case, variant: str, bits: int | None, batch, key, step: bool = False) -> dict:
  fns = variant_fns(case, variant, bits)
  return measure_program(
    jax.grad(fns.loss, has_aux=True), (fns.params, fns.state, batch, key), step
  )


def _rows_of(label: dict, run, repeat: int) -> dict:
  row = dict(label)
  try:
    runs = [run() for _ in range(repeat)]
  except Exception as e:  # pylint: disable=broad-except  # recorded, the table goes on
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return row
  for k in runs[0]:
    row[k] = min(r[k] for r in runs)
  return row


def measure(case, variant: str, bits: int | None, repeat: int, step: bool = False) -> dict:
  batch, key = case.batch(0), jax.random.key(1)
  return _rows_of(
    {"model": case.name, "framework": case.framework, "variant": variant, "bits": bits},
    lambda: measure_once(case, variant, bits, batch, key, step),
    repeat,
  )


def stack_programs(bits: int, depth: int = 8) -> dict:
  """The 8-block pre-LN transformer stack of `experiments.bench.memory_scaling`
  (input (16, 256, 256)) as gradients of a loss: plain, `jact.compressed`
  around each block ("per_block") and around the whole stack ("compressed").
  Compile-only: arguments are ShapeDtypeStructs."""
  import jact

  block, make_params, shape = blocks.BLOCKS["transformer"]
  params = [make_params() for _ in range(depth)]
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  key = jax.random.key(1)
  plain_block = lambda p, x, key: block(p, x, jax.random.key(0), None)

  def stack(block_fn):
    def loss(params, x, key):
      for i, p in enumerate(params):
        x = block_fn(p, x, jax.random.fold_in(key, i))
      return jnp.mean(x * x)

    return loss

  whole = jact.compressed(
    lambda params, x: stack(plain_block)(params, x, key),
    bits=bits,
    name="stack",
    compress_argnums=(1,),
  )
  losses = {
    "plain": stack(plain_block),
    "per_block": stack(blocks.wrap_block(block, bits, "compressed")),
    "compressed": lambda params, x, key: whole(params, x, key=key),
  }
  return {name: (jax.grad(loss), (params, x, key)) for name, loss in losses.items()}


def resnet50_programs(bits: int, batch: int = 8, image: int = 224) -> dict:
  """ResNet-50 (`experiments.lib.models`, ImageNet stem, 1000 classes) at
  `image`² and `batch`: the gradient of a cross-entropy loss, plain and
  `jact.convert`. Compile-only."""
  import optax

  import jact
  from experiments.lib import models

  model = models.ResNet50(num_classes=1000, layers=models.plain_layers())
  x = jax.ShapeDtypeStruct((batch, image, image, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((batch,), jnp.int32)
  variables = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, image, image, 3)), train=False)
  )

  def loss_of(net):
    def loss(params, batch_stats, x, y, key):
      logits, _ = net.apply(
        {"params": params, "batch_stats": batch_stats},
        x,
        train=True,
        rngs={"jact": key},
        mutable=["batch_stats"],
      )
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return jax.grad(loss)

  args = (variables["params"], variables["batch_stats"], x, y, jax.random.key(1))
  return {
    "plain": (loss_of(model), args),
    "convert": (loss_of(jact.convert(model, bits=bits)), args),
  }


def with_ratios(row, plain) -> dict:
  if "error" not in row and "error" not in plain:
    for k in (
      "trace_s",
      "lower_s",
      "compile_s",
      "compile_cpu_s",
      "fusions",
      "stablehlo_lines",
      "hlo_instructions",
      "jaxpr_eqns",
      "step_s",
    ):
      if k in row and k in plain:
        row[k.removesuffix("_s") + "_ratio"] = row[k] / max(plain[k], 1e-9)
  return row


def _print(r) -> None:
  figures = (
    ("error: " + r["error"])
    if "error" in r
    else (
      f"trace {r['trace_s']:6.2f}s lower {r['lower_s']:5.2f}s compile {r['compile_s']:6.2f}s"
      f" (cpu {r['compile_cpu_s']:6.2f}s, x{r.get('compile_cpu_ratio', 1):.1f})"
      f" fusions {r['fusions']:5d} eqns {r['jaxpr_eqns']:6d}"
      + (
        f" step {r['step_s'] * 1e3:8.1f}ms (x{r.get('step_ratio', 1):.2f})" if "step_s" in r else ""
      )
    )
  )
  print(f"{r['model']:15s} {r['variant']:10s} {figures}", flush=True)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS), choices=sorted(CASES))
  parser.add_argument(
    "--variants", nargs="+", default=["convert", "compressed"], choices=["convert", "compressed"]
  )
  parser.add_argument("--bits", type=int, default=2)
  parser.add_argument("--repeat", type=int, default=1)
  parser.add_argument(
    "--step",
    action="store_true",
    help="also time the compiled gradient on the zoo models' real batches",
  )
  parser.add_argument(
    "--stack",
    action="store_true",
    help="add the 8-block transformer stack: plain, per-block and whole "
    "jact.compressed (compile-only)",
  )
  parser.add_argument(
    "--resnet50",
    action="store_true",
    help="add ResNet-50 at 224x224, batch 8: plain and jact.convert (compile-only)",
  )
  parser.add_argument("--json", type=Path, default=RESULTS / "compile_time.json")
  args = parser.parse_args(argv)
  info, rows = (
    metadata.run_metadata(
      "experiments.bench.compile_time", argv, load_average_start=os.getloadavg()
    ),
    [],
  )
  for name in args.models:
    case = CASES[name]
    plain = measure(case, "plain", None, args.repeat, args.step)
    rows.append(plain)
    _print(plain)
    for variant in args.variants:
      rows.append(with_ratios(measure(case, variant, args.bits, args.repeat, args.step), plain))
      _print(rows[-1])
  groups = ([("transformer_stack_x8", stack_programs)] if args.stack else []) + (
    [("resnet50_224", resnet50_programs)] if args.resnet50 else []
  )
  for model, programs in groups:
    plain = None
    for variant, (fn, fn_args) in programs(args.bits).items():
      row = _rows_of(
        {
          "model": model,
          "framework": "jax" if "stack" in model else "linen",
          "variant": variant,
          "bits": None if variant == "plain" else args.bits,
        },
        lambda fn=fn, fn_args=fn_args: measure_program(fn, fn_args),
        args.repeat,
      )
      plain = row if plain is None else plain
      rows.append(row if row is plain else with_ratios(row, plain))
      _print(rows[-1])
  info["load_average_end"] = os.getloadavg()
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
