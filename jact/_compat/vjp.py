"""The backward pass's internals: checkpoint names, the VJP object, the trace stack.

`jact.compressed` and `jact.checkpoint` read and replace the residuals inside
the object `jax.vjp` returns, name them through `checkpoint_name`, and must
know whether a jit trace is open; none of that has a public API.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as _private_core
from jax.extend.core import primitives as _primitives

from jact._compat._probes import CompatError, probes, trace_eqns
from jact._compat.calls import call_body

__all__ = [
  "checkpoint_name",
  "policy_checkpoint_name",
  "vjp_residuals",
  "rebuild_vjp",
  "current_trace",
  "jit_traces_since",
  "abstract_evaluation",
  "defvjp_batching_shared_outputs",
]


# ----------------------------------------------------------------------------- checkpoint names


def checkpoint_name(eqn) -> str | None:
  """The `jax.ad_checkpoint.checkpoint_name` an equation applies, or None.

  Public (partial): the primitive `jax.extend.core.primitives.name_p` by
  identity; that its name is `params["name"]` is undocumented (JAX's own
  policies read it the same way). None public in jax 0.10.2 for the second
  form: JAX's experimental "remat3" `checkpoint_name3` (private in 0.10.2)
  binds a `call_hi_primitive` whose `params["_prim"]` is a `CheckpointName`
  carrying `.name`; JAX's own `saved_residuals` reads both forms. Watch: if
  the public `checkpoint_name` moves to the second form, the first stops
  matching and `check()` fails here."""
  if eqn.primitive is _primitives.name_p and isinstance(eqn.params.get("name"), str):
    return eqn.params["name"]
  hi = eqn.params.get("_prim")
  if type(hi).__name__ == "CheckpointName" and isinstance(getattr(hi, "name", None), str):
    return hi.name
  return None


@probes(
  checkpoint_name=(
    "name_p / params['name'] of jax.ad_checkpoint.checkpoint_name, and "
    "params['_prim'] of the private remat3 checkpoint_name3"
  ),
)
def _check_checkpoint_name():
  from jax.ad_checkpoint import checkpoint_name as name_it  # pylint: disable=import-outside-toplevel

  found = [checkpoint_name(e) for e in trace_eqns(lambda x: name_it(x * 2, "n"), 1.0)]
  assert found == [None, "n"], f"names of (mul, checkpoint_name) are {found}, expected [None, 'n']"
  jitted = jax.make_jaxpr(jax.jit(lambda x: name_it(x * 2, "m")))(1.0).jaxpr.eqns[0]
  body = call_body(jitted)
  assert body is not None and [checkpoint_name(e) for e in body.jaxpr.eqns] == [None, "m"], (
    "checkpoint_name inside a jitted body is not recognised"
  )
  # The experimental hi-primitive form (remove that branch when JAX drops it).
  from jax._src.ad_checkpoint import checkpoint_name3  # pylint: disable=import-outside-toplevel

  hi = trace_eqns(lambda x: checkpoint_name3("h", x * 2), 1.0)
  assert [checkpoint_name(e) for e in hi] == [None, "h"], "remat3's CheckpointName not recognised"


def policy_checkpoint_name(prim, params: dict) -> str | None:
  """The checkpoint name a `jax.checkpoint` policy is asked about, or None.

  Public: the policy calling convention `policy(prim, *avals, **params)` is
  documented; that a `name_p` equation carries its name as `params["name"]`
  is not (jax's `save_only_these_names` reads `prim is name_p and
  params["name"]`). None public in jax 0.10.2 otherwise. Watch: a
  `checkpoint_name` in the hi-primitive form would give None here and
  `jact.save_compressed()` would silently save nothing -- `check()` asserts
  the policy sees the name."""
  name = params.get("name")
  return name if prim is _primitives.name_p and isinstance(name, str) else None


@probes(policy_checkpoint_name="the name a jax.checkpoint policy receives in params['name']")
def _check_policy_checkpoint_name():
  from jax.ad_checkpoint import checkpoint_name as name_it  # pylint: disable=import-outside-toplevel

  seen = []

  def policy(prim, *_, **params):
    seen.append(policy_checkpoint_name(prim, params))
    return False

  f = jax.checkpoint(lambda x: jnp.sin(name_it(jnp.sin(x), "kept")), policy=policy)
  jax.linearize(f, 1.0)
  assert "kept" in seen, f"a jax.checkpoint policy saw names {seen}, not 'kept'"
  assert policy_checkpoint_name(lax.sin_p, {"name": "x"}) is None


# ----------------------------------------------------------------------------- VJP layout


def vjp_residuals(vjp) -> tuple[list, Any]:
  """`(leaves, layout)`: the values the VJP object `jax.vjp` returned keeps
  for the backward pass, and what `rebuild_vjp` needs to rebuild it.

  None public in jax 0.10.2: the object (`jax._src.api.VJP`) is a pytree
  whose leaves are the primal inputs it uses, then the residuals, in an
  order jact's residual names (`f"{name}.{position}"`) are built from.
  `jax.ad_checkpoint.saved_residuals` was removed in 0.10; tracing
  `jax.make_jaxpr(vjp)` and taking its tracer consts gives the same values in
  another order, which would rename every residual and break saved plans.
  Works on the `ShapeDtypeStruct` form `make_jaxpr(..., return_shape=True)`
  returns too. Raises a CompatError when the object stops being such a pytree."""
  leaves, layout = jax.tree.flatten(vjp)
  if not callable(vjp) or any(
    l is vjp or not (hasattr(l, "shape") and hasattr(l, "dtype")) for l in leaves
  ):
    raise CompatError(
      "jact._compat.vjp_residuals: the object jax.vjp returns is no longer a pytree whose "
      f"leaves are its residual arrays (jax {jax.__version__}, got "
      f"{[type(l).__name__ for l in leaves]}); jact.compressed, jact.checkpoint and "
      "jact.residual_report read residuals from it. Update vjp_residuals / rebuild_vjp in "
      "jact/_compat/vjp.py."
    )
  return leaves, layout


def rebuild_vjp(layout, leaves: Sequence) -> Callable:
  """The VJP function of `vjp_residuals`'s `layout` with its residuals
  replaced by `leaves` (same shapes and dtypes). Same layout access as
  `vjp_residuals`."""
  return jax.tree.unflatten(layout, list(leaves))


@probes(
  vjp_residuals="the pytree layout of the object jax.vjp returns",
  rebuild_vjp="jax.tree.unflatten of that layout",
)
def _check_vjp_residuals():
  x = jnp.arange(3.0)
  _, vjp = jax.vjp(jnp.sin, x)
  leaves, layout = vjp_residuals(vjp)
  assert len(leaves) == 1 and bool(jnp.allclose(leaves[0], jnp.cos(x))), "sin's VJP keeps cos(x)"
  (zero,) = rebuild_vjp(layout, [jnp.zeros_like(leaves[0])])(jnp.ones(3))
  assert not bool(jnp.any(zero)), "rebuilt VJP does not use the replaced residuals"
  # The order residual names are built from: used primals, then residuals.
  # (sin, not tanh: jax 0.11 gave tanh a one-residual rule, so what tanh keeps is not stable.)
  x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
  _, vjp = jax.vjp(lambda x, w: jnp.sin(x @ w), x, w)
  leaves, layout = vjp_residuals(vjp)
  shapes = [tuple(l.shape) for l in leaves]
  assert shapes == [(2, 3), (3, 4), (2, 4)], f"sin(x @ w) VJP leaves {shapes}"
  assert bool(jnp.array_equal(leaves[1], w)) and bool(jnp.allclose(leaves[2], jnp.cos(x @ w))), (
    "sin(x @ w) VJP leaves are not (x, w, cos(x @ w))"
  )
  g = jnp.ones((2, 4))
  for a, b in zip(rebuild_vjp(layout, leaves)(g), vjp(g)):
    assert bool(jnp.array_equal(a, b)), "rebuilt VJP differs from the original"
  _, shaped = jax.make_jaxpr(lambda x: jax.vjp(jnp.sin, x), return_shape=True)(jnp.ones(3))
  assert len(vjp_residuals(shaped[1])[0]) == 1


# ----------------------------------------------------------------------------- trace state


def current_trace():
  """The innermost trace active now (an opaque object compared by identity).
  None public in jax 0.10.2: `jax._src.core.trace_ctx.trace`."""
  return _private_core.trace_ctx.trace


def jit_traces_since(outer) -> bool:
  """Whether a `jax.jit` trace opened inside trace `outer` (from
  `current_trace()`) is active now: what is read here from outside it is
  baked into the compiled function as a constant, and its later calls replay
  it. Eager `grad`/`vmap` and the staging of a `scan` or `checkpoint` body do
  not count. None public in jax 0.10.2: walks `Trace.parent_trace` from the
  current trace up to `outer`, reading each staging trace's
  `frame.debug_info.traced_for` ('jit' for jit, pjit and nnx.jit)."""
  trace = current_trace()
  while trace is not None and trace is not outer:
    info = getattr(getattr(trace, "frame", None), "debug_info", None)
    if getattr(info, "traced_for", None) == "jit":
      return True
    trace = getattr(trace, "parent_trace", None)
  return False


_ABSTRACT_ONLY = ("eval_shape", "make_jaxpr_f")  # jax functions whose traces are never compiled


def abstract_evaluation() -> bool:
  """Whether the caller runs inside `jax.eval_shape` / `nnx.eval_shape` or
  `jax.make_jaxpr`, whose jit trace is read once and never compiled. None
  public in jax 0.10.2: looks on the Python stack for those functions'
  frames (by name, in jax's own source files)."""
  root = jax.__file__.rsplit("/", 1)[0]
  frame = inspect.currentframe()
  while frame is not None:
    code = frame.f_code
    if code.co_name in _ABSTRACT_ONLY and code.co_filename.startswith(root):
      return True
    frame = frame.f_back
  return False


@probes(
  current_trace="jax._src.core.trace_ctx.trace",
  jit_traces_since=(
    "Trace.parent_trace and the staging trace's frame.debug_info.traced_for == 'jit'"
  ),
  abstract_evaluation="the frames of jax.eval_shape and jax.make_jaxpr's inner make_jaxpr_f",
)
def _check_trace_state():
  outer, seen = current_trace(), []

  def probe(x):  # a new function each time: jit's trace cache is shared with eval_shape's
    return seen.append((jit_traces_since(outer), abstract_evaluation())) or x

  jax.jit(lambda x: probe(x))(1.0)
  jax.eval_shape(lambda x: probe(x), 1.0)
  jax.make_jaxpr(lambda x: probe(x))(2.0)
  jax.grad(lambda x: probe(x))(1.0)
  jax.vmap(lambda x: probe(x))(jnp.ones(2))
  lax.scan(lambda c, x: (probe(c), None), 1.0, None, length=1)
  jax.grad(jax.checkpoint(lambda x: probe(x)))(1.0)
  jax.jit(lambda x: jax.grad(lambda y: probe(y))(x))(3.0)
  assert seen == [
    (True, False),
    (True, True),
    (True, True),
    (False, False),
    (False, False),
    (False, False),
    (False, False),
    (True, False),
  ], seen
  assert not jit_traces_since(outer) and not abstract_evaluation()


# ----------------------------------------------------------------------------- custom_vjp batching


_GENERIC_BATCHING = "generic_batching" in inspect.signature(jax.custom_vjp.defvjp).parameters


def defvjp_batching_shared_outputs(fn, fwd, bwd) -> None:
  """`fn.defvjp(fwd, bwd)`, for a rule whose outputs may be shared across a
  `vmap`'s batch (a statistic reduced over a named axis) while its inputs are
  batched. Since jax 0.12 JAX refuses to sum such a rule's per-example
  cotangents unless `generic_batching=True` (the shared output's cotangent
  goes to the first example); earlier versions accept the rule as is.

  Public: `jax.custom_vjp.defvjp(..., generic_batching=)` (jax >= 0.12).
  Watch: its default and semantics."""
  if _GENERIC_BATCHING:
    fn.defvjp(fwd, bwd, generic_batching=True)
  else:
    fn.defvjp(fwd, bwd)


@probes(defvjp_batching_shared_outputs="custom_vjp with a shared output under vmap(axis_name)")
def _check_defvjp_batching_shared_outputs():
  @jax.custom_vjp
  def f(x):
    return x * 2.0, lax.pmean(x, "i")

  def fwd(x):
    return f(x), None

  def bwd(_, g):
    return (2.0 * g[0] + g[1],)

  defvjp_batching_shared_outputs(f, fwd, bwd)

  def loss(x):
    y, m = jax.vmap(f, axis_name="i")(x)
    return jnp.sum(y) + jnp.sum(m)

  grad = jax.grad(loss)(jnp.arange(3.0))
  if not bool(jnp.all(jnp.isfinite(grad))):
    raise CompatError("a custom_vjp with a shared output under vmap gave a non-finite gradient")
