"""Which derivatives jact's custom backward rules can give, and clear errors
for the others.

* Every jact op (and `jact.compressed` / `jact.checkpoint`) is a
  `jax.custom_vjp`: reverse mode only. `reverse_only` routes its inputs
  through an identity whose tangent fails, with a jact message, wherever
  JAX would otherwise fail with its generic custom_vjp text: when a forward-
  mode tangent is evaluated or compiled (`jax.jvp`, `jax.jacfwd`,
  `jax.linearize`). Reverse mode transposes it away, unchanged.
* A lossy-compressed residual does not depend on the value it was made from,
  so differentiating it again (`jax.hessian`, grad of grad, jvp of grad)
  would silently drop terms. `first_order_only` marks the value being
  compressed; differentiating it raises at trace time. Exact residuals
  (bits=None, ReLU's 1-bit mask) are not marked: higher orders through them
  are exact.
* A Flax layer or module called without a rounding key (inference, eval,
  decoding) runs the plain computation, which saves nothing as long as
  nothing differentiates it. `inference_only` marks its outputs: a derivative
  through them (any mode) raises at trace time with the message naming the
  key to pass, instead of silently saving full-precision residuals.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jact import _compat

__all__ = ["reverse_only", "first_order_only", "inference_only"]


def _forward_mode_message(op: str) -> str:
  return (
    f"{op} has a custom backward rule and supports reverse-mode differentiation only "
    "(jax.grad, jax.vjp, jax.jacrev, and jax.hessian where its residuals are exact); "
    "forward mode (jax.jvp, jax.jacfwd, jax.linearize) cannot go through it. Use "
    "jax.jacrev instead of jax.jacfwd, or the plain JAX function (the jax.nn / lax "
    "op, or the function without jact.compressed / jact.checkpoint) where forward "
    "mode is needed."
  )


def _fail(*_, op: str):
  raise TypeError(_forward_mode_message(op))


# The tangent of `reverse_only`: linear and shape-preserving, transposed to the
# identity; evaluating or compiling it (forward mode) raises.
_forward_tangent_p = _compat.linear_identity_primitive("jact_forward_tangent", _fail)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _reverse_only(op: str, x):
  return x


@_reverse_only.defjvp
def _reverse_only_jvp(op, primals, tangents):
  return primals[0], _forward_tangent_p.bind(tangents[0], op=op)


def _is_float_array(a) -> bool:
  return _compat.is_jax_value(a) and jnp.issubdtype(a.dtype, jnp.floating)


def reverse_only(fn: Callable, op: str) -> Callable:
  """`fn` (a custom_vjp function) whose forward-mode derivative raises a
  TypeError naming `op` and the fixes, instead of JAX's generic text."""
  guard = lambda a: _reverse_only(op, a) if _is_float_array(a) else a
  return lambda *args: fn(*jax.tree.map(guard, args))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_only(what: str, x):
  return x


@_first_order_only.defjvp
def _first_order_only_jvp(what, primals, tangents):
  raise TypeError(
    f"jact cannot differentiate {what} a second time: it is stored compressed, and the "
    "stored copy does not depend on the input, so a higher-order derivative through it "
    "(jax.hessian, grad of grad, jvp of grad) would be silently wrong. Store it exactly "
    "(bits=None for the op or jact.compressed call, or None for its name in the plan), or "
    "take the higher-order derivative outside the compressed region."
  )


def first_order_only(x: jax.Array, name: str | None, method) -> jax.Array:
  """`x`, the value a lossy residual is made from: differentiating it raises."""
  what = f"residual {name!r} ({method})" if name else f"a residual ({method})"
  return _first_order_only(what, x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _inference_only(message: str, x):
  return x


@_inference_only.defjvp
def _inference_only_jvp(message, primals, tangents):
  raise ValueError(message)


def inference_only(tree, message: str):
  """`tree` unchanged; differentiating one of its float arrays raises
  `ValueError(message)` at trace time.

  JAX runs a custom JVP rule only for a value that carries a nonzero
  tangent, so the values stay free to use wherever nothing differentiates
  them (also under `jax.grad` of something else, or behind
  `jax.lax.stop_gradient`).

  >>> import jax, jax.numpy as jnp
  >>> f = lambda x: inference_only(2.0 * x, "pass a key").sum()
  >>> float(f(jnp.ones(3)))
  6.0
  >>> try:
  ...   jax.grad(f)(jnp.ones(3))
  ... except ValueError as e:
  ...   print(e)
  pass a key
  """
  guard = lambda a: _inference_only(message, a) if _is_float_array(a) else a
  return jax.tree.map(guard, tree)
