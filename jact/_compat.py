"""Every private or undocumented JAX access jact makes, in one place.

jact reads traced programs (jaxprs) and the object `jax.vjp` returns in ways
JAX does not document: primitives recognised by identity or name, equation
parameters, the pytree layout of a VJP. Each such access is one small
function here, with a comment naming the public API that would replace it
(or "none public in jax 0.10.2" and what to watch). Nothing else in jact
touches `jax._src`, `jax.core`, `jax.extend`, `jax.interpreters` or equation
parameters; tests/test_compat.py enforces that with a grep gate.

`check()` runs every access on a tiny program and raises a `CompatError`
naming the access and the function to fix when the installed JAX changed it
(tests/test_compat.py runs it, one test per function).

This module imports only JAX: it sits below jact/_core in the import graph.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import warnings
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import jax
import jax.core
import jax.extend.backend
import jax.extend.core
import jax.extend.linear_util
import jax.extend.source_info_util
import jax.numpy as jnp
from jax import lax
from jax._src import ad_checkpoint as _private_ad_checkpoint
from jax._src import core as _private_core
from jax.experimental import pallas as _pallas
from jax.experimental.pallas import triton as _pallas_triton
from jax.extend.core import primitives as _primitives
from jax.interpreters import ad, batching, mlir

__all__ = [
    "CompatError", "CHECKS", "check", "reduced_axes", "is_row_link",
    "summarize_source", "checkpoint_name", "policy_checkpoint_name", "barrier_operand",
    "passthrough_operand", "is_call", "call_body", "call_name", "platform_dependent_branch",
    "body_operand", "nested_output", "scan_parts", "lowering_platform", "is_view", "pallas_kernel_name", "vjp_residuals",
    "rebuild_vjp", "eval_jaxpr", "is_tracer", "is_jax_value", "on_device", "is_var", "is_literal",
    "literal_value", "prune_jaxpr", "bind_eqn", "max_window_geometry", "is_reduction", "is_layout_primitive",
    "elementwise_kind",
    "conv_kwargs", "linear_identity_primitive", "platform_lowered_primitive", "register_pass_through",
    "saved_residuals", "current_trace", "jit_traces_since", "abstract_evaluation", "varying_axes", "cast_varying", "leading_axis_sharded", "lower_for_cuda",
    "is_static_shape", "bound_axis_sizes", "axes_bound",
]


class CompatError(RuntimeError):
  """The installed JAX changed something jact reads through `jact._compat`."""


# ----------------------------------------------------------------------------- source info

def summarize_source(eqn) -> str:
  """'file:line:col (function)' of the user code that produced `eqn`.

  Public: `jax.extend.source_info_util.summarize` (semi-public jax.extend; it
  replaces `jax._src.source_info_util`)."""
  return jax.extend.source_info_util.summarize(eqn.source_info)


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


_PASS_THROUGH: set = set()  # jact's own primitives whose outputs are their first operands


def register_pass_through(primitive) -> None:
  """Declares that output i of `primitive` is operand i, unchanged in value
  (`barrier_operand` sees through it as through an optimization barrier)."""
  _PASS_THROUGH.add(primitive)


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


# ----------------------------------------------------------------------------- calls

# `jax.jit` and `closed_call` bodies. On jax 0.10.2 the jit primitive is named
# "jit" ("pjit" before); "pjit" and "core_call" name no primitive any more, and
# `call_p` (named "call", with an open `call_jaxpr`) is not entered by jact.
_CALL_PRIMITIVES = (_primitives.jit_p, _primitives.closed_call_p)


def is_call(eqn) -> bool:
  """Whether `eqn` calls a jitted function or a `closed_call` body.

  Public: `jax.extend.core.primitives.jit_p` / `closed_call_p` by identity."""
  return eqn.primitive in _CALL_PRIMITIVES


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


def call_name(eqn) -> str | None:
  """The name of the function a jit equation calls (None for closed_call).

  None public in jax 0.10.2: `params["name"]` of `jit_p`. Watch the key."""
  name = eqn.params.get("name") if is_call(eqn) else None
  return name if isinstance(name, str) else None


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
  index = next((i for i, p in enumerate(choices) if p is not None and platform in p),
               next((i for i, p in enumerate(choices) if p is None), None))
  if index is None:
    return None
  return eqn.params["branches"][index].jaxpr


def body_operand(eqn, j: int):
  """The outer operand behind input `j` of the body `call_body` or
  `platform_dependent_branch` entered (a cond's first operand is its index).

  Public: `cond_p` by identity; the operand layout of `cond` (index first)
  is undocumented."""
  return eqn.invars[j + (eqn.primitive is _primitives.cond_p)]


# ----------------------------------------------------------------------------- platform

def lowering_platform() -> str:
  """The `lax.platform_dependent` name of the default backend: "cpu",
  "cuda", "rocm" or "tpu".

  Public (semi): `jax.extend.backend.get_backend().platform_version` tells
  CUDA from ROCm (`jax.default_backend()` says only "gpu"). No default on a
  missing attribute: a silent "cuda" would pick the wrong branch."""
  backend = jax.default_backend()
  if backend != "gpu":
    return backend
  version = jax.extend.backend.get_backend().platform_version
  return "rocm" if "rocm" in str(version).lower() else "cuda"


# ----------------------------------------------------------------------------- cuda from any host

def _abstract_gpu(device_kind: str):
  """Context naming the GPU a Pallas Triton kernel is lowered for, or None
  where JAX needs none. jax 0.10.2 lowers for compute capability 9.0 when no
  GPU is attached; jax >= 0.11 reads the target from the device kind of the
  context's abstract mesh (`jax._src.pallas.triton.gpu_info`, private) and
  fails without a GPU or one. None public: `jax.sharding.AbstractMesh(...,
  abstract_device=)` is public, its `AbstractDevice` is not exported (watch:
  `jax._src.mesh.AbstractDevice`'s fields)."""
  try:
    from jax._src.pallas.triton import gpu_info  # noqa: F401  # jax >= 0.11
  except ImportError:
    return None
  from jax._src.mesh import AbstractDevice
  mesh = jax.sharding.AbstractMesh((1,), ("jact_cuda_target",), abstract_device=AbstractDevice(
      device_kind=device_kind, num_cores=None, platform="gpu"))
  return jax.sharding.use_abstract_mesh(mesh)


def lower_for_cuda(fn: Callable, *args, device_kind: str = "NVIDIA H100",
                   platforms: Sequence[str] = ("cuda",)):
  """`jax.jit(fn)` traced at `args` and lowered for cuda (with any other
  `platforms`) on any host, a machine without a GPU included, its Pallas
  Triton kernels compiled to Triton IR for `device_kind` ("NVIDIA H100":
  sm_90). Array arguments count by shape and dtype only.

  Public: `jit(f).trace(*args).lower(lowering_platforms=...)`; naming the
  target GPU is not (see `_abstract_gpu`)."""
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if isinstance(a, jax.Array) else a, args)
  target = _abstract_gpu(device_kind) if "cuda" in platforms else None
  with target if target is not None else contextlib.nullcontext():
    return jax.jit(fn).trace(*abstract).lower(lowering_platforms=tuple(platforms))


# ----------------------------------------------------------------------------- kernels

# Reshape-like primitives between a kernel and the residual it wrote.
# (`jnp.expand_dims` lowers to broadcast_in_dim: no "expand_dims" primitive.)
_VIEW_PRIMITIVES = (lax.reshape_p, lax.squeeze_p, lax.slice_p, lax.bitcast_convert_type_p)


def is_view(eqn) -> bool:
  """Whether `eqn` only re-views its first operand (reshape, squeeze,
  slice, bitcast).

  Public: `jax.lax.reshape_p`, `squeeze_p`, `slice_p`,
  `bitcast_convert_type_p` by identity."""
  return eqn.primitive in _VIEW_PRIMITIVES


def pallas_kernel_name(eqn) -> str | None:
  """The name of the Pallas kernel `eqn` runs ("pallas_call" when unnamed),
  or None when `eqn` is no `pallas_call`.

  Public (experimental): `jax.experimental.pallas.pallas_call_p` by
  identity; its `params["name"]` is undocumented (the `name=` given to
  `pl.pallas_call`). Watch: older versions kept `name_and_src_info`."""
  if eqn.primitive is not _pallas.pallas_call_p:
    return None
  return str(eqn.params.get("name") or "pallas_call")


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
  if not callable(vjp) or any(l is vjp or not (hasattr(l, "shape") and hasattr(l, "dtype"))
                              for l in leaves):
    raise CompatError(
        "jact._compat.vjp_residuals: the object jax.vjp returns is no longer a pytree whose "
        f"leaves are its residual arrays (jax {jax.__version__}, got "
        f"{[type(l).__name__ for l in leaves]}); jact.compressed, jact.checkpoint and "
        "jact.residual_report read residuals from it. Update vjp_residuals / rebuild_vjp in "
        "jact/_compat.py.")
  return leaves, layout


def rebuild_vjp(layout, leaves: Sequence) -> Callable:
  """The VJP function of `vjp_residuals`'s `layout` with its residuals
  replaced by `leaves` (same shapes and dtypes). Same layout access as
  `vjp_residuals`."""
  return jax.tree.unflatten(layout, list(leaves))


# ----------------------------------------------------------------------------- jax.core

def eval_jaxpr(jaxpr, consts, *args) -> list:
  """Evaluates an open jaxpr. Public: `jax.core.eval_jaxpr` (one of the
  names jax 0.10.2 keeps in `jax.core`; `jax.extend.core.jaxpr_as_fun` is
  the alternative)."""
  return jax.core.eval_jaxpr(jaxpr, consts, *args)


def is_tracer(x) -> bool:
  """Whether `x` is a tracer (e.g. a closed-over value of an enclosing
  transformation). Public: `jax.core.Tracer` (kept in `jax.core` 0.10.2)."""
  return isinstance(x, jax.core.Tracer)


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


# ----------------------------------------------------------------------------- values

def is_jax_value(x) -> bool:
  """Whether `x` is a JAX value: an array, a tracer, or an object JAX reads
  as one through its `.aval` (flax.nnx Variables do).

  Public: `isinstance(x, jax.Array)` holds for every tracer in jax 0.10.2
  (jit, grad, vmap, jvp, linearize); the `.aval` duck-typing (undocumented,
  what `jax.typeof` reads) admits the foreign array-likes besides."""
  return isinstance(x, jax.Array) or hasattr(x, "aval")


def on_device(x) -> bool:
  """Whether the value `x` lives in device memory (not offloaded to the
  host). Public: `jax.typeof(x).memory_space` and `jax.memory.Space` (jax
  0.10.2); a type without a memory space counts as on the device."""
  return getattr(jax.typeof(x), "memory_space", jax.memory.Space.Device) == jax.memory.Space.Device


# ----------------------------------------------------------------------------- jaxpr walking

def is_var(v) -> bool:
  """Whether a jaxpr atom is a variable. Public (semi): `jax.extend.core.Var`."""
  return isinstance(v, jax.extend.core.Var)


def is_literal(v) -> bool:
  """Whether a jaxpr atom is a literal. Public (semi): `jax.extend.core.Literal`."""
  return isinstance(v, jax.extend.core.Literal)


def literal_value(v):
  """The value of a literal atom. None public in jax 0.10.2: `Literal.val`
  is undocumented."""
  return v.val


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


# ----------------------------------------------------------------------------- rebinding

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


# ----------------------------------------------------------------------------- shard_map axes


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


def cast_varying(x, axes):
  """`x` made to vary over the manual `axes` it does not vary over yet (what
  JAX inserts when an invariant value meets a varying one; its transpose is a
  psum). Public: `jax.lax.pcast(..., to='varying')` in jax 0.10.2,
  `jax.lax.pvary` before."""
  missing = tuple(a for a in (axes if isinstance(axes, (tuple, list)) else (axes,))
                  if a not in varying_axes(x))
  if not missing:
    return x
  if hasattr(lax, "pcast"):
    return lax.pcast(x, missing, to="varying")
  return lax.pvary(x, missing)


def is_static_shape(shape) -> bool:
  """Whether every dimension of `shape` is a known integer: under `jax.export`
  with `jax.export.symbolic_shape("b, ...")` a dimension is a symbolic
  expression, which cannot be compared with a number. Public: symbolic
  dimensions are documented as not being ints; their class is not."""
  return all(isinstance(d, int) for d in shape)


def bound_axis_sizes(axis_name) -> tuple[tuple[Any, int], ...]:
  """`((name, size), ...)` of the named axes of `axis_name` (a name or a
  tuple of names) bound where this is traced (`jax.vmap(axis_name=)`,
  `shard_map`, `pmap`); names not bound here are left out.

  Public: `jax.lax.axis_size(name)`; whether a name is bound has no public
  query in jax 0.10.2 (watch `jax._src.core.get_axis_env().axis_exists`)."""
  from jax._src import core as _core  # pylint: disable=import-outside-toplevel
  names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
  env = _core.get_axis_env()
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


def union_of_varying_axes(values: Sequence) -> tuple[str, ...]:
  """The manual mesh axes any of the arrays among `values` varies over, sorted
  (empty outside shard_map)."""
  return tuple(sorted(frozenset().union(
      *(varying_axes(v) for v in values if _is_array(v)))))


def _is_array(v) -> bool:
  return isinstance(v, jax.Array) or is_tracer(v)


def leading_axis_sharded(x) -> bool:
  """Whether `x`'s type says its leading axis is sharded (explicit sharding
  mode; under automatic sharding types carry no partitioning). Public:
  `jax.typeof(x).sharding.spec` in jax 0.10.2."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return bool(spec) and len(spec) > 0 and spec[0] is not None


def _same_varying(eqn, values: Sequence) -> list:
  """`values` cast to vary over at least the manual axes the equation's
  operands varied over when it was traced; then, for a primitive without
  inner programs (whose operand types are fixed), the arrays cast to the
  union of their axes when they still differ. Unchanged outside shard_map."""
  recorded = [_aval_varying(var.aval) if is_var(var) else frozenset() for var in eqn.invars]
  current = [varying_axes(v) if _is_array(v) else frozenset() for v in values]
  if not any(recorded) and not any(current):  # outside shard_map: nothing to do
    return list(values)
  values = [cast_varying(v, tuple(sorted(r))) if _is_array(v) and r - c else v
            for v, r, c in zip(values, recorded, current)]
  if len(values) < 2 or any(isinstance(p, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr))
                            for p in eqn.params.values()):
    return values
  union = union_of_varying_axes(values)
  if all((varying_axes(v) if _is_array(v) else frozenset()) == frozenset(union) for v in values):
    return values
  # literals (constants in the equation) become arrays of their recorded type to be cast too
  return [cast_varying(v if _is_array(v) else jnp.asarray(v, var.aval.dtype), union)
          for v, var in zip(values, eqn.invars)]


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
  return (tuple(params["window_dimensions"]), tuple(params["window_strides"]),
          tuple(tuple(p) for p in params["padding"]))


_REDUCTION_PRIMITIVES = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                                   "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin",
                                   "reduce"})


def is_reduction(eqn) -> bool:
  """Whether `eqn` reduces its operand over some axes (sum, max, min,
  product, arg-max, a general `lax.reduce`). None public in jax 0.10.2:
  the reduction primitives are told apart by their internal names."""
  return eqn.primitive.name in _REDUCTION_PRIMITIVES


def reduced_axes(eqn) -> tuple[int, ...] | None:
  """The operand axes a reduction equation (`is_reduction`) reduces, or
  None. None public in jax 0.10.2: the axes are `params["axes"]` of the
  reduce_* / arg-max primitives (a general `lax.reduce` names them
  `dimensions`)."""
  if not is_reduction(eqn):
    return None
  axes = eqn.params.get("axes", eqn.params.get("dimensions"))
  return None if axes is None else tuple(int(a) for a in axes)


_ROW_LINKS = frozenset({"add", "add_any", "sub", "mul", "div", "neg", "convert_element_type",
                        "integer_pow", "square", "copy", "copy_p"})


def is_row_link(eqn) -> bool:
  """Whether `eqn` is elementwise arithmetic that keeps its operands' rows
  (sums, differences, products and quotients with broadcast values, casts,
  integer powers): what links a residual to the tensor a normalization's
  statistic is computed from. None public in jax 0.10.2: primitives are
  told apart by their internal names."""
  return eqn.primitive.name in _ROW_LINKS


_ELEMENTWISE_LINEAR = frozenset({"add", "sub", "neg", "convert_element_type", "copy", "copy_p"})
_ELEMENTWISE_NONLINEAR = frozenset({
    "mul", "div", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "integer_pow",
    "sqrt", "rsqrt", "cbrt", "pow", "erf", "erfc", "sin", "cos", "tan", "atan", "asinh", "acosh",
    "atanh", "sinh", "cosh", "abs", "square", "max", "min",
    "one_minus_square"})  # 1 - x**2: tanh's derivative on jax >= 0.11


def elementwise_kind(eqn) -> str | None:
  """'linear' or 'nonlinear' when `eqn` is an elementwise arithmetic
  primitive of floats (sum, difference, cast; products, quotients and unary
  functions such as exp, tanh, logistic, integer_pow), else None. None public
  in jax 0.10.2: primitives are told apart by their internal names."""
  name = eqn.primitive.name
  if name in _ELEMENTWISE_LINEAR:
    return "linear"
  return "nonlinear" if name in _ELEMENTWISE_NONLINEAR else None


_LAYOUT_PRIMITIVES = frozenset({"concatenate", "broadcast_in_dim", "reshape", "transpose",
                                "squeeze", "expand_dims", "convert_element_type"})


def is_layout_primitive(prim) -> bool:
  """Whether primitive `prim` (as a `jax.checkpoint` policy sees it) only
  moves, copies or casts values (concatenate, reshape, transpose, ...). None
  public in jax 0.10.2: primitives are told apart by their internal names."""
  return prim.name in _LAYOUT_PRIMITIVES


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


# ----------------------------------------------------------------------------- primitive

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
  undocumented (watch: its signature)."""
  p = jax.extend.core.Primitive(name)
  p.multiple_results = True
  p.def_impl(lambda *args, n_values, rule: list(args[:n_values]))
  p.def_abstract_eval(lambda *avals, n_values, rule: list(avals[:n_values]))

  def on_platform(*args, n_values, rule):
    with jax.named_scope(name):  # the rule's operations carry the name in the program's locations
      return list(rule(list(args[:n_values]), list(args[n_values:])))

  mlir.register_lowering(p, mlir.lower_fun(on_platform, multiple_results=True), platform=platform)
  mlir.register_lowering(p, lambda ctx, *args, n_values, rule: list(args[:n_values]))

  def jvp(primals, tangents, *, n_values, rule):
    return p.bind(*primals, n_values=n_values, rule=rule), list(tangents[:n_values])

  def batch(args, dims, *, n_values, rule):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    values = [jnp.moveaxis(a, d, 0) if d is not _NOT_MAPPED
              else jnp.broadcast_to(a, (size,) + a.shape) for a, d in zip(args[:n_values], dims)]
    anchors = list(args[n_values:])
    axes = [None if d is _NOT_MAPPED else d for d in dims[n_values:]]
    mapped = lambda v, a: rule(list(v), list(a))
    batched_rule = lambda v, a: jax.vmap(mapped, in_axes=(0, axes), axis_size=size)(v, a)
    return p.bind(*values, *anchors, n_values=n_values, rule=batched_rule), [0] * n_values

  ad.primitive_jvps[p] = jvp
  batching.primitive_batchers[p] = batch
  return p


# ----------------------------------------------------------------------------- tests' helper

def saved_residuals(fn: Callable, *args, **kwargs) -> list[tuple[Any, str]]:
  """`(aval, description)` of every value `jax.vjp(fn, ...)` saves, as JAX
  describes it (no looking through barriers, unlike `jact.residual_report`).

  Public in jax < 0.10 as `jax.ad_checkpoint.saved_residuals`; removed in
  0.10 (only `print_saved_residuals`, which prints the list, remains), so
  this falls back to `jax._src.ad_checkpoint.saved_residuals`."""
  public = getattr(jax.ad_checkpoint, "saved_residuals", None)
  return (public or _private_ad_checkpoint.saved_residuals)(fn, *args, **kwargs)


# ----------------------------------------------------------------------------- self-check

def _eqns(fn, *args) -> list:
  return list(jax.make_jaxpr(fn)(*args).jaxpr.eqns)


def _only(eqns, primitive):
  found = [e for e in eqns if e.primitive is primitive]
  assert len(found) == 1, f"expected one {primitive} equation, got {[str(e.primitive) for e in eqns]}"
  return found[0]


def _check_summarize_source():
  eqn, = _eqns(lambda x: jnp.sin(x), 1.0)  # pylint: disable=unnecessary-lambda  (a user frame)
  text = summarize_source(eqn)
  assert re.fullmatch(r".+:\d+(:\d+)? \(.+\)", text), f"summary {text!r} is not 'file:line (fn)'"


def _check_checkpoint_name():
  from jax.ad_checkpoint import checkpoint_name as name_it  # pylint: disable=import-outside-toplevel
  found = [checkpoint_name(e) for e in _eqns(lambda x: name_it(x * 2, "n"), 1.0)]
  assert found == [None, "n"], f"names of (mul, checkpoint_name) are {found}, expected [None, 'n']"
  jitted = jax.make_jaxpr(jax.jit(lambda x: name_it(x * 2, "m")))(1.0).jaxpr.eqns[0]
  body = call_body(jitted)
  assert body is not None and [checkpoint_name(e) for e in body.jaxpr.eqns] == [None, "m"], (
      "checkpoint_name inside a jitted body is not recognised")
  # The experimental hi-primitive form (remove that branch when JAX drops it).
  hi = _eqns(lambda x: _private_ad_checkpoint.checkpoint_name3("h", x * 2), 1.0)
  assert [checkpoint_name(e) for e in hi] == [None, "h"], "remat3's CheckpointName not recognised"


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


def _check_barrier_operand():
  eqn = _only(_eqns(lambda x, y: lax.optimization_barrier((x, y)), 1.0, 2.0),
              lax.optimization_barrier_p)
  assert barrier_operand(eqn, 1) is eqn.invars[1] and barrier_operand(eqn, 0) is eqn.invars[0]
  assert barrier_operand(_eqns(jnp.sin, 1.0)[0], 0) is None


def _check_passthrough_operand():
  eqn = _only(_eqns(lambda x: lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7), 1.0),
              lax.reduce_precision_p)
  assert passthrough_operand(eqn, 0) is eqn.invars[0]
  eqn = _only(_eqns(lambda x, y: lax.optimization_barrier((x, y)), 1.0, 2.0),
              lax.optimization_barrier_p)
  assert passthrough_operand(eqn, 1) is eqn.invars[1]
  assert passthrough_operand(_eqns(jnp.sin, 1.0)[0], 0) is None


