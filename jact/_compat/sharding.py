"""Mesh axes: values varying over shard_map's manual axes, sharded types, bound axis names.

jact re-binds equations on values whose varying axes differ from the traced
ones, and runs custom_vjp backward rules whose collectives need the forward
rule's axis names; where JAX keeps those facts moves between releases.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax
import jax.extend.core
import jax.numpy as jnp
from jax import lax

from jact._compat._probes import in_shard_map, probes
from jact._compat.jaxpr import is_literal, is_tracer, is_var, literal_value

__all__ = [
  "varying_axes",
  "cast_varying",
  "union_of_varying_axes",
  "leading_axis_sharded",
  "bind_eqn",
  "is_static_shape",
  "bound_axis_sizes",
  "axes_bound",
]


# ----------------------------------------------------------------------------- varying axes


def varying_axes(x) -> frozenset:
  """The manual mesh axes (inside `jax.shard_map`) over which `x` varies.

  `jax.typeof(x)` is public; where it keeps them is not: jax 0.10.2 has
  `.mat.varying`, earlier releases `.vma`. Outside shard_map: empty."""
  return _aval_varying(jax.typeof(x))


def _aval_varying(aval) -> frozenset:
  mat = getattr(aval, "mat", None)
  if mat is not None and hasattr(mat, "varying"):
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


@probes(varying_axes="jax.typeof(x).mat.varying (jax 0.10.2) / .vma (earlier) inside shard_map")
def _check_varying_axes():
  def inside(w):
    assert varying_axes(w) == frozenset(), varying_axes(w)
    v = cast_varying(w, ("i",))
    assert varying_axes(v) == frozenset({"i"}), varying_axes(v)
    return jax.lax.psum(v, "i")

  in_shard_map(inside, jnp.ones(2))
  assert varying_axes(jnp.ones(2)) == frozenset()


def cast_varying(x, axes):
  """`x` made to vary over the manual `axes` it does not vary over yet (what
  JAX inserts when an invariant value meets a varying one; its transpose is a
  psum). Public: `jax.lax.pcast(..., to='varying')` in jax 0.10.2,
  `jax.lax.pvary` before."""
  missing = tuple(
    a for a in (axes if isinstance(axes, (tuple, list)) else (axes,)) if a not in varying_axes(x)
  )
  if not missing:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, missing, to="varying")
  return lax.pvary(x, missing)


@probes(cast_varying="jax.lax.pcast(..., to='varying') / lax.pvary, and pvary_p's params['axes']")
def _check_cast_varying():
  def inside(w):
    v = cast_varying(w, ("i",))
    assert cast_varying(v, ("i",)) is v  # already varying: unchanged
    eqns = jax.make_jaxpr(lambda w: w * v)(w).eqns
    pvary = [e for e in eqns if e.primitive.name == "pvary"]
    assert pvary and "axes" in pvary[0].params, [e.primitive.name for e in eqns]
    (out,) = bind_eqn(pvary[0], [v])  # recorded for an invariant value, run on a varying one
    assert varying_axes(out) == frozenset({"i"})
    return jax.lax.psum(v, "i")

  in_shard_map(inside, jnp.ones(2))


def union_of_varying_axes(values: Sequence) -> tuple[str, ...]:
  """The manual mesh axes any of the arrays among `values` varies over, sorted
  (empty outside shard_map)."""
  return tuple(sorted(frozenset().union(*(varying_axes(v) for v in values if _is_array(v)))))


def _is_array(v) -> bool:
  return isinstance(v, jax.Array) or is_tracer(v)


@probes(union_of_varying_axes="varying_axes of each array (tracers included) inside shard_map")
def _check_union_of_varying_axes():
  def inside(w):
    v = cast_varying(w, ("i",))
    assert union_of_varying_axes([w, v, 1.0]) == ("i",), union_of_varying_axes([w, v, 1.0])
    assert union_of_varying_axes([w, 2.0]) == ()
    return jax.lax.psum(v, "i")

  in_shard_map(inside, jnp.ones(2))
  assert union_of_varying_axes([jnp.ones(2)]) == ()


def leading_axis_sharded(x) -> bool:
  """Whether `x`'s type says its leading axis is sharded (explicit sharding
  mode; under automatic sharding types carry no partitioning). Public:
  `jax.typeof(x).sharding.spec` in jax 0.10.2."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return bool(spec) and len(spec) > 0 and spec[0] is not None


