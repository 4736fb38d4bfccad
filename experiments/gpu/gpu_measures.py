"""GPU measurements no other script makes: ReLU-mask grid, compressor throughput,
host offload, chunked attention, and the effect of the XLA:CPU ordering ties.

Each measure prints a table and adds its rows to one JSON (`--json`). Written
for `experiments.gpu_campaign`, which runs them on a GPU; `--small` gives tiny
sizes, for a smoke run on CPU (the figures then mean nothing).

* `relu_grid`: the ReLU / leaky-ReLU mask kernel (`jact.kernels`' `relu_mask`,
  one program per (row, tile of mask bytes)) against the XLA reference, on row
  lengths chosen for the grid's edges (1 value a row, a partial byte, exactly
  one tile, one byte past a tile, ResNet maps, a 1-D input, an empty batch,
  bfloat16): bit-exactness of activation and mask, GB/s (input read, output
  and mask written) and the share of a same-run device copy of the input.
* `compressors`: compress and decompress of every `jact.compressors` method
  (jitted alone) on a ReLU-like NHWC activation map: milliseconds, GB/s (input
  + stored bytes), stored bytes, relative error of the reconstruction.
* `offload`: train step (gradient) of a stack of 8 pre-LN transformer blocks
  (`experiments.bench.memory_scaling`'s block; `--small`: one ReLU MLP block) plain, `jax.checkpoint` remat,
  `jact.compressed` at 2 bits, the same under `jax.checkpoint` with
  `jact.save_compressed` and with `jact.offload_compressed` (compressed bytes
  in pinned host memory between forward and backward): step time and device /
  host temp memory. On CPU the offload is a no-op.
* `attention`: forward + backward of causal attention: plain (einsum, softmax,
  logits materialized), `jax.nn.dot_product_attention` and
  `jact.ops.chunked_attention` uncompressed and at 8/4 bits, over sequence
  lengths: time and compiled temp memory (out of memory is recorded).
* `ordering`: the data-dependency ties jact adds because XLA:CPU expands
  optimization barriers before scheduling (`jact.core.xla_cpu`: the
  always-true flags that make decompression wait for the cotangent and
  outputs wait for the compressed bytes), lowered only in programs for the
  CPU: "shipped" (as released), "ties" (traced into every program, as before
  they were CPU-only), "no_ties" (none, optimization barriers kept) and
  "no_ties_no_barriers" (barriers removed too), each compiled afresh;
  compiled temp memory and step time of `experiments.bench.memory_scaling`'s stacks
  and a CIFAR ResNet-18, next to plain. On a GPU "shipped" is "no_ties": if
  XLA:GPU keeps the temp memory of "ties" without them, it does not need them.

    python -m experiments.gpu.gpu_measures relu_grid compressors --json /tmp/k.json
    python -m experiments.gpu.gpu_measures offload attention ordering --small --json /tmp/s.json

Timing: compiled once, warmed up, then `reps` back-to-back calls (rotating
inputs where given) synchronised once, median of 3 such blocks
(`experiments.lib.timing.time_call`); compile excluded.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jact
from experiments.lib import blocks, kernel_cases, metadata, models, resumable, timing
from jact import compressors, kernels

__all__ = ["MEASURES", "ORDERING_MODES", "ordering_ties", "failures", "main"]

MB = kernel_cases.MB
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # --small on CPU: quicker XLA:CPU compiles
_compiler_options: dict | None = None  # set by `main`


def _same_bits(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      x.shape == y.shape and x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
      for x, y in zip(la, lb))


def is_oom(e: BaseException) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _median_s(fn: Callable, inputs: list[tuple], reps: int) -> dict:
  times = timing.time_call(fn, inputs, reps, blocks=3)
  return {"ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
          "ms_max": 1e3 * max(times)}


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()  # not jact.compiled_memory: the offload rows need the host_* sizes
  fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "host_temp_size_in_bytes", "host_argument_size_in_bytes",
            "host_output_size_in_bytes")
  return {f.replace("_size_in", ""): int(getattr(m, f)) for f in fields if hasattr(m, f)}


def _compile_and_time(fn: Callable, args: tuple, reps: int) -> dict:
  """Compile seconds, XLA memory and median call time of jit(fn)(*args);
  {"oom": True, "error": ...} when compiling or running runs out of memory,
  {"oom": False, "error": ...} when it fails otherwise (the run goes on; `main`
  exits with status 1)."""
  try:
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile(_compiler_options)
    row = {"compile_s": time.perf_counter() - t0, **_memory(compiled), "oom": False}
    row.update(_median_s(compiled, [args], reps))
    return row
  except Exception as e:  # noqa: BLE001 - recorded: one failing variant must not lose the others
    first = (str(e).splitlines() or [""])[0][:300]
    print(f"   failed: {type(e).__name__}: {first}", flush=True)
    return {"oom": is_oom(e), "error": f"{type(e).__name__}: {first}"}
  finally:
    gc.collect()


def _copy_gbps(x, reps: int) -> float:
  t = statistics.median(timing.time_call(jax.jit(jnp.copy), [(x,)], reps, blocks=3))
  return 2 * kernel_cases.nbytes_of(x) / t / 1e9


def _print_rows(rows: list[dict], keys: tuple[str, ...]) -> None:
  print("  ".join(f"{k:>12s}" for k in keys))
  for r in rows:
    print("  ".join(f"{r[k]:12.3f}" if isinstance(r.get(k), float) else f"{str(r.get(k, '-')):>12s}"
                    for k in keys), flush=True)


# ---------------------------------------------------------------------------
# relu_grid


def _relu_shapes(small: bool) -> list[tuple[str, tuple[int, ...], str]]:
  """(label, shape, dtype): row lengths at the (row, byte tile) grid's edges."""
  if small:
    return [("partial byte", (8, 9), "float32")]
  target = 64 * MB

  def rows(d, itemsize=4):
    return max(1, min(1 << 20, target // (itemsize * d)))
  return [("1 value a row", (rows(1), 1), "float32"),
          ("partial byte", (rows(9), 9), "float32"),
          ("125 bytes", (rows(1000), 1000), "float32"),
          ("one tile", (rows(8192), 8192), "float32"),
          ("tile + 1 byte", (rows(8200), 8200), "float32"),
          ("2 tiles", (rows(16384), 16384), "float32"),
          ("ResNet 56x56x256", (64, 56, 56, 256), "float32"),
          ("ResNet 112x112x64", (128, 112, 112, 64), "float32"),
          ("ResNet 7x7x2048", (256, 7, 7, 2048), "float32"),
          ("1-D", (16 * MB,), "float32"),
          ("bf16 56x56x256", (64, 56, 56, 256), "bfloat16"),
          # the registry sends empty inputs to the reference; the kernel alone runs idle programs
          ("empty batch", (0, 4096), "float32")]


def _relu_row(fn, x, reference, reps: int, copy) -> dict:
  """Bit-exactness against `reference` and, for a non-empty x, time and GB/s."""
  out = fn(x)
  row = {"bit_exact_vs_xla": _same_bits(out, reference)}
  if x.size:
    row.update(_median_s(fn, [(x,)], reps))
    traffic = kernel_cases.nbytes_of(x) + kernel_cases.nbytes_of(out)
    row.update(traffic_bytes=traffic, gbps=traffic / (row["ms"] / 1e3) / 1e9, copy_gbps=copy,
               fraction_of_copy=traffic / (row["ms"] / 1e3) / 1e9 / copy)
  return row


def _relu_fn(fn: Callable, slope) -> Callable:
  return jax.jit(lambda a: fn(a, negative_slope=slope))


def measure_relu_grid(small: bool, reps: int) -> list[dict]:
  impls = ["xla", "pallas_triton"]
  rows = []
  for label, shape, dtype in _relu_shapes(small):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    copy = _copy_gbps(x, reps) if x.size else None
    for slope in (None,) if small else (None, 0.1):
      fns = {i: _relu_fn(kernels.available("relu_mask")[i].fn, slope) for i in impls}
      reference = fns["xla"](x)
      for impl, fn in fns.items():
        row = {"case": label, "shape": list(shape), "dtype": dtype, "negative_slope": slope,
               "impl": impl}
        try:
          row.update(_relu_row(fn, x, reference, reps, copy))
        except Exception as e:  # noqa: BLE001 - recorded; the other shapes still run
          row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
          print(f"   {label} {impl} failed: {row['error']}", flush=True)
        rows.append(row)
  _print_rows(rows, ("case", "dtype", "negative_slope", "impl", "ms", "gbps", "fraction_of_copy",
                     "bit_exact_vs_xla"))
  return rows


# ---------------------------------------------------------------------------
# compressors


def _compressor_list() -> list[tuple[str, compressors.Compressor]]:
  return [("PerGroup 2", compressors.PerGroup(2)), ("PerGroup 4", compressors.PerGroup(4)),
          ("PerGroup 8", compressors.PerGroup(8)),
          ("Division B=8 Q=2", compressors.Division(block=8, bits=2)),
          ("BLPA 4", compressors.BLPA(4)), ("Fixpoint 8", compressors.Fixpoint(8)),
          ("ZeroValue lossless", compressors.ZeroValue(None, capacity=0.6)),
          ("ZeroValue Fixpoint 8", compressors.ZeroValue(compressors.Fixpoint(8), capacity=0.6))]


def measure_compressors(small: bool, reps: int) -> list[dict]:
  shape = (2, 8, 8, 32) if small else (64, 56, 56, 256)
  methods = _compressor_list()
  if small:  # one of each stored form: Packed, Compressed with a kernel, Compressed by XLA alone
    methods = [m for m in methods if m[0] in ("PerGroup 2", "Division B=8 Q=2", "ZeroValue Fixpoint 8")]
  x = jax.nn.relu(jax.random.normal(jax.random.key(0), shape, jnp.float32) + 0.1)  # ~54% non-zero
  seed = jax.random.bits(jax.random.key(1), (), jnp.uint32)
  copy = _copy_gbps(x, reps)
  rows = []
  for label, c in methods:
    compress = jax.jit(c.compress)
    decompress = jax.jit(c.decompress)
    stored = compress(x, seed)
    x_hat = decompress(stored)
    stored_bytes = kernel_cases.nbytes_of(stored)
    row = {"compressor": label, "config": c.to_dict(), "shape": list(shape),
           "input_bytes": kernel_cases.nbytes_of(x), "stored_bytes": stored_bytes,
           "ratio": kernel_cases.nbytes_of(x) / stored_bytes, "copy_gbps": copy,
           "rel_error": float(jnp.linalg.norm(x_hat - x) / jnp.linalg.norm(x))}
    for name, fn, args, out in (("compress", compress, (x, seed), stored),
                                ("decompress", decompress, (stored,), x_hat)):
      t = _median_s(fn, [args], reps)
      row[f"{name}_ms"] = t["ms"]
      row[f"{name}_gbps"] = (kernel_cases.nbytes_of(args[0]) + kernel_cases.nbytes_of(out)) / (t["ms"] / 1e3) / 1e9
    rows.append(row)
  _print_rows(rows, ("compressor", "ratio", "compress_ms", "compress_gbps", "decompress_ms",
                     "decompress_gbps", "rel_error"))
  return rows


# ---------------------------------------------------------------------------
# offload


def _random_params(spec, key):
  leaves, treedef = jax.tree.flatten(spec)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [
      jnp.ones(s.shape, s.dtype) if len(s.shape) == 1 else
      jax.random.normal(k, s.shape, s.dtype) / math.sqrt(s.shape[0]) for s, k in zip(leaves, keys)])


def _stack_loss(block_fn: Callable) -> Callable:
  def loss(params, x, key):
    for i, p in enumerate(params):
      x = block_fn(p, x, jax.random.fold_in(key, i))
    return jnp.mean(x * x)
  return loss


def _mlp_block(p, x):
  """A residual ReLU MLP: the smoke run's block (quick to compile)."""
  return x + jax.nn.relu(x @ p["w1"]) @ p["w2"]


def _offload_variants(small: bool) -> dict[str, Callable]:
  block = blocks.transformer_block
  plain = _mlp_block if small else (lambda p, x: block(p, x, jax.random.key(0), None))
  c = jact.compressed(plain, bits=2, name="block", compress_argnums=(1,))
  saved = jax.checkpoint(lambda p, x, k: c(p, x, key=k), policy=jact.save_compressed("block"))
  offloaded = jax.checkpoint(lambda p, x, k: c(p, x, key=k), policy=jact.offload_compressed("block"))
  return {"plain": lambda p, x, k: plain(p, x),
          "remat": lambda p, x, k: jax.checkpoint(plain)(p, x),
          "compressed 2 bit": lambda p, x, k: c(p, x, key=k),
          "compressed 2 bit + save_compressed": saved,
          "compressed 2 bit + offload_compressed": offloaded}


def measure_offload(small: bool, reps: int) -> list[dict]:
  if small:  # the policies' plumbing only, on an MLP block
    depth, x_shape = 1, (4, 16, 32)
    spec = {"w1": jax.ShapeDtypeStruct((32, 64), jnp.float32),
            "w2": jax.ShapeDtypeStruct((64, 32), jnp.float32)}
  else:
    depth, x_shape = 8, (16, 1024, 512)
    spec = blocks.transformer_params(dim=512, mlp=2048)
  params = [_random_params(spec, jax.random.key(i)) for i in range(depth)]
  x = jax.random.normal(jax.random.key(99), x_shape, jnp.float32)
  key = jax.random.key(7)
  rows = []
  variants = _offload_variants(small)
  if small:
    variants = {k: v for k, v in variants.items() if "_compressed" in k}
  for name, block_fn in variants.items():
    grad = jax.grad(_stack_loss(block_fn))
    row = {"variant": name, "depth": depth, "input_shape": list(x_shape),
           **_compile_and_time(grad, (params, x, key), reps)}
    rows.append(row)
  base = next((r for r in rows if r["variant"] == "compressed 2 bit + save_compressed"), None)
  for r in rows:
    if base and "error" not in r and "error" not in base:
      r["time_vs_save_compressed"] = r["ms"] / base["ms"]
  _print_rows(rows, ("variant", "ms", "temp_bytes", "host_temp_bytes", "time_vs_save_compressed"))
  return rows


# ---------------------------------------------------------------------------
# attention


def _plain_attention(q, k, v):
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  length = q.shape[1]
  causal = jnp.tril(jnp.ones((length, length), bool))
  logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def _attention_variants(chunk: int, small: bool) -> dict[str, Callable]:
  def chunked(bits, c=chunk):
    return lambda q, k, v, key: jact.ops.chunked_attention(
        q, k, v, causal=True, query_chunk=c, key_chunk=c, bits=bits,
        key=None if bits is None else key)
  variants = {"plain (einsum)": lambda q, k, v, key: _plain_attention(q, k, v),
              "jax.nn.dot_product_attention": lambda q, k, v, key: jax.nn.dot_product_attention(
                  q, k, v, is_causal=True),
              "chunked": chunked(None), f"chunked, chunks {4 * chunk}": chunked(None, 4 * chunk),
              "chunked 8 bit": chunked(8), "chunked 4 bit": chunked(4)}
  if small:
    variants = {k: variants[k] for k in ("plain (einsum)", "chunked", "chunked 4 bit")}
  return variants


def measure_attention(small: bool, reps: int) -> list[dict]:
  batch, heads, depth, chunk = (1, 2, 16, 32) if small else (2, 16, 64, 128)
  lengths = (64,) if small else (1024, 4096, 16384)
  rows = []
  for length in lengths:
    ks = jax.random.split(jax.random.key(length), 4)
    q, k, v, ct = (jax.random.normal(kk, (batch, length, heads, depth), jnp.float32) for kk in ks)
    key = jax.random.key(3)
    for name, attend in _attention_variants(chunk, small).items():
      def step(q, k, v, key, ct, attend=attend):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, key), q, k, v)
        return vjp(ct)
      rows.append({"variant": name, "length": length, "shape": [batch, length, heads, depth],
                   **_compile_and_time(step, (q, k, v, key, ct), reps)})
    del q, k, v, ct
  for r in rows:
    base = next(b for b in rows if b["length"] == r["length"] and b["variant"] == "chunked")
    if "error" not in r and "error" not in base:
      r["time_vs_chunked"] = r["ms"] / base["ms"]
  _print_rows(rows, ("variant", "length", "ms", "temp_bytes", "time_vs_chunked", "oom"))
  return rows