def _closed_call_eqn():
  # What JAX's own rules stage (scan partial evaluation, custom_vjp DCE).
  inner = jax.make_jaxpr(jnp.cos)(1.0)
  fun = jax.extend.linear_util.wrap_init(jax.extend.core.jaxpr_as_fun(inner),
                                         debug_info=inner.jaxpr.debug_info)
  return _eqns(lambda x: _primitives.closed_call_p.bind(x, subfuns=(fun,), call_jaxpr=inner)[0],
               1.0)[0]


def _check_is_call():
  eqn, = _eqns(jax.jit(jnp.sin), 1.0)
  assert is_call(eqn) and is_call(_closed_call_eqn()), "jit / closed_call not recognised"
  assert not is_call(_eqns(jnp.sin, 1.0)[0])


def _check_call_body():
  for eqn, fn in ((_eqns(jax.jit(jnp.sin), 1.0)[0], jnp.sin), (_closed_call_eqn(), jnp.cos)):
    body = call_body(eqn)
    assert body is not None, f"no body found in {eqn.primitive} (params {sorted(eqn.params)})"
    assert eval_jaxpr(body.jaxpr, body.consts, 0.5)[0] == fn(0.5), f"wrong body of {eqn.primitive}"
  assert call_body(_closed_call_eqn(), closed_call=False) is None
  assert call_body(_eqns(jax.jit(jnp.sin), 1.0)[0], closed_call=False) is not None
  assert call_body(_eqns(jnp.sin, 1.0)[0]) is None


