"""Kernel bandwidth benchmark: every compression kernel vs a device copy and the XLA reference.

Compression is data movement: its floor is (bytes read + bytes written) /
memory bandwidth. For each kernel of `jact.kernels` and input sizes from 1 MB
to 1 GB this measures the achieved GB/s (each input read once, each output
written once -- the minimal traffic), next to a device-to-device copy timed in
the same run, and the time against the XLA reference; it also checks that
every implementation returns the same bits as the reference on the device
(and, with --check-cpu, as the reference computed on the CPU).

    python -m experiments.bench.bench_kernels                       # GPU: xla and pallas_triton
    python -m experiments.bench.bench_kernels --sizes-mb 1 4 --impls xla   # CPU smoke run

Timing: each configuration is compiled and warmed up, then dispatched `--reps`
times back to back over rotating input buffers (at least `--rotate-mb` of
them, so repeated calls do not hit the cache) and synchronised once; the
median of 5 such blocks is reported with its spread. Below ~16 MB the times
include per-call dispatch (a few microseconds), so the GB/s there are lower
bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import metadata
from jact import kernels
from jact.core.persample import per_sample_capacity
from jact.core.quantize import effective_group_size
from jact.kernels.quantize.reference import quantize_reference

__all__ = ["CASES", "Case", "time_call", "main"]

MB = 2**20


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel configuration.

  Attributes:
    op: the `jact.kernels` op.
    label: its configuration ("2 bit f32", ...).
    make: (input bytes, key) -> the positional arguments of the op's implementations.
    kwargs: keyword arguments of the implementations.
    traffic: (args, outputs) -> minimal bytes read + written.
  """
  op: str
  label: str
  make: Callable[[int, jax.Array], tuple]
  kwargs: dict
  traffic: Callable[[tuple, Any], int]


