"""Telling primitives apart, and making jact's own primitives.

Which equations reduce, keep rows, are elementwise or only move data is
decided by primitive names JAX does not export; jact's custom primitives use
the semi-public `jax.extend.core.Primitive` route with undocumented rule
conventions.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any, Callable

import jax
import jax.extend.core
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad, batching, mlir

from jact._compat._probes import only_eqn, probes, trace_eqns
from jact._compat.jaxpr import barrier_operand, register_pass_through

__all__ = [
  "max_window_geometry",
  "is_reduction",
  "reduced_axes",
  "is_row_link",
  "elementwise_kind",
  "is_layout_primitive",
  "conv_kwargs",
  "linear_identity_primitive",
  "platform_lowered_primitive",
  "lowering_is_partitioned",
]


# ----------------------------------------------------------------------------- classification


def max_window_geometry(eqn) -> tuple | None:
  """`(window_dimensions, window_strides, padding)` of a max-pooling
  equation (`lax.reduce_window` with `lax.max` and a -inf init, undilated),
  else None. None public in jax 0.10.2: the primitive (`reduce_window_max`)
  and its params are internal; the public call is `lax.reduce_window`."""
  if eqn.primitive.name != "reduce_window_max":
    return None
  params = eqn.params
  if any(d != 1 for d in params["base_dilation"]) or any(d != 1 for d in params["window_dilation"]):
    return None
  return (
    tuple(params["window_dimensions"]),
    tuple(params["window_strides"]),
    tuple(tuple(p) for p in params["padding"]),
  )


@probes(max_window_geometry="lax.reduce_window(x, -inf, lax.max, ...)")
def _check_max_window_geometry():
  x = jnp.ones((1, 4, 4, 1))
  pooled = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
  [eqn] = trace_eqns(
    lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"), x
  )
  assert pooled.shape == (1, 2, 2, 1)
  assert max_window_geometry(eqn) == ((1, 2, 2, 1), (1, 2, 2, 1), ((0, 0),) * 4), eqn
  [summed] = trace_eqns(
    lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"), x
  )
  assert max_window_geometry(summed) is None


_REDUCTION_PRIMITIVES = frozenset(
  {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "argmax",
    "argmin",
    "reduce",
  }
)


def is_reduction(eqn) -> bool:
  """Whether `eqn` reduces its operand over some axes (sum, max, min,
  product, arg-max, a general `lax.reduce`). None public in jax 0.10.2:
  the reduction primitives are told apart by their internal names."""
  return eqn.primitive.name in _REDUCTION_PRIMITIVES


@probes(is_reduction="primitive names")
def _check_is_reduction():
  x = jnp.ones((4, 3))
  eqns = trace_eqns(
    lambda x: (x.sum(0), x.max(1), jnp.argmax(x, 1), x @ x.T, lax.reduce(x, 0.0, lax.add, (0,))), x
  )
  found = [is_reduction(e) for e in eqns]
  assert found == [True, True, True, False, False, True], [e.primitive for e in eqns]


def reduced_axes(eqn) -> tuple[int, ...] | None:
  """The operand axes a reduction equation (`is_reduction`) reduces, or
  None. None public in jax 0.10.2: the axes are `params["axes"]` of the
  reduce_* / arg-max primitives (a general `lax.reduce` names them
  `dimensions`)."""
  if not is_reduction(eqn):
    return None
  axes = eqn.params.get("axes", eqn.params.get("dimensions"))
  return None if axes is None else tuple(int(a) for a in axes)


@probes(reduced_axes="params['axes'] of reduce_sum / reduce_max / argmax")
def _check_reduced_axes():
  x = jnp.ones((4, 3, 2))
  eqns = trace_eqns(lambda x: (x.sum((0, 2)), x.max(1), jnp.argmax(x, 2), x * 2), x)
  found = [reduced_axes(e) for e in eqns]
  assert found == [(0, 2), (1,), (2,), None], [(e.primitive, e.params) for e in eqns]


_ROW_LINKS = frozenset(
  {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "neg",
    "convert_element_type",
    "integer_pow",
    "square",
    "copy",
    "copy_p",
  }
)


def is_row_link(eqn) -> bool:
  """Whether `eqn` is elementwise arithmetic that keeps its operands' rows
  (sums, differences, products and quotients with broadcast values, casts,
  integer powers): what links a residual to the tensor a normalization's
  statistic is computed from. None public in jax 0.10.2: primitives are
  told apart by their internal names."""
  return eqn.primitive.name in _ROW_LINKS


@probes(is_row_link="primitive names")
def _check_is_row_link():
  x = jnp.ones((4, 3))
  eqns = trace_eqns(lambda x: ((x - x.mean(1, keepdims=True)) ** 2 * 2.0, jnp.tanh(x)), x)
  found = [is_row_link(e) for e in eqns]
  assert found == [False, False, True, True, True, True, False], [e.primitive for e in eqns]


_ELEMENTWISE_LINEAR = frozenset({"add", "sub", "neg", "convert_element_type", "copy", "copy_p"})


_ELEMENTWISE_NONLINEAR = frozenset(
  {
    "mul",
    "div",
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "logistic",
    "integer_pow",
    "sqrt",
    "rsqrt",
    "cbrt",
    "pow",
    "erf",
    "erfc",
    "sin",
    "cos",
    "tan",
    "atan",
    "asinh",
    "acosh",
    "atanh",
    "sinh",
    "cosh",
    "abs",
    "square",
    "max",
    "min",
    "one_minus_square",
  }
)  # 1 - x**2: tanh's derivative on jax >= 0.11


def elementwise_kind(eqn) -> str | None:
  """'linear' or 'nonlinear' when `eqn` is an elementwise arithmetic
  primitive of floats (sum, difference, cast; products, quotients and unary
  functions such as exp, tanh, logistic, integer_pow), else None. None public
  in jax 0.10.2: primitives are told apart by their internal names."""
  name = eqn.primitive.name
  if name in _ELEMENTWISE_LINEAR:
    return "linear"
  return "nonlinear" if name in _ELEMENTWISE_NONLINEAR else None


@probes(elementwise_kind="primitive names")
def _check_elementwise_kind():
  eqns = trace_eqns(lambda x: (jnp.tanh(x) * x + 1.0, x**3, x.sum()), jnp.ones(3))
  found = [elementwise_kind(e) for e in eqns]
  assert found == ["nonlinear", "nonlinear", "linear", "nonlinear", None], [
    e.primitive for e in eqns
  ]


_LAYOUT_PRIMITIVES = frozenset(
  {
    "concatenate",
    "broadcast_in_dim",
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "convert_element_type",
  }
)


def is_layout_primitive(prim) -> bool:
  """Whether primitive `prim` (as a `jax.checkpoint` policy sees it) only
  moves, copies or casts values (concatenate, reshape, transpose, ...). None
  public in jax 0.10.2: primitives are told apart by their internal names."""
  return prim.name in _LAYOUT_PRIMITIVES


@probes(is_layout_primitive="primitive names")
def _check_is_layout_primitive():
  eqns = trace_eqns(
    lambda x: jnp.concatenate([x, x]).reshape(2, -1).T.astype(jnp.bfloat16) * 2, jnp.ones(3)
  )
  layout = [is_layout_primitive(e.primitive) for e in eqns]
  assert layout == [True, True, True, True, False], [e.primitive for e in eqns]


def conv_kwargs(eqn) -> dict | None:
  """The keyword arguments of `lax.conv_general_dilated` that reproduce a
  convolution equation (None for other equations and for sharded
  convolutions, which jact does not rewrite).

  Public (partial): `jax.lax.conv_general_dilated_p` by identity; that its
  params are the function's keywords (plus `out_sharding`) is undocumented,
  and `dimension_numbers` arrives in its internal `ConvDimensionNumbers`
  form."""
  if eqn.primitive is not lax.conv_general_dilated_p or eqn.params.get("out_sharding") is not None:
    return None
  return {k: v for k, v in eqn.params.items() if k != "out_sharding"}


@probes(conv_kwargs="conv_general_dilated_p params as lax.conv_general_dilated keywords")
def _check_conv_kwargs():
  x, w = jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3))
  conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", rhs_dilation=(2, 1))
  eqn = only_eqn(trace_eqns(conv, x, w), lax.conv_general_dilated_p)
  kwargs = conv_kwargs(eqn)
  accepted = set(inspect.signature(lax.conv_general_dilated).parameters)
  assert kwargs is not None and set(kwargs) <= accepted, (
    f"conv params {sorted(set(kwargs or ()) - accepted)} are not lax.conv_general_dilated keywords"
  )
  assert bool(jnp.array_equal(lax.conv_general_dilated(x, w, **kwargs), conv(x, w)))
  assert conv_kwargs(trace_eqns(jnp.sin, 1.0)[0]) is None


# ----------------------------------------------------------------------------- new primitives


def linear_identity_primitive(name: str, fail: Callable[..., Any]) -> jax.extend.core.Primitive:
  """A new primitive `p` with `p.bind(t, **params)`: shape-preserving,
  linear, transposed to the identity, batched elementwise; evaluating or
  lowering it calls `fail(*operands, **params)` (which should raise).

  Public (semi): `jax.extend.core.Primitive` with `jax.interpreters.ad`,
  `batching` and `mlir` -- the documented route for custom primitives; the
  transpose-rule convention `(ct, *operands, **params)` of `ad.deflinear2`
  is undocumented."""
  p = jax.extend.core.Primitive(name)
  p.def_impl(fail)
  p.def_abstract_eval(lambda t, **_: t)
  mlir.register_lowering(p, fail)
  batching.defvectorized(p)
  ad.deflinear2(p, lambda ct, _, **__: [ct])
  return p


@probes(
  linear_identity_primitive=(
    "jax.extend.core.Primitive with jax.interpreters.ad.deflinear2, "
    "batching.defvectorized, mlir.register_lowering"
  ),
)
def _check_linear_identity_primitive():
  def fail(*_, **__):
    raise TypeError("jact probe: forward mode evaluated")

  p = linear_identity_primitive("jact_compat_probe", fail)
  t = jnp.arange(3.0)
  assert jax.make_jaxpr(lambda t: p.bind(t))(t).out_avals[0].shape == (3,)
  assert jax.make_jaxpr(jax.vmap(lambda t: p.bind(t)))(jnp.ones((2, 3))).out_avals[0].shape == (
    2,
    3,
  )
  (transposed,) = jax.linear_transpose(lambda t: p.bind(t), t)(t)
  assert bool(jnp.array_equal(transposed, t)), "the transpose is not the identity"
  try:
    p.bind(t)
  except TypeError as e:
    assert "jact probe" in str(e)
  else:
    raise AssertionError("evaluating the primitive did not call fail")


_PARTITIONED = contextvars.ContextVar("jact_lowering_partitioned", default=None)


def lowering_is_partitioned() -> bool:
  """Inside the rule of a `platform_lowered_primitive` being lowered: whether
  the program is one SPMD program that XLA partitions over more than one
  device (`jax.jit` with shardings, outside `shard_map`'s manual axes), where
  reading one element of a sharded value is a collective. False elsewhere
  (one device, a `shard_map` body over all its mesh axes, not lowering).

  None public in jax 0.10.2: the lowering context's `module_context.axis_context`
  (a `ShardingContext` with `num_devices`, or inside `shard_map` an
  `SPMDAxisContext` with `mesh` and `manual_axes`) is internal."""
  return _PARTITIONED.get() is True


def _partitioned(ctx) -> bool | None:
  """True / False as `lowering_is_partitioned` says; None for an axis context
  of an unknown kind (read as not partitioned; the probe fails on it)."""
  context = getattr(ctx.module_context, "axis_context", None)
  devices = getattr(context, "num_devices", None)
  if devices is not None:
    return devices > 1
  mesh = getattr(context, "mesh", None)
  if mesh is None:
    return None
  manual = getattr(context, "manual_axes", frozenset())
  return any(size > 1 and axis not in manual for axis, size in dict(mesh.shape).items())


# An operand a batching rule receives unbatched: `batching.not_mapped` in older
# releases, None since (the old name deprecated).
_NOT_MAPPED = getattr(batching, "not_mapped", None)


def platform_lowered_primitive(name: str, platform: str) -> jax.extend.core.Primitive:
  """A new multiple-result primitive `p` for code that only one platform's
  programs should contain: `p.bind(*values, *anchors, n_values=k, rule=f)`
  returns the k values unchanged in type (shape, dtype, sharding, varying
  axes), computed by `f(values, anchors)` (a list of k arrays, traced with
  jax.numpy) in a program lowered for `platform` and passed through unchanged
  on every other platform (the anchors then unused). Forward mode passes the
  values' tangents through; `vmap` maps `f` (every value batched). Evaluated
  eagerly (outside `jit`), it returns the values.

  Public (semi): `jax.extend.core.Primitive` with `mlir.register_lowering(...,
  platform=)` and `mlir.lower_fun` -- the documented route for custom
  primitives with per-platform lowerings; the batching-rule convention (an
  unbatched operand's dimension is None, `batching.not_mapped` before) is
  undocumented (watch: its signature). While `f` is traced,
  `lowering_is_partitioned()` says whether the program is partitioned over
  devices."""
  p = jax.extend.core.Primitive(name)
  p.multiple_results = True
  p.def_impl(lambda *args, n_values, rule: list(args[:n_values]))
  p.def_abstract_eval(lambda *avals, n_values, rule: list(avals[:n_values]))

  def on_platform(*args, n_values, rule):
    with jax.named_scope(name):  # the rule's operations carry the name in the program's locations
      return list(rule(list(args[:n_values]), list(args[n_values:])))

  def lower(ctx, *args, n_values, rule):
    token = _PARTITIONED.set(_partitioned(ctx))
    try:
      lowered = mlir.lower_fun(on_platform, multiple_results=True)
      return lowered(ctx, *args, n_values=n_values, rule=rule)
    finally:
      _PARTITIONED.reset(token)

  mlir.register_lowering(p, lower, platform=platform)
  mlir.register_lowering(p, lambda ctx, *args, n_values, rule: list(args[:n_values]))

  def jvp(primals, tangents, *, n_values, rule):
    return p.bind(*primals, n_values=n_values, rule=rule), list(tangents[:n_values])

  def batch(args, dims, *, n_values, rule):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    values = [
      jnp.moveaxis(a, d, 0) if d is not _NOT_MAPPED else jnp.broadcast_to(a, (size,) + a.shape)
      for a, d in zip(args[:n_values], dims)
    ]
    anchors = list(args[n_values:])
    axes = [None if d is _NOT_MAPPED else d for d in dims[n_values:]]
    mapped = lambda v, a: rule(list(v), list(a))
    batched_rule = lambda v, a: jax.vmap(mapped, in_axes=(0, axes), axis_size=size)(v, a)
    return p.bind(*values, *anchors, n_values=n_values, rule=batched_rule), [0] * n_values

  ad.primitive_jvps[p] = jvp
  batching.primitive_batchers[p] = batch
  return p


@probes(
  platform_lowered_primitive=(
    "jax.extend.core.Primitive, mlir.register_lowering(platform=), mlir.lower_fun, "
    "batching.primitive_batchers / not_mapped, ad.primitive_jvps"
  ),
  lowering_is_partitioned="the lowering context's module_context.axis_context",
)
def _check_platform_lowered_primitive():
  p = platform_lowered_primitive("jact_compat_probe_platform", "cpu")
  double = lambda values, anchors: [v * 2.0 + 0.0 * anchors[0] for v in values]
  f = lambda t, a: p.bind(t, a, n_values=1, rule=double)[0]
  t, a = jnp.arange(3.0), jnp.float32(1.0)
  assert bool(jnp.array_equal(f(t, a), t)), "eager evaluation is not the identity"
  expected = t * 2.0 if jax.default_backend() == "cpu" else t
  assert bool(jnp.array_equal(jax.jit(f)(t, a), expected)), "the lowered rule was not applied"
  batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(jnp.ones((2, 3)), a)
  assert batched.shape == (2, 3)
  _, tangent = jax.jvp(lambda t: f(t, a), (t,), (jnp.ones(3),))
  assert bool(jnp.array_equal(tangent, jnp.ones(3))), "forward mode does not pass the tangent"
  seen = []
  record = lambda values, anchors: seen.append(_PARTITIONED.get()) or values
  jax.jit(lambda t: p.bind(t, a, n_values=1, rule=record)[0]).lower(t)
  # one device: a known axis context, not partitioned (None: the context's fields moved)
  assert seen == [False] and not lowering_is_partitioned(), seen
  text = jax.jit(f).trace(t, a).lower(lowering_platforms=("cuda",)).as_text(debug_info=True)
  assert "jact_compat_probe_platform" not in text, "the rule is lowered for another platform"
  register_pass_through(p)
  eqn = only_eqn(trace_eqns(lambda t: p.bind(t, a, n_values=1, rule=double), t), p)
  assert barrier_operand(eqn, 0) is eqn.invars[0]
