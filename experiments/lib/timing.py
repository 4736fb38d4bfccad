"""The one way experiments time JAX calls: warm up, then wall time around blocks of
back-to-back calls that end in `jax.block_until_ready` (dispatch is asynchronous)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax

__all__ = ["Stopwatch", "median_seconds", "time_call"]


def time_call(fn: Callable, inputs: list[tuple], reps: int, blocks: int = 5) -> list[float]:
  """Seconds per call for `blocks` blocks of `reps` back-to-back calls over rotating inputs
  (each input is called once first, so that compiling and first touches are not timed)."""
  if reps < 1 or blocks < 1 or not inputs:
    raise ValueError(
      f"time_call needs reps >= 1, blocks >= 1 and inputs; got reps={reps}, "
      f"blocks={blocks}, {len(inputs)} inputs"
    )
  jax.block_until_ready([fn(*a) for a in inputs])
  times = []
  for _ in range(blocks):
    start = time.perf_counter()
    outs = [fn(*inputs[i % len(inputs)]) for i in range(reps)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - start) / reps)
    del outs
  return times


def median_seconds(fn: Callable, *args, calls: int = 3) -> float:
  """Median seconds of `calls` single calls of fn(*args), after one untimed call."""
  return statistics.median(time_call(fn, [args], reps=1, blocks=calls))


class Stopwatch:
  """Wall (and process CPU) seconds of a `with` block: `with Stopwatch() as t: ...; t.seconds`."""

  def __enter__(self):
    self._wall, self._cpu = time.perf_counter(), time.process_time()
    return self

  def __exit__(self, *exc):
    self.seconds = time.perf_counter() - self._wall
    self.cpu_seconds = time.process_time() - self._cpu
    return False
