"""The memory/time frontier on XLA:GPU: jact against JAX's own remat and offload policies.

For each model of `experiments.lib.frontier_models` (real sizes: compile-only, nothing is
allocated) and each configuration -- plain; `jax.checkpoint` per block with
`nothing_saveable`, `dots_saveable`, `dots_with_no_batch_dims_saveable`, MaxText-style
named saves (`save_only_these_names`) and host offload of block inputs
(`save_and_offload_only_these_names`); `jact.compressed` per block at 8/4/2 bits;
`jact.convert` of each Flax block at 8/4/2 bits (the LM, ViT and ResNet blocks are modules);
`jact.checkpoint` per block at 4/2 bits; `jact.fit(target=...)` at fractions of plain's
peak -- the gradient step `jax.value_and_grad(loss)` is compiled by XLA:GPU for an H200 on
this machine (`jact.compile_for`, no GPU needed), and the row records:

* `peak_bytes`: arguments + outputs + temporaries - aliases (XLA's buffer assignment),
  `temp_bytes`, and `host_temp_bytes` (what offload keeps in host memory);
* `compile_s`: the CPU seconds XLA:GPU's pipeline took here (a CI-measurable figure);
* `predicted_ms`: the step time *predicted* from the compiled program (a roofline
  calibrated on H200 measurements, `jact._step_time`) -- never a measurement; rows get
  `measured_ms` only from a GPU run;
* `kernels`: jact's Triton kernel calls in the compiled program;
* with `--measure` (on a GPU: the campaign's "frontier" chunk): the same step compiled and run
  on this machine's device -- `device`, `device_temp_bytes` (to hold against the deviceless
  `temp_bytes`) and `measured_ms`.

Each row is written to the JSON as soon as it is measured (a run cut short keeps them; a rerun
skips rows already there unless `--fresh`).

    python -m experiments.bench.frontier [--models lm_6x512 resnet50_224 ...]
        [--configs plain remat_nothing jact2 jact2_xla ...] [--attention xla cudnn] [--fit 0.5 0.25]
        [--json experiments/results/frontier.json] [--fresh]
    python -m experiments.bench.frontier --small --json /tmp/frontier.json     # a quick check
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import pathlib
import time
from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

import jact
from jact import _compat, kernels
from experiments.lib import frontier_models, metadata, paths
from jact._step_time import predict_step_time

__all__ = ["CONFIGS", "wrap_for", "measure", "main"]

NAMED_SAVES = ("qkv", "attn_out", "mlp_in", "mlp_out", "conv_out")
POLICIES = {
  "remat_nothing": jax.checkpoint_policies.nothing_saveable,
  "remat_dots": jax.checkpoint_policies.dots_saveable,
  "remat_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "remat_names": jax.checkpoint_policies.save_only_these_names(*NAMED_SAVES),
  "offload_inputs": jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=["block_input"],
    offload_src="device",
    offload_dst="pinned_host",
  ),
}
JACT = {"jact8": 8, "jact4": 4, "jact2": 2}
CONVERT = {"convert8": 8, "convert4": 4, "convert2": 2}  # Flax blocks: jact.convert(module)
JACT_CHECKPOINT = {"jact_ckpt4": 4, "jact_ckpt2": 2}
# jact.compressed with the XLA quantizer, which XLA may fuse into the residual's producer (and
# the dequantize into its consumer), instead of the Triton kernels: which wins is measured on a GPU
JACT_XLA = {"jact4_xla": 4, "jact2_xla": 2}
CONFIGS = ("plain", *POLICIES, *JACT, *JACT_XLA, *CONVERT, *JACT_CHECKPOINT)
FIT_FRACTIONS = (0.5, 0.25, 0.125, 0.0625)
# --small: every model shrunk to compile in seconds (a check of the pipeline, not a result)
SMALL = {
  "lm_6x512": dict(layers=2, width=64, heads=2, mlp=128, batch=4, length=64),
  "resnet50_224": dict(stages=(1, 1), width=8, image=32, batch=4, classes=10),
  "vit_b16": dict(layers=2, width=64, heads=2, mlp=128, batch=4, image=32, patch=8, classes=10),
  "llama1b_2048": dict(layers=2, width=64, heads=4, kv_heads=2, mlp=128, vocab=128, length=64),
  "llama1b_8192": dict(layers=2, width=64, heads=4, kv_heads=2, mlp=128, vocab=128, length=128),
}


def wrap_for(config: str) -> Callable:
  """The block wrap of `config`: `wrap(block) -> (params, x, key) -> x`."""
  if config == "plain":
    return lambda block: lambda p, x, key: block(p, x)
  if config in POLICIES:
    policy = POLICIES[config]

    def with_policy(block):
      named = lambda p, x, key: block(p, checkpoint_name(x, "block_input"))
      return jax.checkpoint(named, policy=policy)

    return with_policy
  if config in JACT:
    bits = JACT[config]

    def compressed(block):
      c = jact.compressed(block, bits=bits)
      return lambda p, x, key: c(p, x, key=key)

    return compressed
  if config in JACT_XLA:
    compressor = jact.compressors.PerGroup(JACT_XLA[config], implementation="xla")

    def compressed_xla(block):
      c = jact.compressed(block, compressor=compressor)
      return lambda p, x, key: c(p, x, key=key)

    return compressed_xla
  if config in CONVERT:
    bits = CONVERT[config]

    def converted(block):
      if not hasattr(block, "module"):
        raise ValueError(f"{config}: this model's blocks are functions, not Flax modules")
      module = jact.convert(block.module, bits=bits)
      return lambda p, x, key: module.apply({"params": p}, x, rngs={"jact": key})

    return converted
  if config in JACT_CHECKPOINT:
    bits = JACT_CHECKPOINT[config]

    def checkpointed(block):
      c = jact.checkpoint(block, bits=bits, compress_argnums=(1,))
      return lambda p, x, key: c(p, x, key=key)

    return checkpointed
  raise ValueError(f"unknown configuration {config!r}; known: {CONFIGS} and fit_<fraction>")


def _segments():
  """A wrap marking each block as a `jact.segment` (block0, block1, ... in call order)."""
  count = itertools.count()

  def mark(block):
    s = jact.segment(block, name=f"block{next(count)}", compress_argnums=(1,))
    return lambda p, x, key: s(p, x)

  return mark


def _step(loss):
  return jax.value_and_grad(loss)


# each row's compiled program, for --repredict; a row keeps its program's hash, so a program
# another run (--small, another JSON) wrote under the same label is never taken for it
HLO_DIR = pathlib.Path("/tmp/jact_frontier_hlo")


def _row(compiled, seconds: float, target: str, label: str) -> dict:
  m = compiled.memory_analysis()
  peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  text = compiled.as_text()
  HLO_DIR.mkdir(parents=True, exist_ok=True)
  (HLO_DIR / f"{label}.hlo").write_text(text)
  return {
    "hlo_sha1": hashlib.sha1(text.encode()).hexdigest(),
    "peak_bytes": int(peak - m.alias_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
    "host_temp_bytes": int(getattr(m, "host_temp_size_in_bytes", 0)),
    "compile_s": round(seconds, 2),
    "predicted_ms": round(predict_step_time(compiled, target).seconds * 1e3, 3),
    "kernels": kernels.kernel_launches(text),
  }


def label_of(model: str, attention: str, config: str) -> str:
  return f"{model}{'' if attention == 'xla' else '.' + attention}.{config}"


# Without a GPU to autotune on, XLA:GPU's Triton gemm tiling fails on some odd shapes (ViT-B/16's
# 64 x 197 token rows: "Couldn't find output tile sizes"); such a step is compiled again with
# cuBLAS for every matmul, and its row says so.
CUBLAS_ONLY = {"xla_gpu_enable_triton_gemm": False}


def measure(model: frontier_models.FrontierModel, config: str, target: str, label: str) -> dict:
  """One configuration's compiled figures (see the module docstring)."""
  step = _step(model.loss(wrap_for(config)))
  args = (model.params, model.batch, jax.random.key(0))
  started = time.process_time()
  try:
    compiled, options = jact.compile_for(step, *args, target=target), None
  except jax.errors.JaxRuntimeError as e:
    if "output tile sizes" not in str(e):
      raise
    started = time.process_time()
    compiled = jact.compile_for(step, *args, target=target, compiler_options=CUBLAS_ONLY)
    options = CUBLAS_ONLY
  row = _row(compiled, time.process_time() - started, target, label)
  return row if options is None else {**row, "compiler_options": options}


