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
  (`experiments.bench.memory_scaling`'s block; `--small`: one ReLU MLP block) plain,
  `jax.checkpoint` remat, `jact.compressed` at 2 bits, the same under `jax.checkpoint` with
  `jact.save_compressed` and with `jact.offload_compressed` (compressed bytes
  in pinned host memory between forward and backward): step time and device /
  host temp memory. On CPU the offload is a no-op.
* `attention`: forward + backward of causal attention (float32; on a GPU also bfloat16:
  cuDNN's fused kernel against jact's attention on it at 4 and 2 bits and its chunked
  loops, `time_vs_cudnn`): plain (einsum, softmax,
  logits materialized), `jax.nn.dot_product_attention` and
  `jact.ops.chunked_attention` uncompressed and at 8/4 bits, over sequence
  lengths: time and compiled temp memory (out of memory is recorded).
* `ordering`: the data-dependency ties jact adds because XLA:CPU expands
  optimization barriers before scheduling (`jact._core.xla_cpu`: the
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
import math
import sys
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp

import jact
from experiments.gpu import measure_kit as kit
from experiments.gpu.gpu_ordering import ORDERING_MODES, measure_ordering, ordering_ties
from experiments.lib import blocks, kernel_cases, metadata, resumable
from jact import compressors, kernels

__all__ = ["MEASURES", "ORDERING_MODES", "ordering_ties", "failures", "main"]

MB = kernel_cases.MB
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # --small on CPU: quicker XLA:CPU compiles


# ---------------------------------------------------------------------------
# relu_grid


def _relu_shapes(small: bool) -> list[tuple[str, tuple[int, ...], str]]:
  """(label, shape, dtype): row lengths at the (row, byte tile) grid's edges."""
  if small:
    return [("partial byte", (8, 9), "float32")]
  target = 64 * MB

  def rows(d, itemsize=4):
    return max(1, min(1 << 20, target // (itemsize * d)))

  return [
    ("1 value a row", (rows(1), 1), "float32"),
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
    ("empty batch", (0, 4096), "float32"),
  ]


def _relu_row(fn, x, reference, reps: int, copy) -> dict:
  """Bit-exactness against `reference` and, for a non-empty x, time and GB/s."""
  out = fn(x)
  row = {"bit_exact_vs_xla": kit.same_bits(out, reference)}
  if x.size:
    row.update(kit.median_s(fn, [(x,)], reps))
    traffic = kernel_cases.nbytes_of(x) + kernel_cases.nbytes_of(out)
    row.update(
      traffic_bytes=traffic,
      gbps=traffic / (row["ms"] / 1e3) / 1e9,
      copy_gbps=copy,
      fraction_of_copy=traffic / (row["ms"] / 1e3) / 1e9 / copy,
    )
  return row


def _relu_fn(fn: Callable, slope) -> Callable:
  return jax.jit(lambda a: fn(a, negative_slope=slope))


def measure_relu_grid(small: bool, reps: int) -> list[dict]:
  impls = ["xla", "pallas_triton"]
  rows = []
  for label, shape, dtype in _relu_shapes(small):
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    copy = kit.copy_gbps(x, reps) if x.size else None
    for slope in (None,) if small else (None, 0.1):
      fns = {i: _relu_fn(kernels.available("relu_mask")[i].fn, slope) for i in impls}
      reference = fns["xla"](x)
      for impl, fn in fns.items():
        row = {
          "case": label,
          "shape": list(shape),
          "dtype": dtype,
          "negative_slope": slope,
          "impl": impl,
        }
        try:
          row.update(_relu_row(fn, x, reference, reps, copy))
        except Exception as e:  # noqa: BLE001 - recorded; the other shapes still run
          row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
          print(f"   {label} {impl} failed: {row['error']}", flush=True)
        rows.append(row)
  kit.print_rows(
    rows,
    (
      "case",
      "dtype",
      "negative_slope",
      "impl",
      "ms",
      "gbps",
      "fraction_of_copy",
      "bit_exact_vs_xla",
    ),
  )
  return rows


# ---------------------------------------------------------------------------
# compressors


def _compressor_list() -> list[tuple[str, compressors.Compressor]]:
  return [
    ("PerGroup 2", compressors.PerGroup(2)),
    ("PerGroup 4", compressors.PerGroup(4)),
    ("PerGroup 8", compressors.PerGroup(8)),
    ("Division B=8 Q=2", compressors.Division(block=8, bits=2)),
    ("BLPA 4", compressors.BLPA(4)),
    ("Fixpoint 8", compressors.Fixpoint(8)),
    ("ZeroValue lossless", compressors.ZeroValue(None, capacity=0.6)),
    ("ZeroValue Fixpoint 8", compressors.ZeroValue(compressors.Fixpoint(8), capacity=0.6)),
  ]


def measure_compressors(small: bool, reps: int) -> list[dict]:
  shape = (2, 8, 8, 32) if small else (64, 56, 56, 256)
  methods = _compressor_list()
  if small:  # one of each stored form: Packed, Compressed with a kernel, Compressed by XLA alone
    methods = [
      m for m in methods if m[0] in ("PerGroup 2", "Division B=8 Q=2", "ZeroValue Fixpoint 8")
    ]
  x = jax.nn.relu(jax.random.normal(jax.random.key(0), shape, jnp.float32) + 0.1)  # ~54% non-zero
  seed = jax.random.bits(jax.random.key(1), (), jnp.uint32)
  copy = kit.copy_gbps(x, reps)
  rows = []
  for label, c in methods:
    compress = jax.jit(c.compress)
    decompress = jax.jit(c.decompress)
    stored = compress(x, seed)
    x_hat = decompress(stored)
    stored_bytes = kernel_cases.nbytes_of(stored)
    row = {
      "compressor": label,
      "config": c.to_dict(),
      "shape": list(shape),
      "input_bytes": kernel_cases.nbytes_of(x),
      "stored_bytes": stored_bytes,
      "ratio": kernel_cases.nbytes_of(x) / stored_bytes,
      "copy_gbps": copy,
      "rel_error": float(jnp.linalg.norm(x_hat - x) / jnp.linalg.norm(x)),
    }
    for name, fn, args, out in (
      ("compress", compress, (x, seed), stored),
      ("decompress", decompress, (stored,), x_hat),
    ):
      t = kit.median_s(fn, [args], reps)
      row[f"{name}_ms"] = t["ms"]
      row[f"{name}_gbps"] = (
        (kernel_cases.nbytes_of(args[0]) + kernel_cases.nbytes_of(out)) / (t["ms"] / 1e3) / 1e9
      )
    rows.append(row)
  kit.print_rows(
    rows,
    (
      "compressor",
      "ratio",
      "compress_ms",
      "compress_gbps",
      "decompress_ms",
      "decompress_gbps",
      "rel_error",
    ),
  )
  return rows


# ---------------------------------------------------------------------------
# offload


def _mlp_block(p, x):
  """A residual ReLU MLP: the smoke run's block (quick to compile)."""
  return x + jax.nn.relu(x @ p["w1"]) @ p["w2"]


def _offload_variants(small: bool) -> dict[str, Callable]:
  block = blocks.transformer_block
  plain = _mlp_block if small else (lambda p, x: block(p, x, jax.random.key(0), None))
  c = jact.compressed(plain, bits=2, name="block", compress_argnums=(1,))
  saved = jax.checkpoint(lambda p, x, k: c(p, x, key=k), policy=jact.save_compressed("block"))
  offloaded = jax.checkpoint(
    lambda p, x, k: c(p, x, key=k), policy=jact.offload_compressed("block")
  )
  return {
    "plain": lambda p, x, k: plain(p, x),
    "remat": lambda p, x, k: jax.checkpoint(plain)(p, x),
    "compressed 2 bit": lambda p, x, k: c(p, x, key=k),
    "compressed 2 bit + save_compressed": saved,
    "compressed 2 bit + offload_compressed": offloaded,
  }


def measure_offload(small: bool, reps: int) -> list[dict]:
  if small:  # the policies' plumbing only, on an MLP block
    depth, x_shape = 1, (4, 16, 32)
    spec = {
      "w1": jax.ShapeDtypeStruct((32, 64), jnp.float32),
      "w2": jax.ShapeDtypeStruct((64, 32), jnp.float32),
    }
  else:
    depth, x_shape = 8, (16, 1024, 512)
    spec = blocks.transformer_params(dim=512, mlp=2048)
  params = [kit.random_params(spec, jax.random.key(i)) for i in range(depth)]
  x = jax.random.normal(jax.random.key(99), x_shape, jnp.float32)
  key = jax.random.key(7)
  rows = []
  variants = _offload_variants(small)
  if small:
    variants = {k: v for k, v in variants.items() if "_compressed" in k}
  for name, block_fn in variants.items():
    grad = jax.grad(kit.stack_loss(block_fn))
    row = {
      "variant": name,
      "depth": depth,
      "input_shape": list(x_shape),
      **kit.compile_and_time(grad, (params, x, key), reps),
    }
    rows.append(row)
  base = next((r for r in rows if r["variant"] == "compressed 2 bit + save_compressed"), None)
  for r in rows:
    if base and "error" not in r and "error" not in base:
      r["time_vs_save_compressed"] = r["ms"] / base["ms"]
  kit.print_rows(
    rows, ("variant", "ms", "temp_bytes", "host_temp_bytes", "time_vs_save_compressed")
  )
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
      q, k, v, causal=True, query_chunk=c, key_chunk=c, bits=bits, key=None if bits is None else key
    )

  variants = {
    "plain (einsum)": lambda q, k, v, key: _plain_attention(q, k, v),
    "jax.nn.dot_product_attention": lambda q, k, v, key: jax.nn.dot_product_attention(
      q, k, v, is_causal=True
    ),
    "chunked": chunked(None),
    f"chunked, chunks {4 * chunk}": chunked(None, 4 * chunk),
    "chunked 8 bit": chunked(8),
    "chunked 4 bit": chunked(4),
  }
  if small:
    variants = {k: variants[k] for k in ("plain (einsum)", "chunked", "chunked 4 bit")}
  return variants


def _fused_variants(chunk: int) -> dict[str, Callable]:
  """bfloat16 attention as cuDNN runs it: JAX's fused kernel, jact's attention on it (q, k, v
  stored at 4 or 2 bits; implementation=None picks cuDNN on a GPU), and jact's chunked loops
  at two chunk sizes (the default chunks are to be chosen from these rows)."""

  def jact_attention(bits, implementation=None, c=chunk):
    return lambda q, k, v, key: jact.ops.chunked_attention(
      q,
      k,
      v,
      causal=True,
      query_chunk=c,
      key_chunk=c,
      bits=bits,
      key=key,
      implementation=implementation,
    )

  return {
    "cuDNN (bf16)": lambda q, k, v, key: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn"
    ),
    "jact 4 bit (bf16, cuDNN)": jact_attention(4),
    "jact 2 bit (bf16, cuDNN)": jact_attention(2),
    "jact 4 bit (bf16, chunked)": jact_attention(4, "xla"),
    f"jact 4 bit (bf16, chunked, chunks {4 * chunk})": jact_attention(4, "xla", 4 * chunk),
  }


def _attention_rows(variants, dtype, lengths, batch, heads, depth, reps) -> list[dict]:
  rows = []
  for length in lengths:
    ks = jax.random.split(jax.random.key(length), 4)
    q, k, v, ct = (
      jax.random.normal(kk, (batch, length, heads, depth), jnp.float32).astype(dtype) for kk in ks
    )
    key = jax.random.key(3)
    for name, attend in variants.items():

      def step(q, k, v, key, ct, attend=attend):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, key), q, k, v)
        return vjp(ct)

      rows.append(
        {
          "variant": name,
          "length": length,
          "dtype": jnp.dtype(dtype).name,
          "shape": [batch, length, heads, depth],
          **kit.compile_and_time(step, (q, k, v, key, ct), reps),
        }
      )
    del q, k, v, ct
  return rows


