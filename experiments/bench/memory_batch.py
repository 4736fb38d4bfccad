"""Memory buys batch: the largest batch each way of training runs within a memory cap.

Two models -- the CIFAR pre-activation ResNet-20 of `experiments.lib.preact` on
CIFAR-10 images, and the zoo's decoder LM (`experiments.lib.zoo.TransformerLM`)
on windows of tiny Shakespeare characters -- trained six ways:

* `plain`: the model as written (ResNet: preact's "plain" form);
* `remat`: every residual block in `jax.checkpoint` (default policy: only the
  block's inputs are saved, the rest is recomputed in the backward pass; on
  XLA:CPU its compiled temp equals plain's, as in `bench_memory --stack`);
* `jact4`, `jact2`: every layer keeps a 4- / 2-bit copy of what its backward
  pass needs (ResNet: preact's "layers" form; LM: `jact.convert(model, bits=)`);
* `jact_checkpoint`: every block in `jact.checkpoint(bits=4,
  compress_argnums=(1,))`: a 4-bit copy of the block input, the block recomputed;
* `offload`: every block the 4-bit jact block under
  `jax.checkpoint(policy=jact.offload_compressed())`, its compressed residuals
  in pinned host memory. `offload_support` compiles and runs the policy once;
  on CPU, where every memory kind is the same RAM, it is recorded as
  unsupported (with that probe's outcome) and never measured.

Stem, embeddings and head are the same in every method. One train step:
gradient of the mean cross-entropy, SGD with momentum, jitted.

(a) The largest batch whose step memory stays within `--cap-mib`. Each
(model, method, batch) runs in a fresh process (forked from a server that has
imported the modules, not started jax): it puts the parameters, optimizer
state and batch on the device, compiles the step (recording
`jact.compiled_memory` of it), resets the kernel's peak-RSS mark (VmHWM) and
runs `STEPS` steps. Its glibc returns freed blocks at once (`mallopt`), so
RSS follows the live buffers. Recorded per probe, in MiB:

* `step_mib` (what the cap limits unless `--cap-on`): peak RSS during the
  steps minus the RSS after compiling -- the buffers the running step adds
  (activations and temporaries, the new parameters and optimizer state);
* `with_program_mib`: the same peak minus the RSS before compiling, which adds
  `program_mib`: the executable and jax's caches (on CPU ~40-60 MiB for the
  plain steps, 170-450 MiB for jact's, with their many small fusions);
* `compiled_step_mib`: XLA's temp + output bytes of the same step, and
  `compiled_needed_mib` (+ arguments - aliased);
* on an accelerator, `step_mib` is the allocator's peak minus its bytes in
  use after compiling instead (not exercised here: written for GPU, run on CPU).

Batches are multiples of `--granularity`, searched by doubling from `--start`
(halving if it does not fit), then by bisection steered by linear
interpolation of the measured memory (`experiments.lib.batch_search.largest_batch`),
until the answer b ran within the cap and b + granularity did not
(`check_search` records whether that, and monotonicity, hold).

(b) Step-time ratio vs plain at one batch every method fits (the smallest
largest batch, at most `--time-batch`): one process compiles every method
(from the probes' shared compilation cache), runs 2 warm-up steps each, then
`--time-steps` rounds of one step per method, interleaved so that background
load hits every method alike; medians, and ratios to plain's.

(c) `memory_batch_<model>.png` (the capped memory and XLA's estimate vs batch,
per method, with the cap) and `memory_batch.json` (`--small`: `*_small*`)
under `--results`.

    python -m experiments.bench.memory_batch [--models resnet20 transformer_lm] [--methods ...]
        [--cap-mib 512] [--cap-on step_mib] [--granularity 16] [--small] [--results DIR] [--fresh]

A rerun keeps the models already measured with the same settings (see `run`).

`--small` (tiny ResNet, plain and jact2, a 40 MiB cap, `fresh_process.FAST_COMPILE_FLAGS`)
is a quick check of the whole pipeline.

The search, on a pretend step of 3 MiB per example over 10 MiB:

>>> probe = lambda b: {"batch": b, "step_mib": 10.0 + 3.0 * b}
>>> best, probes = batch_search.search_batch(probe, cap_mib=400, start=16, granularity=8, upper=1024)
>>> best, [p["batch"] for p in probes]
(128, [16, 32, 64, 128, 136, 256])
>>> batch_search.check_search(best, probes, cap_mib=400, granularity=8, upper=1024)
{'consistent': True, 'monotone': True}
"""  # noqa: E501 (tables and commands in this docstring)

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Callable

