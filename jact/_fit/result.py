"""What `jact.fit` returns (`Fit`) and raises (`FitError`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jact._planning.plan import BitPlan
from jact._report import format_bytes

__all__ = ["Fit", "FitError", "Measured"]


@dataclasses.dataclass(frozen=True)
class Measured:
  """One compiled configuration: its compiled peak and, compiled for a GPU target, its
  predicted step time (a roofline of the compiled program, not a measurement) and the
  predicted gradient variance (0: exact)."""

  what: str
  peak_bytes: int
  predicted_seconds: float | None = None
  variance: float | None = None

  def line(self, budget: int | None = None) -> str:
    fits = "" if budget is None else ("fits" if self.peak_bytes <= budget else "over")
    time = "" if self.predicted_seconds is None else f"{self.predicted_seconds * 1e3:8.2f} ms"
    var = "" if self.variance is None else f"var {self.variance:.3g}"
    return f"  {format_bytes(self.peak_bytes):>12} {fits:>4} {time:>11} {var:>13}  {self.what}"


@dataclasses.dataclass(frozen=True)
class Fit:
  """A configuration of a training step that fits a budget.

  Attributes:
    loss_fn: the configured loss: `loss_fn(*args, key=..., **kwargs)`; its
      `jax.grad` is the configured step (`key`: a fresh PRNG key per step).
    plan: bits per residual (None: kept uncompressed).
    remat: the `jact.segment` blocks rematerialized (compressed remat).
    peak_bytes: the configured step's compiled peak (XLA's memory analysis).
    budget_bytes: the budget it was fitted to.
    written_peak_bytes: the compiled peak of the step as written.
    predicted_variance: sum_l c_l S(b_l) over the stored residuals.
    recompute_values: values the rematerialized segments recompute.
    compilations: configurations compiled by the search.
    search_seconds: the search's wall time.
    segments: every segment found, the order remat takes them in.
    history: each compiled configuration and its peak, in order.
    target: the GPU the step was compiled for ("h200", ...), or None (this machine).
    policy: the JAX rematerialization policy chosen for every segment (`jax.checkpoint`,
      nothing compressed), or None.
    predicted_seconds: with a target, the chosen step's predicted time (a roofline of
      XLA:GPU's program, calibrated on H200 measurements; not a measurement).
    variance_bound: with a target, the predicted variance a configuration could have.
  """

  loss_fn: Callable[..., Any]
  plan: BitPlan
  remat: tuple[str, ...]
  peak_bytes: int
  budget_bytes: int
  written_peak_bytes: int
  predicted_variance: float
  recompute_values: int
  compilations: int
  search_seconds: float
  segments: tuple[str, ...]
  history: tuple[Measured, ...]
  target: str | None = None
  policy: str | None = None
  predicted_seconds: float | None = None
  variance_bound: float | None = None

  def report(self) -> str:
    """A readable summary: peak against budget, what is rematerialized, widths, the search."""
    counts: dict[str, int] = {}
    for _, b in self.plan.entries:
      counts[str(b or "exact")] = counts.get(str(b or "exact"), 0) + 1
    widths = ", ".join(f"{v} at {k}" for k, v in sorted(counts.items())) or "as written"
    lines = [
      f"peak {format_bytes(self.peak_bytes)} of a {format_bytes(self.budget_bytes)} budget "
      f"(as written: {format_bytes(self.written_peak_bytes)})",
      f"rematerialized: {', '.join(self.remat) or 'nothing'} "
      f"({len(self.remat)} of {len(self.segments)} segments)"
      + (f"; JAX's jax.checkpoint with {self.policy} per segment" if self.policy else ""),
      f"residual widths: {widths}",
      f"predicted gradient variance {self.predicted_variance:.4g}; "
      f"recomputed values {self.recompute_values}",
      f"search: {self.compilations} compilations in {self.search_seconds:.1f} s",
    ]
    if self.target is not None:
      lines.insert(
        1,
        f"compiled for {self.target}: predicted step {self.predicted_seconds * 1e3:.2f} ms "
        f"(a roofline of the compiled program, not a measurement); variance bound "
        f"{self.variance_bound:.4g}"
        + (
          " -- over it: nothing within the bound fits, this is the least-variance "
          "configuration that does"
          if self.predicted_variance > self.variance_bound * (1 + 1e-9)
          else ""
        ),
      )
      lines.append("  the frontier seen (peak, fits, predicted step, predicted variance):")
    lines += [m.line(self.budget_bytes) for m in self.history]
    return "\n".join(lines)


class FitError(ValueError):
  """No configuration fits the budget; says the smallest compiled peak found and what to do.

  `smallest_peak_bytes` is the least peak among every configuration compiled, the step as
  written included (`smallest_what` says which one it was)."""

  def __init__(self, budget, written, smallest, what, n_segments, compilations, seconds):
    self._args = (budget, written, smallest, what, n_segments, compilations, seconds)
    self.budget_bytes, self.written_peak_bytes, self.smallest_peak_bytes = budget, written, smallest
    self.smallest_what = what
    hint = (
      "mark more of the model as jact.segment (its blocks) or lower the batch"
      if n_segments
      else "mark the model's blocks with jact.segment (compressed remat) or lower the batch"
    )
    if smallest >= written:
      reached = (
        f"no configuration compiled below the step as written (its least: "
        f"{format_bytes(smallest)}, {what})"
      )
    else:
      reached = f"the smallest compiled peak is {format_bytes(smallest)} ({what})"
    super().__init__(
      f"jact.fit: nothing fits {format_bytes(budget)} (as written: {format_bytes(written)}); "
      f"{reached}. To go lower: {hint}. ({compilations} compilations, {seconds:.1f} s)"
    )

  def __reduce__(self):  # picklable (process pools send it back)
    return (type(self), self._args)
