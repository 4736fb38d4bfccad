"""XLA:CPU workarounds, in one place, and only in programs for the CPU.

XLA:CPU expands optimization barriers before it fuses and schedules, and
never fuses a pad. The ordering rules (data dependencies XLA cannot fold) go
through one primitive lowered only for the CPU, and `pad_free_group_size`
picks pad-free group sizes only when tracing for the CPU, so programs for
other platforms hold neither. Details: docs/design.md, "XLA:CPU workarounds".

>>> import jax, jax.numpy as jnp
>>> values = on_cpu(lambda v, a: [x * 1.0 for x in v], [jnp.ones(3)], [])
>>> values[0].shape
(3,)
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp

from jact import _compat

__all__ = [
  "on_cpu",
  "select_after_arrival",
  "select_after_any_arrival",
  "select_when_ready",
  "wait_when_ready",
  "row_heads",
  "always",
  "program_platform",
  "traced_for",
  "pad_free_group_size",
]

# Values computed by `rule(values, anchors)` in programs lowered for the CPU,
# passed through unchanged in any other.
_cpu_ordering_p = _compat.platform_lowered_primitive("jact_cpu_ordering", "cpu")
_compat.register_pass_through(_cpu_ordering_p)


def on_cpu(rule, values: list, anchors: list) -> list:
  """`rule(values, anchors)` in a program for the CPU, `values` in any other
  (one equation; the anchors are what the rule may read). Inside `shard_map`
  the values are first made to vary over the manual axes the anchors vary
  over, as a select between them would make them on every platform, so a
  program's types do not depend on the platform it is lowered for. Values a
  checkpoint policy offloaded to host memory pass through untouched: a
  rule's select cannot mix memory spaces, and nothing on the device reads them."""
  values = list(values)
  ordered = [i for i, v in enumerate(values) if _compat.on_device(v)]
  if not ordered:
    return values
  picked = [values[i] for i in ordered]
  axes = sorted(frozenset().union(*(_compat.varying_axes(a) for a in anchors)), key=str)
  if axes:
    picked = [_compat.cast_varying(v, tuple(axes)) for v in picked]
  for i, v in zip(
    ordered, _cpu_ordering_p.bind(*picked, *anchors, n_values=len(picked), rule=rule)
  ):
    values[i] = v
  return values


def select_after_arrival(values, anchors):
  """(CPU rule) each value selected by the always-true flag of the cotangent's
  rows (`anchors[0]`): per row where it shares the cotangent's rows."""
  arrived = always(row_heads(anchors[0]))
  return [jnp.where(_flag_for(arrived, a), a, jnp.zeros_like(a)) for a in values]


def select_after_any_arrival(values, anchors):
  """(CPU rule) each value selected by the cotangent's first row's flag; in a
  program XLA partitions over devices (`jax.jit` with shardings) the values
  pass unchanged: the first row lives on one device, and reading it from the
  others would be a collective (a one-element all-reduce per tie) that the
  plain program does not have."""
  if _compat.lowering_is_partitioned():
    return list(values)
  arrived = _first(always(row_heads(anchors[0])))
  return [jnp.where(arrived, v, jnp.zeros_like(v)) for v in values]


def row_heads(a: jax.Array) -> jax.Array:
  """The first element of each row of `a`'s leading axis (a scalar for 0-d a):
  under batch sharding every device reads only its own rows."""
  return a if a.ndim == 0 else jnp.reshape(a, (a.shape[0], -1))[:, 0]


def _first(flag: jax.Array) -> jax.Array:
  """A per-row flag reduced to a scalar (the flag of a value that has no rows):
  the first row's flag, or, when the rows are sharded in explicit sharding
  mode (which rejects reading one element of a sharded axis), all rows' flags.
  Not always the reduction: on XLA:CPU a kernel tied to it was again flipped
  at the start of the program (tests/test_memory.py flipped-kernel test)."""
  if flag.ndim == 0:
    return flag
  if _compat.leading_axis_sharded(flag):
    return jnp.all(flag)
  return flag[0]