def _check_nested_output():
  def program(x):
    y = jax.jit(lambda x: checkpoint_name_of(x))(x)
    return lax.scan(lambda c, r: (c + r, checkpoint_name_of(c * r)), 0.0, y)

  checkpoint_name_of = lambda v: _private_ad_checkpoint.checkpoint_name(v, "probe")
  eqns = _eqns(program, jnp.ones(3))
  for eqn, i in ((eqns[0], 0), (eqns[1], 1)):
    body, var = nested_output(eqn, i)
    [producer] = [e for e in body.eqns if var in e.outvars]
    assert checkpoint_name(producer) == "probe", producer
  assert nested_output(eqns[1], 0) is not None


def _check_scan_parts():
  w = jnp.float32(3.0)
  eqn, = _eqns(lambda c, xs: lax.scan(lambda c, x: (c * w + x, c - x), c, xs, reverse=True),
               1.0, jnp.arange(4.0))
  parts = scan_parts(eqn)
  assert parts is not None and (parts.num_consts, parts.num_carry, parts.length) == (1, 1, 4), parts
  assert parts.reverse is True
  consts, init, xs = eqn.invars[:1], eqn.invars[1:2], eqn.invars[2:]
  assert len(consts) + len(init) + len(xs) == len(parts.body.jaxpr.invars)
  carry, y = eval_jaxpr(parts.body.jaxpr, parts.body.consts, 3.0, 2.0, 1.0)
  assert (carry, y) == (7.0, 1.0), (carry, y)
  assert scan_parts(_eqns(jnp.sin, 1.0)[0]) is None


