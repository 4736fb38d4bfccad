"""`largest_batch`: the largest batch whose compiled step fits a budget."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from jact._fit.model import allocate
from jact._fit.result import Fit
from jact._fit.search import _Survey, _table, fit
from jact._fit.checks import batch_args, check_argnums, check_batch_bounds, check_budget
from jact._fit.steps import configure, plan_of, step_peak

__all__ = ["LargestBatch", "largest_batch"]


@dataclasses.dataclass(frozen=True)
class LargestBatch:
  """The answer of `largest_batch`.

  Attributes:
    batch: the largest batch found to fit.
    peak_bytes: its compiled peak.
    failing_batch: the smallest batch found not to fit (the true maximum
      lies in `[batch, failing_batch)`), or None when `max_batch` fits.
    compilations: steps compiled by the search.
    fit: with `config="fit"`, `jact.fit`'s configuration at `batch`.
  """

  batch: int
  peak_bytes: int
  failing_batch: int | None
  compilations: int
  fit: Fit | None = None


def _smallest(loss_fn, args, widths):
  """The loss configured as small as fit can make it: every rematerializable segment
  rematerialized, every residual at the lowest width."""
  survey = _Survey.of(loss_fn, args)
  table, inner = _table(survey, {})
  lowest = (min(w for w in widths if w is not None),)
  c = allocate(table, inner, survey.all_remat, float("inf"), lowest)
  return configure(loss_fn, survey.all_remat, plan_of(c))


def largest_batch(
  loss_fn: Callable[..., Any],
  args_for_batch: Callable[[int], Sequence[Any]],
  budget_bytes: int,
  *,
  config: Fit | str | None = None,
  argnums: int | Sequence[int] = 0,
  start: int = 8,
  tolerance: float = 0.05,
  max_batch: int = 1 << 20,
  widths: Sequence[int | None] = (1, 2, 4, 8, None),
  **fit_options: Any,
) -> LargestBatch:
  """The largest batch whose step compiles to at most `budget_bytes` (within `tolerance`).

  Compiles the step at `start` and `2 * start`, extrapolates the peak
  (affine in the batch), then brackets the answer between a fitting and a
  failing batch and narrows it by secant steps and bisection until the
  failing batch is at most `(1 + tolerance)` times the fitting one: the
  result is within `tolerance` of the true maximum. About 4-8 compilations.

  Args:
    loss_fn: the loss, as for `jact.fit`.
    args_for_batch: `batch -> example arguments` (arrays or
      `jax.ShapeDtypeStruct` values: only shapes are compiled).
    budget_bytes: the memory the step may take (per device), an int number of bytes
      (a string such as "2GiB" is refused: write `2 * 2**30`).
    config: None (the loss as written), a `Fit` (its configuration: its plan
      and rematerialized segments, at any batch) or `"fit"`: any
      configuration `jact.fit` can reach -- the smallest one decides the
      batch, and `.fit` is `jact.fit`'s choice at that batch.
    argnums: the differentiated arguments.
    start: the first batch tried.
    tolerance: relative width of the final bracket.
    max_batch: the largest batch tried (the answer is at most this; `start` is
      lowered to it).
    widths: with `config="fit"`, the widths fit may use.
    **fit_options: with `config="fit"`, more keywords of `jact.fit` (e.g.
      `sensitivity=`, `calibration=`) for its choice at the batch found.
  """
  budget_bytes = check_budget(budget_bytes)
  check_batch_bounds(start, tolerance, max_batch)
  start = min(start, max_batch)
  argnums = check_argnums(argnums, len(batch_args(args_for_batch, start)))
  if config is None:
    loss = configure(loss_fn, None, None)
  elif isinstance(config, Fit):
    loss = config.loss_fn
  elif config == "fit":
    loss = _smallest(loss_fn, batch_args(args_for_batch, start), widths)
  else:
    raise ValueError(f"config must be None, a jact.Fit or 'fit', got {config!r}")
  peaks: dict[int, int] = {}

  def peak(b: int) -> int:
    if b not in peaks:
      peaks[b] = step_peak(loss, batch_args(args_for_batch, b), argnums)
    return peaks[b]

  def bracket():
    fits = [b for b, p in peaks.items() if p <= budget_bytes]
    fails = [b for b, p in peaks.items() if p > budget_bytes]
    return max(fits, default=None), min(fails, default=None)

  peak(start)
  if peaks[start] <= budget_bytes:
    peak(min(2 * start, max_batch))
  while True:
    lo, hi = bracket()
    if lo is None and hi == 1:
      raise ValueError(
        f"largest_batch: even batch 1 needs {peaks[1]} bytes, over the budget of {budget_bytes}"
      )
    if lo is not None and (
      hi is None
      and lo >= max_batch
      or hi is not None
      and (hi <= lo * (1 + tolerance) or hi == lo + 1)
    ):
      break
    if lo is None:  # even `start` is too big: halve
      peak(max(1, hi // 2))
      continue
    (b0, p0), (b1, p1) = (
      sorted(peaks.items())[-2:] if hi is None else ((lo, peaks[lo]), (hi, peaks[hi]))
    )
    slope = (p1 - p0) / (b1 - b0) if b1 != b0 and p1 > p0 else None
    predicted = lo * 2 if slope is None else int(b0 + (budget_bytes - p0) / slope)
    closing = max(lo + 1, int(lo * (1 + tolerance)))  # fails -> the bracket is narrow enough
    if hi is None:
      guess = min(max(predicted, closing), max_batch)
    else:
      guess = predicted if lo < predicted < hi else (lo + hi) // 2
      guess = min(max(guess, closing), hi - 1)
    peak(guess)
  lo, hi = bracket()
  chosen = None
  if config == "fit":
    chosen = fit(
      loss_fn,
      *batch_args(args_for_batch, lo),
      budget_bytes=budget_bytes,
      argnums=argnums,
      widths=widths,
      **fit_options,
    )
  return LargestBatch(lo, peaks[lo], hi, len(peaks), chosen)