def _device_values(tree, seed: int = 0):
  """Arrays of `tree`'s shapes on this machine's device: small normal floats, labels 0..9."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  values = [
    jax.random.randint(k, leaf.shape, 0, 10, leaf.dtype)
    if jax.numpy.issubdtype(leaf.dtype, jax.numpy.integer)
    else 0.02 * jax.random.normal(k, leaf.shape, leaf.dtype)
    for k, leaf in zip(keys, leaves)
  ]
  return jax.tree.unflatten(treedef, values)


def measure_on_device(model, config: str, steps: int = 10) -> dict:
  """On this machine's device (a GPU when lent): the same step compiled by the local
  compiler, its temp bytes next to the deviceless ones, and its measured step time
  (median of three runs of `steps` steps after a warm-up)."""
  step = jax.jit(_step(model.loss(wrap_for(config))))
  params, batch = _device_values(model.params), _device_values(model.batch, seed=1)
  compiled = step.lower(params, batch, jax.random.key(0)).compile()
  out = compiled(params, batch, jax.random.key(0))
  jax.block_until_ready(out)
  times = []
  for r in range(3):
    started = time.perf_counter()
    for i in range(steps):
      out = compiled(params, batch, jax.random.key(1 + r * steps + i))
    jax.block_until_ready(out)
    times.append((time.perf_counter() - started) / steps)
  return {
    "device": jax.devices()[0].device_kind,
    "device_temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    "measured_ms": round(sorted(times)[1] * 1e3, 3),
  }


def measure_fit(
  model, fraction: float, plain_peak: int, target: str, label: str, candidates: int = 6
) -> dict:
  """`jact.fit(target=...)` at `fraction` of plain's peak: what it chose and its figures."""
  marked = model.loss(_segments())
  loss = lambda params, batch: marked(params, batch, jax.random.key(0))
  budget = int(plain_peak * fraction)
  started = time.process_time()
  try:
    fitted = jact.fit(
      loss,
      model.params,
      model.batch,
      budget_bytes=budget,
      target=target,
      max_candidates=candidates,
    )
  except jact.FitError as e:
    return {"budget_bytes": budget, "fits": False, "why": str(e), "fit_s": _since(started)}
  step = lambda params, batch, key: jax.value_and_grad(lambda p: fitted.loss_fn(p, batch, key=key))(
    params
  )
  compile_started = time.process_time()
  compiled = jact.compile_for(step, model.params, model.batch, jax.random.key(0), target=target)
  row = _row(compiled, time.process_time() - compile_started, target, label)
  widths: dict[str, int] = {}
  for _, bits in fitted.plan.entries:
    widths[str(bits)] = widths.get(str(bits), 0) + 1
  row.update(
    budget_bytes=budget,
    fits=row["peak_bytes"] <= budget,
    chose=fitted.policy or ("remat " + ",".join(fitted.remat) if fitted.remat else "bits"),
    widths=widths,
    predicted_variance=fitted.predicted_variance,
    variance_bound=fitted.variance_bound,
    compilations=fitted.compilations,
    fit_s=_since(started),
  )
  return row