def _check_call_name():
  def sine(x):
    return jnp.sin(x)
  eqn, = _eqns(jax.jit(sine), 1.0)
  assert call_name(eqn) == "sine", f"jit's function name read as {call_name(eqn)!r}"
  assert call_name(_closed_call_eqn()) is None


def _platform_program():
  closed = jax.make_jaxpr(lambda x: lax.platform_dependent(x, cpu=lambda y: y * 2.0,
                                                           default=lambda y: y * 3.0))(1.0)
  producers = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
  return closed.jaxpr.eqns[-1], producers.get


def _check_platform_dependent_branch():
  eqn, producer_of = _platform_program()
  for platform, factor in (("cpu", 2.0), ("cuda", 3.0)):
    branch = platform_dependent_branch(eqn, producer_of, platform)
    assert branch is not None, f"no branch found for {platform}"
    assert eval_jaxpr(branch, (), 1.0)[0] == factor, f"wrong branch for {platform}"
  plain = _eqns(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x), True, 1.0)[-1]
  assert platform_dependent_branch(plain, {}.get, "cpu") is None


def _check_body_operand():
  eqn, _ = _platform_program()
  assert body_operand(eqn, 0) is eqn.invars[1], "a cond's operands do not follow its index"
  call, = _eqns(jax.jit(lambda x, y: x * y), 1.0, 2.0)
  assert body_operand(call, 1) is call.invars[1]