def _relative(rows, base_name: str, column: str) -> None:
  for r in rows:
    base = next((b for b in rows if b["length"] == r["length"] and b["variant"] == base_name), None)
    if base is not None and "error" not in r and "error" not in base:
      r[column] = r["ms"] / base["ms"]


def measure_attention(small: bool, reps: int) -> list[dict]:
  batch, heads, depth, chunk = (1, 2, 16, 32) if small else (2, 16, 64, 128)
  lengths = (64,) if small else (1024, 4096, 16384)
  rows = _attention_rows(
    _attention_variants(chunk, small), jnp.float32, lengths, batch, heads, depth, reps
  )
  _relative(rows, "chunked", "time_vs_chunked")
  kit.print_rows(rows, ("variant", "length", "ms", "temp_bytes", "time_vs_chunked", "oom"))
  if small or jax.default_backend() != "gpu":  # cuDNN's kernel runs on an NVIDIA GPU only
    return rows
  fused = _attention_rows(
    _fused_variants(chunk), jnp.bfloat16, (2048, 8192, 16384), batch, heads, depth, reps
  )
  _relative(fused, "cuDNN (bf16)", "time_vs_cudnn")
  kit.print_rows(fused, ("variant", "length", "ms", "temp_bytes", "time_vs_cudnn", "oom"))
  return rows + fused


