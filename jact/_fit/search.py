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
each compile measured (`verify`). At most `3 + max_candidates` compilations, +1 for the smallest
configuration when no candidate fitted (the answer if it fits, else the error's figure).
"""  # noqa: E501 (the docstring's formula)

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jact._engine import context as _context
from jact._gpu_target import gpu_target
from jact._core.allocate import variance_factor
from jact._fit.model import Residual
from jact._fit.result import Fit, FitError
from jact._fit import fastest as _fastest
from jact._fit.fastest import WHOLE_LOSS, try_policies, whole_loss_segment
from jact._fit.segments import JAX_POLICIES, Layout, discovering
from jact._fit.checks import (
  check_argnums,
  check_budget,
  check_calibration,
  check_key_parameter,
  check_sensitivity,
  check_sharded,
  leaves_finite,
)
from jact._fit.steps import configure, plan_of
from jact._fit.verify import WRITTEN, Compiles, Verifier, candidate_key
from jact._planning import sensitivity as _sensitivity
from jact._planning.plan import BitPlan

__all__ = ["fit"]

_WIDTHS = (1, 2, 4, 8, None)


def _discover(loss_fn, args, layout: Layout):
  """The sites and segments (`_Discovery`) of one layout's trace."""
  with _context.recording() as recorder, discovering() as found:
    loss = configure(loss_fn, layout, None)
    jax.eval_shape(lambda k, *a: jax.grad(loss)(*a, key=k), jax.random.key(0), *args)
  found.attribute(recorder.sites)
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


def _stable_widths(loss_fn, args, layout, sites, widths) -> tuple:
  """`widths` without those that rename residuals. A residual's name is its position among
  a compressed region's saved values; inside a converted model's generic engine, an inner
  layer's residual kept uncompressed is one saved value where a compressed one is several,
  so the positions after it move and a plan's later entries would miss. Every compressed
  width saves the same values (codes and group statistics), so one trace checks them all
  (the lowest) -- none when the survey's trace already compressed every residual -- and
  one checks None."""
  names = list(sites)
  compressed = [w for w in widths if w is not None]
  all_compressed = all(isinstance(site.bits, int) for site in sites.values())
  if not all_compressed and not _names_hold(loss_fn, args, layout, names, min(compressed)):
    raise ValueError(
      "jact.fit: this loss renames its residuals whenever their widths change, so no plan "
      "can address them; give its blocks names of their own (jact.segment, jact.compressed)"
    )
  if None in widths and not _names_hold(loss_fn, args, layout, names, None):
    return tuple(compressed)
  return widths


@dataclasses.dataclass(frozen=True)
class _Survey:
  """The loss's residuals and segments, from two traces: every segment compressed
  (`sites0`, `found0`) and every rematerializable one rematerialized (`sites1`, `found1`)."""

  sites0: dict
  found0: Any
  sites1: dict
  found1: Any
  order: tuple[str, ...]  # the rematerializable segments, in trace order

  @classmethod
  def of(cls, loss_fn, args) -> "_Survey":
    sites0, found0 = _discover(loss_fn, args, Layout())
    order = tuple(s for s in found0.order if s in found0.rematerializable)
    sites1, found1 = _discover(loss_fn, args, Layout(frozenset(order))) if order else ({}, found0)
    return cls(sites0, found0, sites1, found1, order)

  @property
  def all_remat(self) -> Layout:
    return Layout(frozenset(self.order))

  def compresses_outside_segments(self) -> bool:
    """Whether the loss as written compresses some residual itself (outside segments)."""
    members = {n for names in self.found0.members.values() for n in names}
    return any(isinstance(s.bits, int) for n, s in self.sites0.items() if n not in members)

  def remat_inputs(self) -> list[str]:
    """The rematerialized segments' compressed inputs (not their recomputation's residuals)."""
    return [
      n
      for s in self.order
      for n in self.found1.members[s]
      if n.startswith(f"{s}.remat.") and not n.startswith(f"{s}.remat.body.")
    ]


def _checked(budget_bytes, widths, max_candidates) -> tuple:
  """`widths` deduplicated, after checking the arguments."""
  check_budget(budget_bytes)
  try:
    widths = tuple(dict.fromkeys(widths))
  except TypeError:
    raise TypeError(
      f"widths must be a sequence of widths (some of {_WIDTHS}, None: uncompressed), got "
      f"{widths!r}: e.g. widths=(2, 4, 8)"
    ) from None
  bad = [w for w in widths if w not in _WIDTHS or isinstance(w, bool)]
  if bad or not any(w is not None for w in widths):
    raise ValueError(
      f"widths must be some of {_WIDTHS} with a compressed one, got {widths!r}: "
      f"e.g. widths=(2, 4, 8)"
    )
  if isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 1:
    raise ValueError(f"max_candidates must be a positive int, got {max_candidates!r}")
  return widths


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


def _calibration_sites(loss_fn, layout: Layout, calib, names) -> None:
  """Checks that every residual of `names` is compressed when the loss runs on the
  calibration arguments (segments compress residuals of any size there): a residual that
  is not has no estimate, and its sensitivity must be given."""
  sites, _ = _discover(loss_fn, calib, layout)
  missing = [n for n in names if n not in sites]
  if missing:
    raise ValueError(
      f"jact.fit: residuals {missing[:4]}{' ...' if len(missing) > 4 else ''} are not "
      f"compressed when the loss runs on the calibration arguments (they are outside "
      f"jact.segment blocks and below their layer's size threshold at that batch), so their "
      f"sensitivities cannot be measured there: give a larger calibration batch, or their "
      f"values in sensitivity="
    )


def _sensitivities(loss_fn, survey, sens, calibration, example_args, argnums, seed) -> dict:
  """c_l per residual: `sens` (given), the others estimated on the calibration arrays when
  there are some (missing ones are later taken as sizes). Residuals are matched by name: on
  a calibration batch of another size, segments compress every residual whatever its size
  (`Layout.every_residual`), so each residual of the example step is measured."""
  sens = dict(sens)
  calib = example_args if calibration is None else calibration
  if not all(_is_array(x) for x in jax.tree.leaves(calib)):
    return sens
  if not leaves_finite(calib):
    raise ValueError(
      "jact.fit: the arrays the sensitivities are measured on (calibration=, else the example "
      "arguments) hold NaN or inf: give a finite calibration batch"
    )
  key = jax.random.key(seed)
  every = calibration is not None  # another batch: sizes change, names do not
  unknown = lambda names: [n for n in names if not np.isfinite(sens.get(n, np.nan))]
  for layout, sites, names in (
    (Layout(), survey.sites0, list(survey.sites0)),
    (survey.all_remat, survey.sites1, survey.remat_inputs()),
  ):
    if not (missing := unknown(names)):
      continue
    layout = dataclasses.replace(layout, every_residual=every)
    if every:
      _calibration_sites(loss_fn, layout, calib, missing)
    sens.update(_estimate(loss_fn, layout, missing, sites, calib, argnums, key))
  return sens


def _table(survey: _Survey, sensitivities) -> tuple[list, dict]:
  """Residual rows (segment members of both layouts, outside ones once) and, per segment,
  the names recorded in its recomputation (stored for its own backward only)."""
  owner0 = {n: s for s, ns in survey.found0.members.items() for n in ns}
  members1 = survey.found1.members
  rows = []

  def row(site, segment, remat_input):
    c = sensitivities.get(site.name)
    c = float(site.size) if c is None or not np.isfinite(c) else c
    return Residual(
      site.name, site.size, np.dtype(site.dtype).itemsize, segment, remat_input, float(c)
    )

  for name, site in survey.sites0.items():
    rows.append(row(site, owner0.get(name), False))
  inner = {}
  for s in survey.order:
    prefix = f"{s}.remat."
    inputs = [n for n in members1.get(s, []) if n.startswith(prefix)]
    inner[s] = [n for n in members1.get(s, []) if not n.startswith(prefix)]
    rows += [row(survey.sites1[n], s, True) for n in inputs]
  return rows, inner


def _result(
  loss_fn, budget, written, compiles, started, spec, chosen, order, variance=0.0, bound=None
) -> Fit:
  """The `Fit` of `chosen`: a candidate, a JAX policy's key, or None / "as written" (the
  step as written, of predicted `variance`)."""
  policy = None
  if chosen is None or chosen == "as written":
    loss, plan, peak, remat, recompute = configure(loss_fn, None, None), BitPlan({}), written, (), 0
    key = "as written"
  elif isinstance(chosen, tuple) and chosen[0] == "policy":
    policy, key = chosen[1], chosen
    loss = configure(loss_fn, Layout(policy=policy), None)
    plan, peak, remat, recompute, variance = BitPlan({}), compiles.peaks[key], (), 0, 0.0
  else:
    key = candidate_key(chosen)
    plan = plan_of(chosen)
    loss = configure(loss_fn, chosen.layout, plan)
    peak, variance, recompute = (
      compiles.peaks[candidate_key(chosen)],
      chosen.variance,
      chosen.recompute,
    )
    remat = tuple(s for s in order if s in chosen.layout.remat)
  return Fit(
    loss_fn=loss,
    plan=plan,
    remat=remat,
    peak_bytes=peak,
    budget_bytes=int(budget),
    written_peak_bytes=written,
    predicted_variance=float(variance),
    recompute_values=recompute,
    compilations=len(compiles),
    search_seconds=time.perf_counter() - started,
    segments=tuple(order),
    history=tuple(compiles.history),
    target=None if spec is None else spec.name,
    policy=policy,
    predicted_seconds=compiles.measured[key].predicted_seconds,
    variance_bound=bound,
  )


def _checked_policies(policies) -> tuple[str, ...]:
  policies = tuple(policies)
  unknown = [p for p in policies if p not in JAX_POLICIES]
  if unknown:
    raise ValueError(f"unknown JAX policies {unknown}; known: {sorted(JAX_POLICIES)}")
  return policies


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
  target: str | Any = None,
  variance_bound: float | None = None,
  policies: Sequence[str] = tuple(JAX_POLICIES),
) -> Fit:
  """Configures `loss_fn`'s training step to fit `budget_bytes`.

  Chooses bits per residual (a `BitPlan`) and which `jact.segment` blocks to
  rematerialize (compressed remat) such that the compiled peak of
  `jax.grad(loss_fn, argnums)` -- XLA's memory analysis: arguments, outputs
  and temporaries -- is at most `budget_bytes`; among those, the one with the
  least predicted gradient variance, then the least recomputation.

  With `target="h200"` (or "h100", a `jact.GpuTarget`) every configuration is
  compiled by XLA:GPU for that GPU, on any machine, and JAX's own
  `jax.checkpoint` policies per segment (`policies`) join the candidates; the
  answer is then the configuration with the least step time *predicted* from
  the compiled program (a roofline; `Fit.predicted_seconds`) whose peak fits
  and whose predicted gradient variance is at most `variance_bound` (default:
  every residual at 4 bits). A loss with no `jact.segment` and no compressed
  residual is taken as one segment (the whole loss captured and compressed).

  Args:
    loss_fn: `loss_fn(*args) -> scalar`, plain JAX, jact ops, a converted Flax
      model and/or `jact.segment` blocks (the parts that may be rematerialized).
    *example_args: arrays or `jax.ShapeDtypeStruct` values (with a `sharding` for a
      per-device budget under a mesh); only their shapes are compiled.
    budget_bytes: the memory the step may take (per device), an int number of bytes
      (a string such as "2GiB" is refused: write `2 * 2**30`).
    argnums: the arguments differentiated (the parameters).
    calibration: real arguments (a smaller batch is fine) on which the
      sensitivities are estimated; default: `example_args` when they are all
      arrays. Without either, or `sensitivity`, a residual's sensitivity is
      taken as its number of values.
    sensitivity: residual name -> c_l, or a `jact.sensitivity.SensitivityState`
      (a `jact.Controller` state's `estimates`); names it lacks, or gives NaN,
      are estimated as above (NaN needs arrays to estimate on); negative or
      infinite values are an error.
    widths: the widths residuals may get (None: uncompressed).
    max_candidates: at most this many configurations are compiled to verify
      (besides the three calibration compiles).
    seed: the estimator's rounding seed (the search is deterministic).
    target: None (this machine's compiler, least variance), or the GPU to fit
      the step for (fastest predicted step within `variance_bound`).
    variance_bound: with a target, the largest predicted gradient variance
      allowed (default: the uniform 4-bit configuration's).
    policies: with a target, JAX's policies tried on every segment (names of
      `JAX_POLICIES`: "nothing_saveable", "dots_saveable",
      "dots_with_no_batch_dims_saveable", "offload_inputs").

  Returns:
    A `Fit`: `.loss_fn(*args, key=...)` (the configured loss), `.peak_bytes`,
    `.plan`, `.remat`, `.report()`.

  Raises:
    FitError: no configuration fits (it gives the smallest compiled peak found).
  """
  started = time.perf_counter()
  argnums = check_argnums(argnums, len(example_args))
  widths = _checked(budget_bytes, widths, max_candidates)
  policies = _checked_policies(policies)
  check_key_parameter(loss_fn, len(example_args))
  check_sharded(example_args)
  calibration = check_calibration(calibration, example_args)
  estimable = all(
    _is_array(x) for x in jax.tree.leaves(example_args if calibration is None else calibration)
  )
  sensitivity = check_sensitivity(sensitivity, estimable)
  spec = None if target is None else gpu_target(target)
  compiles = Compiles(example_args, argnums, spec)
  written = compiles.peak("as written", configure(loss_fn, None, None), "the step as written", 0.0)
  survey = _Survey.of(loss_fn, example_args)
  if not survey.found0.order and not survey.sites0:  # unmarked: the whole loss, one segment
    loss_fn = whole_loss_segment(loss_fn)
    survey = _Survey.of(loss_fn, example_args)
  result = functools.partial(_result, loss_fn, budget_bytes, written, compiles, started, spec)

  if written <= budget_bytes and not survey.compresses_outside_segments():
    return result(None, survey.order)  # fits as written, compressing nothing: least variance
  if spec is not None and survey.found0.order not in ([], [WHOLE_LOSS]):
    try_policies(compiles, loss_fn, policies, spec.host_memory)
  widths = _stable_widths(loss_fn, example_args, Layout(), survey.sites0, widths)
  if survey.order:
    widths = _stable_widths(loss_fn, example_args, survey.all_remat, survey.sites1, widths)
  sens = _sensitivities(loss_fn, survey, sensitivity, calibration, example_args, argnums, seed)
  table, inner = _table(survey, sens)
  verifier = Verifier(loss_fn, compiles, table, inner, survey.order, widths, budget_bytes)
  verifier.calibrate()
  written_variance = sum(
    r.sensitivity * variance_factor(survey.sites0[r.name].bits)
    for r in table
    if r.segment is None and isinstance(survey.sites0[r.name].bits, int)
  )
  chosen = verifier.best(written, written_variance, max_candidates)
  if spec is not None:
    limit = _fastest.bound(table, widths) if variance_bound is None else float(variance_bound)
    compiles.set_variance("as written", written_variance)
    key = _fastest.fastest(compiles, budget_bytes, limit)
    if key is not None:
      chosen = verifier.candidates.get(key, key)
      return result(chosen, verifier.order, variance=written_variance, bound=limit)
    result = functools.partial(result, bound=limit)  # none within the bound: least variance
  if chosen is None:  # the smallest configuration: it fits (then it is the answer) or nothing does
    smallest = verifier.smallest()
    if verifier.run(smallest) > budget_bytes:
      least = min(compiles.history, key=lambda m: m.peak_bytes)  # the step as written included
      raise FitError(
        budget_bytes,
        written,
        least.peak_bytes,
        least.what,
        len(survey.order),
        len(compiles),
        time.perf_counter() - started,
      )
    chosen = smallest
  if chosen is WRITTEN:
    return result(None, verifier.order, variance=written_variance)
  return result(chosen, verifier.order)
