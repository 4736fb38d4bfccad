"""Elementwise chains inside `jact.compressed` store one derivative.

A chain of elementwise operations of one tensor (gelu, `x * logistic(x)`)
has a diagonal Jacobian; differentiated op by op it saves one tensor per
nonlinear step, each adding rounding noise. `unary_regions` finds such
chains and `folded_chain` stores only the exact derivative f'(x), compressed
once: fewer bytes, less noise, still unbiased. Details: docs/design.md,
"Folded elementwise chains".

The derivative is taken in reverse mode (the chain's VJP of a cotangent of
ones), so its products run in plain JAX's order: an overflowed step whose
derivative is 0 (`tanh(inf)`, `exp(-inf)`) gives 0, as in plain JAX, where a
forward-mode tangent would overflow first and give 0 * inf = NaN. The one
product that differs from plain's order is the cotangent's: `g * f'(x)`
rather than g carried through each step, so an intermediate product of g
that overflows in plain JAX (a large loss scale in float16) may stay finite.

>>> import jax, jax.numpy as jnp
>>> closed = jax.make_jaxpr(lambda x: jax.nn.gelu(x) + 1.0)(jnp.ones(4))
>>> [region] = unary_regions(closed.jaxpr).values()
>>> len(region.eqns), region.nonlinear   # gelu: x**3, tanh, x * cdf; then + 1.0
(9, 3)
>>> f = folded_chain(closed.jaxpr, region)
>>> x = jnp.linspace(-2.0, 2.0, 4)
>>> bool(jnp.allclose(f(x), jax.nn.gelu(x) + 1.0))
True
>>> bool(jnp.allclose(jax.grad(lambda x: f(x).sum())(x), jax.vmap(jax.grad(jax.nn.gelu))(x)))
True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jact import _compat
from jact._transforms import _interpreter as interpreter

__all__ = ["Region", "unary_regions", "fold_rule", "folded_chain", "MIN_NONLINEAR"]

MIN_NONLINEAR = 2  # a chain with fewer nonlinear steps saves at most one tensor anyway


@dataclasses.dataclass(frozen=True)
class Region:
  """An elementwise chain of one variable.

  Attributes:
    root: the variable x every equation of the chain is a function of.
    eqns: indices (in order) of the chain's equations in the jaxpr.
    output: the one variable of the chain read outside it.
    nonlinear: how many of its equations save a residual when differentiated.
  """

  root: object
  eqns: tuple[int, ...]
  output: object
  nonlinear: int


def _is_float(v) -> bool:
  return hasattr(v.aval, "dtype") and jnp.issubdtype(v.aval.dtype, jnp.floating)


def _scalar_literal(v) -> bool:
  return _compat.is_literal(v) and jnp.ndim(_compat.literal_value(v)) == 0


def unary_regions(jaxpr) -> dict:
  """The foldable elementwise chains of `jaxpr`'s top level: output var -> `Region`.

  An equation joins the chain of x when it is elementwise arithmetic
  (`jact._compat.elementwise_kind`), its one output is a float of x's shape,
  and every operand is x, another member's output, or a scalar literal. A
  chain is foldable when exactly one of its values is read outside it (by
  another equation or as an output of the jaxpr) and it has at least
  `MIN_NONLINEAR` nonlinear steps (a product of two chain values counts,
  a product with a literal does not).
  """
  root_of, members, nonlinear = {}, {}, {}
  for i, eqn in enumerate(jaxpr.eqns):
    kind = _compat.elementwise_kind(eqn)
    if kind is None or len(eqn.outvars) != 1 or not _is_float(eqn.outvars[0]):
      continue
    out = eqn.outvars[0]
    operands = [v for v in eqn.invars if not _scalar_literal(v)]
    if not operands or not all(
      _compat.is_var(v) and _is_float(v) and v.aval.shape == out.aval.shape for v in operands
    ):
      continue
    roots = {root_of.get(v, v) for v in operands}
    if len(roots) != 1:
      continue
    [root] = roots
    if root in jaxpr.constvars:
      continue  # a closed-over constant: nothing to differentiate
    root_of[out] = root
    members.setdefault(root, []).append(i)
    nonlinear[root] = nonlinear.get(root, 0) + (kind == "nonlinear" and not _scaling(eqn))
  regions = {}
  for root, eqns in members.items():
    inside = set(eqns)
    values = {jaxpr.eqns[i].outvars[0] for i in eqns}
    read = {
      v
      for k, e in enumerate(jaxpr.eqns)
      if k not in inside
      for v in e.invars
      if _compat.is_var(v) and v in values
    }
    read |= {v for v in jaxpr.outvars if _compat.is_var(v) and v in values}
    if len(read) == 1 and nonlinear[root] >= MIN_NONLINEAR:
      [output] = read
      regions[output] = Region(root, tuple(eqns), output, nonlinear[root])
  return regions


def _scaling(eqn) -> bool:
  """A product with a literal or a quotient by one: linear, saves nothing."""
  name, ins = eqn.primitive.name, eqn.invars
  return (name == "mul" and any(_compat.is_literal(v) for v in ins)) or (
    name == "div" and _compat.is_literal(ins[1])
  )


def fold_rule(jaxpr) -> tuple:
  """An interpreter rule (`jact._transforms._interpreter`) for `jaxpr`: the
  equations of each foldable chain (`unary_regions`) make no value of their
  own; the one whose output the chain exports makes it with `folded_chain`."""
  member_of = {i: region for region in unary_regions(jaxpr).values() for i in region.eqns}

  def fold(frame, eqn):
    region = member_of.get(frame.index)
    if region is None:
      return None
    if eqn.outvars[0] is not region.output:
      return [None]  # evaluated with its chain, where the chain's output is made
    return [folded_chain(jaxpr, region)(frame.env[region.root])]

  return interpreter.EVERY, fold


def folded_chain(jaxpr, region: Region):
  """`region`'s output as a function of its root, with a custom VJP that
  keeps `f'(x)` (one tensor of x's shape) as its only residual."""
  steps = interpreter.Fragment(
    (), (region.root,), tuple(jaxpr.eqns[i] for i in region.eqns), (region.output,)
  )

  def chain(x):
    [y] = interpreter.evaluate(steps, (), [x])
    return y

  @jax.custom_vjp
  def folded(x):
    return chain(x)

  def fwd(x):
    # reverse mode: the products run from the output back, in plain JAX's order
    y, vjp = jax.vjp(chain, x)
    (derivative,) = vjp(jnp.ones_like(y))
    return y, derivative

  def bwd(derivative, g):
    return ((g * derivative).astype(region.root.aval.dtype),)

  folded.defvjp(fwd, bwd)
  return folded