MEASURES = {
  "relu_grid": measure_relu_grid,
  "compressors": measure_compressors,
  "offload": measure_offload,
  "attention": measure_attention,
  "ordering": measure_ordering,
}


def failures(result: dict) -> list[str]:
  """Measures that raised, and rows that failed other than by running out of memory."""
  out = [
    f"{name}: {rows['error']}"
    for name, rows in result.items()
    if isinstance(rows, dict) and "error" in rows and name != "meta"
  ]
  for name, rows in result.items():
    if isinstance(rows, list):
      out += [f"{name}: {r['error']}" for r in rows if "error" in r and not r.get("oom")]
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("measures", nargs="+", choices=list(MEASURES))
  parser.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke run)")
  parser.add_argument(
    "--reps", type=int, default=None, help="calls per timed block (default 20, small 2)"
  )
  parser.add_argument("--json", help="write the rows to this file")
  parser.add_argument(
    "--ordering-modes",
    nargs="+",
    choices=ORDERING_MODES,
    default=ORDERING_MODES,
    help="ordering: the modes to compare (plain workloads run shipped only)",
  )
  parser.add_argument(
    "--ordering-workloads",
    nargs="+",
    default=None,
    help="ordering: only workloads whose name holds one of these",
  )
  args = parser.parse_args(argv)
  reps = args.reps or (2 if args.small else 20)
  kit.COMPILER_OPTIONS = FAST_COMPILE if args.small and jax.default_backend() == "cpu" else None
  result = {
    "meta": {
      **metadata.run_metadata("experiments.gpu.gpu_measures", argv),
      "small": args.small,
      "reps": reps,
      "compiler_options": kit.COMPILER_OPTIONS,
      "kernels": {op: kernels.select(op).name for op in ("quantize", "relu_mask")},
    }
  }
  for name in args.measures:
    print(f"== {name}", flush=True)
    t0 = time.perf_counter()
    try:
      extra = (
        dict(modes=tuple(args.ordering_modes), workloads=args.ordering_workloads)
        if name == "ordering"
        else {}
      )
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
