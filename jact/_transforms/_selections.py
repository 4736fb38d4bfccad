"""Max pooling inside `jact.compressed` keeps its selection exact.

The VJP of `lax.reduce_window(x, -inf, lax.max, ...)` (what `nn.max_pool`
runs) saves the whole input and re-selects each window's arg-max from it in
the backward pass. Quantized, that input moves the arg-max: gradients land on
the wrong positions (docs/design.md, "Exact max-pool selections", has the
measured damage). `evaluate_with_exact_selections` evaluates a
function's jaxpr with every undilated max-pooling equation replaced by
`jact.ops.max_pool`, which computes the same maxima and stores only the
arg-max position per window, exactly, in 1 to 8 bits.

>>> import jax, jax.numpy as jnp
>>> from jax import lax
>>> pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
>>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
>>> closed = jax.make_jaxpr(pool)(x)
>>> [y] = evaluate_with_exact_selections(closed.jaxpr, closed.consts, x, name="demo")
>>> bool((y == pool(x)).all())
True
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jact import _compat
from jact.ops._pooling import max_pool
from jact._transforms import _interpreter as interpreter
from jact._transforms._folding import fold_rule

__all__ = ["evaluate_with_exact_selections"]

_MAX_WINDOW = 256  # positions a stored arg-max can address (8 bits)


def _pool_full_rank(x, window, strides, padding, name: str):
  """`reduce_window_max` over every axis of `x` through `jact.ops.max_pool`
  (which pools the axes between a batch and a feature axis: both added)."""
  y = max_pool(x[None, ..., None], window, strides, padding, name=name)
  return y[0, ..., 0]


def _is_max_pool(eqn) -> bool:
  return _compat.max_window_geometry(eqn) is not None


def evaluate_with_exact_selections(jaxpr, consts, *args, name: str, fold: bool = True) -> list:
  """`jax.core.eval_jaxpr(jaxpr, consts, *args)` with max pooling that
  stores its arg-max (residuals named `f"{name}.pool{k}.argmax"`) and, with
  `fold`, elementwise chains of one tensor that store one derivative
  (`jact._transforms._folding`)."""

  def exact_pool(frame, eqn):
    geometry = _compat.max_window_geometry(eqn)
    x = frame.read(eqn.invars[0])
    if not jnp.issubdtype(x.dtype, jnp.floating) or math.prod(geometry[0]) > _MAX_WINDOW:
      return None  # run as it is
    return [_pool_full_rank(x, *geometry, name=f"{name}.pool{frame.index}")]

  rules = [fold_rule(jaxpr)] if fold else []
  rules.append((_is_max_pool, exact_pool))
  return interpreter.evaluate(jaxpr, consts, args, rules)
