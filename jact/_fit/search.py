"""`jact.fit`: the configuration of a training step that fits a memory budget.

The search, host side: (1) trace the loss twice -- every segment compressed,
every segment rematerialized -- to list the residuals and which segment each
belongs to; (2) estimate each residual's sensitivity (GACT's numeric
estimator on the calibration arguments, or sizes when there are none);
(3) compile the step as written and the two layouts at 4 bits to calibrate
`peak = base[layout] + stored bytes`; (4) for every layout "the first k
segments rematerialized" allocate widths under the budget (ActNN's greedy),
order the candidates by predicted variance, then recomputed values, and
compile them in that order until one fits, correcting a layout's base by what
each compile measured. At most `3 + max_candidates` compilations, +1 for the smallest
configuration when no candidate fitted (the answer if it fits, else the error's figure).
"""  # noqa: E501 (the docstring's formula)

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jact._engine import context as _context
from jact._core.allocate import variance_factor
from jact._fit.model import Candidate, Residual, allocate, layouts
from jact._fit.result import Fit, FitError, Measured
from jact._fit.segments import SEGMENT_BITS, Layout, discovering
from jact._fit.steps import argnums_tuple, configure, plan_of, step_peak
from jact._planning import sensitivity as _sensitivity
from jact._planning.plan import BitPlan

__all__ = ["fit"]

_WIDTHS = (1, 2, 4, 8, None)


def _discover(loss_fn, args, layout: Layout):
  """The sites and segments (`_Discovery`) of one layout's trace."""
  with _context.recording() as recorder, discovering() as found:
    loss = configure(loss_fn, layout, None)
    jax.eval_shape(lambda k, *a: jax.grad(loss)(*a, key=k), jax.random.key(0), *args)
  return dict(recorder.sites), found


def _names_hold(loss_fn, args, layout: Layout, names, width) -> bool:
  """Whether every residual of `names` keeps its name when all of them get `width`."""
  loss = configure(loss_fn, layout, BitPlan({n: width for n in names}), strict=True)
  try:
    jax.eval_shape(lambda k, *a: jax.grad(loss)(*a, key=k), jax.random.key(0), *args)
  except ValueError as e:
    if "not traced" in str(e) or "names residuals" in str(e):
      return False
    raise
  return True


def _stable_widths(loss_fn, args, layout, names, widths) -> tuple:
  """`widths` without those that rename residuals. A residual's name is its position among
  a compressed region's saved values; inside a converted model's generic engine, an inner
  layer's residual kept uncompressed is one saved value where a compressed one is several,
  so the positions after it move and a plan's later entries would miss."""
  kept = tuple(w for w in widths if _names_hold(loss_fn, args, layout, names, w))
  if not any(w is not None for w in kept):
    raise ValueError(
      "jact.fit: this loss renames its residuals whenever their widths change, so no plan "
      "can address them; give its blocks names of their own (jact.segment, jact.compressed)"
    )
  return kept


def _members(found) -> set[str]:
  return {n for names in found.members.values() for n in names}


def _as_written(loss_fn, budget_bytes, written, order, compilations, started, history) -> Fit:
  return Fit(
    loss_fn=configure(loss_fn, None, None),
    plan=BitPlan({}),
    remat=(),
    peak_bytes=written,
    budget_bytes=int(budget_bytes),
    written_peak_bytes=written,
    predicted_variance=0.0,
    recompute_values=0,
    compilations=compilations,
    search_seconds=time.perf_counter() - started,
    segments=tuple(order),
    history=tuple(history),
  )


def _key(c: Candidate):
  return (c.layout, c.widths, c.transient)


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def _estimate(loss_fn, layout, names, sites, args, argnums, key) -> dict[str, float]:
  """GACT's numeric sensitivity of `names` under `layout`, on real arguments."""
  loss = configure(loss_fn, layout, None)

  def as_three(params, rest, k):
    full = list(rest)
    for i, p in zip(argnums, params):
      full.insert(i, p)
    return loss(*full, key=k)

  params = tuple(args[i] for i in argnums)
  rest = tuple(a for i, a in enumerate(args) if i not in argnums)
  est = _sensitivity.numeric(as_three)
  state = _sensitivity._empty_state({n: sites[n] for n in names})
  state = est.update(state, params, rest, key)
  return dict(zip(state.names, np.asarray(state.sensitivity, np.float64).tolist()))


def _table(sites0, members0, sites1, members1, order, sensitivities) -> tuple[list, dict]:
  """Residual rows (segment members of both layouts, outside ones once) and, per segment,
  the names recorded in its recomputation (stored for its own backward only)."""
  owner0 = {n: s for s, ns in members0.items() for n in ns}
  rows = []

  def row(site, segment, remat_input):
    c = sensitivities.get(site.name)
    c = float(site.size) if c is None or not np.isfinite(c) else c
    return Residual(
      site.name, site.size, np.dtype(site.dtype).itemsize, segment, remat_input, float(c)
    )

  for name, site in sites0.items():
    rows.append(row(site, owner0.get(name), False))
  inner = {}
  for s in order:
    prefix = f"{s}.remat."
    inputs = [n for n in members1.get(s, []) if n.startswith(prefix)]
    inner[s] = [n for n in members1.get(s, []) if not n.startswith(prefix)]
    rows += [row(sites1[n], s, True) for n in inputs]
  return rows, inner


