"""Calls inside a jaxpr: jit and closed_call bodies, scan, shard_map, platform_dependent.

jact enters nested programs to find residuals and to run a scan's body again;
where each body sits in the equation's params and how its operands map onto
the outer ones is undocumented.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.extend.core
import jax.extend.linear_util
import jax.numpy as jnp
from jax import lax
from jax.extend.core import primitives as _primitives

from jact._compat._probes import in_shard_map, probes, trace_eqns
from jact._compat.jaxpr import eval_jaxpr, is_var

__all__ = [
  "is_call",
  "call_body",
  "call_name",
  "shard_map_body",
  "nested_output",
  "ScanParts",
  "scan_parts",
  "platform_dependent_branch",
  "body_operand",
]


# ----------------------------------------------------------------------------- jit and closed_call


# `jax.jit` and `closed_call` bodies. On jax 0.10.2 the jit primitive is named
# "jit" ("pjit" before); "pjit" and "core_call" name no primitive any more, and
# `call_p` (named "call", with an open `call_jaxpr`) is not entered by jact.
_CALL_PRIMITIVES = (_primitives.jit_p, _primitives.closed_call_p)


def is_call(eqn) -> bool:
  """Whether `eqn` calls a jitted function or a `closed_call` body.

  Public: `jax.extend.core.primitives.jit_p` / `closed_call_p` by identity."""
  return eqn.primitive in _CALL_PRIMITIVES


def _closed_call_eqn():
  # What JAX's own rules stage (scan partial evaluation, custom_vjp DCE).
  inner = jax.make_jaxpr(jnp.cos)(1.0)
  fun = jax.extend.linear_util.wrap_init(
    jax.extend.core.jaxpr_as_fun(inner), debug_info=inner.jaxpr.debug_info
  )
  return trace_eqns(
    lambda x: _primitives.closed_call_p.bind(x, subfuns=(fun,), call_jaxpr=inner)[0], 1.0
  )[0]


@probes(is_call="jit_p / closed_call_p in jax.extend.core.primitives")
def _check_is_call():
  (eqn,) = trace_eqns(jax.jit(jnp.sin), 1.0)
  assert is_call(eqn) and is_call(_closed_call_eqn()), "jit / closed_call not recognised"
  assert not is_call(trace_eqns(jnp.sin, 1.0)[0])


def call_body(eqn, *, closed_call: bool = True) -> jax.extend.core.ClosedJaxpr | None:
  """The body of a jit (or, unless `closed_call=False`, closed_call)
  equation whose inputs and outputs map 1:1 onto the body's, or None.

  Public (partial): the primitives by identity; the body is
  `params["jaxpr"]` for jit and `params["call_jaxpr"]` for closed_call
  (undocumented; `jax.extend.core.jaxprs_in_params` finds it key-agnostically
  but yields the open jaxpr without its consts). Watch: the key names and
  the 1:1 operand mapping."""
  if eqn.primitive is _primitives.jit_p:
    body = eqn.params.get("jaxpr")
  elif closed_call and eqn.primitive is _primitives.closed_call_p:
    body = eqn.params.get("call_jaxpr")
  else:
    return None
  if not isinstance(body, jax.extend.core.ClosedJaxpr):
    return None
  if len(body.jaxpr.invars) != len(eqn.invars) or len(body.jaxpr.outvars) != len(eqn.outvars):
    return None
  return body


@probes(call_body="the body of jit / closed_call in params['jaxpr'] / params['call_jaxpr']")
def _check_call_body():
  for eqn, fn in ((trace_eqns(jax.jit(jnp.sin), 1.0)[0], jnp.sin), (_closed_call_eqn(), jnp.cos)):
    body = call_body(eqn)
    assert body is not None, f"no body found in {eqn.primitive} (params {sorted(eqn.params)})"
    assert eval_jaxpr(body.jaxpr, body.consts, 0.5)[0] == fn(0.5), f"wrong body of {eqn.primitive}"
  assert call_body(_closed_call_eqn(), closed_call=False) is None
  assert call_body(trace_eqns(jax.jit(jnp.sin), 1.0)[0], closed_call=False) is not None
  assert call_body(trace_eqns(jnp.sin, 1.0)[0]) is None


def call_name(eqn) -> str | None:
  """The name of the function a jit equation calls (None for closed_call).

  None public in jax 0.10.2: `params["name"]` of `jit_p`. Watch the key."""
  name = eqn.params.get("name") if is_call(eqn) else None
  return name if isinstance(name, str) else None


@probes(call_name="the jitted function's name in jit's params['name']")
def _check_call_name():
  def sine(x):
    return jnp.sin(x)

  (eqn,) = trace_eqns(jax.jit(sine), 1.0)
  assert call_name(eqn) == "sine", f"jit's function name read as {call_name(eqn)!r}"
  assert call_name(_closed_call_eqn()) is None


# ----------------------------------------------------------------------------- shard_map


def shard_map_body(eqn):
  """The per-device body (an open jaxpr) of a `jax.shard_map` equation whose
  inputs and outputs map 1:1 onto the body's, or None.

  Public (partial): the primitive is found by its name "shard_map" (not in
  `jax.extend.core.primitives` in jax 0.10.2); its body is
  `params["jaxpr"]` (undocumented). Watch: the name, the key and the 1:1
  mapping."""
  if eqn.primitive.name != "shard_map":
    return None
  body = eqn.params.get("jaxpr")
  body = getattr(body, "jaxpr", body)  # a ClosedJaxpr in other releases
  if not isinstance(body, jax.extend.core.Jaxpr):
    return None
  if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
    return None
  return body


@probes(shard_map_body="the jax.shard_map primitive (by name) and its params['jaxpr']")
def _check_shard_map_body():
  (eqn,) = trace_eqns(lambda x: in_shard_map(jnp.sin, x), jnp.ones(2))
  body = shard_map_body(eqn)
  assert body is not None, f"no body found in {eqn.primitive} (params {sorted(eqn.params)})"
  assert [e.primitive for e in body.eqns] == [lax.sin_p], body
  assert shard_map_body(trace_eqns(jnp.sin, 1.0)[0]) is None


# ----------------------------------------------------------------------------- scan


def nested_output(eqn, i: int) -> tuple | None:
  """`(body, var)`: the open jaxpr and its output variable behind output `i`
  of a jit / closed_call / scan equation (a scan's body outputs map 1:1 onto
  the scan's: carries, then stacked per-iteration values), else None.

  Public (partial): the primitives by identity (`jax.extend.core.primitives`);
  a scan's body is `params["jaxpr"]` (undocumented). Watch: the key and the
  1:1 output mapping."""
  body = call_body(eqn)
  if body is None and eqn.primitive is _primitives.scan_p:
    body = eqn.params.get("jaxpr")
  if not isinstance(body, jax.extend.core.ClosedJaxpr):
    return None
  outvars = body.jaxpr.outvars
  if len(outvars) != len(eqn.outvars) or not is_var(outvars[i]):
    return None
  return body.jaxpr, outvars[i]


@probes(nested_output="jit_p / closed_call_p / scan_p; params['jaxpr'] and its 1:1 outputs")
def _check_nested_output():
  def program(x):
    y = jax.jit(jnp.sin)(x)
    return lax.scan(lambda c, r: (c + r, c * r), 0.0, y)

  eqns = trace_eqns(program, jnp.ones(3))
  for eqn, i, primitive in ((eqns[0], 0, lax.sin_p), (eqns[1], 1, lax.mul_p)):
    body, var = nested_output(eqn, i)
    [producer] = [e for e in body.eqns if var in e.outvars]
    assert producer.primitive is primitive, producer
  assert nested_output(eqns[1], 0) is not None
  assert nested_output(trace_eqns(jnp.sin, 1.0)[0], 0) is None


class ScanParts(NamedTuple):
  """What `lax.scan` needs to run a scan equation's body again."""

  body: Any  # ClosedJaxpr: (consts, carry, x) -> (carry, y)
  num_consts: int
  num_carry: int
  length: int
  reverse: bool
  unroll: Any


def scan_parts(eqn) -> ScanParts | None:
  """The body and settings of a `lax.scan` equation (its operands are the
  body's consts, then the initial carry, then the stacked xs), else None.

  Public (partial): `jax.extend.core.primitives.scan_p` by identity; its
  params are undocumented. `jaxpr`, `length`, `reverse`, `unroll` are read as
  they are; how many operands are consts and carries comes from
  `num_consts`/`num_carry` on jax 0.10.2 and from `ft_in` on jax >= 0.11 (a
  flat tree of three groups, consts / carry / xs, whose leaves count the
  operands: `len(ft_in.unpack()[0])`). Watch: the keys and the operand order."""
  if eqn.primitive is not _primitives.scan_p:
    return None
  p = eqn.params
  if not isinstance(p.get("jaxpr"), jax.extend.core.ClosedJaxpr):
    return None
  if "num_consts" in p:
    num_consts, num_carry = p["num_consts"], p["num_carry"]
  else:
    consts, carry, _ = p["ft_in"].unpack()
    num_consts, num_carry = len(consts), len(carry)
  return ScanParts(p["jaxpr"], num_consts, num_carry, p["length"], p["reverse"], p["unroll"])


@probes(
  scan_parts=(
    "scan_p; params jaxpr, num_consts/num_carry (jax 0.10) or ft_in (>= 0.11), "
    "length, reverse, unroll"
  ),
  ScanParts="the scan settings lax.scan takes again (what scan_parts returns)",
)
def _check_scan_parts():
  w = jnp.float32(3.0)
  (eqn,) = trace_eqns(
    lambda c, xs: lax.scan(lambda c, x: (c * w + x, c - x), c, xs, reverse=True),
    1.0,
    jnp.arange(4.0),
  )
  parts = scan_parts(eqn)
  assert parts is not None and (parts.num_consts, parts.num_carry, parts.length) == (1, 1, 4), parts
  assert parts.reverse is True
  consts, init, xs = eqn.invars[:1], eqn.invars[1:2], eqn.invars[2:]
  assert len(consts) + len(init) + len(xs) == len(parts.body.jaxpr.invars)
  carry, y = eval_jaxpr(parts.body.jaxpr, parts.body.consts, 3.0, 2.0, 1.0)
  assert (carry, y) == (7.0, 1.0), (carry, y)
  assert scan_parts(trace_eqns(jnp.sin, 1.0)[0]) is None


# ----------------------------------------------------------------------------- platform_dependent


def platform_dependent_branch(eqn, producer_of: Callable[[Any], Any], platform: str):
  """The branch (an open Jaxpr) a `lax.platform_dependent` cond runs on
  `platform` ("cpu", "cuda", "rocm", "tpu"), or None for any other equation.

  `producer_of(var)` returns the equation that produced `var` (or None).
  None public in jax 0.10.2: the cond's index comes from a `platform_index`
  equation (primitive not exported; recognised by name) whose
  `params["platforms"]` holds one tuple of platform names per branch, None
  for the default; the cond's branches are `params["branches"]`. Watch: the
  cond also carries `params["branches_platforms"]` on 0.10.2, a simpler
  route if `platform_index` goes away."""
  if eqn.primitive is not _primitives.cond_p:
    return None
  found = producer_of(eqn.invars[0])
  if found is None or found.primitive.name != "platform_index":
    return None
  choices = found.params["platforms"]
  index = next(
    (i for i, p in enumerate(choices) if p is not None and platform in p),
    next((i for i, p in enumerate(choices) if p is None), None),
  )
  if index is None:
    return None
  return eqn.params["branches"][index].jaxpr


def _platform_program():
  closed = jax.make_jaxpr(
    lambda x: lax.platform_dependent(x, cpu=lambda y: y * 2.0, default=lambda y: y * 3.0)
  )(1.0)
  producers = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
  return closed.jaxpr.eqns[-1], producers.get


@probes(
  platform_dependent_branch=(
    "lax.platform_dependent: platform_index params['platforms'] and cond params['branches']"
  ),
)
def _check_platform_dependent_branch():
  eqn, producer_of = _platform_program()
  for platform, factor in (("cpu", 2.0), ("cuda", 3.0)):
    branch = platform_dependent_branch(eqn, producer_of, platform)
    assert branch is not None, f"no branch found for {platform}"
    assert eval_jaxpr(branch, (), 1.0)[0] == factor, f"wrong branch for {platform}"
  plain = trace_eqns(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x), True, 1.0)[-1]
  assert platform_dependent_branch(plain, {}.get, "cpu") is None


def body_operand(eqn, j: int):
  """The outer operand behind input `j` of the body `call_body` or
  `platform_dependent_branch` entered (a cond's first operand is its index).

  Public: `cond_p` by identity; the operand layout of `cond` (index first)
  is undocumented."""
  return eqn.invars[j + (eqn.primitive is _primitives.cond_p)]


@probes(body_operand="cond's operand layout (index first)")
def _check_body_operand():
  eqn, _ = _platform_program()
  assert body_operand(eqn, 0) is eqn.invars[1], "a cond's operands do not follow its index"
  (call,) = trace_eqns(jax.jit(lambda x, y: x * y), 1.0, 2.0)
  assert body_operand(call, 1) is call.invars[1]
