"""One jaxpr interpreter for jact's rewrites: an environment, a rule table and hooks.

jact re-evaluates captured jaxprs with some equations run differently:
convolutions by a compressed conv (`jact._planning.levels`), max pooling by
an exact arg-max pool (`_selections`), elementwise chains by one folded
custom VJP (`_folding`), residuals stored as soon as the forward pass is
done with them and rebuilt just before the backward pass reads them
(`_interleave`). `evaluate` owns what they share -- the environment, literal
operands, entering jitted calls in place, binding an equation as JAX would
(`jact._compat.bind_eqn`) -- and each of them supplies only its rules and
hooks.

A rule is `(match, handler)`: `match` is a primitive (by identity), a
predicate `eqn -> bool`, or `EVERY`; `handler(frame, eqn)` returns the
equation's outputs (one value per outvar; a None is not written) or None
to decline (the next rule, then the default, runs the equation). The first
rule that matches and does not decline wins. Handlers read operands with
`frame.read`, so an equation whose operands are not all in the environment
(a folded chain's inner steps, a residual rebuilt later) can still be
handled.

>>> import jax, jax.numpy as jnp
>>> from jax import lax
>>> closed = jax.make_jaxpr(lambda x: jnp.sin(jax.jit(jnp.cos)(x)) + 1.0)(0.5)
>>> negated_cos = (lax.cos_p, lambda frame, eqn: [-jnp.cos(frame.read(eqn.invars[0]))])
>>> [y] = evaluate(closed.jaxpr, closed.consts, [0.5], [negated_cos], calls="jit")
>>> bool(jnp.isclose(y, jnp.sin(-jnp.cos(0.5)) + 1.0))
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

from jact import _compat

__all__ = ["EVERY", "Fragment", "Frame", "evaluate", "run"]

Rule = tuple  # (primitive | predicate(eqn) -> bool, handler(frame, eqn) -> list | None)
Hook = Callable[..., None]


def EVERY(eqn) -> bool:  # noqa: N802 -- a constant-like predicate
  """Matches every equation (a handler that declines what it does not run)."""
  del eqn
  return True


class Fragment(NamedTuple):
  """Equations of a jaxpr evaluated as one: `invars` given, `outvars` read."""

  constvars: tuple
  invars: tuple
  eqns: tuple
  outvars: tuple


@dataclasses.dataclass
class Frame:
  """One jaxpr being evaluated.

  Attributes:
    jaxpr: the open jaxpr (or `Fragment`).
    env: `{var: value}`, in the order values were first written (constvars,
      invars, then each equation's outputs); hooks may replace or drop values.
    index: position in `jaxpr.eqns` of the equation being evaluated (-1 before).
    parent: the frame of the call this one's jaxpr is the body of, or None.
    binding: `{invar: operand atom in parent}` for a body entered in place.
  """

  jaxpr: Any
  env: dict
  index: int = -1
  parent: Frame | None = None
  binding: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def start(cls, jaxpr, consts: Sequence, args: Sequence, **kwargs) -> Frame:
    """A frame with `jaxpr`'s constvars and invars bound (a None argument is
    left unbound: a value a hook or rule provides later)."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update((v, x) for v, x in zip(jaxpr.invars, args) if x is not None)
    return cls(jaxpr, env, **kwargs)

  def read(self, atom):
    """The value of a variable or a literal."""
    return _compat.literal_value(atom) if _compat.is_literal(atom) else self.env[atom]

  def read_all(self, atoms: Sequence) -> list:
    return [self.read(a) for a in atoms]

  def write(self, variables: Sequence, values: Sequence) -> None:
    """Binds each variable to its value (literals and None values skipped)."""
    for var, value in zip(variables, values):
      if _compat.is_var(var) and value is not None:
        self.env[var] = value

  def origin(self, var):
    """The atom `var` is bound to in the outermost frame, following operands
    of the calls entered in place (`var` itself when it is not a body's input)."""
    frame = self
    while frame.parent is not None and var in frame.binding:
      var, frame = frame.binding[var], frame.parent
    return var


def _matches(match, eqn) -> bool:
  if hasattr(match, "bind"):  # a primitive (predicates are plain functions)
    return eqn.primitive is match
  return bool(match(eqn))


def _body(eqn, calls: str | None):
  """The body of a call equation `evaluate` enters in place, or None."""
  if calls is None:
    return None
  return _compat.call_body(eqn, closed_call=calls == "all")


def run(
  frame: Frame,
  rules: Sequence[Rule] = (),
  *,
  before: Hook | None = None,
  after: Hook | None = None,
  calls: str | None = None,
) -> Frame:
  """Evaluates `frame.jaxpr`'s equations in order, writing into `frame.env`.

  Args:
    rules: `(match, handler)` pairs, tried in order (a mapping works too).
    before: `before(frame, eqn)`, called before each equation is run.
    after: `after(frame, eqn, outs)`, called once its outputs are written.
    calls: which call equations no rule handles are entered in place, their
      bodies evaluated with the same rules and hooks in a child frame: None
      (bound as one equation), "jit" (`jax.jit` bodies) or "all" (also
      `closed_call`).
  """
  if calls not in (None, "jit", "all"):
    raise ValueError(f"calls must be None, 'jit' or 'all', got {calls!r}")
  rules = list(rules.items()) if hasattr(rules, "items") else list(rules)
  for index, eqn in enumerate(frame.jaxpr.eqns):
    frame.index = index
    if before is not None:
      before(frame, eqn)
    outs = _apply(frame, eqn, rules, before, after, calls)
    frame.write(eqn.outvars, outs)
    if after is not None:
      after(frame, eqn, outs)
  return frame


def _apply(frame: Frame, eqn, rules: list, before, after, calls) -> list:
  for match, handler in rules:
    if _matches(match, eqn):
      outs = handler(frame, eqn)
      if outs is not None:
        return outs
  body = _body(eqn, calls)
  values = frame.read_all(eqn.invars)
  if body is None:
    return _compat.bind_eqn(eqn, values)
  child = Frame.start(
    body.jaxpr, body.consts, values, parent=frame, binding=dict(zip(body.jaxpr.invars, eqn.invars))
  )
  run(child, rules, before=before, after=after, calls=calls)
  return child.read_all(body.jaxpr.outvars)


def evaluate(
  jaxpr,
  consts: Sequence,
  args: Sequence,
  rules: Sequence[Rule] = (),
  *,
  before: Hook | None = None,
  after: Hook | None = None,
  calls: str | None = None,
) -> list:
  """The values of `jaxpr.outvars` given `consts` and `args`, every equation
  run by the first rule that handles it, else as JAX runs it (see `run`).
  With no rules, hooks or calls this is `jax.core.eval_jaxpr`."""
  frame = run(Frame.start(jaxpr, consts, args), rules, before=before, after=after, calls=calls)
  return frame.read_all(jaxpr.outvars)
