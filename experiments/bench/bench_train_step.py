"""End-to-end ResNet-50 train step: plain Flax vs jact at 4 and 2 bits.

Times a whole jitted training step -- loss gradient through `model.apply`
with a fresh 'jact' key per step (the step counter folded in), SGD with
momentum, BatchNorm statistics updated, parameters and optimizer state donated
-- for plain Flax and for jact's twins at each of `--bits`, on the same batch
of real images (CIFAR-10 resized to `--image` and repeated to fill the batch,
real labels). Each step is compiled once, ahead of time (compile excluded);
after `--warmup` steps, `--steps` steps are dispatched back to back and
timed, three times; the median per-step time gives images/s and its ratio to
plain at the same batch. XLA's memory analysis of the same (donated) compile
gives the temp bytes; on GPU the allocator's peak is recorded too (it
accumulates over the process: a config's peak shows only where it is the
largest so far, so compiled temp is the main memory figure).

Then, for each model, the largest batch <= `--max-batch-search` whose compiled
memory (temp + arguments + outputs - aliased) fits the device
(`memory_stats()["bytes_limit"]` less what is in use, or `--memory-limit-gb`):
powers of two from the largest timed batch, then bisection steered by linear
interpolation of the compiled sizes (to ~5%); the predicted batch is then run
(a step, plus two timed ones) and stepped down by 5% while it runs out of
memory.

    python -m experiments.bench.bench_train_step [--image 224] [--batches 64 128 256] [--bits 4 2]
        [--steps 20] [--warmup 3] [--max-batch-search 4096] [--dtype float32|bfloat16]
        [--json experiments/results/bench_train_step.json]

Parts can run separately (`--batches` with no values skips the timing,
`--max-batch-search 0` the search, `--no-plain` the plain model; `--search-start`
is the search's first batch). CPU smoke test (`--stage-sizes 1 1 1 1 --width 8`
shrinks the network to a 4-block bottleneck ResNet for a quicker one):

    python -m experiments.bench.bench_train_step --image 32 --batches 2 --steps 2 --max-batch-search 0 --json /tmp/x.json

(a smoke test only: at 32 px the last stage is 1x1, so with 2 images BatchNorm
normalizes 2 values; gradient norms reach ~1e9 for plain Flax too, and the loss
may turn non-finite after a few steps -- reported as null.)
"""  # noqa: E501 (tables and commands in this docstring)

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import jact.kernels
from experiments.lib import batch_search, memory, metadata, models, train_step_report
from experiments.lib import data as data_lib

__all__ = ["Bench", "main"]

POOL = 256  # real images kept on the device; batches repeat them
REPEATS = 3  # timed blocks per config (median reported)
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # halves XLA:CPU compile times
LEARNING_RATE = 1e-3  # small: the same batch is stepped on repeatedly, values stay finite
KERNEL_OPS = ("quantize", "dequantize", "relu_mask")
ENV_VARS = (
  "XLA_PYTHON_CLIENT_PREALLOCATE",
  "XLA_PYTHON_CLIENT_MEM_FRACTION",
  "XLA_PYTHON_CLIENT_ALLOCATOR",
  "XLA_FLAGS",
  "JACT_DATA",
)


def config_name(bits) -> str:
  return "plain" if bits is None else f"jact{bits}"