def _check_lowering_platform():
  platform = lowering_platform()
  assert platform in ("cpu", "cuda", "rocm", "tpu"), platform
  if jax.default_backend() != "gpu":
    assert platform == jax.default_backend()
  version = jax.extend.backend.get_backend().platform_version
  assert isinstance(version, str) and version, f"platform_version is {version!r}"


def _check_is_view():
  x = jnp.ones((2, 3))
  views = [_eqns(lambda x: x.reshape(3, 2), x), _eqns(lambda x: x[1:], x),
           _eqns(lambda x: lax.squeeze(x[:1], (0,)), x),
           _eqns(lambda x: lax.bitcast_convert_type(x, jnp.int32), x)]
  for eqns in views:
    assert is_view(eqns[-1]), f"{eqns[-1].primitive} not seen as a view"
  assert not is_view(_eqns(jnp.sin, 1.0)[0])


def _check_pallas_kernel_name():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  call = _pallas.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
                             interpret=True, name="jact_probe")
  eqn, = _eqns(call, jnp.ones(8))
  assert pallas_kernel_name(eqn) == "jact_probe", f"kernel name read as {pallas_kernel_name(eqn)!r}"
  assert pallas_kernel_name(_eqns(jnp.sin, 1.0)[0]) is None


def _check_lower_for_cuda():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0
  call = _pallas.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), name="jact_probe",
      compiler_params=_pallas_triton.CompilerParams(num_warps=4, num_stages=1))
  text = lower_for_cuda(call, jnp.ones((8, 128))).as_text()
  assert "__gpu$xla.gpu.triton" in text and "jact_probe" in text, "no Triton call in the lowering"