from experiments.lib import (
  batch_search,
  fresh_process,
  memory,
  metadata,
  paths,
  resumable,
)
from experiments.lib.blockwise import (
  CHECKPOINT_BITS,
  FULL,
  LEARNING_RATE,
  METHODS,
  MODELS,
  SMALL,
  SMALL_METHODS,
  SMALL_MODELS,
  Config,
  block_method,
  init_params,
  lm_blockwise_logits,
  loss_fn,
  real_batch,
  resnet_blockwise_logits,
  train_step,
)
from experiments.lib.memory_probe import STEPS, measure_probe, offload_support, time_methods
from experiments.lib.notebook_support import memory_batch_plot as plot

__all__ = [
  "MODELS",
  "METHODS",
  "MEASURES",
  "Config",
  "FULL",
  "SMALL",
  "block_method",
  "resnet_blockwise_logits",
  "lm_blockwise_logits",
  "init_params",
  "real_batch",
  "loss_fn",
  "train_step",
  "measure_probe",
  "time_methods",
  "offload_support",
  "describe",
  "run",
  "plot",
  "summary",
  "main",
]

MODULE = "experiments.bench.memory_batch"
ROOT = paths.ROOT
RESULTS = ROOT / "experiments" / "results"
MIB = memory.MIB
MEASURES = ("step_mib", "with_program_mib")


# ----------------------------------------------------------------------------- the experiment


def describe(model: str, config: Config) -> str:
  if model == "resnet20":
    depth = 2 + 2 * config.blocks * len(config.widths)
    return (
      f"pre-activation ResNet-{depth} (experiments.lib.preact, widths {list(config.widths)}, "
      f"{config.blocks} blocks per stage) on CIFAR-10 32x32 training images"
    )
  lm = config.lm
  return (
    f"experiments.lib.zoo.TransformerLM ({lm.num_layers} layers, width {lm.emb_dim}, "
    f"{lm.num_heads} heads, MLP {lm.mlp_dim}) on {lm.max_len}-character windows of "
    "tiny Shakespeare"
  )


def _xla_flags(config: Config) -> str:
  return fresh_process.FAST_COMPILE_FLAGS if config.fast_compile else ""


def _probe_fn(model: str, method: str, config: Config, cache_dir, log) -> Callable:
  """`probe(batch) -> row`: one memory probe in a fresh process, logged."""
  params = init_params(model, config)

  def probe(batch: int) -> dict:
    t0 = time.perf_counter()
    row = fresh_process.run(
      MODULE,
      "measure_probe",
      model,
      method,
      params,
      real_batch(model, batch, config),
      config,
      memory=True,
      cache_dir=cache_dir,
      xla_flags=_xla_flags(config),
    )
    row = {"batch": batch, **row, "wall_s": time.perf_counter() - t0}
    if "error" in row:
      log(f"  {model} {method} batch {batch}: error {row['error'].splitlines()[0]}")
    else:
      log(
        f"  {model} {method} batch {batch}: step {row['step_mib']:.1f} MiB, with program "
        f"{row['with_program_mib']:.1f} MiB (XLA: {row['compiled_step_mib']:.1f} MiB), "
        f"{row['wall_s']:.0f} s"
      )
    return row

  return probe


def search_method(model: str, method: str, config: Config, cache_dir, log) -> dict:
  """Largest batch of one method within the cap, with its probes and checks."""
  probe = _probe_fn(model, method, config, cache_dir, log)
  search = (config.cap_mib, config.start, config.granularity, config.upper)
  best, probes = batch_search.search_batch(probe, *search, measure=config.measure)
  row = {
    "status": "measured",
    "largest_batch": best,
    **batch_search.check_search(
      best, probes, config.cap_mib, config.granularity, config.upper, config.measure
    ),
    "probes": probes,
  }
  at_best = [p for p in probes if p["batch"] == best]
  if at_best:
    row["at_largest"] = {
      k: at_best[0].get(k)
      for k in (
        "step_mib",
        "with_program_mib",
        "program_mib",
        "compiled_step_mib",
        "compiled_needed_mib",
      )
    }
  log(
    f"{model} {method}: largest batch {best} within {config.cap_mib:g} MiB of {config.measure} "
    f"({len(probes)} probes, consistent={row['consistent']}, monotone={row['monotone']})"
  )
  return row