def _nbytes(tree) -> int:
  return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def _activation(nbytes: int, key, dtype=jnp.float32, row: int = 16384):
  """Real-valued data (normal, with a ReLU-like zero half) of about `nbytes`, rows of `row` values."""
  n = max(1, nbytes // (jnp.dtype(dtype).itemsize * row))
  x = jax.random.normal(key, (n, row), jnp.float32)
  return jnp.where(x > -0.1, x, 0.5 * x).astype(dtype)


def _map(nbytes: int, key, hw: int = 64, c: int = 64):
  """A channels-last activation map (N, hw, hw, c) of about `nbytes` float32."""
  n = max(1, nbytes // (4 * hw * hw * c))
  return jax.random.normal(key, (n, hw, hw, c), jnp.float32)


def _seed(key):
  return jax.random.bits(key, (), jnp.uint32)


def _quantize_case(bits: int, dtype=jnp.float32) -> Case:
  def make(nbytes, key):
    x = _activation(nbytes, key, dtype)
    return (x, _seed(key))
  g = effective_group_size(16384, 256)
  return Case("quantize", f"{bits} bit {jnp.dtype(dtype).name}", make,
              dict(bits=bits, group_size=g, stochastic=True),
              lambda args, out: _nbytes(args[0]) + _nbytes(out))


def _dequantize_case(bits: int) -> Case:
  def make(nbytes, key):
    x = _activation(nbytes, key)
    return (quantize_reference(x, _seed(key), bits=bits, group_size=256),)
  return Case("dequantize", f"{bits} bit f32", make, dict(dtype=jnp.float32),
              lambda args, out: _nbytes(args[0]) + _nbytes(out))


def _relu_case() -> Case:
  return Case("relu_mask", "relu f32", lambda nbytes, key: (_activation(nbytes, key),),
              dict(negative_slope=None), lambda args, out: _nbytes(args[0]) + _nbytes(out))


def _per_sample_widths(n: int):
  """Widths 1/2/4 (probabilities 1/4, 1/2, 1/4): 2.25 bits a value on average."""
  return jnp.asarray(np.random.default_rng(0).choice([1, 2, 4], size=n, p=[0.25, 0.5, 0.25]),
                     jnp.int32)


def _quantize_per_sample_case() -> Case:
  def make(nbytes, key):
    x = _activation(nbytes, key, row=4096)
    return (x, _per_sample_widths(x.shape[0]))

  return Case("quantize_per_sample", "mixed 1/2/4 bit f32", make,
              dict(group_size=256, seed=jnp.uint32(7)),
              lambda args, out: _nbytes(args[0]) + _nbytes(out))


def _dequantize_per_sample_case() -> Case:
  def make(nbytes, key):
    x, widths = _quantize_per_sample_case().make(nbytes, key)
    capacity = per_sample_capacity(x.shape, 4.0)
    fn = kernels.available("quantize_per_sample")["xla"].fn
    return (fn(x, widths, capacity_bytes=capacity, group_size=256, seed=jnp.uint32(7)),)
  return Case("dequantize_per_sample", "mixed 1/2/4 bit f32", make, dict(dtype=jnp.float32),
              lambda args, out: _nbytes(args[0]) + _nbytes(out))


def _division_case(bits: int = 2, block: int = 8) -> Case:
  return Case("division_compress", f"B={block} Q={bits} f32 64x64x64",
              lambda nbytes, key: (_map(nbytes, key), _seed(key)),
              dict(block=block, bits=bits, group_size=256, lfc_dtype=jnp.dtype(jnp.bfloat16)),
              lambda args, out: _nbytes(args[0]) + _nbytes(out))


CASES = {
    "quantize": [_quantize_case(b) for b in (1, 2, 4, 8)] + [_quantize_case(2, jnp.bfloat16)],
    "dequantize": [_dequantize_case(b) for b in (2, 4, 8)],
    "relu_mask": [_relu_case()],
    "quantize_per_sample": [_quantize_per_sample_case()],
    "dequantize_per_sample": [_dequantize_per_sample_case()],
    "division_compress": [_division_case()],
}


def _bind(case: Case, impl: str, args: tuple) -> Callable:
  fn = kernels.available(case.op)[impl].fn
  kwargs = dict(case.kwargs)
  if case.op == "quantize_per_sample":
    kwargs["capacity_bytes"] = per_sample_capacity(args[0].shape, 4.0)
  return jax.jit(lambda *a: fn(*a, **kwargs))


def time_call(fn: Callable, inputs: list[tuple], reps: int, blocks: int = 5) -> list[float]:
  """Seconds per call for `blocks` blocks of `reps` back-to-back calls over rotating inputs."""
  jax.block_until_ready(fn(*inputs[0]))
  jax.block_until_ready([fn(*a) for a in inputs])  # warm every buffer
  times = []
  for _ in range(blocks):
    t0 = time.perf_counter()
    outs = [fn(*inputs[i % len(inputs)]) for i in range(reps)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t0) / reps)
    del outs
  return times


def _same_bits(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  if len(la) != len(lb):
    return False
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
      return False
    if x.tobytes() != y.tobytes():
      return False
  return True


def _copy_gbps(nbytes: int, reps: int, rotate: int) -> dict:
  """Device-to-device copy (read + write) bandwidth at this size, two ways."""
  key = jax.random.key(1)
  count = max(1, -(-rotate // nbytes))
  inputs = [(jax.random.normal(jax.random.fold_in(key, i), (max(1, nbytes // 4),), jnp.float32),)
            for i in range(count)]
  out = {}
  for name, fn in (("copy", jax.jit(jnp.copy)), ("negate", jax.jit(jnp.negative))):
    t = statistics.median(time_call(fn, inputs, reps))
    out[name] = 2 * _nbytes(inputs[0]) / t / 1e9
  return out


def run(sizes_mb: list[float], impls: list[str], ops: list[str], reps: int, rotate_mb: float,
        check_cpu: bool) -> list[dict]:
  rows = []
  rotate = int(rotate_mb * MB)
  for size_mb in sizes_mb:
    nbytes = int(size_mb * MB)
    copy = _copy_gbps(nbytes, reps, rotate)
    copy_gbps = max(copy.values())
    print(f"-- {size_mb:g} MB: copy {copy['copy']:.0f} GB/s, negate {copy['negate']:.0f} GB/s", flush=True)
    for op in ops:
      for case in CASES[op]:
        base = case.make(nbytes, jax.random.key(0))
        count = max(1, -(-rotate // max(1, _nbytes(base))))
        inputs = [base] + [case.make(nbytes, jax.random.key(i + 1)) for i in range(count - 1)]
        reference = _bind(case, "xla", base)(*base)
        cpu_ref = None
        if check_cpu and jax.default_backend() != "cpu":
          cpu = jax.devices("cpu")[0]
          host_args = jax.device_put(base, cpu)
          with jax.default_device(cpu):
            cpu_ref = jax.device_get(_bind(case, "xla", host_args)(*host_args))
        xla_time = None
        for impl in impls:
          if impl not in kernels.available(op):
            continue
          fn = _bind(case, impl, base)
          try:
            out = fn(*base)
          except Exception as e:  # noqa: BLE001 - a kernel that fails here is recorded; xla re-raises
            if impl == "xla":
              raise
            rows.append({"op": op, "config": case.label, "impl": impl,
                         "input_bytes": _nbytes(base[0]), "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"{op:22s} {case.label:22s} {impl:14s} {size_mb:7g} MB failed: {rows[-1]['error']}",
                  flush=True)
            continue
          same = _same_bits(out, reference)
          same_cpu = None if cpu_ref is None else _same_bits(jax.device_get(out), cpu_ref)
          times = time_call(fn, inputs, reps)
          t = statistics.median(times)
          traffic = case.traffic(base, out)
          gbps = traffic / t / 1e9
          xla_time = t if impl == "xla" else xla_time
          row = {"op": op, "config": case.label, "impl": impl, "input_bytes": _nbytes(base[0]),
                 "traffic_bytes": traffic, "ms": t * 1e3, "ms_min": min(times) * 1e3,
                 "ms_max": max(times) * 1e3, "gbps": gbps, "copy_gbps": copy_gbps,
                 "copy_gbps_by_method": copy, "fraction_of_copy": gbps / copy_gbps,
                 "bit_exact_vs_xla_on_device": same, "bit_exact_vs_xla_on_cpu": same_cpu,
                 "speedup_vs_xla": (xla_time / t) if xla_time else None}
          rows.append(row)
          speedup = row["speedup_vs_xla"]
          print(f"{op:22s} {case.label:22s} {impl:14s} {size_mb:7g} MB {t * 1e3:9.3f} ms "
                f"{gbps:8.1f} GB/s {gbps / copy_gbps:6.1%} of copy"
                f"{'' if speedup is None else f'  x{speedup:.2f} vs xla'}  exact={same}"
                f"{'' if same_cpu is None else f' exact_vs_cpu={same_cpu}'}", flush=True)
        del inputs
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes-mb", nargs="+", type=float, default=[1, 4, 16, 64, 256, 1024])
  parser.add_argument("--impls", nargs="+", default=None,
                      help="default: xla, plus every registered kernel on GPU")
  parser.add_argument("--ops", nargs="+", default=list(CASES), choices=list(CASES))
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--rotate-mb", type=float, default=256.0)
  parser.add_argument("--check-cpu", action="store_true",
                      help="also compare the on-device reference with the CPU reference")
  parser.add_argument("--json", default="experiments/results/bench_kernels.json")
  args = parser.parse_args(argv)
  every = sorted({name for op in args.ops for name in kernels.available(op)})  # jax_triton too
  impls = args.impls or (every if jax.default_backend() == "gpu" else ["xla"])
  rows = run(args.sizes_mb, impls, args.ops, args.reps, args.rotate_mb, args.check_cpu)
  meta = metadata.run_metadata(
      "experiments.bench.bench_kernels", argv,
      traffic="minimal bytes: every input read once, every output written once",
      timing="median of 5 blocks of back-to-back calls over rotating inputs")
  print(f"\n{'op':22s} {'config':22s} {'impl':14s} {'MB':>7s} {'GB/s':>8s} {'of copy':>8s} {'vs xla':>7s} exact")
  for r in (r for r in rows if "error" not in r):
    print(f"{r['op']:22s} {r['config']:22s} {r['impl']:14s} {r['input_bytes'] / MB:7.1f} "
          f"{r['gbps']:8.1f} {r['fraction_of_copy']:8.1%} "
          f"{'' if r['speedup_vs_xla'] is None else format(r['speedup_vs_xla'], '.2f'):>7s} "
          f"{r['bit_exact_vs_xla_on_device']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
  return rows


if __name__ == "__main__":
  main()
