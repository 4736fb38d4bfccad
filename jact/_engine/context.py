"""Trace-time contexts read by every compression site.

The active bit plan, a residual recorder, the per-residual salt of the
rounding seeds (GACT Algorithm 1), a layer-statistics collector and the
batch's mesh axes reach the compression sites of ops and `jact.compressed`
without changing their signatures. Each is one `contextvars.ContextVar`, set
on entering a block and reset on leaving it. Why five variables and how
they nest: docs/design.md, "Trace-time contexts".
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import warnings
from typing import Any, Iterator

import jax
import jax.numpy as jnp

# The plan channel holds a tuple of enclosing PlanScopes (innermost last); the
# others hold their innermost value. Values are never mutated in place.
_CHANNELS: dict[str, contextvars.ContextVar] = {
  "plan": contextvars.ContextVar("jact_plan_scopes", default=()),
  "recorder": contextvars.ContextVar("jact_recorder", default=None),
  "salt": contextvars.ContextVar("jact_salt", default=None),
  "stats": contextvars.ContextVar("jact_stats", default=None),
  "batch": contextvars.ContextVar("jact_batch_sharding", default=None),
}


@contextlib.contextmanager
def _set(kind: str, value) -> Iterator[None]:
  """Sets channel `kind` to `value` inside the block; the token restores the
  value the block found, however the block is left."""
  token = _CHANNELS[kind].set(value)
  try:
    yield
  finally:
    _CHANNELS[kind].reset(token)


@contextlib.contextmanager
def _pushed(kind: str, value) -> Iterator[Any]:
  if kind == "plan":
    with _set(kind, _CHANNELS[kind].get() + (value,)):
      yield value
  else:
    with _set(kind, value):
      yield value


def current(kind: str):
  """The innermost active value of `kind`, or None.

  `kind` is one of 'plan', 'recorder', 'salt', 'stats', 'batch'."""
  if kind not in _CHANNELS:
    raise ValueError(f"jact: unknown context channel {kind!r}; one of {sorted(_CHANNELS)}")
  value = _CHANNELS[kind].get()
  if kind == "plan":
    return value[-1] if value else None
  return value


# ----------------------------------------------------------------------------- plan


class UnknownResidualWarning(UserWarning):
  """A plan or `overrides` entry names a residual that was not traced."""


@dataclasses.dataclass
class PlanScope:
  """One `use_plan` block: its plan, whether unknown names are errors, and
  the residual names traced while it was entered."""

  plan: Any
  strict: bool = False
  traced: set = dataclasses.field(default_factory=set)


@contextlib.contextmanager
def plan_scope(plan, strict: bool = False) -> Iterator[PlanScope]:
  """Applies `plan` inside the block; on a normal exit, checks that every
  name the plan gives an entry or a budget was traced inside it."""
  with _pushed("plan", PlanScope(plan, strict)) as scope:
    yield scope
  if plan is not None:
    names = {n for n, _ in plan.entries} | {n for n, _ in plan.budgets}
    # stacklevel 6: the caller's `with use_plan(...)` line (or `planned`'s wrapper).
    check_traced(
      names,
      scope.traced,
      strict=strict,
      stacklevel=6,
      what="the plan of a jact.use_plan / jact.planned block",
      fix="Fix the names (jact.residual_report lists a function's residuals). A function "
      "jitted on its own inside the block is not re-traced when jit's cache hits: jit "
      "the outer step only."
      + (
        ""
        if strict
        else " use_plan(..., strict=True) / planned(..., strict=True) make this an error."
      ),
    )


def _active_plan():
  scope = current("plan")
  return None if scope is None else scope.plan


def strict_plan() -> bool:
  """Whether the innermost plan block was entered with strict=True."""
  scope = current("plan")
  return scope is not None and scope.strict


def note_residual(name: str) -> None:
  """Marks residual `name` as traced for every enclosing plan block."""
  for scope in _CHANNELS["plan"].get():
    scope.traced.add(name)


def check_traced(names, traced, *, strict: bool, what: str, fix: str, stacklevel: int = 2) -> None:
  """Warns (strict: raises ValueError) when `names` has names not in `traced`,
  listing each with the closest traced names."""
  unknown = sorted(set(names) - set(traced))
  if not unknown:
    return

  def closest(n):
    close = difflib.get_close_matches(n, sorted(traced), n=3, cutoff=0.6)
    return f"{n!r}" + (f" (closest: {', '.join(map(repr, close))})" if close else "")

  shown = sorted(traced)[:8]
  known = (
    ", ".join(map(repr, shown)) + (", ..." if len(traced) > len(shown) else "")
    if traced
    else "none"
  )
  message = (
    f"jact: {what} names residuals that were not traced, so their entries do "
    f"nothing: {', '.join(map(closest, unknown))}; traced: {known}. {fix}"
  )
  if strict:
    raise ValueError(message)
  warnings.warn(message, UnknownResidualWarning, stacklevel=stacklevel)


def planned_bits(name: str, compressor):
  """The active plan's entry for residual `name` (an int width, a compressor
  or None); `compressor` (the call site's) when the plan has none.

  Residuals the call site keeps uncompressed (compressor None) stay so: a plan
  changes widths, it does not add rounding noise where no key was asked for.
  """
  plan = _active_plan()
  if plan is None or compressor is None:
    return compressor
  return plan.bits_for(name, compressor)


def planned_budget(name: str):
  """The per-sample average-bit budget of `name` in the active plan, or None."""
  plan = _active_plan()
  return None if plan is None else plan.budget_for(name)


# ----------------------------------------------------------------------------- recorder


@dataclasses.dataclass(frozen=True)
class Site:
  """One compressed residual seen while tracing."""

  name: str
  shape: tuple[int, ...]
  dtype: Any
  bits: Any  # `jact._engine.rounding.site_width`: an int (PerGroup), a compressor, or None

  @property
  def size(self) -> int:
    n = 1
    for s in self.shape:
      n *= s
    return n


class Recorder:
  """Collects the compressed residuals of a trace, first occurrence per name."""

  def __init__(self):
    self.sites: dict[str, Site] = {}

  def add(self, name: str, x, bits) -> None:
    if name not in self.sites:
      self.sites[name] = Site(name, tuple(x.shape), jnp.dtype(x.dtype), bits)


def recording():
  return _pushed("recorder", Recorder())


def record(name: str | None, x, bits) -> None:
  recorder = current("recorder")
  if recorder is not None and name is not None:
    recorder.add(name, x, bits)


# ----------------------------------------------------------------------------- salt


@dataclasses.dataclass(frozen=True)
class Salt:
  """Per-name salts: `values[i]` is mixed into the seed of residual `names[i]`."""

  names: tuple[str, ...]
  values: jax.Array

  def index(self, name: str) -> int | None:
    try:
      return self.names.index(name)
    except ValueError:
      return None


def salted(names, values):
  return _pushed("salt", Salt(tuple(names), values))


# ----------------------------------------------------------------------------- statistics


def collecting(collector):
  return _pushed("stats", collector)
