"""`BitPlan`: which bit width each residual gets, as a static, hashable value.

A plan maps residual names (the names jact ops and `jact.compressed` give
their residuals, see `jact.residual_report`) to widths: 1 to 8 or 16, or None
(kept uncompressed; 32 is accepted as an alias), or a compressor from
`jact.compressors` (which replaces the call site's method; an integer entry
changes the width of the call site's method). Names not in the plan get
`default`, or -- with the default `"call"` -- the width their call site asked
for. A per-sample entry (`budgets`) gives a residual an average number of
bits that is split among the samples inside the step (ActNN L3).

Plans decide buffer shapes, so they are trace-time values: apply one inside
the traced function, with the plan a static argument of the jitted step, so
that a new plan means one retrace and an unchanged (equal) plan none:

>>> import jax, jax.numpy as jnp, jact
>>> def loss(w, x, key):
...   return jact.ops.dense(x, w, key=key, name="fc").sum()
>>> step = jax.jit(jact.planned(jax.grad(loss)), static_argnames="plan")
>>> plan = jact.BitPlan({"fc.lhs": 8})
>>> g = step(jnp.ones((256, 4)), jnp.ones((8, 256)), jax.random.key(0), plan=plan)
>>> plan == jact.BitPlan.from_json(plan.to_json()), hash(plan) == hash(jact.BitPlan({"fc.lhs": 8}))
(True, True)

Entering `use_plan` *outside* a jitted function has no effect on calls
that hit jit's cache: the plan must be part of what the step is traced with.
For the same reason, a function jitted on its own *inside* the step keeps the
plan of its first trace: jit the outer step only.

Plan entries naming no residual traced inside the block (typos) are
reported when it ends, with the closest traced names: a warning, or an
error under `use_plan(plan, strict=True)` / `planned(step, strict=True)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import math
import numbers
from typing import Any, Callable, Iterator, Mapping

from jact._engine import context as _context
from jact._engine.context import UnknownResidualWarning
from jact.compressors import Compressor, from_dict as compressor_from_dict
from jact._core.packing import check_bits

__all__ = ["BitPlan", "use_plan", "planned", "CALL_SITE", "UnknownResidualWarning"]

CALL_SITE = "call"
"""`BitPlan.default` value meaning: unlisted residuals keep their call site's width."""

_GROUP_STATS_BYTES = 4  # bf16 minimum + bf16 step per group


def _check_width(bits, what: str):
  if isinstance(bits, Compressor):
    return bits
  if isinstance(bits, Mapping) and "method" in bits:
    return compressor_from_dict(bits)
  if bits is None or (isinstance(bits, int) and not isinstance(bits, bool) and bits == 32):
    return None
  try:
    return check_bits(bits)
  except ValueError as e:
    raise ValueError(f"{what}: {e} (None or 32 keeps a residual uncompressed)") from None


def _check_size(d, name: str) -> int:
  """A residual's number of values: a positive integer (2.0 is accepted, 2.7 is not)."""
  integral = isinstance(d, numbers.Integral) or (isinstance(d, float) and d.is_integer())
  if isinstance(d, bool) or not integral or d <= 0:
    raise ValueError(
      f"jact.BitPlan: sizes[{name!r}] must be a positive integer number of "
      f"values, got {d!r}; give each residual's number of elements"
    )
  return int(d)


def _check_field(value, field: str) -> Mapping:
  if value is None or isinstance(value, Mapping):
    return value
  raise ValueError(
    f"jact.BitPlan: {field} must be a mapping from residual names, got "
    f"{type(value).__name__} {value!r}"
  )


def _check_budget(avg, name: str) -> float:
  if isinstance(avg, bool) or not isinstance(avg, (int, float)) or not 1 <= avg <= 8:
    raise ValueError(
      f"jact.BitPlan: per-sample budget of {name!r} must be a number of "
      f"average bits in [1, 8], got {avg!r}"
    )
  return float(avg)