def _check_vjp_residuals():
  x = jnp.arange(3.0)
  _, vjp = jax.vjp(jnp.sin, x)
  leaves, layout = vjp_residuals(vjp)
  assert len(leaves) == 1 and bool(jnp.allclose(leaves[0], jnp.cos(x))), "sin's VJP keeps cos(x)"
  zero, = rebuild_vjp(layout, [jnp.zeros_like(leaves[0])])(jnp.ones(3))
  assert not bool(jnp.any(zero)), "rebuilt VJP does not use the replaced residuals"
  # The order residual names are built from: used primals, then residuals.
  # (sin, not tanh: jax 0.11 gave tanh a one-residual rule, so what tanh keeps is not stable.)
  x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.5)
  _, vjp = jax.vjp(lambda x, w: jnp.sin(x @ w), x, w)
  leaves, layout = vjp_residuals(vjp)
  shapes = [tuple(l.shape) for l in leaves]
  assert shapes == [(2, 3), (3, 4), (2, 4)], f"sin(x @ w) VJP leaves {shapes}"
  assert bool(jnp.array_equal(leaves[1], w)) and bool(jnp.allclose(leaves[2], jnp.cos(x @ w))), (
      "sin(x @ w) VJP leaves are not (x, w, cos(x @ w))")
  g = jnp.ones((2, 4))
  for a, b in zip(rebuild_vjp(layout, leaves)(g), vjp(g)):
    assert bool(jnp.array_equal(a, b)), "rebuilt VJP differs from the original"
  _, shaped = jax.make_jaxpr(lambda x: jax.vjp(jnp.sin, x), return_shape=True)(jnp.ones(3))
  assert len(vjp_residuals(shaped[1])[0]) == 1


def _check_eval_jaxpr():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    closed = jax.make_jaxpr(lambda x: x * 2.0 + 1.0)(1.0)
    assert eval_jaxpr(closed.jaxpr, closed.consts, 3.0)[0] == 7.0


def _check_is_tracer():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    seen = []
    jax.make_jaxpr(lambda x: seen.append(is_tracer(x)) or x)(1.0)
    assert seen == [True] and not is_tracer(jnp.ones(1)) and not is_tracer(1.0)


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
  assert seen == [(True, False), (True, True), (True, True), (False, False), (False, False),
                  (False, False), (False, False), (True, False)], seen
  assert not jit_traces_since(outer) and not abstract_evaluation()


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


def _check_on_device():
  def program(x):
    assert on_device(x)
    assert not on_device(jax.device_put(x, jax.memory.Space.Host))
    return x

  jax.jit(program).lower(jnp.ones(3))


def _check_is_var():
  eqn, = _eqns(lambda x: x * 2.0, 1.0)
  assert is_var(eqn.invars[0]) and not is_var(eqn.invars[1])


def _check_is_literal():
  eqn, = _eqns(lambda x: x * 2.0, 1.0)
  assert is_literal(eqn.invars[1]) and not is_literal(eqn.invars[0])


def _check_literal_value():
  eqn, = _eqns(lambda x: x * 2.0, 1.0)
  assert literal_value(eqn.invars[1]) == 2.0


def _check_prune_jaxpr():
  closed = jax.make_jaxpr(lambda x: (jnp.zeros(3) + 1.0, x * 2.0))(1.0)
  pruned = prune_jaxpr(closed.jaxpr, [closed.jaxpr.outvars[0]])
  value, = eval_jaxpr(pruned, closed.consts)
  assert bool(jnp.array_equal(value, jnp.ones(3))), f"pruned jaxpr computes {value}"


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
      env.update(zip(eqn.outvars, bind_eqn(
          eqn, [literal_value(v) if is_literal(v) else env[v] for v in eqn.invars])))
    return env[closed.jaxpr.outvars[0]]

  ours, theirs = rebound(*args), jax.jit(program)(*args)
  assert bool(jnp.allclose(ours, theirs)), "re-binding every equation changes the result"


def _check_max_window_geometry():
  x = jnp.ones((1, 4, 4, 1))
  pooled = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
  [eqn] = _eqns(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                            "VALID"), x)
  assert pooled.shape == (1, 2, 2, 1)
  assert max_window_geometry(eqn) == ((1, 2, 2, 1), (1, 2, 2, 1), ((0, 0),) * 4), eqn
  [summed] = _eqns(lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1),
                                               "VALID"), x)
  assert max_window_geometry(summed) is None


def _check_is_reduction():
  x = jnp.ones((4, 3))
  eqns = _eqns(lambda x: (x.sum(0), x.max(1), jnp.argmax(x, 1), x @ x.T,
                          lax.reduce(x, 0.0, lax.add, (0,))), x)
  found = [is_reduction(e) for e in eqns]
  assert found == [True, True, True, False, False, True], [e.primitive for e in eqns]


def _check_reduced_axes():
  x = jnp.ones((4, 3, 2))
  eqns = _eqns(lambda x: (x.sum((0, 2)), x.max(1), jnp.argmax(x, 2), x * 2), x)
  found = [reduced_axes(e) for e in eqns]
  assert found == [(0, 2), (1,), (2,), None], [(e.primitive, e.params) for e in eqns]


def _check_is_row_link():
  x = jnp.ones((4, 3))
  eqns = _eqns(lambda x: ((x - x.mean(1, keepdims=True)) ** 2 * 2.0, jnp.tanh(x)), x)
  found = [is_row_link(e) for e in eqns]
  assert found == [False, False, True, True, True, True, False], [e.primitive for e in eqns]


def _check_elementwise_kind():
  eqns = _eqns(lambda x: (jnp.tanh(x) * x + 1.0, x ** 3, x.sum()), jnp.ones(3))
  found = [elementwise_kind(e) for e in eqns]
  assert found == ["nonlinear", "nonlinear", "linear", "nonlinear", None], (
      [e.primitive for e in eqns])


