"""The configured loss and the compiled peak of its gradient step."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax

from jact._compiled_memory import compiled_memory, memory_of
from jact._gpu_target import compile_for
from jact._step_time import predict_step_time
from jact._fit.model import TRANSIENT_BITS
from jact._fit.segments import Layout, configured
from jact._planning.plan import BitPlan, use_plan

__all__ = ["configure", "plan_of", "step_peak", "step_cost", "StepCost"]


def plan_of(candidate) -> BitPlan:
  """The BitPlan of a candidate: its allocated widths and its transient residuals'."""
  transient = {n: TRANSIENT_BITS for n in candidate.transient}
  return BitPlan({**transient, **dict(candidate.widths)})


def configure(
  loss_fn: Callable[..., Any], layout: Layout | None, plan: BitPlan | None, strict: bool = False
):
  """`loss_fn` with its segments following `layout` and `plan` applied, plus keyword `key`.
  `layout=None`: the loss as written (segments plain). `strict`: a plan entry naming no
  traced residual is an error (see `use_plan`)."""

  @functools.wraps(loss_fn)
  def loss(*args, key=None, **kwargs):
    if layout is None:
      return loss_fn(*args, **kwargs)
    with configured(layout, key), use_plan(plan, strict=strict):
      return loss_fn(*args, **kwargs)

  return loss


def step_peak(loss, args, argnums) -> int:
  """Compiled peak bytes of `jax.grad(loss, argnums)(*args, key=...)`: arguments, outputs
  and temporaries, less donated aliases (per device when `args` carry shardings)."""
  return step_cost(loss, args, argnums).peak


@dataclasses.dataclass(frozen=True)
class StepCost:
  """A configured step's compiled peak (bytes) and, compiled for a GPU target, its step
  time *predicted* from the compiled XLA:GPU program (`jact._step_time`; never measured)."""

  peak: int
  predicted_seconds: float | None = None


def step_cost(loss, args, argnums, target=None) -> StepCost:
  """`StepCost` of `jax.grad(loss, argnums)(*args, key=...)`, compiled for this machine's
  backend (`target=None`) or by XLA:GPU for `target` ("h100", "h200": `jact.compile_for`)."""

  def step(key, *args):
    return jax.grad(loss, argnums=argnums)(*args, key=key)

  peak = lambda m: m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes
  if target is None:
    return StepCost(peak(compiled_memory(step, jax.random.key(0), *args)))
  compiled = compile_for(step, jax.random.key(0), *args, target=target)
  return StepCost(peak(memory_of(compiled)), predict_step_time(compiled, target).seconds)
