"""The search for the largest batch that fits: doubling, then bisection (`largest_batch`), or
multiples of a granularity against a cap (`search_batch`, checked by `check_search`)."""

from __future__ import annotations

import math
from typing import Callable

__all__ = ["TOLERANCE", "check_search", "largest_batch", "search_batch"]

TOLERANCE = 0.05  # resolution of the largest-batch search


def largest_batch(fits, start: int, upper: int, tol: float = TOLERANCE, need=None) -> int:
  """Largest batch b <= upper with fits(b) (0 if none), assuming fits is monotone.

  Powers of two from the largest one <= start (up, or down when it does not
  fit), then bisection until the bracket is within `tol`; with `need(b)` ->
  (bytes, limit) the split point is the linear interpolation of the compiled
  sizes (memory is nearly affine in the batch), kept inside the bracket.

  >>> need = lambda b: (3 * b + 10, 1000)     # exact fit: b = 330
  >>> fits = lambda b: need(b)[0] <= 1000
  >>> largest_batch(fits, start=64, upper=4096), largest_batch(fits, 64, 4096, need=need)
  (320, 330)
  >>> largest_batch(lambda b: True, 64, 100), largest_batch(lambda b: False, 64, 100)
  (100, 0)
  """
  b = 2 ** int(math.log2(max(1, min(start, upper))))
  if fits(b):
    lo = b
    while True:
      nxt = min(2 * lo, upper)
      if nxt == lo:
        return lo
      if not fits(nxt):
        hi = nxt
        break
      lo = nxt
  else:
    hi = b
    while True:
      b //= 2
      if b < 1:
        return 0
      if fits(b):
        lo = b
        break
      hi = b
  while hi - lo > max(1, tol * lo):
    margin = max(1, int(tol * lo / 2))
    mid = (lo + hi) // 2
    if need is not None:
      (n_lo, limit), (n_hi, _) = need(lo), need(hi)
      if math.isfinite(n_hi) and n_hi > n_lo:
        mid = lo + int((limit - n_lo) * (hi - lo) / (n_hi - n_lo))
    mid = min(max(mid, lo + margin), hi - margin)
    if fits(mid):
      lo = mid
    else:
      hi = mid
  return lo


def search_batch(
  probe: Callable[[int], dict],
  cap_mib: float,
  start: int,
  granularity: int,
  upper: int,
  measure: str = "step_mib",
) -> tuple[int, list[dict]]:
  """Largest multiple of `granularity` <= `upper` whose `probe(batch)[measure]`
  is within `cap_mib` (0 if none), and every probe made, by batch.

  Doubling from `start` (down when it does not fit), then bisection steered by
  linear interpolation of the measured memory
  (`experiments.lib.batch_search.largest_batch` on batch / granularity), until
  the answer fits and the answer + granularity does not. A probe without the
  measure (an error) does not fit.
  """
  probes: dict[int, dict] = {}

  def measured(units: int) -> dict:
    batch = units * granularity
    if batch not in probes:
      probes[batch] = probe(batch)
    return probes[batch]

  def need(units: int):
    mib = measured(units).get(measure)
    return (math.inf if mib is None else mib), cap_mib

  fits = lambda units: need(units)[0] <= cap_mib
  units = largest_batch(
    fits, max(1, start // granularity), max(1, upper // granularity), tol=0.0, need=need
  )
  return units * granularity, [probes[b] for b in sorted(probes)]


def check_search(
  best: int,
  probes: list[dict],
  cap_mib: float,
  granularity: int,
  upper: int,
  measure: str = "step_mib",
) -> dict:
  """Whether the answer is backed by the probes: it ran within the cap and the
  next multiple of the granularity did not (or is past `upper`), and the probes
  are monotone (every fitting batch below every failing one)."""
  fit = {p["batch"]: p.get(measure) is not None and p[measure] <= cap_mib for p in probes}
  above = best + granularity
  consistent = (best == 0 or fit.get(best, False)) and (above > upper or fit.get(above) is False)
  order = [fit[b] for b in sorted(fit)]
  monotone = order == sorted(order, reverse=True)
  return {"consistent": consistent, "monotone": monotone}


# ----------------------------------------------------------------------------- offload
