"""Reading jaxprs: atoms, evaluation, values, source info and pass-throughs.

jact walks traced programs to find what a backward pass keeps; these accessors
read the parts of a jaxpr JAX does not document (literal values, pruning,
which primitives only pass a value through).
"""

from __future__ import annotations

import re
import warnings
from typing import Sequence

import jax
import jax.core
import jax.extend.core
import jax.extend.source_info_util
import jax.numpy as jnp
from jax import lax

from jact._compat._probes import only_eqn, probes, trace_eqns

__all__ = [
  "summarize_source",
  "is_var",
  "is_literal",
  "literal_value",
  "eval_jaxpr",
  "prune_jaxpr",
  "is_tracer",
  "is_jax_value",
  "on_device",
  "barrier_operand",
  "register_pass_through",
  "passthrough_operand",
  "is_view",
]


# ----------------------------------------------------------------------------- source info


def summarize_source(eqn) -> str:
  """'file:line:col (function)' of the user code that produced `eqn`.

  Public: `jax.extend.source_info_util.summarize` (semi-public jax.extend; it
  replaces `jax._src.source_info_util`)."""
  return jax.extend.source_info_util.summarize(eqn.source_info)


@probes(summarize_source="jax.extend.source_info_util.summarize of an equation's source_info")
def _check_summarize_source():
  (eqn,) = trace_eqns(lambda x: jnp.sin(x), 1.0)  # pylint: disable=unnecessary-lambda  (a user frame)
  text = summarize_source(eqn)
  assert re.fullmatch(r".+:\d+(:\d+)? \(.+\)", text), f"summary {text!r} is not 'file:line (fn)'"


# ----------------------------------------------------------------------------- atoms and evaluation


def is_var(v) -> bool:
  """Whether a jaxpr atom is a variable. Public (semi): `jax.extend.core.Var`."""
  return isinstance(v, jax.extend.core.Var)


@probes(is_var="jax.extend.core.Var")
def _check_is_var():
  (eqn,) = trace_eqns(lambda x: x * 2.0, 1.0)
  assert is_var(eqn.invars[0]) and not is_var(eqn.invars[1])


def is_literal(v) -> bool:
  """Whether a jaxpr atom is a literal. Public (semi): `jax.extend.core.Literal`."""
  return isinstance(v, jax.extend.core.Literal)


@probes(is_literal="jax.extend.core.Literal")
def _check_is_literal():
  (eqn,) = trace_eqns(lambda x: x * 2.0, 1.0)
  assert is_literal(eqn.invars[1]) and not is_literal(eqn.invars[0])


def literal_value(v):
  """The value of a literal atom. None public in jax 0.10.2: `Literal.val`
  is undocumented."""
  return v.val


@probes(literal_value="Literal.val")
def _check_literal_value():
  (eqn,) = trace_eqns(lambda x: x * 2.0, 1.0)
  assert literal_value(eqn.invars[1]) == 2.0


def eval_jaxpr(jaxpr, consts, *args) -> list:
  """Evaluates an open jaxpr. Public: `jax.core.eval_jaxpr` (one of the
  names jax 0.10.2 keeps in `jax.core`; `jax.extend.core.jaxpr_as_fun` is
  the alternative)."""
  return jax.core.eval_jaxpr(jaxpr, consts, *args)


@probes(eval_jaxpr="jax.core.eval_jaxpr")
def _check_eval_jaxpr():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    closed = jax.make_jaxpr(lambda x: x * 2.0 + 1.0)(1.0)
    assert eval_jaxpr(closed.jaxpr, closed.consts, 3.0)[0] == 7.0


def prune_jaxpr(jaxpr, wanted: Sequence):
  """A jaxpr with no inputs computing `wanted` (variables of `jaxpr` that do
  not depend on its inputs) from its constvars; evaluate it with
  `eval_jaxpr(pruned, consts)`.

  None public in jax 0.10.2: `Jaxpr.replace` is undocumented; the public
  constructor `jax.extend.core.Jaxpr(constvars, invars, outvars, eqns)` is
  the replacement (watch: newer JAX checks `debug_info` against the arity)."""
  needed = {v for v in wanted if is_var(v)}
  eqns = []
  for eqn in reversed(jaxpr.eqns):
    if needed.intersection(eqn.outvars):
      eqns.append(eqn)
      needed.update(v for v in eqn.invars if is_var(v))
  return jaxpr.replace(invars=[], outvars=list(wanted), eqns=eqns[::-1])


