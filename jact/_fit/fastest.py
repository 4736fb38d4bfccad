"""`jact.fit(..., target=...)`: the fastest step that fits, among jact's configurations and
JAX's own.

With a GPU target every configuration is compiled by XLA:GPU (`jact.compile_for`) and
gets a step time *predicted* from the compiled program (`jact._step_time`: a roofline
calibrated on H200 measurements). JAX's rematerialization policies (`jax.checkpoint` per
segment: `JAX_POLICIES`) join the candidates with variance 0; the answer is the least
predicted time whose compiled peak fits and whose predicted gradient variance is within
the bound.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

from jact._core.allocate import variance_factor
from jact._fit.segments import Layout, segment
from jact._fit.steps import configure
from jact._fit.verify import Compiles

__all__ = ["WHOLE_LOSS", "whole_loss_segment", "policy_key", "try_policies", "fastest", "bound"]

WHOLE_LOSS = "loss"  # the segment name of an unmarked loss


def whole_loss_segment(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
  """`loss_fn` as one segment (jact's generic capture of the whole loss), for a loss with
  no segment and no compressed residual of its own."""
  whole = segment(lambda *args, **kwargs: loss_fn(*args, **kwargs), name=WHOLE_LOSS)
  return functools.wraps(loss_fn)(lambda *args, **kwargs: whole(*args, **kwargs))


def policy_key(policy: str) -> tuple[str, str]:
  return ("policy", policy)


def try_policies(
  compiles: Compiles, loss_fn: Callable[..., Any], policies: Iterable[str], host_memory: bool
) -> None:
  """Compiles the step with each JAX policy applied to every segment (exact: variance 0)."""
  for policy in policies:
    if policy == "offload_inputs" and not host_memory:
      continue
    loss = configure(loss_fn, Layout(policy=policy), None)
    compiles.peak(policy_key(policy), loss, f"jax.checkpoint({policy}) per segment", 0.0)


def bound(table, widths: tuple) -> float:
  """The default variance bound: every residual at 4 bits (the lowest compressed width
  of `widths` when 4 is not among them), remat inputs aside."""
  compressed = [w for w in widths if w is not None]
  width = 4 if 4 in compressed else min(compressed)
  return sum(r.sensitivity * variance_factor(width) for r in table if not r.remat_input)


def fastest(compiles: Compiles, budget: int, variance_bound: float):
  """The key of the compiled configuration with the least predicted step time whose peak
  fits `budget` and whose predicted variance is at most `variance_bound`, or None."""
  eligible = [
    (m.predicted_seconds, m.variance or 0.0, i, key)
    for i, (key, m) in enumerate(compiles.measured.items())
    if m.peak_bytes <= budget
    and (m.variance or 0.0) <= variance_bound * (1 + 1e-9)
    and m.predicted_seconds is not None
  ]
  return min(eligible)[3] if eligible else None
