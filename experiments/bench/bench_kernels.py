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
import json
import statistics
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import metadata, timing
from experiments.lib.kernel_cases import CASES, MB, Case, nbytes_of
from jact import kernels
from jact._core.persample import per_sample_capacity

__all__ = ["CASES", "Case", "main"]


def _bind(case: Case, impl: str, args: tuple) -> Callable:
  fn = kernels.available(case.op)[impl].fn
  kwargs = dict(case.kwargs)
  if case.op == "quantize_per_sample":
    kwargs["capacity_bytes"] = per_sample_capacity(args[0].shape, 4.0)
  return jax.jit(lambda *a: fn(*a, **kwargs))


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
  inputs = [
    (jax.random.normal(jax.random.fold_in(key, i), (max(1, nbytes // 4),), jnp.float32),)
    for i in range(count)
  ]
  out = {}
  for name, fn in (("copy", jax.jit(jnp.copy)), ("negate", jax.jit(jnp.negative))):
    t = statistics.median(timing.time_call(fn, inputs, reps))
    out[name] = 2 * nbytes_of(inputs[0]) / t / 1e9
  return out


def run(
  sizes_mb: list[float],
  impls: list[str],
  ops: list[str],
  reps: int,
  rotate_mb: float,
  check_cpu: bool,
) -> list[dict]:
  rows = []
  rotate = int(rotate_mb * MB)
  for size_mb in sizes_mb:
    nbytes = int(size_mb * MB)
    copy = _copy_gbps(nbytes, reps, rotate)
    copy_gbps = max(copy.values())
    print(
      f"-- {size_mb:g} MB: copy {copy['copy']:.0f} GB/s, negate {copy['negate']:.0f} GB/s",
      flush=True,
    )
    for op in ops:
      for case in CASES[op]:
        base = case.make(nbytes, jax.random.key(0))
        count = max(1, -(-rotate // max(1, nbytes_of(base))))
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
            rows.append(
              {
                "op": op,
                "config": case.label,
                "impl": impl,
                "input_bytes": nbytes_of(base[0]),
                "error": f"{type(e).__name__}: {e}"[:500],
              }
            )
            print(
              f"{op:22s} {case.label:22s} {impl:14s} {size_mb:7g} MB failed: {rows[-1]['error']}",
              flush=True,
            )
            continue
          same = _same_bits(out, reference)
          same_cpu = None if cpu_ref is None else _same_bits(jax.device_get(out), cpu_ref)
          times = timing.time_call(fn, inputs, reps)
          t = statistics.median(times)
          traffic = case.traffic(base, out)
          gbps = traffic / t / 1e9
          xla_time = t if impl == "xla" else xla_time
          row = {
            "op": op,
            "config": case.label,
            "impl": impl,
            "input_bytes": nbytes_of(base[0]),
            "traffic_bytes": traffic,
            "ms": t * 1e3,
            "ms_min": min(times) * 1e3,
            "ms_max": max(times) * 1e3,
            "gbps": gbps,
            "copy_gbps": copy_gbps,
            "copy_gbps_by_method": copy,
            "fraction_of_copy": gbps / copy_gbps,
            "bit_exact_vs_xla_on_device": same,
            "bit_exact_vs_xla_on_cpu": same_cpu,
            "speedup_vs_xla": (xla_time / t) if xla_time else None,
          }
          rows.append(row)
          speedup = row["speedup_vs_xla"]
          print(
            f"{op:22s} {case.label:22s} {impl:14s} {size_mb:7g} MB {t * 1e3:9.3f} ms "
            f"{gbps:8.1f} GB/s {gbps / copy_gbps:6.1%} of copy"
            f"{'' if speedup is None else f'  x{speedup:.2f} vs xla'}  exact={same}"
            f"{'' if same_cpu is None else f' exact_vs_cpu={same_cpu}'}",
            flush=True,
          )
        del inputs
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes-mb", nargs="+", type=float, default=[1, 4, 16, 64, 256, 1024])
  parser.add_argument(
    "--impls", nargs="+", default=None, help="default: xla, plus every registered kernel on GPU"
  )
  parser.add_argument("--ops", nargs="+", default=list(CASES), choices=list(CASES))
  parser.add_argument("--reps", type=int, default=20)
  parser.add_argument("--rotate-mb", type=float, default=256.0)
  parser.add_argument(
    "--check-cpu",
    action="store_true",
    help="also compare the on-device reference with the CPU reference",
  )
  parser.add_argument("--json", default="experiments/results/bench_kernels.json")
  args = parser.parse_args(argv)
  every = sorted({name for op in args.ops for name in kernels.available(op)})  # jax_triton too
  impls = args.impls or (every if jax.default_backend() == "gpu" else ["xla"])
  rows = run(args.sizes_mb, impls, args.ops, args.reps, args.rotate_mb, args.check_cpu)
  meta = metadata.run_metadata(
    "experiments.bench.bench_kernels",
    argv,
    traffic="minimal bytes: every input read once, every output written once",
    timing="median of 5 blocks of back-to-back calls over rotating inputs",
  )
  print(
    f"\n{'op':22s} {'config':22s} {'impl':14s} {'MB':>7s} {'GB/s':>8s} "
    f"{'of copy':>8s} {'vs xla':>7s} exact"
  )
  for r in (r for r in rows if "error" not in r):
    print(
      f"{r['op']:22s} {r['config']:22s} {r['impl']:14s} {r['input_bytes'] / MB:7.1f} "
      f"{r['gbps']:8.1f} {r['fraction_of_copy']:8.1%} "
      f"{'' if r['speedup_vs_xla'] is None else format(r['speedup_vs_xla'], '.2f'):>7s} "
      f"{r['bit_exact_vs_xla_on_device']}"
    )
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
  return rows


if __name__ == "__main__":
  main()