@probes(prune_jaxpr="Jaxpr.replace(invars=, outvars=, eqns=)")
def _check_prune_jaxpr():
  closed = jax.make_jaxpr(lambda x: (jnp.zeros(3) + 1.0, x * 2.0))(1.0)
  pruned = prune_jaxpr(closed.jaxpr, [closed.jaxpr.outvars[0]])
  (value,) = eval_jaxpr(pruned, closed.consts)
  assert bool(jnp.array_equal(value, jnp.ones(3))), f"pruned jaxpr computes {value}"


# ----------------------------------------------------------------------------- values


def is_tracer(x) -> bool:
  """Whether `x` is a tracer (e.g. a closed-over value of an enclosing
  transformation). Public: `jax.core.Tracer` (kept in `jax.core` 0.10.2)."""
  return isinstance(x, jax.core.Tracer)


@probes(is_tracer="jax.core.Tracer")
def _check_is_tracer():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    seen = []
    jax.make_jaxpr(lambda x: seen.append(is_tracer(x)) or x)(1.0)
    assert seen == [True] and not is_tracer(jnp.ones(1)) and not is_tracer(1.0)


def is_jax_value(x) -> bool:
  """Whether `x` is a JAX value: an array, a tracer, or an object JAX reads
  as one through its `.aval` (flax.nnx Variables do).

  Public: `isinstance(x, jax.Array)` holds for every tracer in jax 0.10.2
  (jit, grad, vmap, jvp, linearize); the `.aval` duck-typing (undocumented,
  what `jax.typeof` reads) admits the foreign array-likes besides."""
  return isinstance(x, jax.Array) or hasattr(x, "aval")


@probes(is_jax_value="tracers are jax.Array; the .aval attribute")
def _check_is_jax_value():
  seen = []

  def f(x):
    seen.append(is_jax_value(x) and isinstance(x, jax.Array))
    return x.sum()

  jax.jit(f)(1.0)
  jax.grad(f)(1.0)
  jax.vmap(f)(jnp.ones(2))
  jax.jvp(f, (1.0,), (1.0,))
  assert seen == [True] * 4, f"tracers seen as JAX values: {seen}"
  assert is_jax_value(jnp.ones(1)) and not is_jax_value(1.0) and not is_jax_value("s")


def on_device(x) -> bool:
  """Whether the value `x` lives in device memory (not offloaded to the
  host). Public: `jax.typeof(x).memory_space` and `jax.memory.Space` (jax
  0.10.2); a type without a memory space counts as on the device."""
  return getattr(jax.typeof(x), "memory_space", jax.memory.Space.Device) == jax.memory.Space.Device


@probes(on_device="jax.typeof(x).memory_space, jax.memory.Space")
def _check_on_device():
  def program(x):
    assert on_device(x)
    assert not on_device(jax.device_put(x, jax.memory.Space.Host))
    return x

  jax.jit(program).lower(jnp.ones(3))


# ----------------------------------------------------------------------------- pass-throughs


def barrier_operand(eqn, out_index: int):
  """The operand behind output `out_index` of a `lax.optimization_barrier`
  equation (its outputs are its operands, position by position), or None for
  any other equation.

  Public: `jax.lax.optimization_barrier_p` by identity; the positional
  pass-through is the documented meaning of `lax.optimization_barrier`."""
  if eqn.primitive is lax.optimization_barrier_p or eqn.primitive in _PASS_THROUGH:
    return eqn.invars[out_index]
  return None