@dataclasses.dataclass(frozen=True, init=False)
class BitPlan(Mapping):
  """Immutable, hashable residual name -> bit width mapping.

  Args:
    bits: mapping of residual names to widths 1 to 8 or 16, None (uncompressed) or a
      `jact.compressors.Compressor`.
    default: width of unlisted names, or `CALL_SITE` ("call") to keep the
      width each call site asked for.
    budgets: per-sample entries: name -> average bits per value; the step
      splits them among samples by per-sample sensitivity.
    sizes: values per residual (optional; for `summary`, `average_bits`).

  Equal plans are equal values with equal hashes, so a jitted step with the
  plan as a static argument is traced once per distinct plan.
  """

  entries: tuple[tuple[str, int | None], ...]
  default: int | None | str
  budgets: tuple[tuple[str, float], ...]
  sizes: tuple[tuple[str, int], ...]

  def __init__(
    self,
    bits: Mapping[str, int | None] | None = None,
    *,
    default=CALL_SITE,
    budgets: Mapping[str, float] | None = None,
    sizes: Mapping[str, int] | None = None,
  ):
    bits = dict(_check_field(bits, "bits") or {})
    for name in bits:
      if not isinstance(name, str) or not name:
        raise ValueError(f"jact.BitPlan: residual names must be non-empty strings, got {name!r}")
    entries = tuple(
      sorted((n, _check_width(b, f"jact.BitPlan: bits of {n!r}")) for n, b in bits.items())
    )
    if default != CALL_SITE:
      default = _check_width(default, "jact.BitPlan: default")
    budgets = tuple(
      sorted((n, _check_budget(a, n)) for n, a in (_check_field(budgets, "budgets") or {}).items())
    )
    sizes = tuple(
      sorted((n, _check_size(d, n)) for n, d in (_check_field(sizes, "sizes") or {}).items())
    )
    object.__setattr__(self, "entries", entries)
    object.__setattr__(self, "default", default)
    object.__setattr__(self, "budgets", budgets)
    object.__setattr__(self, "sizes", sizes)

  # Mapping protocol over the explicit entries.
  def __getitem__(self, name: str):
    return dict(self.entries)[name]

  def __iter__(self):
    return (n for n, _ in self.entries)

  def __len__(self):
    return len(self.entries)

  def __contains__(self, name):
    return any(n == name for n, _ in self.entries)

  def bits_for(self, name: str, call_bits=None):
    """The entry of residual `name` (an int width, a compressor or None);
    `call_bits` (its call site's compressor) when the default is `CALL_SITE`."""
    for n, b in self.entries:
      if n == name:
        return b
    return call_bits if self.default == CALL_SITE else self.default

  def budget_for(self, name: str) -> float | None:
    """The per-sample average-bit budget of `name`, or None."""
    return dict(self.budgets).get(name)

  def replace(self, bits: Mapping[str, int | None] | None = None, **changes) -> "BitPlan":
    """A copy with some entries changed (`bits` merged in) or other fields replaced."""
    merged = dict(self.entries)
    merged.update(bits or {})
    kwargs = dict(default=self.default, budgets=dict(self.budgets), sizes=dict(self.sizes))
    kwargs.update(changes)
    return BitPlan(merged, **kwargs)

  @classmethod
  def uniform(cls, sizes: Mapping[str, int], bits: int | None) -> "BitPlan":
    """Every named residual at the same width."""
    return cls({n: bits for n in sizes}, sizes=sizes)

  # ------------------------------------------------------------------ accounting

  def stored_bits(self, name: str, size: int | None = None, float_bits: int = 32) -> float:
    """Bits per value stored for `name` (uncompressed: `float_bits`)."""
    avg = self.budget_for(name)
    if avg is not None:
      return avg
    b = self.bits_for(name, None)
    if isinstance(b, Compressor):
      return b.average_bits
    return float(float_bits if b is None else b)

  def average_bits(self) -> float:
    """Size-weighted average bits per value over the plan's `sizes`."""
    sizes = dict(self.sizes)
    if not sizes:
      raise ValueError("average_bits needs the residual sizes: build the plan with sizes=...")
    total = sum(sizes.values())
    return sum(self.stored_bits(n) * d for n, d in sizes.items()) / total

  def nbytes(self, name: str, group_size: int = 256) -> int:
    """Stored bytes of residual `name` (codes plus bf16 group statistics; a
    compressor entry: its `average_bits`)."""
    d = dict(self.sizes).get(name)
    if d is None:
      raise ValueError(
        f"jact.BitPlan.nbytes: the plan has no size for residual {name!r}; "
        "build it with sizes={name: values, ...} (or plan.replace(sizes=...))"
      )
    if isinstance(self.bits_for(name, None), Compressor) and self.budget_for(name) is None:
      return math.ceil(d * self.stored_bits(name) / 8)
    bits = self.stored_bits(name)
    if bits == 32:
      return 4 * d
    return math.ceil(d * bits / 8) + _GROUP_STATS_BYTES * math.ceil(d / group_size)

  def summary(self, group_size: int = 256) -> str:
    """A readable table: bits and bytes per residual, average bits, total bytes."""
    names = sorted(set(dict(self.sizes)) | set(self) | set(dict(self.budgets)))
    sizes = dict(self.sizes)
    rows = [f"{'residual':<32} {'values':>10} {'bits':>6} {'bytes':>12}"]
    for n in names:
      d = sizes.get(n)
      b = self.budget_for(n)
      entry = self.bits_for(n, None)
      if isinstance(entry, Compressor):
        shown = f"{entry.method}:{entry.bits}"
      else:
        shown = f"~{b:g}" if b is not None else str(entry or 32)
      rows.append(
        f"{n:<32} {d if d else '?':>10} {shown:>6} {self.nbytes(n, group_size) if d else '?':>12}"
      )
    default = "call site" if self.default == CALL_SITE else (self.default or 32)
    rows.append(f"default: {default}")
    if sizes:
      total = sum(self.nbytes(n, group_size) for n in sizes)
      rows.append(f"average bits: {self.average_bits():.3f}   total bytes: {total}")
    return "\n".join(rows)

  def __repr__(self):
    return (
      f"BitPlan({dict(self.entries)!r}, default={self.default!r}"
      + (f", budgets={dict(self.budgets)!r}" if self.budgets else "")
      + ")"
    )

  # ------------------------------------------------------------------ JSON

  def to_dict(self) -> dict[str, Any]:
    def plain(b):
      return b.to_dict() if isinstance(b, Compressor) else b

    return {
      "bits": {n: plain(b) for n, b in self.entries},
      "default": plain(self.default),
      "budgets": dict(self.budgets),
      "sizes": dict(self.sizes),
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "BitPlan":
    if not isinstance(d, Mapping):
      raise ValueError(
        f"jact.BitPlan.from_dict / from_json expects an object with the fields "
        f"bits, default, budgets, sizes (as BitPlan.to_json writes it), got "
        f"{type(d).__name__} {d!r}"
      )
    unknown = set(d) - {"bits", "default", "budgets", "sizes"}
    if unknown:
      raise ValueError(
        f"jact.BitPlan: unknown fields {sorted(map(str, unknown))}; expected "
        "bits, default, budgets, sizes (as BitPlan.to_json writes them)"
      )
    return cls(
      d.get("bits"),
      default=d.get("default", CALL_SITE),
      budgets=d.get("budgets"),
      sizes=d.get("sizes"),
    )

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "BitPlan":
    try:
      d = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(
        f"jact.BitPlan.from_json: the text is not valid JSON ({e}); pass what BitPlan.to_json wrote"
      ) from e
    return cls.from_dict(d)


@contextlib.contextmanager
def use_plan(plan: BitPlan | None, *, strict: bool = False) -> Iterator[BitPlan | None]:
  """Applies `plan` to every compressed residual traced inside the block.

  Enter it inside the function being traced (see `planned`); None applies no
  plan. When the block ends, plan entries (or budgets) naming no residual
  traced inside it -- typos -- are reported with the closest traced names: an
  `UnknownResidualWarning`, or with `strict=True` a ValueError. `strict`
  also applies to the `overrides` of `jact.compressed` calls in the block.
  """
  if plan is not None and not isinstance(plan, BitPlan):
    raise TypeError(
      f"use_plan takes a jact.BitPlan (or None), got {type(plan).__name__}; "
      "build one with jact.BitPlan({name: bits, ...})"
    )
  if not isinstance(strict, bool):
    raise TypeError(f"jact.use_plan: strict must be True or False, got {strict!r}")
  with _context.plan_scope(plan, strict):
    yield plan


def planned(step: Callable[..., Any] | None = None, *, strict: bool = False) -> Callable[..., Any]:
  """`step` with an extra keyword argument `plan` applied while it runs.

  Jit it with `static_argnames="plan"`: equal plans reuse the compiled step,
  a changed plan retraces once. `strict=True`: plan entries naming no
  residual of the step raise instead of warning (see `use_plan`).
  """
  if step is None:
    return functools.partial(planned, strict=strict)
  if not callable(step):
    raise TypeError(
      f"jact.planned takes the training step function (then called with "
      f"plan=...), got {type(step).__name__} {step!r:.40}"
    )

  @functools.wraps(step)
  def run(*args, plan: BitPlan | None, **kwargs):
    with use_plan(plan, strict=strict):
      return step(*args, **kwargs)

  # jit reads the signature to find static arguments: show `plan` in it.
  del run.__wrapped__
  try:
    params = list(inspect.signature(step).parameters.values())
  except (TypeError, ValueError):
    return run
  plan_param = inspect.Parameter("plan", inspect.Parameter.KEYWORD_ONLY)
  variadic = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
  params = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
  run.__signature__ = inspect.Signature(params + [plan_param] + variadic)
  return run
