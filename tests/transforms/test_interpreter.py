"""The jaxpr interpreter jact's rewrites share (jact/_transforms/_interpreter.py).

Rules override one primitive or decline; jitted calls are entered in place
(or bound whole); literals are read; hooks see every equation in order; with
no rules it computes what `jax.core.eval_jaxpr` computes, equation for
equation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jact._transforms import _interpreter as interpreter


def _closed(fn, *args):
  return jax.make_jaxpr(fn)(*args)


def _model(x):
  inner = jax.jit(lambda y: jnp.sin(y) * 3.0)  # a literal inside a jitted body
  return jnp.exp(inner(x) + 2.0) - jnp.sin(x)


X = jnp.linspace(-1.0, 1.0, 5)


def test_no_rules_equals_eval_jaxpr():
  closed = _closed(_model, X)
  got = interpreter.evaluate(closed.jaxpr, closed.consts, [X])
  want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, X)
  np.testing.assert_array_equal(got[0], want[0])


def test_the_same_jaxpr_is_bound_as_eval_jaxpr_binds():
  closed = _closed(_model, X)
  ours = jax.make_jaxpr(lambda x: interpreter.evaluate(closed.jaxpr, closed.consts, [x]))(X)
  reference = jax.make_jaxpr(lambda x: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x))(X)
  assert str(ours) == str(reference)


def _cos_for_sin(frame, eqn):
  return [jnp.cos(frame.read(eqn.invars[0]))]


@pytest.mark.parametrize("calls", [None, "jit"])
def test_a_rule_overrides_one_primitive_and_calls_are_entered_only_when_asked(calls):
  closed = _closed(_model, X)
  [y] = interpreter.evaluate(
    closed.jaxpr, closed.consts, [X], {lax.sin_p: _cos_for_sin}, calls=calls
  )
  inner = jnp.cos(X) if calls == "jit" else jnp.sin(X)  # the sin inside jax.jit
  np.testing.assert_allclose(y, jnp.exp(inner * 3.0 + 2.0) - jnp.cos(X), rtol=1e-6)


def test_a_declining_rule_falls_through_to_the_next_then_the_default():
  closed = _closed(lambda x: jnp.sin(x) + jnp.sin(2.0 * x), X)
  seen = []

  def only_the_first(frame, eqn):
    seen.append(frame.index)
    return [jnp.zeros_like(X)] if len(seen) == 1 else None

  [y] = interpreter.evaluate(
    closed.jaxpr,
    closed.consts,
    [X],
    [(lax.sin_p, only_the_first), (interpreter.EVERY, lambda f, e: None)],
  )
  np.testing.assert_allclose(y, jnp.sin(2.0 * X), rtol=1e-6)
  assert len(seen) == 2


def test_predicates_literals_and_hooks_see_each_equation_in_order():
  closed = _closed(lambda x: (x * 2.0 + 1.0) * x, X)
  order = []
  is_add = lambda eqn: eqn.primitive is lax.add_p
  subtract = lambda frame, eqn: [frame.read(eqn.invars[0]) - frame.read(eqn.invars[1])]
  [y] = interpreter.evaluate(
    closed.jaxpr,
    closed.consts,
    [X],
    [(is_add, subtract)],
    before=lambda frame, eqn: order.append(("before", frame.index, eqn.primitive.name)),
    after=lambda frame, eqn, outs: order.append(("after", frame.index, eqn.primitive.name)),
  )
  np.testing.assert_allclose(y, (X * 2.0 - 1.0) * X, rtol=1e-6)
  names = [e.primitive.name for e in closed.jaxpr.eqns]
  assert order == [(when, i, n) for i, n in enumerate(names) for when in ("before", "after")]


def test_origin_follows_operands_into_entered_calls():
  closed = _closed(lambda x, y: jax.jit(lambda a, b: jnp.sin(a) + jnp.sin(b))(x, y * 2.0), X, X)
  origins = []

  def record(frame, eqn):
    origins.append(frame.origin(eqn.invars[0]))

  interpreter.evaluate(closed.jaxpr, closed.consts, [X, X], {lax.sin_p: record}, calls="jit")
  x_var = closed.jaxpr.invars[0]
  assert origins[0] is x_var  # the body's `a` is the outer `x`
  assert origins[1] is not x_var and origins[1] not in closed.jaxpr.invars  # `y * 2.0`


def test_a_fragment_evaluates_some_equations_of_a_jaxpr():
  closed = _closed(lambda x: jnp.tanh(jnp.exp(x)) * 2.0, X)
  first, second, _ = closed.jaxpr.eqns
  steps = interpreter.Fragment((), (first.invars[0],), (first, second), (second.outvars[0],))
  [y] = interpreter.evaluate(steps, (), [X])
  np.testing.assert_allclose(y, jnp.tanh(jnp.exp(X)), rtol=1e-6)


def test_unknown_call_mode_is_named():
  closed = _closed(_model, X)
  with pytest.raises(ValueError, match="calls must be None, 'jit' or 'all', got 'every'"):
    interpreter.evaluate(closed.jaxpr, closed.consts, [X], calls="every")


@pytest.mark.parametrize("compress_argnums", [(), (0,)])
def test_levels_keeps_an_argument_read_inside_nested_jits_by_reference(compress_argnums):
  """`compress_convolutions` enters jitted bodies in place (`calls="jit"`) and
  finds, through two levels of calls, which conv input is the block's argument."""
  from jact._compat.testing import saved_residuals
  from jact._planning.levels import compress_convolutions

  dn = ("NHWC", "HWIO", "NHWC")
  conv = lambda a, w: lax.conv_general_dilated(a, w, (1, 1), "SAME", dimension_numbers=dn)
  block = lambda x, w: jnp.sum(jax.jit(lambda a, w: jax.jit(conv)(a, w) + conv(a * 2.0, w))(x, w))
  wrapped = compress_convolutions(block, bits=2, compress_argnums=compress_argnums, min_size=1)
  x, w = jnp.ones((2, 4, 4, 3)), jnp.ones((3, 3, 3, 4))
  saved = saved_residuals(lambda x, w: wrapped(x, w, key=jax.random.key(0)), x, w)
  packed = sum(aval.dtype == jnp.uint8 for aval, _ in saved)
  x_kept = any(source == "from the argument x" for _, source in saved)
  assert (packed, x_kept) == ((1, True) if compress_argnums == () else (2, False))