# ---------------------------------------------------------------------------
# ordering

ORDERING_MODES = ("shipped", "ties", "no_ties", "no_ties_no_barriers")


def _ties_everywhere(rule, values, anchors):
  return list(rule(list(values), list(anchors))) if values else list(values)


def _no_ties(rule, values, anchors):
  del rule, anchors
  return list(values)


@contextlib.contextmanager
def ordering_ties(mode: str):
  """Within the block, jact's XLA:CPU ordering ties (`jact.core.xla_cpu.on_cpu`)
  are as shipped (in programs for the CPU only: "shipped"), traced into every
  program whatever its platform, as before they were CPU-only ("ties"),
  left out everywhere ("no_ties"), also without optimization barriers
  ("no_ties_no_barriers"). jax's caches are cleared on entry and exit so no
  trace made in another mode is reused."""
  if mode not in ORDERING_MODES:
    raise ValueError(f"mode must be one of {ORDERING_MODES}, got {mode!r}")
  from jact.core import xla_cpu
  from jact.engine import scheduling
  patches = []
  if mode == "ties":
    patches.append((xla_cpu, "on_cpu", _ties_everywhere))
  elif mode != "shipped":
    patches.append((xla_cpu, "on_cpu", _no_ties))
  if mode == "no_ties_no_barriers":
    patches.append((scheduling, "_optimization_barrier", lambda tree: tree))
  saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
  jax.clear_caches()
  try:
    for m, name, value in patches:
      setattr(m, name, value)
    yield
  finally:
    for m, name, value in saved:
      setattr(m, name, value)
    jax.clear_caches()


