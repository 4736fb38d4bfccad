"""Residuals a `lax.scan` produces per iteration, stored and rebuilt inside the loop.

A scan's residuals (what its backward needs of each iteration) leave the
loop as stacked outputs, one slice per iteration: an RNN's gates over time,
the activations of each layer of a scanned stack. Compressed after the loop,
the whole full-precision stack is alive at once, and so it is again when it
is rebuilt before the backward loop: a compressed model would cut the
residual bytes but not the compiled peak. `store_scan` instead runs the loop
with a body that stores each iteration's value (quantized with that
iteration's own seed, `step_seed`) and emits the stored pieces, stacked
(`jact._engine.scheduling.Stacked`); `restore_scan` runs a backward loop that
reads such a residual one iteration at a time and rebuilds it inside the
body. Neither direction holds the full-precision stack.

Both recurse into the body through the evaluator they are given
(`jact._transforms._interleave`), so scans nested in scans are stored and
rebuilt per innermost iteration.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from jact import _compat
from jact._core import rng
from jact._engine import context as _context
from jact._engine.rounding import NoKey, SaltedSeed
from jact._engine.scheduling import Stacked, is_stored

__all__ = [
  "step_seed",
  "step_config",
  "scan_residuals",
  "call_residuals",
  "scan_inputs",
  "store_stacked",
  "store_scan",
  "restore_scan",
  "rebuild",
]


def step_seed(seed, steps):
  """The rounding seed of one iteration of enclosing scans: `steps` holds their
  iteration indices, outermost first (a uint32 seed is hashed with each in
  turn; a `SaltedSeed` keeps its salt; a `NoKey` stays one).

  >>> import jax.numpy as jnp
  >>> a, b = step_seed(jnp.uint32(7), (0,)), step_seed(jnp.uint32(7), (1,))
  >>> bool(a != b), int(step_seed(jnp.uint32(7), ()))
  (True, 7)
  """
  if not steps or isinstance(seed, NoKey):
    return seed
  if isinstance(seed, SaltedSeed):
    return dataclasses.replace(seed, base=step_seed(seed.base, steps))
  for s in steps:
    seed = rng.hash_uint32(seed, jnp.asarray(s).astype(jnp.uint32))
  return seed


def step_config(config, var):
  """`config` (a `ResidualConfig`) for one iteration's value of the residual
  `var` stored inside its scan: whether it is large enough to compress
  (`min_size`) is the whole residual's to decide, not one iteration's."""
  shape = var.aval.shape
  if _compat.is_static_shape(shape) and math.prod(shape) >= config.min_size:
    return dataclasses.replace(config, min_size=1)
  return config


def scan_residuals(eqns, store_at: dict) -> dict[int, dict[int, int]]:
  """`{equation index: {ys index: position}}`: the residuals of `store_at`
  (`{position: var}`) that a scan equation emits as stacked per-iteration values."""
  found = {}
  for i, eqn in enumerate(eqns):
    parts = _compat.scan_parts(eqn)
    if parts is None:
      continue
    ys = {v: k for k, v in enumerate(eqn.outvars[parts.num_carry :])}
    hit = {ys[var]: p for p, var in store_at.items() if var in ys}
    if hit:
      found[i] = hit
  return found


def _from_scan(jaxpr, var) -> bool:
  """Whether `var` of `jaxpr` is a scan's stacked output, possibly through
  jitted calls."""
  for eqn in jaxpr.eqns:
    if var in eqn.outvars:
      k = eqn.outvars.index(var)
      parts = _compat.scan_parts(eqn)
      if parts is not None:
        return k >= parts.num_carry
      body = _compat.call_body(eqn)
      return (
        body is not None
        and _compat.is_var(body.jaxpr.outvars[k])
        and _from_scan(body.jaxpr, body.jaxpr.outvars[k])
      )
  return False


def call_residuals(eqns, store_at: dict) -> dict[int, dict[int, int]]:
  """`{equation index: {output index: position}}`: the residuals of
  `store_at` that a jitted call (`jax.jit`, `closed_call`) returns from a
  scan inside it (its body is evaluated in place, so that the scan's
  residuals are stored inside the loop)."""
  found = {}
  for i, eqn in enumerate(eqns):
    body = _compat.call_body(eqn)
    if body is None:
      continue
    outs = {v: k for k, v in enumerate(eqn.outvars)}
    hit = {
      outs[var]: p
      for p, var in store_at.items()
      if var in outs
      and _compat.is_var(body.jaxpr.outvars[outs[var]])
      and _from_scan(body.jaxpr, body.jaxpr.outvars[outs[var]])
    }
    if hit:
      found[i] = hit
  return found


def scan_inputs(eqns, store_at: dict) -> set:
  """The positions of the residuals of `store_at` (`{position: var}`) that a
  scan equation reads as stacked per-iteration input (its xs): stored one
  leading index at a time (`store_stacked`), the backward loop that reads
  them the same way can rebuild them one iteration at a time."""
  xs = set()
  for eqn in eqns:
    parts = _compat.scan_parts(eqn)
    if parts is not None:
      xs.update(v for v in eqn.invars[parts.num_consts + parts.num_carry :] if _compat.is_var(v))
  return {p for p, var in store_at.items() if var in xs}


def store_stacked(position, value, store: Callable):
  """`Stacked` pieces of `value` stored one leading index at a time
  (`store(position, value[i], (i,))` for every i), or `store(position,
  value)` when one index alone is not compressed (too small)."""
  if _context.current("recorder") is not None:  # recorded first: the whole shape
    jax.eval_shape(lambda v: store(position, v), jax.ShapeDtypeStruct(value.shape, value.dtype))
  pieces = jax.vmap(lambda v, i: store(position, v, (i,)))(value, jnp.arange(value.shape[0]))
  return Stacked(pieces) if is_stored(pieces) else store(position, value)


def store_scan(
  eqn, values, residuals: dict[int, int], full: set, store: Callable, evaluate: Callable
) -> tuple[list, dict]:
  """Runs the scan `eqn` on `values` (its operands), storing inside the loop
  the per-iteration values of its stacked outputs in `residuals`.

  Args:
    residuals: `{ys index: position}` of the outputs to store.
    full: the ys indices that are also needed as they are (read again by the
      forward pass); the others are not emitted at full precision.
    store: `(position, value, steps) -> stored form`; `steps` holds the
      iteration indices of this loop and of any loop inside it.
    evaluate: `jact._transforms._interleave.evaluate_storing` (the body is
      evaluated with it: residuals inside are stored as early as outside).

  Returns:
    `(outs, stored)`: one value per output of `eqn` (None for a residual
    not needed as it is) and `{position: Stacked}`. A residual whose
    iteration values the store keeps as they are (too small to compress
    alone) comes back in `outs` and not in `stored`.
  """
  parts = _compat.scan_parts(eqn)
  nc, nk = parts.num_consts, parts.num_carry
  consts, init, xs = list(values[:nc]), list(values[nc : nc + nk]), list(values[nc + nk :])
  body = parts.body.jaxpr
  n_ys = len(body.outvars) - nk
  store_at = {
    p: body.outvars[nk + k] for k, p in residuals.items() if _compat.is_var(body.outvars[nk + k])
  }
  if _context.current("recorder") is not None:
    for k, p in residuals.items():  # recorded first: the residual's whole shape, not one step's
      aval = eqn.outvars[nk + k].aval
      jax.eval_shape(lambda v, p=p: store(p, v, ()), jax.ShapeDtypeStruct(aval.shape, aval.dtype))

  def step(carry, x):
    x, i = x
    outs, stored = evaluate(
      body,
      parts.body.consts,
      [*consts, *carry, *x],
      store_at,
      lambda p, v, steps=(): store(p, v, (i, *steps)),
    )
    ys, packed = [], {}
    for k in range(n_ys):
      p = residuals.get(k)
      if p in stored and is_stored(stored[p]):
        packed[p] = stored[p]
        ys.append(outs[nk + k] if k in full else None)
      else:
        ys.append(outs[nk + k])
    return list(outs[:nk]), (ys, packed)

  carry, (ys, packed) = jax.lax.scan(
    step,
    init,
    (xs, jnp.arange(parts.length)),
    length=parts.length,
    reverse=parts.reverse,
    unroll=parts.unroll,
  )
  return [*carry, *ys], {p: Stacked(pieces) for p, pieces in packed.items()}


def rebuild(pieces, rebuild_one: Callable, shape) -> jax.Array:
  """The value of stored `pieces` of shape `shape`: `rebuild_one(pieces,
  shape=shape)`, or, for `Stacked` pieces, every iteration's value rebuilt
  that way and stacked."""
  if isinstance(pieces, Stacked):
    return jax.vmap(lambda p: rebuild(p, rebuild_one, tuple(shape[1:])))(pieces.pieces)
  return rebuild_one(pieces, shape=tuple(shape))


def restore_scan(eqn, values, lazy: dict[int, tuple], evaluate: Callable) -> list:
  """Runs the scan `eqn` whose stacked operands `lazy` (`{operand index:
  (Stacked pieces, rebuild_one)}`, xs operands only) are rebuilt one iteration
  at a time inside the loop; `values` are its operands (those in `lazy` are
  ignored). `evaluate` is `jact._transforms._interleave.evaluate_restoring`
  (each iteration's value is rebuilt just before its first use in the body)."""
  parts = _compat.scan_parts(eqn)
  nc, nk = parts.num_consts, parts.num_carry
  consts, init = list(values[:nc]), list(values[nc : nc + nk])
  xs = [None if j in lazy else v for j, v in enumerate(values) if j >= nc + nk]
  pieces = {j: stacked.pieces for j, (stacked, _) in lazy.items()}

  def step(carry, x):
    x, per_step = x
    inputs = [*consts, *carry, *x]
    restore = {j: (per_step[j], lazy[j][1]) for j in lazy}
    outs = evaluate(parts.body.jaxpr, parts.body.consts, inputs, restore)
    return list(outs[:nk]), list(outs[nk:])

  carry, ys = jax.lax.scan(
    step, init, (xs, pieces), length=parts.length, reverse=parts.reverse, unroll=parts.unroll
  )
  return [*carry, *ys]
