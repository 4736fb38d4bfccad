"""The compiling half of `jact.fit`: candidates proposed per layout, verified in order of
predicted variance, each layout's stored-bytes target corrected by what its compiles measured.

Every compile is XLA's memory analysis of the configured gradient step (`step_cost`), done
once per configuration (`Compiles`). A layout's first target comes from the calibration
compiles (`peak = base[layout] + stored bytes`); later ones follow the line through its
measured points, kept inside the bracket of what fitted and what did not (secant, never
past a bisection).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from jact._fit.model import Candidate, Residual, allocate, layouts
from jact._fit.result import Measured
from jact._fit.segments import SEGMENT_BITS, Layout
from jact._fit.steps import configure, plan_of, step_cost

__all__ = ["Compiles", "Verifier", "WRITTEN", "candidate_key"]

WRITTEN = "written"  # the step as written is the answer


def candidate_key(c: Candidate):
  return (c.layout, c.widths, c.transient)


@dataclasses.dataclass
class Compiles:
  """The compiled peak of each configuration, compiled once (by XLA:GPU for `target`, with
  a predicted step time); `history` in compile order."""

  args: tuple
  argnums: tuple[int, ...]
  target: Any = None
  peaks: dict[Any, int] = dataclasses.field(default_factory=dict)
  history: list[Measured] = dataclasses.field(default_factory=list)
  measured: dict[Any, Measured] = dataclasses.field(default_factory=dict)

  def peak(self, key, loss: Callable[..., Any], what: str, variance: float | None = None) -> int:
    if key not in self.peaks:
      cost = step_cost(loss, self.args, self.argnums, self.target)
      self.peaks[key] = cost.peak
      self.measured[key] = Measured(what, cost.peak, cost.predicted_seconds, variance)
      self.history.append(self.measured[key])
    return self.peaks[key]

  def set_variance(self, key, variance: float) -> None:
    """Records a compiled configuration's predicted variance (known after the survey)."""
    old = self.measured[key]
    self.measured[key] = dataclasses.replace(old, variance=variance)
    self.history[self.history.index(old)] = self.measured[key]

  def __len__(self) -> int:
    return len(self.peaks)


class Verifier:
  """Proposes, compiles and ranks candidates for one budget.

  Args:
    loss_fn: the loss as written.
    compiles: the search's compile record.
    table: every residual fit may give a width (`Residual`).
    inner: per segment, the residuals of its recomputation.
    order: the rematerializable segments, the order remat takes them in.
    widths: the widths residuals may get.
    budget: bytes.
  """

  def __init__(
    self,
    loss_fn: Callable[..., Any],
    compiles: Compiles,
    table: Sequence[Residual],
    inner: dict[str, list[str]],
    order: Sequence[str],
    widths: tuple,
    budget: int,
  ):
    self.loss_fn, self.compiles, self.table, self.inner = loss_fn, compiles, table, inner
    self.widths, self.budget = widths, budget
    self.full = {
      s: sum(r.size * r.itemsize for r in table if r.segment == s and not r.remat_input)
      for s in order
    }
    self.order = sorted(order, key=lambda s: (-self.full[s], list(order).index(s)))
    self.all_remat = Layout(frozenset(order))
    self.points: dict[Layout, dict[int, int]] = {}  # per layout: stored bytes -> compiled peak
    self.at_point: dict[tuple[Layout, int], Candidate] = {}  # the candidate compiled at each
    self.candidates: dict[Any, Candidate] = {}  # every compiled candidate, by candidate_key

  def run(self, c: Candidate) -> int:
    """Compiles `c` (once) and records its point; its compiled peak."""
    loss = configure(self.loss_fn, c.layout, plan_of(c), strict=True)
    peak = self.compiles.peak(candidate_key(c), loss, c.describe(), c.variance)
    self.points.setdefault(c.layout, {})[c.stored] = peak
    self.at_point.setdefault((c.layout, c.stored), c)
    self.candidates.setdefault(candidate_key(c), c)
    return peak

  def peak_of(self, c: Candidate) -> int | None:
    return self.compiles.peaks.get(candidate_key(c))

  def calibrate(self) -> None:
    """Compiles both extreme layouts with every residual at `SEGMENT_BITS`."""
    for layout in dict.fromkeys((Layout(), self.all_remat)):
      self.run(allocate(self.table, self.inner, layout, float("inf"), (SEGMENT_BITS,)))

  def _offset(self, layout: Layout) -> float:
    """peak - stored, interpolated between the two calibrated layouts by rematerialized
    bytes."""
    of = lambda lay: min(p - s for s, p in self.points[lay].items())
    share = sum(self.full[s] for s in layout.remat) / (sum(self.full.values()) or 1)
    return of(Layout()) + share * (of(self.all_remat) - of(Layout()))

  def propose(self, layout: Layout) -> Candidate | None:
    """The layout's least-variance candidate predicted to fit: the stored-bytes target
    where the line through its measured points meets the budget, kept between the
    largest stored that fitted and the smallest that did not."""
    budget = self.budget
    own = sorted(self.points.get(layout, {}).items())
    fit_s = max((s for s, p in own if p <= budget), default=None)
    fail_s = min((s for s, p in own if p > budget), default=None)
    if not own:
      goal = budget - self._offset(layout)
    else:
      below = [sp for sp in own if sp[1] <= budget][-1:]
      above = [sp for sp in own if sp[1] > budget][:1]
      pair = below + above if below and above else own[-2:] if len(own) > 1 else own
      (s0, p0), (s1, p1) = pair[0], pair[-1]
      slope = (p1 - p0) / (s1 - s0) if s1 != s0 and p1 != p0 else 1.0
      goal = s0 + (budget - p0) / max(slope, 0.05)
    if fail_s is not None:
      goal = min(goal, fail_s - 1)
      if fit_s is not None:  # bracketed: never closer to the failing end than a bisection
        goal = min(goal, (fit_s + fail_s) / 2)
    if fit_s is not None and goal <= fit_s * 1.02 + 1:
      return self.at_point[(layout, fit_s)]
    return allocate(self.table, self.inner, layout, goal, self.widths)

  def best(self, written: int, written_variance: float, max_candidates: int):
    """The chosen configuration: `WRITTEN`, a verified `Candidate`, or None (nothing
    verified fits). Compiles at most `max_candidates` candidates, least predicted
    variance (then recompute) first, re-proposing a layout after each of its compiles."""
    pool = {layout: self.propose(layout) for layout in layouts(self.order)}
    for verified in range(max_candidates + 1):
      ranked = sorted(
        ((c.variance, c.recompute, len(c.layout.remat)), i, c)
        for i, c in enumerate(pool.values())
        if c is not None
      )
      if written <= self.budget and (not ranked or written_variance <= ranked[0][0][0]):
        return WRITTEN  # fits as written, and nothing predicted has less variance
      if not ranked:
        break
      c = ranked[0][2]
      peak = self.peak_of(c)
      if peak is not None and peak <= self.budget:
        return c  # verified, and nothing predicted to fit has less variance
      if verified == max_candidates:
        break
      self.run(c)
      pool[c.layout] = self.propose(c.layout)
    fits = [c for c in self.at_point.values() if self.peak_of(c) <= self.budget]
    return min(fits, key=lambda c: (c.variance, c.recompute), default=None)

  def smallest(self) -> Candidate:
    """Every rematerializable segment rematerialized, every residual at the lowest width."""
    lowest = (min(w for w in self.widths if w is not None),)
    return allocate(self.table, self.inner, self.all_remat, float("inf"), lowest)
