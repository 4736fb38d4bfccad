"""Compress each residual of a whole-function VJP as soon as the forward is done with it.

`jact.compressed` captures the forward pass and its residuals as one jaxpr.
Evaluated whole and compressed afterwards, every full-precision residual
would be alive at the end of the forward pass (XLA schedules a computation
that only the backward needs as late as it can): wrapping a whole model
would cut the residual bytes but not the compiled peak. `evaluate_storing`
instead walks the jaxpr equation by equation and, once the residuals whose
last forward use is done add up to a share of the total (`flush_bytes`),
compresses them and makes every value the rest of the forward pass reads
wait for the compressed bytes (`jact._engine.scheduling.materialize`), so the
compiler must finish the compression -- and can free the full-precision
residual -- before it goes on. A whole model then behaves like a chain of
separately wrapped blocks.

A residual a `lax.scan` emits per iteration (an RNN over time, a scanned
stack of layers) is stored inside the loop instead, one iteration at a time,
and `evaluate_restoring` rebuilds it inside the backward loop that reads it
(`jact._transforms._scan`): no full-precision stack in either direction.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jact import _compat
from jact._engine.scheduling import Stacked, barrier, kept_until_cotangent, wait_for_all
from jact._transforms import _interpreter as interpreter
from jact._transforms._scan import (
  call_residuals,
  rebuild,
  restore_scan,
  scan_inputs,
  scan_residuals,
  store_scan,
  store_stacked,
)

__all__ = ["evaluate_storing", "evaluate_restoring", "FLUSHES"]

# Compressions are grouped so that about this many flushes (each ties the
# values alive at that point to the compressed bytes) cover the forward pass.
# Each group's full-precision values are alive until its flush: with 16, an
# 8-block CNN stack (3 residuals a block) kept ~1.5 groups of activations
# alive at the end of the forward pass, 1.37x the temp memory of wrapping each
# block; 32 brings it to 1.01x (48: no further gain; the transformer stack is
# the same at 16, 32 and 48).
FLUSHES = 32


def _nbytes(var) -> int:
  """Bytes of `var`; 0 for a symbolic (jax.export) shape: such a residual is
  kept exact (`jact._engine.store.compress_residual`), nothing to schedule."""
  aval = var.aval  # typed PRNG keys (extended dtypes) have an itemsize but no numpy dtype
  if not _compat.is_static_shape(aval.shape):
    return 0
  return math.prod(aval.shape) * aval.dtype.itemsize


def _tieable(value) -> bool:
  dtype = getattr(value, "dtype", None)
  return (
    dtype is not None
    and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
    and jnp.size(value) > 0
    and _compat.on_device(value)
  )


def evaluate_storing(
  jaxpr,
  consts: Sequence,
  inputs: Sequence,
  store_at: dict,
  store: Callable[[int, jax.Array], object],
  needed: Sequence[bool] | None = None,
) -> tuple[list, dict]:
  """Evaluates `jaxpr` on `inputs`, storing residuals as it goes.

  Args:
    jaxpr, consts: the open jaxpr of the forward pass and its constants.
    inputs: values of `jaxpr.invars`.
    store_at: `{position: var}` for the residuals to store (`var` one of
      `jaxpr`'s variables, `position` passed back to `store`).
    store: `(position, value, steps=()) -> stored form` (compressed pieces,
      or the value itself when nothing is compressed); `steps` holds the
      iteration indices of the scans a per-iteration value comes from
      (outermost first: its rounding seed must differ per iteration).
    needed: one flag per output of `jaxpr`; outputs not needed (residuals
      used only through their stored form) come back as None and are not
      kept alive. Default: all.

  Returns:
    `(outputs, stored)`: the values of `jaxpr.outvars` and `{position:
    stored form}` (`jact._engine.scheduling.Stacked` for a residual stored
    inside a scan). Values are unchanged; only the order in which the
    compiler may compute them is constrained.
  """
  eqns = jaxpr.eqns
  last_read = {}
  for i, eqn in enumerate(eqns):
    for v in eqn.invars:
      if _compat.is_var(v):
        last_read[v] = i
  produced = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
  if needed is None:
    needed = [True] * len(jaxpr.outvars)
  outputs = {v for v, n in zip(jaxpr.outvars, needed) if n and _compat.is_var(v)}
  given = set(jaxpr.invars) | set(jaxpr.constvars)

  # Eqn index after which each residual is no longer needed by the forward pass.
  done_after = {}
  for position, var in store_at.items():
    done_after.setdefault(max(last_read.get(var, -1), produced.get(var, -1)), []).append(position)
  in_loops = scan_residuals(eqns, store_at)
  in_calls = call_residuals(eqns, store_at)
  per_step = scan_inputs(eqns, store_at)
  # Residuals stored inside their scan do not wait for a flush: the groups
  # are a share of the others.
  in_loop = {
    p for found in (in_loops, in_calls) for residuals in found.values() for p in residuals.values()
  }
  sizes = [_nbytes(var) for p, var in store_at.items() if p not in in_loop]
  flush_bytes = max([sum(sizes) / FLUSHES] + sizes)
  frame = interpreter.Frame.start(jaxpr, consts, inputs)
  env = frame.env
  stored, pending, pending_bytes = {}, [], 0

  def flush(after: int):
    nonlocal pending, pending_bytes
    pieces = {
      p: store_stacked(p, env[store_at[p]], store) if p in per_step else store(p, env[store_at[p]])
      for p in pending
    }
    pending, pending_bytes = [], 0
    packed = [s for p, s in pieces.items() if s is not env[store_at[p]]]
    stored.update(pieces)
    if not packed or after >= len(eqns) - 1:
      return  # nothing compressed, or nothing left to order (the epilogue does)
    # Only what the rest of the forward pass reads is ordered after the
    # flush; values merely returned (outputs, pieces an inner jact op stored)
    # keep their identity and their names (the epilogue orders the outputs).
    waiting = [
      v
      for v, value in env.items()
      if last_read.get(v, -1) > after and v not in given and _tieable(value)
    ]
    for v, value in zip(waiting, wait_for_all([env[v] for v in waiting], packed)):
      env[v] = value

  def settle(after: int):
    nonlocal pending_bytes
    for position in done_after.get(after, ()):
      if position in stored:
        continue  # stored inside its scan
      pending.append(position)
      pending_bytes += _nbytes(store_at[position])
    if pending and pending_bytes >= flush_bytes:
      flush(after)

  def store_inside_loops(frame, eqn):
    """A scan (or a jitted call around one) emitting residuals: stored per iteration."""
    i = frame.index
    if i in in_loops:
      residuals = in_loops[i]
      full = {
        k
        for k, p in residuals.items()
        if last_read.get(store_at[p], -1) > i or store_at[p] in outputs
      }
      outs, inner = store_scan(
        eqn, frame.read_all(eqn.invars), residuals, full, store, evaluate_storing
      )
    elif i in in_calls:  # a jitted call around a scan: its body evaluated in place
      body, residuals = _compat.call_body(eqn), in_calls[i]
      wanted = [
        k not in residuals or last_read.get(v, -1) > i or v in outputs
        for k, v in enumerate(eqn.outvars)
      ]
      outs, inner = evaluate_storing(
        body.jaxpr,
        body.consts,
        frame.read_all(eqn.invars),
        {p: body.jaxpr.outvars[k] for k, p in residuals.items()},
        store,
        wanted,
      )
    else:
      return None
    stored.update(inner)
    return outs

  def settle_and_forget(frame, eqn, outs):
    i = frame.index
    settle(i)
    for v in eqn.invars:  # forget what nothing reads any more
      if (
        _compat.is_var(v)
        and last_read.get(v) == i
        and v not in outputs
        and v not in given
        and all(store_at[p] is not v for p in pending)
      ):
        env.pop(v, None)

  settle(-1)
  interpreter.run(frame, [(interpreter.EVERY, store_inside_loops)], after=settle_and_forget)
  if pending:
    flush(len(eqns))
  return [frame.read(v) if n else None for v, n in zip(jaxpr.outvars, needed)], stored


def evaluate_restoring(
  jaxpr, consts: Sequence, inputs: Sequence, restore: dict, start=None, kept: Sequence[int] = ()
) -> list:
  """Evaluates a backward-pass `jaxpr`, reconstructing residuals just before use.

  Args:
    jaxpr, consts: the open jaxpr of the backward pass and its constants.
    inputs: values of `jaxpr.invars`; those of the positions in `restore`
      are ignored.
    restore: `{invar position: (pieces, rebuild)}`: the stored pieces of a
      residual and `rebuild(pieces, shape=...) -> value` (`shape` the value's
      shape, or one iteration's for `Stacked` pieces).
    start: the value to tie reconstructions to before anything is computed
      (the incoming cotangent).
    kept: invar positions of residuals kept as they are (kernels).

  Each residual is rebuilt right before the first equation that reads it,
  from pieces tied (`jact._engine.scheduling.barrier`) to a value that
  equation reads or, failing that, the latest value computed: the compiler
  cannot hoist every reconstruction to the start of the backward pass, where
  they would all be alive at once (the peak a whole-model wrap would have
  otherwise; the incoming cotangent of a loss is often a constant, so tying
  to it alone orders nothing). A `Stacked` residual that a scan reads as
  per-iteration input is rebuilt inside that scan's body, one iteration at a
  time (`jact._transforms._scan.restore_scan`). An equation that reads only
  given values, at least one of them `kept` (a kernel's reversal for a
  convolution's input gradient), reads them tied to the latest value
  computed (`kept_until_cotangent`): XLA:CPU would otherwise compute it at
  the start of the program and keep it alive through the forward pass.
  """
  lazy = {jaxpr.invars[p]: entry for p, entry in restore.items()}
  frame = interpreter.Frame.start(
    jaxpr, consts, [None if v in lazy else x for v, x in zip(jaxpr.invars, inputs)]
  )
  env = frame.env
  given = set(env)
  kept = {jaxpr.invars[p] for p in kept} - set(lazy)
  frontier = start if start is not None and _tieable(start) else None

  def rebuild_before_use(frame, eqn):
    """Rebuilds the residuals `eqn` reads (except those a loop rebuilds per iteration)."""
    deferred = set(_in_loop(eqn, lazy, env).values()) | set(_in_call(eqn, lazy, env).values())
    waiting = [
      v
      for v in eqn.invars
      if _compat.is_var(v) and v in lazy and v not in env and v not in deferred
    ]
    if not waiting:
      return
    anchors = [
      env[v]
      for v in eqn.invars
      if _compat.is_var(v) and v in env and v not in given and v not in lazy and _tieable(env[v])
    ]
    anchor = anchors[0] if anchors else frontier
    for v in waiting:
      pieces, rebuild_one = lazy[v]
      if anchor is not None and all(map(_compat.on_device, jax.tree.leaves(pieces))):
        pieces, _ = barrier(pieces, anchor)
      env[v] = rebuild(pieces, rebuild_one, v.aval.shape)

  def restore_inside_loops(frame, eqn):
    """A scan (or a jitted call around scans) reading residuals per iteration."""
    in_loop, in_call = _in_loop(eqn, lazy, env), _in_call(eqn, lazy, env)
    if in_loop:
      return restore_scan(
        eqn,
        [None if j in in_loop else frame.read(v) for j, v in enumerate(eqn.invars)],
        {j: lazy[v] for j, v in in_loop.items()},
        evaluate_restoring,
      )
    if in_call:  # a jitted call around the scans that read them: evaluated in place
      body = _compat.call_body(eqn)
      return evaluate_restoring(
        body.jaxpr,
        body.consts,
        [None if j in in_call else frame.read(v) for j, v in enumerate(eqn.invars)],
        {j: lazy[v] for j, v in in_call.items()},
        start=frontier,
      )
    return None

  def tie_kept(frame, eqn):
    """An equation of given values only, some `kept`: run after the latest value."""
    variables = [v for v in eqn.invars if _compat.is_var(v)]
    if (
      frontier is None
      or not any(v in kept for v in variables)
      or not all(v in given for v in variables)
    ):
      return None
    return _compat.bind_eqn(
      eqn,
      [
        kept_until_cotangent(frame.read(v), frontier)
        if _compat.is_var(v) and v in kept
        else frame.read(v)
        for v in eqn.invars
      ],
    )

  def advance_frontier(frame, eqn, outs):
    nonlocal frontier
    for var, value in zip(eqn.outvars, outs):
      if _compat.is_var(var) and _tieable(value):
        frontier = value

  interpreter.run(
    frame,
    [(interpreter.EVERY, restore_inside_loops), (interpreter.EVERY, tie_kept)],
    before=rebuild_before_use,
    after=advance_frontier,
  )
  for v in jaxpr.outvars:  # a residual passed straight through
    if _compat.is_var(v) and v in lazy and v not in env:
      env[v] = rebuild(lazy[v][0], lazy[v][1], v.aval.shape)
  return frame.read_all(jaxpr.outvars)


def _in_call(eqn, lazy: dict, env: dict) -> dict:
  """`{operand index: var}`: the `Stacked` residuals not yet rebuilt that the
  jitted call `eqn` reads (its body is evaluated in place, where a scan
  can rebuild them one iteration at a time)."""
  if _compat.call_body(eqn) is None:
    return {}
  return {
    j: v
    for j, v in enumerate(eqn.invars)
    if _compat.is_var(v) and v in lazy and v not in env and isinstance(lazy[v][0], Stacked)
  }


def _in_loop(eqn, lazy: dict, env: dict) -> dict:
  """`{operand index: var}`: the `Stacked` residuals not yet rebuilt that the
  scan `eqn` reads only as per-iteration inputs (rebuilt inside its body)."""
  parts = _compat.scan_parts(eqn)
  if parts is None:
    return {}
  first_x = parts.num_consts + parts.num_carry
  found = {}
  for j, v in enumerate(eqn.invars):
    if _compat.is_var(v) and v in lazy and v not in env and isinstance(lazy[v][0], Stacked):
      found.setdefault(v, []).append(j)
  return {js[0]: v for v, js in found.items() if len(js) == 1 and js[0] >= first_x}