@probes(leading_axis_sharded="jax.typeof(x).sharding.spec (explicit sharding mode)")
def _check_leading_axis_sharded():
  assert not leading_axis_sharded(jnp.ones((4, 2)))
  mesh = jax.make_mesh(
    (1,), ("i",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Explicit,)
  )
  x = jax.device_put(
    jnp.ones((4, 2)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
  )
  seen = []
  jax.jit(lambda x: seen.append(leading_axis_sharded(x)) or x)(x)
  assert seen == [True], seen


# ----------------------------------------------------------------------------- re-binding equations


def bind_eqn(eqn, values: Sequence) -> list:
  """Runs one equation on `values` (what `jax.core.eval_jaxpr` does per
  equation); returns its outputs as a list.

  None public in jax 0.10.2: `Primitive.get_bind_params` and the equation
  context `eqn.ctx.manager` are undocumented, and `eval_jaxpr` has no
  per-equation hook. Earlier JAX returned `(subfuns, params)` from
  `get_bind_params`; 0.10 returns the params.

  Inside `shard_map`, the values may vary over other mesh axes than those
  the equation was traced with (a jaxpr traced from abstract values, run on
  sharded ones): a `pvary` is run on the axes the value does not vary over
  yet (none: the value as it is), and operands that vary over different axes
  are first cast to vary over all of them, the cast JAX itself inserts when
  an invariant value meets a varying one."""
  prim = eqn.primitive
  if prim.name == "pvary" and len(values) == 1 and "axes" in eqn.params:
    return [cast_varying(values[0], eqn.params["axes"])]
  values = _same_varying(eqn, values)
  params = prim.get_bind_params(eqn.params)
  subfuns, params = params if isinstance(params, tuple) else ((), params)
  with eqn.ctx.manager:
    outs = prim.bind(*subfuns, *values, **params)
  return list(outs) if prim.multiple_results else [outs]


def _same_varying(eqn, values: Sequence) -> list:
  """`values` cast to vary over at least the manual axes the equation's
  operands varied over when it was traced; then, for a primitive without
  inner programs (whose operand types are fixed), the arrays cast to the
  union of their axes when they still differ. Unchanged outside shard_map."""
  recorded = [_aval_varying(var.aval) if is_var(var) else frozenset() for var in eqn.invars]
  current = [varying_axes(v) if _is_array(v) else frozenset() for v in values]
  if not any(recorded) and not any(current):  # outside shard_map: nothing to do
    return list(values)
  values = [
    cast_varying(v, tuple(sorted(r))) if _is_array(v) and r - c else v
    for v, r, c in zip(values, recorded, current)
  ]
  if len(values) < 2 or any(
    isinstance(p, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)) for p in eqn.params.values()
  ):
    return values
  union = union_of_varying_axes(values)
  if all((varying_axes(v) if _is_array(v) else frozenset()) == frozenset(union) for v in values):
    return values
  # literals (constants in the equation) become arrays of their recorded type to be cast too
  return [
    cast_varying(v if _is_array(v) else jnp.asarray(v, var.aval.dtype), union)
    for v, var in zip(values, eqn.invars)
  ]


@probes(bind_eqn="Primitive.get_bind_params, eqn.ctx.manager, Primitive.bind")
def _check_bind_eqn():
  w = jnp.ones((2, 1, 3, 3)) / 9

  def program(x, key):
    y = jax.jit(jnp.sin)(x) + lax.cond(x.sum() > 0, jnp.cos, jnp.sin, x)
    y = lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(4), y)[1]
    y = y + jax.random.uniform(key, y.shape)
    image = lax.conv_general_dilated(y.reshape(1, 1, 4, 4), w, (1, 1), "SAME")
    return image.sum() + y.sum()

  args = (jnp.arange(16.0).reshape(4, 4) / 16, jax.random.key(0))
  closed = jax.make_jaxpr(program)(*args)

  @jax.jit
  def rebound(*args):
    env = dict(zip(closed.jaxpr.constvars, closed.consts)) | dict(zip(closed.jaxpr.invars, args))
    for eqn in closed.jaxpr.eqns:
      env.update(
        zip(
          eqn.outvars,
          bind_eqn(eqn, [literal_value(v) if is_literal(v) else env[v] for v in eqn.invars]),
        )
      )
    return env[closed.jaxpr.outvars[0]]

  ours, theirs = rebound(*args), jax.jit(program)(*args)
  assert bool(jnp.allclose(ours, theirs)), "re-binding every equation changes the result"


