"""What the GPU measurements share: compile, time and read the memory of one variant
(`compile_and_time`), bit equality, copy bandwidth, random parameters and a printed table."""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import kernel_cases, memory, timing

__all__ = [
  "COMPILER_OPTIONS",
  "compile_and_time",
  "copy_gbps",
  "median_s",
  "print_rows",
  "random_params",
  "same_bits",
  "stack_loss",
  "xla_sizes",
]

COMPILER_OPTIONS: dict | None = None  # XLA options of every compile here (set by gpu_measures.main)


def same_bits(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
    x.shape == y.shape and x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
    for x, y in zip(la, lb)
  )


def median_s(fn: Callable, inputs: list[tuple], reps: int) -> dict:
  times = timing.time_call(fn, inputs, reps, blocks=3)
  return {
    "ms": 1e3 * statistics.median(times),
    "ms_min": 1e3 * min(times),
    "ms_max": 1e3 * max(times),
  }


def xla_sizes(compiled) -> dict:
  m = compiled.memory_analysis()  # not jact.compiled_memory: the offload rows need the host_* sizes
  fields = (
    "temp_size_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "host_temp_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
  )
  return {f.replace("_size_in", ""): int(getattr(m, f)) for f in fields if hasattr(m, f)}


def compile_and_time(fn: Callable, args: tuple, reps: int) -> dict:
  """Compile seconds, XLA memory and median call time of jit(fn)(*args);
  {"oom": True, "error": ...} when compiling or running runs out of memory,
  {"oom": False, "error": ...} when it fails otherwise (the run goes on; `main`
  exits with status 1)."""
  try:
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile(COMPILER_OPTIONS)
    row = {"compile_s": time.perf_counter() - t0, **xla_sizes(compiled), "oom": False}
    row.update(median_s(compiled, [args], reps))
    return row
  except Exception as e:  # noqa: BLE001 - recorded: one failing variant must not lose the others
    first = (str(e).splitlines() or [""])[0][:300]
    print(f"   failed: {type(e).__name__}: {first}", flush=True)
    return {"oom": memory.is_oom(e), "error": f"{type(e).__name__}: {first}"}
  finally:
    gc.collect()


def copy_gbps(x, reps: int) -> float:
  t = statistics.median(timing.time_call(jax.jit(jnp.copy), [(x,)], reps, blocks=3))
  return 2 * kernel_cases.nbytes_of(x) / t / 1e9


def print_rows(rows: list[dict], keys: tuple[str, ...]) -> None:
  print("  ".join(f"{k:>12s}" for k in keys))
  for r in rows:
    print(
      "  ".join(
        f"{r[k]:12.3f}" if isinstance(r.get(k), float) else f"{str(r.get(k, '-')):>12s}"
        for k in keys
      ),
      flush=True,
    )


def random_params(spec, key):
  leaves, treedef = jax.tree.flatten(spec)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(
    treedef,
    [
      jnp.ones(s.shape, s.dtype)
      if len(s.shape) == 1
      else jax.random.normal(k, s.shape, s.dtype) / math.sqrt(s.shape[0])
      for s, k in zip(leaves, keys)
    ],
  )


def stack_loss(block_fn: Callable) -> Callable:
  def loss(params, x, key):
    for i, p in enumerate(params):
      x = block_fn(p, x, jax.random.fold_in(key, i))
    return jnp.mean(x * x)

  return loss