class Bench:
  """Models, initial state (on the host) and compiled steps for one setting."""

  def __init__(self, args):
    self.image, self.classes, self.stem = args.image, args.classes, args.stem
    self.arch = {"width": args.width}  # ResNet-50 unless --stage-sizes shrinks it (smoke tests)
    if args.stage_sizes:
      self.arch["stage_sizes"] = tuple(args.stage_sizes)
    self.dtype = jnp.dtype(args.dtype)
    self.tx = optax.sgd(LEARNING_RATE, momentum=0.9)
    self.dataset, self.pool_x, self.pool_y = data_lib.load_pool(
      args.dataset, args.image, self.dtype, POOL
    )
    self.key = jax.random.key(1)  # the 'jact' stream; the step counter is folded in
    self.compiler_options = FAST_COMPILE if args.fast_compile else None
    self.host_state = self._init_state()
    self.state_spec = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.host_state
    )

  def model(self, bits):
    layers = models.plain_layers() if bits is None else models.jact_layers(bits)
    return models.ResNet50(num_classes=self.classes, stem=self.stem, layers=layers, **self.arch)

  def _init_state(self):
    """Parameters, BatchNorm statistics, momentum and step counter, as numpy."""
    model = self.model(None)
    init = jax.jit(lambda k, x: model.init({"params": k}, x, train=False))
    variables = init(jax.random.key(0, impl="rbg"), self.pool_x[:1].astype(jnp.float32))
    state = {
      "variables": variables,
      "opt": self.tx.init(variables["params"]),
      "step": jnp.zeros((), jnp.int32),
    }
    return jax.device_get(state)

  def step_fn(self, bits):
    """The train step (state, x, y, key) -> (state, loss) of one model."""
    model, tx, dtype = self.model(bits), self.tx, self.dtype

    def step(state, x, y, key):
      variables = state["variables"]
      key = jax.random.fold_in(key, state["step"])

      def loss(params):
        params = jax.tree.map(lambda p: p.astype(dtype), params)
        logits, updates = model.apply(
          {**variables, "params": params},
          x,
          train=True,
          rngs={"jact": key},
          mutable=["batch_stats"],
        )
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

      (value, updates), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"])
      changes, opt = tx.update(grads, state["opt"], variables["params"])
      stats = jax.tree.map(
        lambda new, old: new.astype(old.dtype), updates["batch_stats"], variables["batch_stats"]
      )
      new = {"params": optax.apply_updates(variables["params"], changes), "batch_stats": stats}
      return {"variables": new, "opt": opt, "step": state["step"] + 1}, value

    return step

  def compile(self, bits, batch: int):
    """(compiled step with the state donated, its `CompiledMemory`, compile seconds)."""
    x = jax.ShapeDtypeStruct((batch, self.image, self.image, 3), self.dtype)
    y = jax.ShapeDtypeStruct((batch,), jnp.int32)
    t0 = time.perf_counter()
    compiled = (
      jax.jit(self.step_fn(bits), donate_argnums=0)
      .lower(self.state_spec, x, y, self.key)
      .compile(self.compiler_options)
    )
    seconds = time.perf_counter() - t0
    return compiled, memory.compiled_memory_of(compiled), seconds

  def batch(self, batch: int):
    """Real images and labels repeated to `batch` examples, on the device."""
    idx = jnp.arange(batch) % self.pool_x.shape[0]
    return self.pool_x[idx], self.pool_y[idx]

  def run(self, compiled, batch: int, warmup: int, steps: int, repeats: int):
    """Per-step seconds of `repeats` timed blocks of `steps` steps, and the last
    loss (None when not finite)."""
    state = jax.device_put(self.host_state)
    x, y = self.batch(batch)
    loss = None
    for _ in range(warmup):
      state, loss = compiled(state, x, y, self.key)
    jax.block_until_ready((state, loss))
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      for _ in range(steps):
        state, loss = compiled(state, x, y, self.key)
      jax.block_until_ready((state, loss))
      times.append((time.perf_counter() - t0) / steps)
    value = float(loss)
    del state, x, y
    return times, value if math.isfinite(value) else None  # None keeps the JSON strict


def kernel_name(bits) -> str | None:
  return None if bits is None else jact.kernels.select("quantize").name


