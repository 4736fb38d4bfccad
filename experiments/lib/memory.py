"""Device memory of compiled steps: `compiled_memory_of` gives `jact.compiled_memory`'s figures
for an executable the caller already compiled (to run, time or read it), and the allocator's
counters; the only place experiments read XLA's `memory_analysis()`."""

from __future__ import annotations

import jax

from jact._compiled_memory import CompiledMemory

__all__ = ["MIB", "compiled_memory_of", "device_memory", "is_oom", "needed_bytes"]

MIB = 2.0**20


def is_oom(e: BaseException) -> bool:
  """An XLA out-of-memory error (raised by compiling or running)."""
  text = str(e)
  return isinstance(e, RuntimeError) and (  # jax.errors.JaxRuntimeError is one
    "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
  )


def device_memory() -> dict | None:
  """The allocator's counters of the first device (None on CPU)."""
  stats = jax.devices()[0].memory_stats()
  if not stats:
    return None
  return {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def compiled_memory_of(compiled) -> CompiledMemory:
  """`jact.compiled_memory`'s figures for an executable already compiled (the caller runs or
  times it too; compiling it again to measure would double the compile time)."""
  s = compiled.memory_analysis()
  if s is None:
    raise RuntimeError(
      f"the {jax.default_backend()!r} backend gives no memory analysis for compiled "
      "functions; measure on CPU or GPU"
    )
  return CompiledMemory(
    int(s.temp_size_in_bytes),
    int(s.argument_size_in_bytes),
    int(s.output_size_in_bytes),
    int(s.alias_size_in_bytes),
    int(s.generated_code_size_in_bytes),
  )


def needed_bytes(mem: CompiledMemory) -> int:
  """Device memory a compiled step needs: temp + arguments + outputs - aliased."""
  return mem.temp_bytes + mem.argument_bytes + mem.output_bytes - mem.alias_bytes
