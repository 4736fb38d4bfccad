"""`Controller`: adaptive bit plans inside an ordinary training loop.

The controller lives at the loop level, next to the optimizer: the jitted
train step takes the plan as a static argument, and every `adapt_interval`
steps (after `warmup`) the controller runs its estimator, re-allocates the
bits under the average-bit budget, checks GACT's failure alert (compression
variance against the gradient's sampling variance) and hands back a new
plan -- one retrace when the plan changed, none when it did not.

    controller = jact.Controller(loss_fn, estimator="numeric", avg_bits=2.0)
    state = controller.init(params, batch, key)
    step = jax.jit(jact.planned(train_step), static_argnames="plan")
    for batch in data:
      params, opt_state = step(params, opt_state, batch, key, plan=state.plan)
      state = controller.update(state, params, batch, key)   # cheap unless due

`save`/`restore` write and read the controller state with orbax; a restored
controller continues with the same plan, estimates and schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any, Callable

import jax
import numpy as np

from jact._planning import acgc as _acgc
from jact._core import allocate
from jact._planning import sensitivity
from jact._planning.plan import BitPlan
from jact.compressors import PerGroup, PerSample

__all__ = ["Controller", "ControllerState", "CompressionVarianceWarning"]

_ESTIMATORS = ("numeric", "analytic", "acgc")


class CompressionVarianceWarning(UserWarning):
  """The predicted compression variance is a large fraction of the sampling variance."""


@dataclasses.dataclass(frozen=True)
class ControllerState:
  """Host-side controller state.

  Attributes:
    estimates: the estimator's state pytree (arrays).
    plan: the current `BitPlan`.
    step: number of `update` calls so far.
    report: the last adaptation's figures (step, average bits, predicted
      compression variance, sampling variance, their ratio).
  """

  estimates: Any
  plan: BitPlan
  step: int
  report: dict


def _check_allowed(allowed, avg_bits: float | None) -> tuple[int, ...]:
  """The allocator's widths, sorted: at least one compressed width, the
  narrowest within `avg_bits` (None: no budget)."""
  try:
    widths = allocate._check_allowed(allowed)  # pylint: disable=protected-access
  except ValueError:
    widths = ()
  if not any(b != allocate.UNCOMPRESSED for b in widths):
    raise ValueError(
      f"jact.Controller: allowed must list the widths the allocator may pick, at least one "
      f"of 1..8 or 16 (32: keep a residual uncompressed), got {allowed!r}; e.g. "
      "allowed=(1, 2, 4, 8)"
    )
  if avg_bits is not None and widths[0] > avg_bits:
    raise ValueError(
      f"jact.Controller: avg_bits={avg_bits} is below the narrowest allowed width "
      f"{widths[0]}, so no plan fits the budget: raise avg_bits or allow narrower widths"
    )
  return widths


@dataclasses.dataclass(frozen=True)
class Controller:
  """Runs a sensitivity estimator every `adapt_interval` steps and re-plans.

  Args:
    loss_fn: `loss_fn(params, batch, key) -> scalar` using jact compression.
    estimator: "numeric" (GACT Alg. 1), "analytic" (ActNN) or "acgc" (AC-GC
      error bounds; `avg_bits` is then not used, `error` is).
    avg_bits: average bits per value over the estimated residuals.
    allowed: widths the allocator may pick (32: keep uncompressed).
    adapt_interval: steps between estimations.
    warmup: steps before the first estimation (the initial plan is uniform).
    alert_fraction: warn when predicted compression variance exceeds this
      fraction of the sampling variance (GACT Sec. 4.2).
    per_sample: ActNN L3. Each re-plan solves ActNN's joint allocation
      (`jact.allocate.allocate_layers_and_samples`: one width from `allowed`
      per layer and sample, under `avg_bits`) on c[l, n] = c_l times sample
      n's share of layer l's per-sample sensitivity in the update's batch
      (`analytic`; even shares for `numeric`), and gives each residual the
      mean of its samples' widths as a per-sample entry: `PerSample(mean,
      widths=allowed)` with `compressor`'s group size and rounding, which
      splits it among the step's own samples (ActNN Sec. 4.3: per-layer
      allocation between steps, per-sample allocation inside). `allowed`
      must be widths from 1..8 (ActNN's are `jact.allocate.ACTNN_WIDTHS`).
    error: e^2 of AC-GC.
    compressor: for "acgc", the fixed-point compressor the widths are for
      (see `jact.acgc.error_bounded`); for `per_sample`, the per-group
      quantizer whose group size and rounding the per-sample entries take;
      None: jact's per-group quantizer (`PerGroup()`).
    scale_bound: for "acgc", also bound normalization scale gradients (not in
      AC-GC's Table 1; see `jact.acgc.error_bounded`).
    decay, chunk_size: estimator settings (see `jact.sensitivity`).
  """

  loss_fn: Callable[..., Any]
  estimator: str = "numeric"
  avg_bits: float = 2.0
  allowed: tuple[int, ...] = (1, 2, 4, 8)
  adapt_interval: int = 50
  warmup: int = 0
  alert_fraction: float = 0.5
  per_sample: bool = False
  error: float = 0.5
  compressor: Any = None
  scale_bound: bool = False
  decay: float = 0.9
  chunk_size: int | None = None

  def __post_init__(self):
    if not callable(self.loss_fn):
      raise TypeError(
        f"jact.Controller: loss_fn must be loss_fn(params, batch, key) -> "
        f"scalar, got {type(self.loss_fn).__name__} {self.loss_fn!r:.40}"
      )
    for field in ("avg_bits", "alert_fraction", "error"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(
          f"jact.Controller: {field} must be a number, got {type(value).__name__} {value!r}"
        )
    if not self.alert_fraction > 0:
      raise ValueError(
        f"jact.Controller: alert_fraction must be positive (the fraction of the "
        f"sampling variance above which to warn, e.g. 0.5), got "
        f"{self.alert_fraction!r}"
      )
    if self.estimator not in _ESTIMATORS:
      raise ValueError(f"estimator must be one of {_ESTIMATORS}, got {self.estimator!r}")
    if not isinstance(self.adapt_interval, int) or self.adapt_interval < 1:
      raise ValueError(
        f"jact.Controller: adapt_interval must be a positive int (steps "
        f"between estimations, e.g. 50), got {self.adapt_interval!r}"
      )
    if not isinstance(self.warmup, int) or self.warmup < 0:
      raise ValueError(f"warmup must be a non-negative int, got {self.warmup!r}")
    if not 1 <= self.avg_bits <= 32:
      raise ValueError(f"avg_bits must be in [1, 32], got {self.avg_bits!r}")
    budget = None if self.estimator == "acgc" else self.avg_bits  # acgc: widths from `error`
    object.__setattr__(self, "allowed", _check_allowed(self.allowed, budget))
    if self.per_sample and self.estimator != "acgc":
      if self.allowed[-1] > 8:
        raise ValueError(
          f"jact.Controller: per_sample=True gives each sample a width from 1..8 (PerSample "
          f"stores no wider and keeps no sample uncompressed), got allowed={self.allowed}; "
          f"e.g. allowed=jact.allocate.ACTNN_WIDTHS"
        )
      if self.compressor is not None and not isinstance(self.compressor, PerGroup):
        raise ValueError(
          f"jact.Controller: with per_sample=True, compressor gives the per-group quantizer's "
          f"group size and rounding for the per-sample entries; got {self.compressor!r}: pass "
          "a jact.compressors.PerGroup, or None for its defaults"
        )
    object.__setattr__(self, "_impl", self._make_estimator())
    per_sample = None
    if self.per_sample and self.estimator == "analytic":
      per_sample = sensitivity.analytic_per_sample(self.loss_fn)
    object.__setattr__(self, "_per_sample_sensitivity", per_sample)
    # compiled once per controller (run eagerly, the exact gradients cost hundreds of steps)
    object.__setattr__(
      self,
      "_sampling_variance",
      jax.jit(functools.partial(sensitivity.sampling_variance, self.loss_fn)),
    )

  def _make_estimator(self):
    if self.estimator == "numeric":
      return sensitivity.numeric(self.loss_fn, decay=self.decay, chunk_size=self.chunk_size)
    if self.estimator == "analytic":
      return sensitivity.analytic(self.loss_fn, decay=self.decay)
    return _acgc.error_bounded(
      self.loss_fn, error=self.error, compressor=self.compressor, scale_bound=self.scale_bound
    )

  # ------------------------------------------------------------------ loop

  def init(self, params, batch, key) -> ControllerState:
    """Finds the residuals; the first plan is uniform at the nearest allowed width."""
    estimates = self._impl.init(params, batch, key)
    sizes = dict(
      zip(
        estimates.names,
        getattr(estimates, "sizes", None) or self._sizes(params, batch, key, estimates.names),
      )
    )
    uniform = min(
      (b for b in self.allowed if b != allocate.UNCOMPRESSED),
      key=lambda b: (abs(b - self.avg_bits), b),
    )
    return ControllerState(estimates, BitPlan.uniform(sizes, uniform), 0, {})

  def _sizes(self, params, batch, key, names):
    sites = sensitivity.find_residuals(self.loss_fn, params, batch, key)
    return tuple(sites[n].size for n in names)

  def due(self, step: int) -> bool:
    """Whether `update` at this step count runs the estimator."""
    return step >= self.warmup and (step - self.warmup) % self.adapt_interval == 0

  def update(self, state: ControllerState, params, batch, key) -> ControllerState:
    """Counts a step; every `adapt_interval` steps estimates, re-plans and reports."""
    if not self.due(state.step):
      return dataclasses.replace(state, step=state.step + 1)
    k_est, k_var = jax.random.split(key)
    estimates = self._impl.update(state.estimates, params, batch, k_est)
    shares = self._sample_shares(params, batch, k_est) if self.per_sample else None
    plan = self._replan(estimates, state.plan, shares)
    report = {"step": state.step, "average_bits": plan.average_bits()}
    if self.estimator != "acgc":
      predicted = sensitivity.predicted_variance(estimates, plan)
      sampled = float(self._sampling_variance(params, batch, k_var))
      ratio = predicted / sampled if sampled > 0 else float("inf")
      report.update(predicted_variance=predicted, sampling_variance=sampled, ratio=ratio)
      if ratio > self.alert_fraction:
        warnings.warn(
          f"jact: predicted compression variance is {ratio:.2f}x the gradient's sampling "
          f"variance at step {state.step} (alert above {self.alert_fraction}): raise "
          "avg_bits, or check the learning rate",
          CompressionVarianceWarning,
          stacklevel=2,
        )
    return ControllerState(estimates, plan, state.step + 1, report)

  def _sample_shares(self, params, batch, key) -> tuple[int, dict]:
    """(N, {name: float64[N]}): each residual's per-sample share of its sensitivity in
    this batch (summing to 1); residuals left out get even shares."""
    leaves = jax.tree.leaves(batch)
    n = int(leaves[0].shape[0]) if leaves and np.ndim(leaves[0]) else 1
    if self._per_sample_sensitivity is None:
      return n, {}
    shares = {}
    for name, w in self._per_sample_sensitivity(params, batch, key).items():
      w = np.asarray(w, np.float64)
      total = w.sum()
      if w.shape == (n,) and np.isfinite(total) and total > 0 and (w >= 0).all():
        shares[name] = w / total
    return n, shares

  def _joint_plan(self, previous, names, followers, c, d, shares) -> BitPlan:
    """ActNN's joint layer x sample allocation; each layer's mean width becomes its
    per-sample entry (see `per_sample`)."""
    n, by_name = shares
    even = np.full(n, 1.0 / n)
    sensitivity_ln = np.stack([c_l * by_name.get(m, even) for c_l, m in zip(c, names)])
    bits = allocate.allocate_layers_and_samples(sensitivity_ln, d, self.avg_bits, self.allowed)
    base = self.compressor if self.compressor is not None else PerGroup()
    entries, budgets = {}, {}
    for m, row in zip(names, bits):
      avg = float(row.mean())
      entry = PerSample(avg, base.group_size, base.stochastic, widths=self.allowed)
      for k in (m, *followers[m]):
        entries[k], budgets[k] = entry, avg
    return previous.replace(entries, budgets=budgets)

  def _replan(self, estimates, previous: BitPlan, shares=None) -> BitPlan:
    sizes = dict(previous.sizes)
    if self.estimator == "acgc":
      return self._impl.plan(estimates).replace(sizes=sizes)
    c = np.asarray(estimates.sensitivity, np.float64)
    follows = dict(zip(estimates.names, estimates.follows or (None,) * len(c)))
    known = [i for i, v in enumerate(c) if np.isfinite(v)]
    if not known:
      return previous
    # A residual that follows another (ActNN: a normalization takes its producer's width) is
    # not allocated on its own; its values count in its leader's size and in the budget.
    estimated = {estimates.names[i] for i in known}
    names = [estimates.names[i] for i in known if follows[estimates.names[i]] not in estimated]
    followers = {n: sorted(m for m in estimated if follows[m] == n) for n in names}
    d = [sizes[n] + sum(sizes[m] for m in followers[n]) for n in names]
    budget = int(self.avg_bits * sum(d))
    index = {n: i for i, n in enumerate(estimates.names)}
    c_named = np.maximum([c[index[n]] for n in names], 0.0)
    if self.per_sample:
      return self._joint_plan(previous, names, followers, c_named, d, shares)
    bits = allocate.greedy_allocate(c_named, d, budget, self.allowed)
    chosen = dict(zip(names, bits))
    chosen.update({m: chosen[n] for n in names for m in followers[n]})
    return previous.replace(chosen)

  # ------------------------------------------------------------------ checkpoints

  def save(self, state: ControllerState, directory: str | os.PathLike) -> None:
    """Writes the controller state to `directory` (orbax; must not exist yet)."""
    ocp = _orbax()
    meta = {
      "plan": state.plan.to_dict(),
      "step": state.step,
      "report": state.report,
      "estimator": self.estimator,
      "names": list(state.estimates.names),
    }
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
      ckpt.save(
        os.fspath(os.path.abspath(directory)),
        args=ocp.args.Composite(
          estimates=ocp.args.StandardSave(state.estimates), meta=ocp.args.JsonSave(meta)
        ),
      )

  def restore(self, directory: str | os.PathLike, like: ControllerState) -> ControllerState:
    """Reads a state written by `save`; `like` (e.g. from `init`) gives its structure.

    The checkpoint's residual names and sizes must be those of `like` (the
    model being trained): sensitivities and plan entries belong to names.
    """
    if not isinstance(like, ControllerState):
      raise TypeError(
        f"jact.Controller.restore: like must be a ControllerState of the model being trained "
        f"(it gives the estimates' structure and the residual names), got "
        f"{type(like).__name__} {like!r:.60}; pass like=controller.init(params, batch, key)"
      )
    path = os.fspath(os.path.abspath(directory))
    meta = _read_meta(path)
    plan, saved_names = _check_meta(path, meta)
    if meta["estimator"] != self.estimator:
      raise ValueError(
        f"jact.Controller.restore: the checkpoint at {path} was written by a "
        f"{meta['estimator']!r} controller, this one uses {self.estimator!r}; "
        f"restore it with Controller(..., estimator={meta['estimator']!r})"
      )
    _check_same_residuals(path, saved_names, dict(plan.sizes), like)
    estimates = _read_estimates(path, like.estimates)
    return ControllerState(estimates, plan, meta["step"], dict(meta["report"]))


def _orbax():
  """orbax.checkpoint, imported on first save/restore: importing it takes seconds."""
  try:
    import orbax.checkpoint as ocp
  except ImportError as e:
    raise ImportError(
      "jact.Controller.save/restore write checkpoints with orbax-checkpoint, "
      f"which does not import here ({e}); install it with "
      "`pip install orbax-checkpoint` (a dependency of jact)"
    ) from e
  return ocp


_DAMAGED = (
  "it is missing pieces or was cut off while being written: restore an earlier "
  "checkpoint, or start again from Controller.init"
)


def _read_meta(path: str) -> dict:
  """The JSON part of a controller checkpoint (plan, step, report, estimator, names)."""
  ocp = _orbax()
  if not os.path.isdir(path):
    raise FileNotFoundError(
      f"jact.Controller.restore: no checkpoint at {path}; write one with "
      "Controller.save(state, directory)"
    )
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
      meta = ckpt.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as e:  # orbax raises many kinds for a damaged directory
    raise ValueError(
      f"jact.Controller.restore: cannot read the controller checkpoint at "
      f"{path} ({type(e).__name__}: {e}); {_DAMAGED}"
    ) from e
  if not isinstance(meta, dict) or not {"plan", "step", "report", "estimator"} <= set(meta):
    raise ValueError(
      f"jact.Controller.restore: {path} holds no controller state (fields "
      f"plan, step, report, estimator); {_DAMAGED}"
    )
  return meta


_EDITED = (
  "the checkpoint's metadata (meta/metadata) was edited or damaged: restore an "
  "unedited checkpoint, or start again from Controller.init"
)


def _check_meta(path: str, meta: dict) -> tuple[BitPlan, tuple[str, ...]]:
  """`(plan, names)` of a checkpoint's metadata, checked for consistency: a
  known estimator, a non-negative int step, a report dict, a valid plan and
  residual names that are the plan's."""

  def bad(what):
    return ValueError(f"jact.Controller.restore: {what} in the checkpoint at {path}; {_EDITED}")

  if meta["estimator"] not in _ESTIMATORS:
    raise bad(f"estimator={meta['estimator']!r} is none of {_ESTIMATORS}")
  step = meta["step"]
  if isinstance(step, bool) or not isinstance(step, int) or step < 0:
    raise bad(f"step={step!r} is not a non-negative int")
  if not isinstance(meta["report"], dict):
    raise bad(f"report={meta['report']!r:.60} is not a mapping")
  try:
    plan = BitPlan.from_dict(meta["plan"])
  except (TypeError, ValueError) as e:
    raise bad(f"the plan is not valid ({e})") from e
  names = meta.get("names")
  if names is None:  # checkpoints written before names were stored
    return plan, tuple(sorted(dict(plan.sizes)))
  if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
    raise bad(f"names={names!r:.60} is not a list of residual names")
  if set(names) != set(dict(plan.sizes)):
    raise bad(
      f"the residual names {sorted(names)} are not those of its plan {sorted(dict(plan.sizes))}"
    )
  return plan, tuple(names)


def _check_same_residuals(path: str, saved_names, saved_sizes: dict, like: ControllerState):
  """Raises unless the checkpoint's residual names (and sizes) are `like`'s."""
  names = tuple(like.estimates.names)
  if tuple(saved_names) != names:
    only_saved = sorted(set(saved_names) - set(names))
    only_model = sorted(set(names) - set(saved_names))
    raise ValueError(
      f"jact.Controller.restore: the checkpoint at {path} holds {len(saved_names)} residuals "
      f"whose names differ from the {len(names)} of this model (`like`): only in the "
      f"checkpoint: {only_saved}; only in the model: {only_model}. Estimates and plan "
      "entries belong to residual names: restore into a model with the same residual names "
      "(the `name=` of its jact ops), or start again from Controller.init"
    )
  sizes = dict(like.plan.sizes)
  changed = sorted(
    n for n in names if n in saved_sizes and n in sizes and saved_sizes[n] != sizes[n]
  )
  if changed:
    raise ValueError(
      f"jact.Controller.restore: residuals {changed} of the checkpoint at {path} have other "
      f"sizes than in this model ({[saved_sizes[n] for n in changed]} vs "
      f"{[sizes[n] for n in changed]} values): the plan's budget would be wrong; restore "
      "into the model the checkpoint was written for, or start again from Controller.init"
    )


def _read_estimates(path: str, like):
  """The estimator state of a controller checkpoint, structured like `like`."""
  ocp = _orbax()
  try:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckpt:
      return ckpt.restore(path, args=ocp.args.Composite(estimates=ocp.args.StandardRestore(like)))[
        "estimates"
      ]
  except Exception as e:  # orbax raises many kinds for a damaged directory
    raise ValueError(
      f"jact.Controller.restore: cannot read the estimates in the checkpoint "
      f"at {path} ({type(e).__name__}: {e}); {_DAMAGED}"
    ) from e