def time_model(model: str, methods, largest: dict, config: Config, cache_dir, log) -> dict:
  """Step times of `methods` at one batch they all fit (<= config.time_batch), in one process."""
  batch = min([config.time_batch, *(largest[m] for m in methods)])
  if batch <= 0:
    return {"skipped": "a method fits no batch"}
  log(f"{model}: timing {', '.join(methods)} at batch {batch} ({config.time_steps} rounds)")
  result = fresh_process.run(
    MODULE,
    "time_methods",
    model,
    list(methods),
    init_params(model, config),
    real_batch(model, batch, config),
    config,
    config.time_steps,
    cache_dir=cache_dir,
    xla_flags=_xla_flags(config),
  )
  for method, row in result.get("methods", {}).items():
    ratio = row.get("ratio_vs_plain")
    log(
      f"  {method:16s} {row['median_ms']:9.1f} ms/step"
      + ("" if ratio is None else f"  {ratio:.2f}x plain")
    )
  return result


def measure_model(
  model: str, methods, config: Config, offload: dict | None, cache_dir, log
) -> dict:
  """Every method's largest batch under the cap, and the step times at a common batch."""
  rows = {}
  for method in methods:
    if method == "offload" and not offload["supported"]:
      rows[method] = {"status": "unsupported", **offload}
      log(f"{model} offload: {offload['reason']}")
      continue
    rows[method] = search_method(model, method, config, cache_dir, log)
  measured = [m for m in methods if rows[m]["status"] == "measured"]
  largest = {m: rows[m]["largest_batch"] for m in measured}
  if largest.get("plain"):
    for m in measured:
      rows[m]["batch_vs_plain"] = largest[m] / largest["plain"]
  timing = time_model(model, measured, largest, config, cache_dir, log) if measured else {}
  return {"description": describe(model, config), "methods": rows, "timing": timing}


def settings(config: Config, models, methods) -> dict:
  return {
    "models": list(models),
    "methods": list(methods),
    **dataclasses.asdict(config),
    "checkpoint_bits": CHECKPOINT_BITS,
    "steps_per_probe": STEPS,
    "xla_flags_added": _xla_flags(config),
    "optimizer": f"sgd({LEARNING_RATE}, momentum=0.9)",
    "step_mib": (
      "peak RSS (VmHWM, reset after compiling) during the probe's steps minus the "
      "RSS after compiling: the buffers the running step adds (parameters, "
      "batch, optimizer state and compiled program already resident; malloc "
      "returns freed blocks at once); on an accelerator, the allocator's peak "
      "minus its bytes in use after compiling"
    ),
    "with_program_mib": "the same peak minus the RSS before compiling",
    "program_mib": "RSS after compiling minus before: the executable and jax's caches",
    "compiled_step_mib": "jact.compiled_memory of the step: temp + outputs",
    "compiled_needed_mib": "jact.compiled_memory: temp + arguments + outputs - aliased",
  }


def _same_settings(a: dict, b: dict) -> bool:
  """Whether two runs' settings agree on everything but the models measured."""
  comparable = lambda s: json.loads(json.dumps({k: v for k, v in s.items() if k != "models"}))
  return comparable(a) == comparable(b)