def _stack_workloads(small: bool) -> dict[str, tuple]:
  """name -> (make_loss, params, x), make_loss() -> loss(params, x, key) built
  afresh in each mode: memory_scaling's stacks plain, with jact.ops and with
  jact.compressed at 2 bits, and a CIFAR ResNet-18 (small: the ReLU CNN stack
  plain and with jact.ops only)."""
  depth = 2 if small else 8
  shapes = {"relu_cnn": (2, 8, 8, 8) if small else (32, 32, 32, 64),
            "transformer": (2, 16, 32) if small else (16, 256, 256)}
  kwargs = {"relu_cnn": dict(channels=8) if small else {},
            "transformer": dict(dim=32, mlp=64) if small else {}}
  out = {}
  names = ["relu_cnn"] if small else list(blocks.BLOCKS)
  variants = [("plain", None, "ops"), ("ops 2 bit", 2, "ops")] + (
      [] if small else [("compressed 2 bit", 2, "compressed")])
  for name in names:
    block, make_params, _ = blocks.BLOCKS[name]
    params = [_random_params(make_params(**kwargs[name]), jax.random.key(i)) for i in range(depth)]
    x = jax.random.normal(jax.random.key(5), shapes[name], jnp.float32)
    for label, bits, mode in ((f"{name} x{depth} {v}", b, m) for v, b, m in variants):
      make = lambda block=block, bits=bits, mode=mode: _stack_loss(
          blocks.wrap_block(block, bits, mode))
      out[label] = (make, params, x)
  if not small:
    for label, bits in (("ResNet-18 CIFAR b128 plain", None), ("ResNet-18 CIFAR b128 jact 2 bit", 2)):
      out[label] = _resnet_workload(bits)
  return out