@probes(barrier_operand="lax.optimization_barrier_p and its positional pass-through")
def _check_barrier_operand():
  eqn = only_eqn(
    trace_eqns(lambda x, y: lax.optimization_barrier((x, y)), 1.0, 2.0), lax.optimization_barrier_p
  )
  assert barrier_operand(eqn, 1) is eqn.invars[1] and barrier_operand(eqn, 0) is eqn.invars[0]
  assert barrier_operand(trace_eqns(jnp.sin, 1.0)[0], 0) is None


_PASS_THROUGH: set = set()  # jact's own primitives whose outputs are their first operands


def register_pass_through(primitive) -> None:
  """Declares that output i of `primitive` is operand i, unchanged in value
  (`barrier_operand` sees through it as through an optimization barrier)."""
  _PASS_THROUGH.add(primitive)


@probes(register_pass_through="barrier_operand through a primitive declared a pass-through")
def _check_register_pass_through():
  p = jax.extend.core.Primitive("jact_compat_probe_pass_through")
  p.def_abstract_eval(lambda t: t)
  register_pass_through(p)
  try:
    eqn = only_eqn(trace_eqns(p.bind, 1.0), p)
    assert barrier_operand(eqn, 0) is eqn.invars[0], "a declared pass-through is not seen through"
  finally:
    _PASS_THROUGH.discard(p)


def passthrough_operand(eqn, out_index: int):
  """Like `barrier_operand`, also through `lax.reduce_precision` (same value,
  rounded) and casts to varying mesh axes: the operand behind output
  `out_index`, or None.

  Public: `jax.lax.optimization_barrier_p`, `jax.lax.reduce_precision_p`
  by identity."""
  if eqn.primitive is lax.reduce_precision_p or _is_varying_cast(eqn):
    return eqn.invars[out_index]
  return barrier_operand(eqn, out_index)


def _is_varying_cast(eqn) -> bool:
  """Whether `eqn` casts values to vary over manual mesh axes (the same
  values on every device: `cast_varying`). Found by the primitive's name,
  "pvary" in jax 0.10.2 (not exported); "pcast" with to="varying" in
  releases that rename it. Watch: the names and the parameter."""
  name = eqn.primitive.name
  return name == "pvary" or (name == "pcast" and str(eqn.params.get("to", "")) == "varying")


@probes(passthrough_operand="lax.reduce_precision_p / optimization_barrier_p pass-through")
def _check_passthrough_operand():
  eqn = only_eqn(
    trace_eqns(lambda x: lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7), 1.0),
    lax.reduce_precision_p,
  )
  assert passthrough_operand(eqn, 0) is eqn.invars[0]
  eqn = only_eqn(
    trace_eqns(lambda x, y: lax.optimization_barrier((x, y)), 1.0, 2.0), lax.optimization_barrier_p
  )
  assert passthrough_operand(eqn, 1) is eqn.invars[1]
  assert passthrough_operand(trace_eqns(jnp.sin, 1.0)[0], 0) is None


# Reshape-like primitives between a kernel and the residual it wrote.
# (`jnp.expand_dims` lowers to broadcast_in_dim: no "expand_dims" primitive.)
_VIEW_PRIMITIVES = (lax.reshape_p, lax.squeeze_p, lax.slice_p, lax.bitcast_convert_type_p)


def is_view(eqn) -> bool:
  """Whether `eqn` only re-views its first operand (reshape, squeeze,
  slice, bitcast).

  Public: `jax.lax.reshape_p`, `squeeze_p`, `slice_p`,
  `bitcast_convert_type_p` by identity."""
  return eqn.primitive in _VIEW_PRIMITIVES


@probes(is_view="lax.reshape_p / squeeze_p / slice_p / bitcast_convert_type_p")
def _check_is_view():
  x = jnp.ones((2, 3))
  views = [
    trace_eqns(lambda x: x.reshape(3, 2), x),
    trace_eqns(lambda x: x[1:], x),
    trace_eqns(lambda x: lax.squeeze(x[:1], (0,)), x),
    trace_eqns(lambda x: lax.bitcast_convert_type(x, jnp.int32), x),
  ]
  for eqns in views:
    assert is_view(eqns[-1]), f"{eqns[-1].primitive} not seen as a view"
  assert not is_view(trace_eqns(jnp.sin, 1.0)[0])