def _check_is_layout_primitive():
  eqns = _eqns(lambda x: jnp.concatenate([x, x]).reshape(2, -1).T.astype(jnp.bfloat16) * 2, jnp.ones(3))
  layout = [is_layout_primitive(e.primitive) for e in eqns]
  assert layout == [True, True, True, True, False], [e.primitive for e in eqns]


def _check_conv_kwargs():
  x, w = jnp.ones((1, 2, 5, 5)), jnp.ones((3, 2, 3, 3))
  conv = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", rhs_dilation=(2, 1))
  eqn = _only(_eqns(conv, x, w), lax.conv_general_dilated_p)
  kwargs = conv_kwargs(eqn)
  accepted = set(inspect.signature(lax.conv_general_dilated).parameters)
  assert kwargs is not None and set(kwargs) <= accepted, (
      f"conv params {sorted(set(kwargs or ()) - accepted)} are not lax.conv_general_dilated keywords")
  assert bool(jnp.array_equal(lax.conv_general_dilated(x, w, **kwargs), conv(x, w)))
  assert conv_kwargs(_eqns(jnp.sin, 1.0)[0]) is None


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
  text = jax.jit(f).trace(t, a).lower(lowering_platforms=("cuda",)).as_text(debug_info=True)
  assert "jact_compat_probe_platform" not in text, "the rule is lowered for another platform"
  register_pass_through(p)
  eqn = _only(_eqns(lambda t: p.bind(t, a, n_values=1, rule=double), t), p)
  assert barrier_operand(eqn, 0) is eqn.invars[0]


def _check_linear_identity_primitive():
  def fail(*_, **__):
    raise TypeError("jact probe: forward mode evaluated")

  p = linear_identity_primitive("jact_compat_probe", fail)
  t = jnp.arange(3.0)
  assert jax.make_jaxpr(lambda t: p.bind(t))(t).out_avals[0].shape == (3,)
  assert jax.make_jaxpr(jax.vmap(lambda t: p.bind(t)))(jnp.ones((2, 3))).out_avals[0].shape == (2, 3)
  transposed, = jax.linear_transpose(lambda t: p.bind(t), t)(t)
  assert bool(jnp.array_equal(transposed, t)), "the transpose is not the identity"
  try:
    p.bind(t)
  except TypeError as e:
    assert "jact probe" in str(e)
  else:
    raise AssertionError("evaluating the primitive did not call fail")


def _check_saved_residuals():
  x = jnp.arange(3.0)
  saved = saved_residuals(lambda x: jnp.sin(x).sum(), x)
  assert len(saved) == 1 and tuple(saved[0][0].shape) == (3,) and isinstance(saved[0][1], str), (
      f"saved_residuals(sin) gave {saved}")


def _in_shard_map(fn, *args):
  """Runs `fn` inside a shard_map over a one-device mesh axis 'i' (args replicated)."""
  mesh = jax.make_mesh((1,), ("i",), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Auto,))
  return jax.shard_map(fn, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
                       out_specs=jax.sharding.PartitionSpec())(*args)


def _check_varying_axes():
  def inside(w):
    assert varying_axes(w) == frozenset(), varying_axes(w)
    v = cast_varying(w, ("i",))
    assert varying_axes(v) == frozenset({"i"}), varying_axes(v)
    return jax.lax.psum(v, "i")
  _in_shard_map(inside, jnp.ones(2))
  assert varying_axes(jnp.ones(2)) == frozenset()


def _check_cast_varying():
  def inside(w):
    v = cast_varying(w, ("i",))
    assert cast_varying(v, ("i",)) is v  # already varying: unchanged
    eqns = jax.make_jaxpr(lambda w: w * v)(w).eqns
    pvary = [e for e in eqns if e.primitive.name == "pvary"]
    assert pvary and "axes" in pvary[0].params, [e.primitive.name for e in eqns]
    out, = bind_eqn(pvary[0], [v])  # recorded for an invariant value, run on a varying one
    assert varying_axes(out) == frozenset({"i"})
    return jax.lax.psum(v, "i")
  _in_shard_map(inside, jnp.ones(2))


