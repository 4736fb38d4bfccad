"""What `experiments.bench.memory_batch` measures inside one fresh process: a probe's step
memory (peak RSS or the device allocator's peak), the methods' step times, and whether
`jact.offload_compressed()` can move memory off this device."""

from __future__ import annotations

import ctypes
import gc
import math
import re
import statistics
import time

import jax
import jax.numpy as jnp

import jact
from experiments.lib import memory
from experiments.lib.blockwise import (
  CHECKPOINT_BITS,
  Config,
  loss_fn,
  on_device,
  optimizer,
  train_step,
)

__all__ = ["STEPS", "measure_probe", "time_methods", "offload_support"]

STEPS = 2  # train steps per memory probe
MIB = memory.MIB


# ----------------------------------------------------------------------------- memory readings


def _proc_status_mib(field: str) -> float:
  """A `/proc/self/status` memory field (VmRSS, VmHWM) in MiB."""
  with open("/proc/self/status", encoding="ascii") as f:
    return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def _settle_rss() -> float:
  """Collects garbage, returns free heap to the system, and reads VmRSS."""
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass  # not glibc: the reading is a little higher
  return _proc_status_mib("VmRSS")


def _reset_peak_rss() -> None:
  """Sets the peak-RSS mark (VmHWM, ru_maxrss) to the current RSS (Linux >= 4.0)."""
  with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
    f.write("5")


def _device_bytes(key: str) -> int | None:
  stats = jax.devices()[0].memory_stats()
  return None if not stats else stats.get(key)


def _run_steps(step, params, opt_state, batch, steps: int, first: int = 0):
  """Runs `steps` steps (a fresh key each), each waited for: (params, opt_state, last loss)."""
  value = None
  for i in range(first, first + steps):
    params, opt_state, value = step(params, opt_state, batch, jax.random.key(i))
    jax.block_until_ready((params, opt_state, value))
  return params, opt_state, value


def measure_probe(
  model: str, method: str, params, batch, config: Config, steps: int = STEPS
) -> dict:
  """Step memory of `steps` train steps of `model` under `method` on `batch`
  (numpy arrays), measured in this process: run it in a fresh one."""
  t0 = time.perf_counter()
  params, opt_state, batch = on_device(params, batch)
  rss_before = _settle_rss()
  step = train_step(loss_fn(model, method, config), optimizer())
  key = jax.random.key(0)
  estimate = jact.compiled_memory(step, params, opt_state, batch, key)
  compiled = (
    jax.jit(step).lower(params, opt_state, batch, key).compile()
  )  # jit's cache: no recompile
  rss_compiled = _settle_rss()
  device_compiled = _device_bytes("bytes_in_use")
  compile_s = time.perf_counter() - t0
  _reset_peak_rss()
  t1 = time.perf_counter()
  loss = float(_run_steps(compiled, params, opt_state, batch, steps)[2])
  run_s = time.perf_counter() - t1
  peak = _proc_status_mib("VmHWM")
  row = {
    "batch": len(batch[0]),
    "steps": steps,
    "measure": "rss",
    "step_mib": peak - rss_compiled,
    "with_program_mib": peak - rss_before,
    "program_mib": rss_compiled - rss_before,
    "peak_rss_steps_mib": peak,
    "rss_before_compile_mib": rss_before,
    "rss_after_compile_mib": rss_compiled,
    "compiled_step_mib": (estimate.temp_bytes + estimate.output_bytes) / MIB,
    "compiled_temp_mib": estimate.temp_bytes / MIB,
    "compiled_needed_mib": memory.needed_bytes(estimate) / MIB,
    "loss": loss if math.isfinite(loss) else None,
    "compile_s": compile_s,
    "run_s": run_s,
  }
  device_peak = _device_bytes("peak_bytes_in_use")
  if device_peak is not None:  # an accelerator: its allocator, not the host's RSS, holds the step
    row.update(
      measure="device",
      step_mib=(device_peak - (device_compiled or 0)) / MIB,
      device_peak_mib=device_peak / MIB,
      with_program_mib=None,
    )
  return row


def time_methods(
  model: str, methods, params, batch, config: Config, steps: int, warmup: int = 2
) -> dict:
  """Per-step seconds of each method on the same batch, in this process: every
  method compiled and warmed up, then `steps` rounds of one step per method."""
  runs, compile_s = {}, {}
  for method in methods:
    t0 = time.perf_counter()
    p, o, b = on_device(params, batch)
    step = jax.jit(train_step(loss_fn(model, method, config), optimizer()))
    p, o, _ = _run_steps(step, p, o, b, warmup)
    runs[method] = [step, p, o, b]
    compile_s[method] = time.perf_counter() - t0
  times = {m: [] for m in methods}
  for i in range(steps):
    for method in methods:
      step, p, o, b = runs[method]
      t0 = time.perf_counter()
      runs[method][1:3] = _run_steps(step, p, o, b, 1, first=warmup + i)[:2]
      times[method].append(time.perf_counter() - t0)
  rows = {
    m: {
      "median_ms": 1e3 * statistics.median(t),
      "min_ms": 1e3 * min(t),
      "max_ms": 1e3 * max(t),
      "compile_and_warmup_s": compile_s[m],
    }
    for m, t in times.items()
  }
  if "plain" in rows:
    for row in rows.values():
      row["ratio_vs_plain"] = row["median_ms"] / rows["plain"]["median_ms"]
  return {"batch": len(batch[0]), "steps": steps, "warmup": warmup, "methods": rows}


# ----------------------------------------------------------------------------- search


def offload_support() -> dict:
  """Whether `jact.offload_compressed()` moves memory off the device here: a tiny
  block under the policy is compiled and differentiated; on CPU, where
  'pinned_host' is the same RAM as the device, it is unsupported either way."""
  backend = jax.default_backend()
  block = jax.checkpoint(
    jact.compressed(lambda w, x: jnp.tanh(x @ w), bits=CHECKPOINT_BITS, name="probe"),
    policy=jact.offload_compressed(),
  )
  loss = lambda w, x: block(w, x, key=jax.random.key(0)).sum()
  try:
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=1))(jnp.eye(64), jnp.ones((8, 64))))
  except Exception as e:  # noqa: BLE001 - the platform's answer is the result
    return {
      "supported": False,
      "reason": f"unsupported on {backend}: {type(e).__name__}: {str(e).splitlines()[0]}",
    }
  if backend == "cpu":
    kinds = [m.kind for m in jax.devices()[0].addressable_memories()]
    return {
      "supported": False,
      "probe": "compiled and ran",
      "reason": (
        f"unsupported on cpu: the policy compiles and runs, but the CPU device's "
        f"memories {kinds} are all the same RAM, so offloading cannot lower the "
        "memory measured here (not measured rather than shown as a fake saving)"
      ),
    }
  return {"supported": True, "probe": "compiled and ran"}