def throughput_row(bench: Bench, bits, batch: int, args) -> dict:
  """Step time, images/s and memory of one model at one batch."""
  row = {
    "config": config_name(bits),
    "bits": bits,
    "kernel": kernel_name(bits),
    "batch": batch,
    "image": args.image,
    "dtype": args.dtype,
  }
  try:
    compiled, mem, row["compile_s"] = bench.compile(bits, batch)
  except Exception as e:  # noqa: BLE001 - only out-of-memory is recorded, the rest re-raised
    if not memory.is_oom(e):
      raise
    row["oom"] = True
    return row
  row.update(
    temp_bytes=mem.temp_bytes,
    argument_bytes=mem.argument_bytes,
    output_bytes=mem.output_bytes,
    alias_bytes=mem.alias_bytes,
    needed_bytes=memory.needed_bytes(mem),
  )
  before = memory.device_memory()
  try:
    times, row["loss"] = bench.run(compiled, batch, args.warmup, args.steps, REPEATS)
  except Exception as e:  # noqa: BLE001
    if not memory.is_oom(e):
      raise
    row["oom"] = True
    return row
  finally:
    del compiled
    gc.collect()
  after = memory.device_memory()
  med = statistics.median(times)
  row.update(
    step_ms=1e3 * med,
    step_ms_min=1e3 * min(times),
    step_ms_max=1e3 * max(times),
    step_ms_repeats=[1e3 * t for t in times],
    images_per_s=batch / med,
    oom=False,
    loss_finite=row["loss"] is not None,
  )
  if after is not None:
    row.update(
      peak_bytes_before=before["peak_bytes_in_use"],
      peak_bytes_after=after["peak_bytes_in_use"],
      bytes_in_use_after=after["bytes_in_use"],
    )
  return row


def search_row(bench: Bench, bits, args, limit: int, rows=()) -> dict:
  """Predicted (compiled memory) and verified (run) largest batch of one model;
  `rows` (timed configs) give the compiled sizes of batches already compiled."""
  t0 = time.perf_counter()
  cache = {
    r["batch"]: float(r["needed_bytes"]) for r in rows if r["bits"] == bits and "needed_bytes" in r
  }
  compiles, kept = 0, {}  # kept: the executable of the largest fitting batch, reused to verify

  def need(b):
    nonlocal compiles
    if b not in cache:
      compiles += 1
      try:
        compiled, mem, _ = bench.compile(bits, b)
        cache[b] = float(memory.needed_bytes(mem))
        if cache[b] <= limit and b > max(kept, default=0):
          kept.clear()
          kept[b] = compiled
        del compiled
      except Exception as e:  # noqa: BLE001
        if not memory.is_oom(e):
          raise
        cache[b] = math.inf
      print(
        f"  {config_name(bits)} batch {b}: needs {cache[b] / memory.MIB:.0f} MiB "
        f"(limit {limit / memory.MIB:.0f} MiB)",
        flush=True,
      )
    return cache[b], limit

  fits = lambda b: need(b)[0] <= limit
  start = args.search_start or (max(args.batches) if args.batches else 64)
  predicted = batch_search.largest_batch(fits, start, args.max_batch_search, need=need)
  row = {
    "config": config_name(bits),
    "bits": bits,
    "kernel": kernel_name(bits),
    "image": args.image,
    "dtype": args.dtype,
    "limit_bytes": limit,
    "upper_bound": args.max_batch_search,
    "predicted_batch": predicted,
    "predicted_needed_bytes": cache.get(predicted),
    "compiles": compiles,
  }
  row.update(verify(bench, bits, predicted, kept.pop(predicted, None)))
  kept.clear()
  row["seconds"] = time.perf_counter() - t0
  return row


def verify(bench: Bench, bits, batch: int, compiled=None) -> dict:
  """Runs the step at `batch` (`compiled` for it if given), stepping down 5% on
  each out-of-memory error."""
  failed = []
  while batch > 0:
    try:
      if compiled is None:
        compiled = bench.compile(bits, batch)[0]
      times, loss = bench.run(compiled, batch, warmup=1, steps=2, repeats=1)
      return {
        "verified_batch": batch,
        "oom_batches": failed,
        "loss": loss,
        "step_ms_rough": 1e3 * times[0],
        "images_per_s_rough": batch / times[0],
      }
    except Exception as e:  # noqa: BLE001
      if not memory.is_oom(e):
        raise
      failed.append(batch)
      print(f"  {config_name(bits)} batch {batch}: out of memory when run", flush=True)
      batch = min(batch - 1, int(batch * (1 - batch_search.TOLERANCE)))
    finally:
      compiled = None
      gc.collect()
  return {"verified_batch": 0, "oom_batches": failed}


def memory_limit(args) -> int | None:
  """Bytes the search may use: --memory-limit-gb, else the device's limit less what is in use."""
  if args.memory_limit_gb is not None:
    return int(args.memory_limit_gb * 2**30)
  gc.collect()
  mem = memory.device_memory()
  if not mem or not mem.get("bytes_limit"):
    return None
  return int(mem["bytes_limit"] - (mem["bytes_in_use"] or 0))