def _check_leading_axis_sharded():
  assert not leading_axis_sharded(jnp.ones((4, 2)))
  mesh = jax.make_mesh((1,), ("i",), devices=jax.devices()[:1],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.device_put(jnp.ones((4, 2)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i")))
  seen = []
  jax.jit(lambda x: seen.append(leading_axis_sharded(x)) or x)(x)
  assert seen == [True], seen


# One probe per compat function: (what it reads, probe).
def _check_is_static_shape():
  from jax import export  # pylint: disable=import-outside-toplevel
  b, = export.symbolic_shape("b")
  seen = {}

  def f(x):
    seen["shape"] = x.shape
    return x

  export.export(jax.jit(f))(jax.ShapeDtypeStruct((b, 3), jnp.float32))
  assert is_static_shape((2, 3)) and not is_static_shape(seen["shape"]), seen["shape"]


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
  assert bool(jnp.allclose(got, x.mean() + x)), got  # d/dx of f(x) * x, f backward a mean


CHECKS: dict[str, tuple[str, Callable[[], None]]] = {
    "is_static_shape": ("symbolic dimensions (jax.export) are not ints", _check_is_static_shape),
    "bound_axis_sizes": ("jax._src.core.get_axis_env().axis_exists and lax.axis_size",
                         _bound_axes_backward),
    "axes_bound": ("jax._src.core.extend_axis_env_nd in a custom_vjp backward under vmap",
                   _bound_axes_backward),
    "leading_axis_sharded": ("jax.typeof(x).sharding.spec (explicit sharding mode)",
                             _check_leading_axis_sharded),
    "varying_axes": ("jax.typeof(x).mat.varying (jax 0.10.2) / .vma (earlier) inside shard_map",
                     _check_varying_axes),
    "cast_varying": ("jax.lax.pcast(..., to='varying') / lax.pvary, and pvary_p's params['axes']",
                     _check_cast_varying),
    "summarize_source": ("jax.extend.source_info_util.summarize of an equation's source_info",
                         _check_summarize_source),
    "checkpoint_name": ("name_p / params['name'] of jax.ad_checkpoint.checkpoint_name, and "
                        "params['_prim'] of the private remat3 checkpoint_name3",
                        _check_checkpoint_name),
    "policy_checkpoint_name": ("the name a jax.checkpoint policy receives in params['name']",
                               _check_policy_checkpoint_name),
    "barrier_operand": ("lax.optimization_barrier_p and its positional pass-through",
                        _check_barrier_operand),
    "passthrough_operand": ("lax.reduce_precision_p / optimization_barrier_p pass-through",
                            _check_passthrough_operand),
    "is_call": ("jit_p / closed_call_p in jax.extend.core.primitives", _check_is_call),
    "call_body": ("the body of jit / closed_call in params['jaxpr'] / params['call_jaxpr']",
                  _check_call_body),
    "nested_output": ("jit_p/closed_call_p/scan_p; params['jaxpr']", _check_nested_output),
    "scan_parts": ("scan_p; params jaxpr, num_consts/num_carry (jax 0.10) or ft_in (>= 0.11), "
                   "length, reverse, unroll",
                   _check_scan_parts),
    "call_name": ("the jitted function's name in jit's params['name']", _check_call_name),
    "platform_dependent_branch": (
        "lax.platform_dependent: platform_index params['platforms'] and cond params['branches']",
        _check_platform_dependent_branch),
    "body_operand": ("cond's operand layout (index first)", _check_body_operand),
    "lowering_platform": ("jax.extend.backend.get_backend().platform_version",
                          _check_lowering_platform),
    "is_view": ("lax.reshape_p / squeeze_p / slice_p / bitcast_convert_type_p", _check_is_view),
    "pallas_kernel_name": ("jax.experimental.pallas.pallas_call_p and its params['name']",
                           _check_pallas_kernel_name),
    "lower_for_cuda": ("a Pallas Triton kernel lowered for cuda on any host: the abstract mesh's "
                       "AbstractDevice on jax >= 0.11", _check_lower_for_cuda),
    "vjp_residuals": ("the pytree layout of the object jax.vjp returns", _check_vjp_residuals),
    "rebuild_vjp": ("jax.tree.unflatten of that layout", _check_vjp_residuals),
    "eval_jaxpr": ("jax.core.eval_jaxpr", _check_eval_jaxpr),
    "is_tracer": ("jax.core.Tracer", _check_is_tracer),
    "is_jax_value": ("tracers are jax.Array; the .aval attribute", _check_is_jax_value),
    "current_trace": ("jax._src.core.trace_ctx.trace", _check_trace_state),
    "jit_traces_since": ("Trace.parent_trace and the staging trace's "
                         "frame.debug_info.traced_for == 'jit'", _check_trace_state),
    "abstract_evaluation": ("the frames of jax.eval_shape and jax.make_jaxpr's inner "
                            "make_jaxpr_f", _check_trace_state),
    "on_device": ("jax.typeof(x).memory_space, jax.memory.Space", _check_on_device),
    "is_var": ("jax.extend.core.Var", _check_is_var),
    "is_literal": ("jax.extend.core.Literal", _check_is_literal),
    "literal_value": ("Literal.val", _check_literal_value),
    "prune_jaxpr": ("Jaxpr.replace(invars=, outvars=, eqns=)", _check_prune_jaxpr),
    "bind_eqn": ("Primitive.get_bind_params, eqn.ctx.manager, Primitive.bind", _check_bind_eqn),
    "max_window_geometry": ("lax.reduce_window(x, -inf, lax.max, ...)", _check_max_window_geometry),
    "is_reduction": ("primitive names", _check_is_reduction),
    "reduced_axes": ("params['axes'] of reduce_sum / reduce_max / argmax", _check_reduced_axes),
    "is_row_link": ("primitive names", _check_is_row_link),
    "is_layout_primitive": ("primitive names", _check_is_layout_primitive),
    "elementwise_kind": ("primitive names", _check_elementwise_kind),
    "conv_kwargs": ("conv_general_dilated_p params as lax.conv_general_dilated keywords",
                    _check_conv_kwargs),
    "platform_lowered_primitive": (
        "jax.extend.core.Primitive, mlir.register_lowering(platform=), mlir.lower_fun, "
        "batching.primitive_batchers / not_mapped, ad.primitive_jvps",
        _check_platform_lowered_primitive),
    "register_pass_through": ("barrier_operand through jact's own pass-through primitives",
                              _check_platform_lowered_primitive),
    "linear_identity_primitive": (
        "jax.extend.core.Primitive with jax.interpreters.ad.deflinear2, batching.defvectorized, "
        "mlir.register_lowering", _check_linear_identity_primitive),
    "saved_residuals": ("jax.ad_checkpoint.saved_residuals, or jax._src.ad_checkpoint's",
                        _check_saved_residuals),
}


def check(names: Iterable[str] | None = None) -> None:
  """Runs the probe of each compat function in `names` (all by default) on a
  tiny program; raises a CompatError naming every access the installed JAX
  changed and the function in jact/_compat.py to update."""
  names = list(CHECKS) if names is None else list(names)
  unknown = [n for n in names if n not in CHECKS]
  if unknown:
    raise ValueError(f"no compat check named {unknown}; choose from {sorted(CHECKS)}")
  broken = []
  for name in names:
    what, probe = CHECKS[name]
    try:
      probe()
    except Exception as e:  # any failure of a probe is a changed access  # pylint: disable=broad-except
      broken.append(f"jact._compat.{name} ({what}): {type(e).__name__}: {e}")
  if broken:
    raise CompatError(
        f"jax {jax.__version__} changed what jact reads through jact/_compat.py; update these "
        "functions there (each names the public API that would replace it):\n  "
        + "\n  ".join(broken))