def _flag_for(flag: jax.Array, value: jax.Array) -> jax.Array:
  """`flag` shaped to select `value`: per row when `value`'s leading axis is the
  flag's rows, else reduced to a scalar."""
  if flag.ndim == 1 and value.ndim >= 1 and value.shape[0] == flag.shape[0]:
    return jnp.reshape(flag, flag.shape + (1,) * (value.ndim - 1))
  return _first(flag)


def always(v: jax.Array) -> jax.Array:
  """Booleans, elementwise, that are True for every value of `v` (NaN and
  infinities included) but depend on it, so XLA keeps the data dependency:
  no float exceeds +inf, and `v == v` holds for any other dtype."""
  if jnp.issubdtype(v.dtype, jnp.complexfloating):
    v = jnp.real(v)
  if jnp.issubdtype(v.dtype, jnp.floating):
    return jnp.logical_not(v > jnp.asarray(jnp.inf, v.dtype))
  return v == v  # pylint: disable=comparison-with-itself


def select_when_ready(values, anchors):
  """(CPU rule) each value selected by the ready flag of the packed bytes."""
  ready = _ready_flag(anchors)
  return [jnp.where(_flag_for(ready, o), o, jnp.zeros_like(o)) for o in values]


def wait_when_ready(values, anchors):
  """(CPU rule) each value made to wait for the ready flag (`_wait_for`)."""
  ready = _ready_flag(anchors)
  return [_wait_for(o, ready) for o in values]


def _ready_flag(packed: list) -> jax.Array:
  """(In CPU rules) an always-true flag that depends on every packed byte
  array: per row (shape [rows]) when all share their leading axis -- row n
  waits for row n of each, so under data parallelism the flag is local to
  each device -- else a scalar from the rows' first bytes of each."""
  leading = {r.shape[0] if r.ndim else None for r in packed}
  if len(leading) == 1 and None not in leading:
    t = sum(row_heads(r).astype(jnp.float32) for r in packed)
  else:  # one byte of each (a sum over its rows where explicit sharding mode needs it)
    t = sum(
      jnp.sum(row_heads(r).astype(jnp.float32))
      if _compat.leading_axis_sharded(r)
      else jnp.reshape(r, (-1,))[0].astype(jnp.float32)
      for r in packed
    )
  return t == t  # pylint: disable=comparison-with-itself


def _wait_for(value: jax.Array, ready: jax.Array) -> jax.Array:
  """(In CPU rules) `value`, computed only after the always-true flag `ready`:
  a float is divided elementwise by a runtime 1.0 (see `materialize`; a
  scalar divisor is rewritten by XLA into a cheap multiplication by its
  reciprocal), anything else selected by the flag."""
  ready = _flag_for(ready, value)
  if jnp.issubdtype(value.dtype, jnp.floating):
    return value / jnp.where(ready, jnp.ones_like(value), value)
  return jnp.where(ready, value, jnp.zeros_like(value))


_TARGET = threading.local()


def program_platform() -> str:
  """The platform the function being traced is for: the innermost `traced_for`,
  else the default backend ("cpu", "cuda", "rocm" or "tpu")."""
  stack = getattr(_TARGET, "stack", None)
  return stack[-1] if stack else _compat.lowering_platform()


@contextlib.contextmanager
def traced_for(platform: str):
  """Traces inside this context as for `platform` (e.g. "cuda" when lowering
  for a GPU from a machine without one), so shapes chosen at trace time (the
  group size) are that platform's.

  >>> with traced_for("cuda"):
  ...   pad_free_group_size(784, 256)
  256
  """
  stack = getattr(_TARGET, "stack", None)
  if stack is None:
    stack = _TARGET.stack = []
  stack.append(platform)
  try:
    yield
  finally:
    stack.pop()


def pad_free_group_size(sample_size: int, group_size: int) -> int:
  """On the CPU, the largest multiple of 8 that divides `sample_size` and is
  at least a quarter of `group_size` (so no pad), else `group_size`; on any
  other platform `group_size`. (`group_size` already validated, larger than
  the sample.)

  >>> with traced_for("cpu"):
  ...   pad_free_group_size(784, 256), pad_free_group_size(32 * 32 * 64, 256)
  (112, 256)
  """
  if program_platform() != "cpu":
    return group_size
  for g in range(group_size, max(8, group_size // 4) - 1, -8):
    if sample_size % g == 0:
      return g
  return group_size