def fit(
  loss_fn: Callable[..., Any],
  *example_args: Any,
  budget_bytes: int,
  argnums: int | Sequence[int] = 0,
  calibration: Sequence[Any] | None = None,
  sensitivity: Mapping[str, float] | Any = None,
  widths: Sequence[int | None] = _WIDTHS,
  max_candidates: int = 6,
  seed: int = 0,
) -> Fit:
  """Configures `loss_fn`'s training step to fit `budget_bytes`.

  Chooses bits per residual (a `BitPlan`) and which `jact.segment` blocks to
  rematerialize (compressed remat) such that the compiled peak of
  `jax.grad(loss_fn, argnums)` -- XLA's memory analysis: arguments, outputs
  and temporaries -- is at most `budget_bytes`; among those, the one with the
  least predicted gradient variance, then the least recomputation.

  Args:
    loss_fn: `loss_fn(*args) -> scalar`, plain JAX, jact ops, a converted Flax
      model and/or `jact.segment` blocks (the parts that may be rematerialized).
    *example_args: arrays or `jax.ShapeDtypeStruct` values (with a `sharding` for a
      per-device budget under a mesh); only their shapes are compiled.
    budget_bytes: the memory the step may take (per device).
    argnums: the arguments differentiated (the parameters).
    calibration: real arguments (a smaller batch is fine) on which the
      sensitivities are estimated; default: `example_args` when they are all
      arrays. Without either, or `sensitivity`, a residual's sensitivity is
      taken as its number of values.
    sensitivity: residual name -> c_l, or a `jact.sensitivity.SensitivityState`
      (a `jact.Controller` state's `estimates`); names it lacks, or gives NaN,
      are estimated as above.
    widths: the widths residuals may get (None: uncompressed).
    max_candidates: at most this many configurations are compiled to verify
      (besides the three calibration compiles).
    seed: the estimator's rounding seed (the search is deterministic).

  Returns:
    A `Fit`: `.loss_fn(*args, key=...)` (the configured loss), `.peak_bytes`,
    `.plan`, `.remat`, `.report()`.

  Raises:
    FitError: no configuration fits (it gives the smallest compiled peak found).
  """
  started = time.perf_counter()
  argnums = argnums_tuple(argnums)
  if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
    raise TypeError(f"budget_bytes must be an int number of bytes, got {budget_bytes!r}")
  if budget_bytes <= 0:
    raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
  widths = tuple(dict.fromkeys(widths))
  bad = [w for w in widths if w not in _WIDTHS]
  if bad or not any(w is not None for w in widths):
    raise ValueError(f"widths must be some of {_WIDTHS} with a compressed one, got {widths!r}")
  if not isinstance(max_candidates, int) or max_candidates < 1:
    raise ValueError(f"max_candidates must be a positive int, got {max_candidates!r}")

  compiled: dict[Any, int] = {}
  history: list[Measured] = []

  def measure(key, loss, what) -> int:
    if key not in compiled:
      compiled[key] = step_peak(loss, example_args, argnums)
      history.append(Measured(what, compiled[key]))
    return compiled[key]

  written = measure("as written", configure(loss_fn, None, None), "the step as written")
  sites0, found = _discover(loss_fn, example_args, Layout())
  order = [s for s in found.order if s in found.rematerializable]
  all_remat = Layout(frozenset(order))
  sites1, found1 = _discover(loss_fn, example_args, all_remat) if order else ({}, found)

  if written <= budget_bytes and not any(
    isinstance(site.bits, int) for name, site in sites0.items() if name not in _members(found)
  ):  # fits as written, with nothing compressed: nothing can have less variance
    return _as_written(loss_fn, budget_bytes, written, order, len(compiled), started, history)
  widths = _stable_widths(loss_fn, example_args, Layout(), list(sites0), widths)
  if order:
    widths = _stable_widths(loss_fn, example_args, all_remat, list(sites1), widths)
  sens = dict(sensitivity.as_dict() if hasattr(sensitivity, "as_dict") else sensitivity or {})
  calib = example_args if calibration is None else tuple(calibration)
  if all(_is_array(x) for x in jax.tree.leaves(calib)):
    key = jax.random.key(seed)
    missing = [n for n in sites0 if not np.isfinite(sens.get(n, np.nan))]
    if missing:
      sens.update(_estimate(loss_fn, Layout(), missing, sites0, calib, argnums, key))
    inputs = [n for s in order for n in found1.members[s] if n.startswith(f"{s}.remat.")]
    inputs = [n for n in inputs if not n.startswith(f"{n.split('.remat.')[0]}.remat.body.")]
    if any(not np.isfinite(sens.get(n, np.nan)) for n in inputs):
      missing = [n for n in inputs if not np.isfinite(sens.get(n, np.nan))]
      sens.update(_estimate(loss_fn, all_remat, missing, sites1, calib, argnums, key))
  table, inner = _table(sites0, found.members, sites1, found1.members, order, sens)

  full = {
    s: sum(r.size * r.itemsize for r in table if r.segment == s and not r.remat_input)
    for s in order
  }
  order = sorted(order, key=lambda s: (-full[s], order.index(s)))
  points: dict[Layout, dict[int, int]] = {}  # per layout: stored bytes -> compiled peak
  at_point: dict[tuple[Layout, int], Candidate] = {}  # the candidate compiled at each point

  def run(c: Candidate) -> int:
    loss = configure(loss_fn, c.layout, plan_of(c), strict=True)
    peak = measure(_key(c), loss, c.describe())
    points.setdefault(c.layout, {})[c.stored] = peak
    at_point.setdefault((c.layout, c.stored), c)
    return peak

  for layout in dict.fromkeys((Layout(), all_remat)):  # calibration: every residual at 4 bits
    run(allocate(table, inner, layout, float("inf"), (SEGMENT_BITS,)))

  def offset(layout) -> float:  # peak - stored, interpolated between the measured layouts
    of = lambda lay: min(p - s for s, p in points[lay].items())
    share = sum(full[s] for s in layout.remat) / (sum(full.values()) or 1)
    return of(Layout()) + share * (of(all_remat) - of(Layout()))

  def propose(layout) -> Candidate | None:
    """The layout's least-variance candidate predicted to fit: the stored-bytes target
    where the line through its measured points meets the budget, kept between the
    largest stored that fitted and the smallest that did not."""
    own = sorted(points.get(layout, {}).items())
    fit_s = max((s for s, p in own if p <= budget_bytes), default=None)
    fail_s = min((s for s, p in own if p > budget_bytes), default=None)
    if not own:
      goal = budget_bytes - offset(layout)
    else:
      below = [sp for sp in own if sp[1] <= budget_bytes][-1:]
      above = [sp for sp in own if sp[1] > budget_bytes][:1]
      pair = below + above if below and above else own[-2:] if len(own) > 1 else own
      (s0, p0), (s1, p1) = pair[0], pair[-1]
      slope = (p1 - p0) / (s1 - s0) if s1 != s0 and p1 != p0 else 1.0
      goal = s0 + (budget_bytes - p0) / max(slope, 0.05)
    if fail_s is not None:
      goal = min(goal, fail_s - 1)
      if fit_s is not None:  # bracketed: never closer to the failing end than a bisection
        goal = min(goal, (fit_s + fail_s) / 2)
    if fit_s is not None and goal <= fit_s * 1.02 + 1:
      return at_point[(layout, fit_s)]
    return allocate(table, inner, layout, goal, widths)

  written_variance = sum(
    r.sensitivity * variance_factor(sites0[r.name].bits)
    for r in table
    if r.segment is None and isinstance(sites0[r.name].bits, int)
  )
  pool = {layout: propose(layout) for layout in layouts(order)}
  verified, chosen = 0, None
  while True:
    ranked = sorted(
      ((c.variance, c.recompute, len(c.layout.remat)), i, c)
      for i, c in enumerate(pool.values())
      if c is not None
    )
    if written <= budget_bytes and (not ranked or written_variance <= ranked[0][0][0]):
      chosen = "written"  # fits as written, and nothing predicted has less variance
      break
    if not ranked:
      break
    c = ranked[0][2]
    if _key(c) in compiled and compiled[_key(c)] <= budget_bytes:
      chosen = c  # verified, and nothing predicted to fit has less variance
      break
    if verified >= max_candidates:
      break
    verified += 1
    run(c)
    pool[c.layout] = propose(c.layout)
  if chosen is None:  # out of compilations: the best verified configuration, if any
    fits = [c for c in at_point.values() if compiled[_key(c)] <= budget_bytes]
    chosen = min(fits, key=lambda c: (c.variance, c.recompute), default=None)

  elapsed = lambda: time.perf_counter() - started
  if chosen is None:  # the smallest configuration: it fits (then it is the answer) or nothing does
    lowest = (min(w for w in widths if w is not None),)
    smallest = allocate(table, inner, all_remat, float("inf"), lowest)
    if run(smallest) <= budget_bytes:
      chosen = smallest
    else:
      raise FitError(
        budget_bytes,
        written,
        compiled[_key(smallest)],
        smallest.describe(),
        len(order),
        len(compiled),
        elapsed(),
      )
  if chosen == "written":
    loss, plan = configure(loss_fn, None, None), BitPlan({})
    peak, variance, remat, recompute = written, written_variance, (), 0
  else:
    plan = plan_of(chosen)
    loss = configure(loss_fn, chosen.layout, plan)
    peak = compiled[_key(chosen)]
    variance, recompute = chosen.variance, chosen.recompute
    remat = tuple(s for s in order if s in chosen.layout.remat)
  return Fit(
    loss_fn=loss,
    plan=plan,
    remat=remat,
    peak_bytes=peak,
    budget_bytes=int(budget_bytes),
    written_peak_bytes=written,
    predicted_variance=float(variance),
    recompute_values=recompute,
    compilations=len(compiled),
    search_seconds=elapsed(),
    segments=tuple(order),
    history=tuple(history),
  )