def _since(started: float) -> float:
  return round(time.process_time() - started, 1)


def _load(path: pathlib.Path, fresh: bool) -> dict:
  if path.exists() and not fresh:
    return json.loads(path.read_text())
  return {"rows": []}


def _order(row: dict) -> tuple:
  """Rows in the order of models, attentions and configurations (fit rows by fraction)."""
  models = list(frontier_models.MODELS)
  config = row["config"]
  rank = CONFIGS.index(config) if config in CONFIGS else len(CONFIGS)
  fraction = -float(config[4:]) if config.startswith("fit_") else 0.0
  model = models.index(row["model"]) if row["model"] in models else len(models)
  return (model, row["attention"] != "xla", rank, fraction)


def _write(path: pathlib.Path, payload: dict) -> None:
  payload["rows"].sort(key=_order)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=1) + "\n")


def repredict(payload: dict, target: str) -> None:
  """Recomputes every row's `predicted_ms` from its saved program (after a recalibration)."""
  for row in payload["rows"]:
    path = HLO_DIR / f"{label_of(row['model'], row['attention'], row['config'])}.hlo"
    text = path.read_text() if path.exists() else ""
    if "predicted_ms" in row and hashlib.sha1(text.encode()).hexdigest() == row.get("hlo_sha1"):
      row["predicted_ms"] = round(predict_step_time(text, target).seconds * 1e3, 3)
    elif "predicted_ms" in row:
      print(f"kept {path.name}'s predicted_ms: its program is not the one saved", flush=True)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", default=list(frontier_models.MODELS))
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
  parser.add_argument("--attention", nargs="+", default=["xla", "cudnn"])
  parser.add_argument("--fit", nargs="*", type=float, default=list(FIT_FRACTIONS))
  parser.add_argument("--target", default="h200")
  parser.add_argument("--fit-candidates", type=int, default=6, help="jact.fit's max_candidates")
  parser.add_argument("--small", action="store_true", help="tiny models: a quick check")
  parser.add_argument("--fresh", action="store_true", help="ignore rows already in the JSON")
  parser.add_argument(
    "--repredict", action="store_true", help="only recompute predicted_ms from saved programs"
  )
  parser.add_argument(
    "--measure",
    action="store_true",
    help="also run each configuration on this machine's device (a GPU when lent): measured_ms",
  )
  parser.add_argument("--json", default=str(paths.RESULTS / "frontier.json"))
  args = parser.parse_args(argv)
  path = pathlib.Path(args.json)
  payload = _load(path, args.fresh)
  runs = payload.get("meta", {}).get("runs", [])
  payload["meta"] = metadata.run_metadata(
    "experiments.bench.frontier",
    argv,
    target=args.target,
    compiler="XLA:GPU, deviceless (jax.experimental.topologies), on this CPU machine",
    step="jax.value_and_grad(loss) over one batch (no optimizer)",
    predicted="predicted_ms is a roofline of the compiled program, not a measurement",
  )
  payload["meta"]["runs"] = [*runs, payload["meta"]["command"]]  # every run that wrote rows
  if args.repredict:
    repredict(payload, args.target)
    _write(path, payload)
    return payload
  done = {(r["model"], r["attention"], r["config"]) for r in payload["rows"]}
  overrides = SMALL if args.small else {}
  for name, attention in itertools.product(args.models, args.attention):
    try:
      with _compat.cudnn_for_target(jact.gpu_target(args.target).cudnn_version):  # init traces
        model = frontier_models.build(name, attention=attention, **overrides.get(name, {}))
    except ValueError as e:  # e.g. ResNet-50 has no attention to fuse
      print(f"skipped {name} with attention={attention}: {e}", flush=True)
      continue
    plain_peak = next(
      (
        r["peak_bytes"]
        for r in payload["rows"]
        if (r["model"], r["attention"], r["config"]) == (name, attention, "plain")
      ),
      None,
    )
    configs = list(args.configs) + [f"fit_{f:g}" for f in args.fit]
    for config in configs:
      if (name, attention, config) in done:
        continue
      if config.startswith("fit_"):
        if plain_peak is None:
          continue
        label = label_of(name, attention, config)
        fraction = float(config[4:])
        row = measure_fit(model, fraction, plain_peak, args.target, label, args.fit_candidates)
      else:
        try:
          row = measure(model, config, args.target, label_of(name, attention, config))
          if args.measure:
            row.update(measure_on_device(model, config))
        except ValueError as e:
          if "not Flax modules" not in str(e):
            raise
          print(f"skipped {name} {config}: {e}", flush=True)  # jact.convert takes Flax modules
          continue
        except Exception as e:  # a configuration XLA:GPU or jact refuses is a row, not a crash
          row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      row = {"model": name, "attention": attention, "config": config, **row}
      if config == "plain" and "peak_bytes" in row:
        plain_peak = row["peak_bytes"]
      payload["rows"].append(row)
      _write(path, payload)
      print(json.dumps(row), flush=True)
  return payload


if __name__ == "__main__":
  main()