def _resnet_workload(bits):
  x = jax.random.normal(jax.random.key(0), (128, 32, 32, 3), jnp.float32)
  y = jnp.arange(128, dtype=jnp.int32) % 10
  init_model = models.ResNet18(num_classes=10, stem="cifar", layers=models.plain_layers())
  variables = init_model.init(jax.random.key(0), x[:1], train=False)

  def make():
    layers = models.plain_layers() if bits is None else models.jact_layers(bits)
    model = models.ResNet18(num_classes=10, stem="cifar", layers=layers)

    def loss(params, x, key):
      logits, _ = model.apply({**variables, "params": params}, x, train=True, rngs={"jact": key},
                              mutable=["batch_stats"])
      return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0])
    return loss
  return make, variables["params"], x


def measure_ordering(small: bool, reps: int, modes=ORDERING_MODES, workloads=None) -> list[dict]:
  rows = []
  for name, (make_loss, params, x) in _stack_workloads(small).items():
    if workloads and not any(w in name for w in workloads):
      continue
    for mode in ("shipped",) if "plain" in name else modes:
      with ordering_ties(mode):
        grad = jax.grad(make_loss())  # a fresh function: traced in this mode
        row = {"workload": name, "mode": mode,
               **_compile_and_time(grad, (params, x, jax.random.key(1)), reps)}
      rows.append(row)
      print(f"   {name} [{mode}]: " + ", ".join(f"{k} {row[k]}" for k in ("temp_bytes", "ms", "error")
                                               if k in row), flush=True)
  for r in rows:
    base = next(b for b in rows if b["workload"] == r["workload"] and b["mode"] == "shipped")
    if "error" not in r and "error" not in base:
      r["temp_vs_shipped"] = r["temp_bytes"] / base["temp_bytes"]
      r["time_vs_shipped"] = r["ms"] / base["ms"]
  _print_rows(rows, ("workload", "mode", "temp_bytes", "temp_vs_shipped", "ms", "time_vs_shipped"))
  return rows