def meta_block(args, argv, bench: Bench, limit) -> dict:
  return metadata.run_metadata(
    "experiments.bench.bench_train_step",
    argv,
    kernels={op: jact.kernels.select(op).name for op in KERNEL_OPS},
    **{
      "model": f"ResNet50 ({args.stem} stem)"
      + (
        f", stages {args.stage_sizes}, width {args.width}"
        if args.stage_sizes or args.width != 64
        else ""
      ),
      "image": args.image,
      "classes": args.classes,
      "dtype": args.dtype,
      "dataset": bench.dataset,
      "pool_images": int(bench.pool_x.shape[0]),
      "optimizer": f"sgd({LEARNING_RATE}, momentum=0.9)",
      "steps": args.steps,
      "warmup": args.warmup,
      "repeats": REPEATS,
      "compiler_options": bench.compiler_options,
      "search_limit_bytes": limit,
      "device_memory": memory.device_memory(),
      "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
      "note": (
        "step time: median of the repeats of `steps` back-to-back steps (compile "
        "excluded); temp/needed bytes: XLA memory analysis of the donated step; "
        "peak_bytes_*: allocator peak over the whole process (cumulative)"
      ),
    },
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--image", type=int, default=224)
  parser.add_argument("--classes", type=int, default=1000)
  parser.add_argument("--stem", default="imagenet", choices=["imagenet", "cifar"])
  parser.add_argument(
    "--batches",
    nargs="*",
    type=int,
    default=[64, 128, 256],
    help="batch sizes to time (none: skip the timing)",
  )
  parser.add_argument("--bits", nargs="*", type=int, default=[4, 2])
  parser.add_argument(
    "--plain",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="include the plain Flax model",
  )
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument(
    "--max-batch-search",
    type=int,
    default=4096,
    help="upper bound of the largest-batch search (0: no search)",
  )
  parser.add_argument(
    "--memory-limit-gb",
    type=float,
    default=None,
    help="memory limit for the search (default: the device's; required on CPU)",
  )
  parser.add_argument(
    "--search-start",
    type=int,
    default=None,
    help="first batch the search tries (default: the largest timed batch, or 64)",
  )
  parser.add_argument(
    "--stage-sizes",
    nargs="+",
    type=int,
    default=None,
    help="bottleneck blocks per stage (default ResNet-50's 3 4 6 3; smoke tests)",
  )
  parser.add_argument("--width", type=int, default=64, help="channels of the first stage")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--dataset", default="auto", choices=list(data_lib.DATASETS))
  parser.add_argument(
    "--fast-compile",
    action=argparse.BooleanOptionalAction,
    default=None,
    help=f"compile with {FAST_COMPILE} (default: on CPU only, for smoke tests)",
  )
  parser.add_argument("--json", default="experiments/results/bench_train_step.json")
  args = parser.parse_args(argv)
  if args.steps < 1 or args.warmup < 0:
    parser.error("--steps must be >= 1 and --warmup >= 0")
  configs = ([None] if args.plain else []) + list(args.bits)
  if args.fast_compile is None:
    args.fast_compile = jax.default_backend() == "cpu"

  bench = Bench(args)
  if bench.dataset == "sklearn_digits":
    print("warning: CIFAR-10 not found, using scikit-learn digits", file=sys.stderr)
  rows = []
  for batch in args.batches:
    for bits in configs:
      rows.append(throughput_row(bench, bits, batch, args))
      print(train_step_report.progress_line(rows[-1]), flush=True)
  train_step_report.add_ratios(rows)

  searches, limit = [], None
  if args.max_batch_search > 0:
    limit = memory_limit(args)
    if limit is None:
      print("largest-batch search skipped: no device memory limit (pass --memory-limit-gb)")
    else:
      searches = [search_row(bench, bits, args, limit, rows) for bits in configs]

  meta = meta_block(args, argv, bench, limit)
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows, "largest_batch": searches}, f, indent=1)
  print(train_step_report.table(rows, searches))
  return rows, searches


if __name__ == "__main__":
  main()