def run(
  models=MODELS,
  methods=METHODS,
  config: Config = FULL,
  results=RESULTS,
  argv=None,
  suffix: str = "",
  log=print,
  fresh: bool = False,
) -> dict:
  """The whole experiment; writes `memory_batch{suffix}.json` (after each model)
  and `memory_batch{suffix}_{model}.png` under `results`.

  A model already in that JSON, measured with the same settings, is kept
  rather than measured again (a stopped run resumes at the next model) unless
  `fresh`.
  """
  t0 = time.perf_counter()
  results = Path(results)
  path = results / f"memory_batch{suffix}.json"
  out = {
    "meta": metadata.run_metadata(MODULE, argv),
    "settings": settings(config, models, methods),
    "models": {},
  }
  earlier = resumable.earlier_result(
    path, lambda e: _same_settings(e["settings"], out["settings"]), fresh, log
  )
  offload = offload_support() if "offload" in methods else None
  if offload is not None:
    out["offload"] = offload
  with tempfile.TemporaryDirectory(prefix="memory_batch_xla_cache_") as cache_dir:
    for model in models:
      if earlier is not None and model in earlier["models"]:
        log(f"{model}: kept from {path} (--fresh measures it again)")
        out["models"][model] = earlier["models"][model]
        continue
      result = measure_model(model, methods, config, offload, cache_dir, log)
      result["plot"] = plot(model, result, config, results / f"memory_batch{suffix}_{model}.png")
      out["models"][model] = result
      out["wall_s"] = time.perf_counter() - t0
      resumable.write_json(path, out)
  log(summary(out))
  return out


def summary(out: dict) -> str:
  """One line per (model, method): largest batch, its ratio to plain's, memory there, time ratio."""
  lines = [
    f"{'model':15s} {'method':16s} {'largest':>8s} {'x plain':>8s} {'step MiB':>9s} "
    f"{'+program':>9s} {'XLA MiB':>8s} {'time x plain':>13s}"
  ]
  for model, result in out["models"].items():
    times = result.get("timing", {}).get("methods", {})
    for method, row in result["methods"].items():
      if row["status"] != "measured":
        lines.append(f"{model:15s} {method:16s} {row['reason'][:70]}")
        continue
      at = row.get("at_largest", {})
      ratio = times.get(method, {}).get("ratio_vs_plain")
      number = lambda v, width: f"{v:{width}.1f}" if v is not None else f"{'-':>{width}s}"
      lines.append(
        f"{model:15s} {method:16s} {row['largest_batch']:8d} "
        f"{number(row.get('batch_vs_plain'), 8)} {number(at.get('step_mib'), 9)} "
        f"{number(at.get('with_program_mib'), 9)} {number(at.get('compiled_step_mib'), 8)} "
        f"{'-' if ratio is None else f'{ratio:.2f}':>13s}"
      )
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", choices=MODELS, default=None)
  parser.add_argument("--methods", nargs="+", choices=METHODS, default=None)
  parser.add_argument(
    "--small",
    action="store_true",
    help=f"tiny models, a tiny cap, {' and '.join(SMALL_METHODS)} on "
    f"{' and '.join(SMALL_MODELS)} by default: a quick check",
  )
  parser.add_argument("--cap-mib", type=float, default=None, help="the memory cap (MiB)")
  parser.add_argument(
    "--cap-on",
    choices=MEASURES,
    default=None,
    help="what the cap limits (default step_mib: the running step's buffers)",
  )
  parser.add_argument("--granularity", type=int, default=None)
  parser.add_argument("--start", type=int, default=None, help="first batch of the doubling")
  parser.add_argument("--max-batch", type=int, default=None, help="largest batch tried")
  parser.add_argument(
    "--time-batch",
    type=int,
    default=None,
    help="largest batch of the timing (it uses one every method fits)",
  )
  parser.add_argument("--time-steps", type=int, default=None, help="timed rounds")
  parser.add_argument(
    "--fast-compile",
    action=argparse.BooleanOptionalAction,
    default=None,
    help=f"compile with {fresh_process.FAST_COMPILE_FLAGS} (same buffers, slower code; "
    "default: with --small only)",
  )
  parser.add_argument("--results", type=Path, default=RESULTS)
  parser.add_argument(
    "--fresh",
    action="store_true",
    help="measure every model again, even those already in the results JSON",
  )
  args = parser.parse_args(argv)
  config = SMALL if args.small else FULL
  overrides = {
    "cap_mib": args.cap_mib,
    "measure": args.cap_on,
    "granularity": args.granularity,
    "start": args.start,
    "upper": args.max_batch,
    "time_batch": args.time_batch,
    "time_steps": args.time_steps,
    "fast_compile": args.fast_compile,
  }
  config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
  models = args.models or (SMALL_MODELS if args.small else MODELS)
  methods = args.methods or (SMALL_METHODS if args.small else METHODS)
  return run(
    models,
    methods,
    config,
    args.results,
    argv,
    suffix="_small" if args.small else "",
    fresh=args.fresh,
  )


if __name__ == "__main__":
  main()