MEASURES = {"relu_grid": measure_relu_grid, "compressors": measure_compressors,
            "offload": measure_offload, "attention": measure_attention,
            "ordering": measure_ordering}


def failures(result: dict) -> list[str]:
  """Measures that raised, and rows that failed other than by running out of memory."""
  out = [f"{name}: {rows['error']}" for name, rows in result.items()
         if isinstance(rows, dict) and "error" in rows and name != "meta"]
  for name, rows in result.items():
    if isinstance(rows, list):
      out += [f"{name}: {r['error']}" for r in rows if "error" in r and not r.get("oom")]
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("measures", nargs="+", choices=list(MEASURES))
  parser.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
  parser.add_argument("--reps", type=int, default=None, help="calls per timed block (default 20, small 2)")
  parser.add_argument("--json", help="write the rows to this file")
  parser.add_argument("--ordering-modes", nargs="+", choices=ORDERING_MODES, default=ORDERING_MODES,
                      help="ordering: the modes to compare (plain workloads run shipped only)")
  parser.add_argument("--ordering-workloads", nargs="+", default=None,
                      help="ordering: only workloads whose name holds one of these")
  args = parser.parse_args(argv)
  reps = args.reps or (2 if args.small else 20)
  global _compiler_options
  _compiler_options = FAST_COMPILE if args.small and jax.default_backend() == "cpu" else None
  result = {"meta": {**metadata.run_metadata("experiments.gpu.gpu_measures", argv),
                     "small": args.small, "reps": reps, "compiler_options": _compiler_options,
                     "kernels": {op: kernels.select(op).name for op in ("quantize", "relu_mask")}}}
  for name in args.measures:
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
      extra = (dict(modes=tuple(args.ordering_modes), workloads=args.ordering_workloads)
               if name == "ordering" else {})
      result[name] = MEASURES[name](args.small, reps, **extra)
    except Exception as e:  # noqa: BLE001 - the other measures still run; the exit status says so
      traceback.print_exc()
      result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
    if args.json:  # after each measure: a run stopped later keeps what it measured
      resumable.write_json(args.json, result)
  failed = failures(result)
  if failed:
    print("FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
    if argv is None:
      sys.exit(1)
  return result


if __name__ == "__main__":
  main()
