"""Runs one function of an experiment module in a fresh process (a forkserver that imported the
module, not jax's backend), so each memory reading starts from the same empty process."""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import os
import time
import traceback

import jax

__all__ = ["FAST_COMPILE_FLAGS", "run"]


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _return_freed_memory() -> None:
  """glibc: blocks over 64 KiB are mmapped and unmapped when freed (no dynamic
  threshold), and the heap is trimmed above 64 KiB free, so RSS follows the live buffers."""
  try:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 65536)
    libc.mallopt(_M_TRIM_THRESHOLD, 65536)
  except (OSError, AttributeError):
    pass


def _use_compilation_cache(path: str) -> None:
  """Shares compiled steps between a run's processes (the timing reuses the probes' compiles)."""
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Halve XLA:CPU's compile times, to the same buffers; the code runs ~2x slower.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _child(
  conn, module: str, target: str, args: tuple, memory: bool, cache_dir: str | None, xla_flags: str
) -> None:
  """Entry point of a fresh process: runs `target(*args)`, sends ("ok", result) or ("error",
  text)."""
  try:
    if memory:
      _return_freed_memory()
    if cache_dir:
      _use_compilation_cache(cache_dir)
    if xla_flags:  # read when the backend starts, which this process has not done yet
      os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip()
    t0 = time.perf_counter()
    result = getattr(importlib.import_module(module), target)(*args)
    conn.send(("ok", {**result, "process_s": time.perf_counter() - t0}))
  except Exception as e:  # noqa: BLE001 - reported to the parent, which records it
    conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"))
  finally:
    conn.close()


_CONTEXTS = {}


def _context(module: str):
  """A forkserver that imported this module (not jax's backend): children start in
  well under a second instead of importing jax, flax and jact again."""
  if module not in _CONTEXTS:
    _CONTEXTS[module] = multiprocessing.get_context("forkserver")
    _CONTEXTS[module].set_forkserver_preload([module])
  return _CONTEXTS[module]


def run(
  module: str,
  target: str,
  *args,
  memory: bool = False,
  cache_dir: str | None = None,
  xla_flags: str = "",
  timeout_s: float = 3600,
) -> dict:
  """`target(*args)` (`module`'s function named `target`) in a fresh process;
  its result, or {"error": ...} if it raised, died or timed out."""
  ctx = _context(module)
  receive, send = ctx.Pipe(duplex=False)
  proc = ctx.Process(
    target=_child, args=(send, module, target, args, memory, cache_dir, xla_flags), daemon=True
  )
  proc.start()
  send.close()
  try:
    if not receive.poll(timeout_s):
      proc.kill()
      return {"error": f"timed out after {timeout_s} s"}
    status, value = receive.recv()
  except EOFError:
    value, status = None, "died"
  finally:
    proc.join()
    receive.close()
  if status == "ok":
    return value
  if status == "died":
    return {"error": f"the process died (exit code {proc.exitcode})"}
  return {"error": value}