# ----------------------------------------------------------------------------- named axes


def is_static_shape(shape) -> bool:
  """Whether every dimension of `shape` is a known integer: under `jax.export`
  with `jax.export.symbolic_shape("b, ...")` a dimension is a symbolic
  expression, which cannot be compared with a number. Public: symbolic
  dimensions are documented as not being ints; their class is not."""
  return all(isinstance(d, int) for d in shape)


@probes(is_static_shape="symbolic dimensions (jax.export) are not ints")
# One probe per compat function: (what it reads, probe).
def _check_is_static_shape():
  from jax import export  # pylint: disable=import-outside-toplevel

  (b,) = export.symbolic_shape("b")
  seen = {}

  def f(x):
    seen["shape"] = x.shape
    return x

  export.export(jax.jit(f))(jax.ShapeDtypeStruct((b, 3), jnp.float32))
  assert is_static_shape((2, 3)) and not is_static_shape(seen["shape"]), seen["shape"]


def bound_axis_sizes(axis_name) -> tuple[tuple[Any, int], ...]:
  """`((name, size), ...)` of the named axes of `axis_name` (a name or a
  tuple of names; None: every named axis) bound where this is traced
  (`jax.vmap(axis_name=)`, `shard_map`, `pmap`); names not bound here are left out.

  Public: `jax.lax.axis_size(name)`; whether a name is bound has no public
  query in jax 0.10.2 (watch `jax._src.core.get_axis_env()`: `axis_exists`, `axis_sizes`)."""
  from jax._src import core as _core  # pylint: disable=import-outside-toplevel

  env = _core.get_axis_env()
  if axis_name is None:
    return tuple(env.axis_sizes.items())
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  return tuple((n, int(lax.axis_size(n))) for n in names if env.axis_exists(n))


@contextlib.contextmanager
def axes_bound(sizes: Sequence[tuple[Any, int]]):
  """Binds the named axes `sizes` (from `bound_axis_sizes` in a forward
  rule) that are not bound here, for a custom_vjp backward rule.

  JAX traces the backward rule of a custom_vjp function batched by
  `jax.vmap(axis_name=...)` under `jax.grad` outside that vmap without the
  vmap's axis in scope (jax 0.10.2), so a collective over it there (batch
  norm's cross-device means) fails with "unbound axis name", although the
  batching trace that runs the rule handles the collective. Public
  replacement: none in jax 0.10.2; watch `jax._src.core.extend_axis_env_nd`
  and `batching.batch_custom_vjp_bwd`."""
  from jax._src import core as _core  # pylint: disable=import-outside-toplevel

  env = _core.get_axis_env()
  missing = [(n, s) for n, s in sizes if not env.axis_exists(n)]
  if not missing:
    yield
    return
  with _core.extend_axis_env_nd(missing):
    yield


@probes(
  bound_axis_sizes="jax._src.core.get_axis_env().axis_exists and lax.axis_size",
  axes_bound="jax._src.core.extend_axis_env_nd in a custom_vjp backward under vmap",
)
def _bound_axes_backward():
  """grad outside vmap(axis_name) of a custom_vjp whose backward takes a pmean."""
  sizes = {}

  @jax.custom_vjp
  def f(x):
    return x

  def fwd(x):
    sizes["b"] = bound_axis_sizes("b")
    return x, None

  def bwd(_, g):
    with axes_bound(sizes["b"]):
      return (lax.pmean(g, "b"),)

  f.defvjp(fwd, bwd)
  x = jnp.arange(4.0)
  got = jax.grad(lambda x: jnp.sum(jax.vmap(f, axis_name="b")(x) * x))(x)
  assert sizes["b"] == (("b", 4),), sizes["b"]
  seen = {}

  def record(x):
    seen["all"] = bound_axis_sizes(None)
    return x

  jax.eval_shape(jax.vmap(jax.vmap(record, axis_name="c"), axis_name="b"), jnp.ones((2, 3)))
  assert set(seen["all"]) == {("b", 2), ("c", 3)}, seen["all"]
  assert bool(jnp.allclose(got, x.mean() + x)), got  # d/dx of f(x) * x, f backward a mean
