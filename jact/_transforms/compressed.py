"""`jact.compressed`: compress the residuals of any JAX function (GACT's engine).

The tensors a function saves for its backward pass are exactly the
residuals of its VJP. `compressed(fn)` evaluates `fn` exactly, captures the
residuals of `jax.vjp(fn, ...)` (the VJP object is a pytree whose leaves are
the primal inputs it uses followed by the residuals) as variables of one
traced jaxpr, and keeps for the backward pass:

* nothing new for residuals that are `fn`'s own inputs (parameters): they
  are alive anyway and are stored by reference -- unless the argument is
  listed in `compress_argnums` (an activation, such as a block's input);
* one copy of a residual that appears several times;
* nothing for residuals that do not depend on the inputs (constants, such
  as the broadcast zero `jax.nn.relu` saves): recomputed in the backward;
* pieces already compressed by an inner jact op or `compressed` call as
  they are;
* boolean residuals (masks) packed losslessly to 1 bit;
* floating residuals of at least `min_size` values quantized with
  stochastic rounding to `bits` bits;
* everything else (integers, complex values, small tensors, residuals whose
  shape has a symbolic `jax.export` dimension) as it is.

The backward starts with an optimization barrier, reconstructs the
residuals and feeds them to the original VJP, so the gradients are exactly
those of `fn` evaluated on the reconstructions.

>>> import jax, jax.numpy as jnp, jact
>>> def mlp(w1, w2, x):
...   return jnp.tanh(x @ w1) @ w2
>>> block = jact.compressed(mlp, bits=2, name="mlp")
>>> w1, w2, x = jnp.ones((64, 256)) / 64, jnp.ones((256, 8)), jnp.ones((32, 64))
>>> bool(jnp.allclose(block(w1, w2, x, key=jax.random.key(0)), mlp(w1, w2, x)))
True
>>> loss = lambda w1, w2, x: block(w1, w2, x, key=jax.random.key(0)).sum()
>>> jax.grad(loss)(w1, w2, x).shape
(64, 256)
>>> plain = jact.residual_report(lambda *a: mlp(*a).sum(), w1, w2, x).total_bytes
>>> plain // jact.residual_report(loss, w1, w2, x).total_bytes
15
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


from jact import _compat
from jact._engine import context as _context
from jact.compressors import Compressor
from jact._engine.rounding import SaltedSeed, make_seed, resolve_compressor, salt_seed, NoKey
from jact._engine.names import tag
from jact._engine.scheduling import Stacked, barrier, materialize
from jact._engine.derivatives import reverse_only
from jact._transforms._arguments import (
  check_policy,
  check_argnums,
  input_flags,
  reserved_key_check,
  returning_arrays,
)
from jact._transforms._modules import (
  _MODULE_ROUTES,
  CompressedModule,
  is_callable_pytree,
  module_argnums,
  module_call,
)
from jact._transforms._selections import evaluate_with_exact_selections
from jact._transforms._interleave import evaluate_restoring, evaluate_storing
from jact._transforms._scan import step_config, step_seed
from jact._transforms._vjp_residuals import (
  DEFAULT_MIN_SIZE,
  ResidualConfig,
  Saved,
  check_overrides,
  eval_constants,
  is_array,
  is_float,
  is_stored,
  output_epilogue,
  plan_saved,
  restore_saved,
  store_saved,
)

__all__ = ["compressed", "ResidualConfig", "DEFAULT_MIN_SIZE"]


def is_complex(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.complexfloating)


def over_array_leaves(fn, args, kwargs, is_dynamic: Callable[[Any], bool] = is_array):
  """`(call, values, dynamic)`: `call(*values)` is `fn(*args, **kwargs)` with
  the array leaves of `(args, kwargs)` (those `is_dynamic` accepts; indices
  `dynamic` among its leaves) passed positionally and every other leaf held fixed."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  dynamic = [i for i, leaf in enumerate(leaves) if is_dynamic(leaf)]

  def call(*values):
    full = list(leaves)
    for i, v in zip(dynamic, values):
      full[i] = v
    a, k = jax.tree.unflatten(treedef, full)
    return fn(*a, **k)

  return call, [leaves[i] for i in dynamic], dynamic


# ---------------------------------------------------------------------------
# The transform.


def compressed(
  fn: Callable[..., Any] | None = None,
  *,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  min_size: int = DEFAULT_MIN_SIZE,
  name: str = "compressed",
  overrides: Any = None,
  policy: Callable[..., Any] | None = None,
  compress_argnums: Sequence[int] = (),
):
  """Returns `fn` with compressed residuals: same signature plus keyword `key`.

  The forward pass runs `fn` exactly; the backward pass runs `fn`'s VJP on
  reconstructions of its residuals (see the module docstring for what is
  stored how). Works under `jit`, `vmap`, `lax.scan`, `jax.checkpoint`, and
  nested (a compressed block inside a compressed model).

  Args:
    fn: any function of pytrees of arrays (non-array leaves are treated as
      static). Can also be used as a decorator with keyword arguments only.
      A callable pytree (an `eqx.Module`, a `jax.tree_util.Partial`) gives
      a `CompressedModule`: a pytree holding it, so its parameters get
      gradients, and passing `key=` on to it when its call takes `key`.
    bits: bit width of floating residuals (1 to 8, or 16) or None to keep them.
    compressor: a `jact.compressors` object for the floating residuals
      instead of `bits` (leave `bits` at its default), e.g.
      `PerGroup(4, group_size=128, stochastic=False)` for round-to-nearest
      (no key needed) in groups of 128.
    min_size: floating residuals with fewer values are kept as they are.
    name: prefix of residual names: a residual is named `f"{name}.{i}"`,
      `i` its position among the VJP's leaves (stable for a given `fn`
      and argument shapes). Names tag the stored pieces with
      `checkpoint_name`, so `jax.checkpoint` policies can select them.
    overrides: per-name bit widths (mapping or object with `bits_for`);
      names that are none of this call's residuals are reported (a warning).
    policy: optional `jax.checkpoint` policy deciding which intermediates
      are residuals; e.g. `jax.checkpoint_policies.dots_saveable` keeps only
      matmul/convolution outputs (compressed) and recomputes the elementwise
      ops between them in the backward pass from their reconstructions.
    compress_argnums: positional arguments that are activations rather than
      parameters: the backward pass keeps a compressed copy of them instead
      of the argument itself. Every other argument, keyword arguments
      included, is kept by reference and exact (a parameter is alive
      anyway); the default `()` compresses none -- the rule and default of
      `jact.checkpoint`. In a stack of compressed blocks, pass the block
      input's position, so that the previous block's output can die after
      the forward pass.

  Returns:
    `wrapped(*args, key=None, **kwargs)`; `key` (a PRNG key) is required when
    residuals are stochastically rounded; use a fresh key every step.
  """
  config = ResidualConfig(
    resolve_compressor(bits, compressor, "jact.compressed"), min_size, name, overrides
  )
  argnums = check_argnums(compress_argnums)
  check_policy(policy, "jact.compressed")
  if fn is None:
    return functools.partial(_wrap, config=config, policy=policy, compress_argnums=argnums)
  return _wrap(fn, config=config, policy=policy, compress_argnums=argnums)


def _wrap(fn, *, config: ResidualConfig, policy=None, compress_argnums=()):
  if not callable(fn):
    raise TypeError(f"jact.compressed takes a function, got {type(fn).__name__}")
  for route in _MODULE_ROUTES:  # Flax modules have their own path (jact._flax registers it)
    if route.handles(fn):
      return route.wrap(fn, config, policy, compress_argnums)
  if is_callable_pytree(fn):  # an Equinox module: its parameters stay leaves of the wrapper
    return CompressedModule(
      fn,
      _wrap(
        module_call(fn),
        config=config,
        policy=policy,
        compress_argnums=module_argnums(compress_argnums),
      ),
    )
  check_key = reserved_key_check(fn, "jact.compressed")
  checked = returning_arrays(fn, "jact.compressed")

  @functools.wraps(fn)
  def wrapped(*args, key=None, **kwargs):
    check_key(args)
    for route in _MODULE_ROUTES:  # e.g. nnx modules/Rngs passed as arguments
      if route.takes_arguments(args, kwargs):
        return route.call(
          fn, args, kwargs, key=key, config=config, policy=policy, compress_argnums=compress_argnums
        )
    return call_compressed(
      checked,
      args,
      kwargs,
      key=key,
      config=config,
      policy=policy,
      compress_inputs=input_flags(fn, args, kwargs, compress_argnums),
    )

  wrapped.residual_config = config
  return wrapped


def _hoist_closure(fn, args, name: str):
  """`(converted, consts)`: `converted(*args, *consts)` computes `fn(*args)`
  with every tracer `fn` closes over passed in explicitly.

  Closed-over tracers are the values `fn` is differentiated with, and also
  keys and loop indices of an enclosing `lax.scan`, `fori_loop`, `cond` or
  `jax.checkpoint`. `jax.closure_convert` hoists only values autodiff may
  perturb; a key or integer left in the jaxpr leaks into the custom VJP's
  rules, which are traced apart (UnexpectedTracerError)."""
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  out_tree = jax.tree.structure(out_shape)
  hoisted = [_compat.is_tracer(c) for c in closed.consts]
  kept = [c for c, h in zip(closed.consts, hoisted) if not h]

  def converted(*inputs):
    passed, kept_it = iter(inputs[len(args) :]), iter(kept)
    consts = [next(passed) if h else next(kept_it) for h in hoisted]
    return jax.tree.unflatten(
      out_tree,
      evaluate_with_exact_selections(closed.jaxpr, consts, *inputs[: len(args)], name=name),
    )

  return converted, [c for c, h in zip(closed.consts, hoisted) if h]


def call_compressed(
  fn,
  args,
  kwargs,
  *,
  key,
  config: ResidualConfig,
  policy=None,
  compress_inputs=None,
  materialize_cotangent: bool = False,
  state_output: bool = False,
):
  """`fn(*args, **kwargs)` with compressed residuals (the body of `compressed`).

  `policy`, when given, is a `jax.checkpoint` policy applied to `fn` before
  its residuals are captured: it chooses which intermediates are residuals
  (the rest is recomputed in the backward pass from the reconstructions).
  `compress_inputs` has one flag per leaf of `(args, kwargs)`: store a
  compressed copy of that input instead of keeping it by reference.
  `materialize_cotangent` makes the backward materialize its incoming
  cotangent once (see `jact.checkpoint`). `state_output`: `fn` returns
  `(output, state)`, the state (a module's updated variables: batch
  statistics, RNG counts) being no activation: it does not wait for the
  stored residuals, so a statistic averaged over a `jax.vmap` axis stays
  unbatched (as `nnx.vmap(..., out_axes=None)` / `in_axes=None` need).
  """
  if config.needs_key and key is None:
    raise ValueError(
      f"jact.compressed({config.name!r}) quantizes residuals with stochastic rounding and "
      f"needs a PRNG key: call it with key=jax.random.key(...) (a fresh key per step), or "
      f"build it with compressor=jact.compressors.PerGroup(bits, stochastic=False) "
      f"(round-to-nearest) or bits=None (keep residuals)."
    )
  seed = make_seed(key, config.compressor, "compressed")
  if isinstance(seed, NoKey) and _context.current("salt") is not None:
    seed = salt_seed(jnp.uint32(0))  # carries the estimator's salt into the forward rule

  call, dynamic_leaves, dynamic = over_array_leaves(fn, args, kwargs)
  n_leaves = len(jax.tree.leaves((args, kwargs)))
  if compress_inputs is None:
    compress_inputs = [False] * n_leaves
  if len(compress_inputs) != n_leaves:
    raise ValueError("compress_inputs needs one flag per leaf of (args, kwargs)")
  if policy is not None:
    call = jax.checkpoint(call, policy=policy)
  converted, consts = _hoist_closure(call, dynamic_leaves, config.name)
  inputs = list(dynamic_leaves) + list(consts)
  input_flags = [bool(compress_inputs[i]) for i in dynamic] + [False] * len(consts)
  # complex inputs are differentiable too; their residuals are kept exact (`store_saved`)
  differentiable = tuple(is_float(x) or is_complex(x) for x in inputs)

  def run(*inputs):
    return converted(*inputs[: len(dynamic_leaves)], *inputs[len(dynamic_leaves) :])

  def split(inputs):
    return [x for x, d in zip(inputs, differentiable) if d]

  def merged(diff_inputs, inputs):
    it = iter(diff_inputs)
    return [next(it) if d else x for x, d in zip(inputs, differentiable)]

  # The named axes bound at the call (jax.vmap(axis_name=), shard_map). JAX
  # may run the rules outside them (a backward under jax.grad of the vmap, a
  # forward re-run from a traced program): the rules bind them again to trace
  # the collectives of `fn` (cross-device batch norm).
  axes = _compat.bound_axis_sizes(None)

  @jax.custom_vjp
  def op(seed, *inputs):
    return run(*inputs)

  def fwd(seed, *inputs):
    with _compat.axes_bound(axes):
      if isinstance(seed, SaltedSeed):  # inner ops see this trace's salt, not a closed-over one
        with _context.salted(seed.names, seed.salt):
          return _fwd(seed, *inputs)
      return _fwd(seed, *inputs)

  def _fwd(seed, *inputs):
    trees = {}

    def forward_and_residuals(*inputs):
      out, vjp = jax.vjp(lambda *diff: run(*merged(diff, inputs)), *split(inputs))
      out_leaves, trees["out"] = jax.tree.flatten(out)
      vjp_leaves, trees["vjp"] = _compat.vjp_residuals(vjp)
      return out_leaves, vjp_leaves

    capture = jax.make_jaxpr(forward_and_residuals)(*inputs)
    n_out = trees["out"].num_leaves
    residual_vars = tuple(capture.jaxpr.outvars[n_out:])
    plan = plan_saved(capture.jaxpr, residual_vars, input_flags, config)
    results, stored = evaluate_storing(
      capture.jaxpr,
      capture.consts,
      inputs,
      {p: v for p, ((kind, _), v) in enumerate(zip(plan, residual_vars)) if kind == "compress"},
      lambda p, leaf, steps=(): store_saved(
        leaf,
        f"{config.name}.{p}",
        step_seed(seed, steps),
        p,
        step_config(config, residual_vars[p]) if steps else config,
        plan[p][1],
      ),
      needed=[True] * n_out + [kind not in ("compress", "same", "constant") for kind, _ in plan],
    )
    # pieces stacked by a scan carry their name inside its body: named again outside
    stored = {
      p: tag(s, f"{config.name}.{p}") if isinstance(s, Stacked) else s for p, s in stored.items()
    }
    out = jax.tree.unflatten(trees["out"], results[:n_out])
    values, index = [], []
    for position, ((kind, _), leaf) in enumerate(zip(plan, results[n_out:])):
      if kind in ("same", "constant"):
        index.append(-1)
        continue
      if kind == "compress":
        leaf = stored[position]
      index.append(len(values))
      values.append(leaf)
    check_overrides(
      config, {f"{config.name}.{i}" for i, (k, _) in enumerate(plan) if k == "compress"}
    )
    if state_output:
      result, values = output_epilogue(out[0], tuple(values))
      out = (result, out[1])
    else:
      out, values = output_epilogue(out, tuple(values))
    shapes = tuple(tuple(v.aval.shape) for v in residual_vars)
    dtypes = tuple(v.aval.dtype for v in residual_vars)
    return out, Saved(
      values, plan, tuple(index), shapes, dtypes, capture, residual_vars, trees["vjp"]
    )

  def bwd(saved, g):
    with _compat.axes_bound(axes):
      return _bwd(saved, g)

  def _bwd(saved, g):
    values, g = barrier(saved.values, g)
    if materialize_cotangent:
      g = jax.tree.map(
        lambda t: materialize(t, values) if is_array(t) and is_float(t) and jnp.size(t) else t, g
      )
    constants = iter(
      eval_constants(
        saved.capture.jaxpr,
        saved.capture.consts,
        [v for v, (kind, _) in zip(saved.residual_vars, saved.plan) if kind == "constant"],
      )
    )
    leaves, restore, kept = [], {}, []
    for position, ((kind, detail), i, shape, dtype) in enumerate(
      zip(saved.plan, saved.index, saved.shapes, saved.dtypes)
    ):
      if kind == "same":
        leaves.append(leaves[detail])
      elif kind == "constant":
        leaves.append(next(constants))
      elif kind == "compress" and is_stored(values[i]):
        restore[position] = (values[i], functools.partial(restore_saved, shape=shape, dtype=dtype))
        leaves.append(jax.ShapeDtypeStruct(shape, dtype))
      else:
        kept.append(position)
        leaves.append(restore_saved(values[i], shape, dtype))
    g_leaves, g_tree = jax.tree.flatten(g)
    backward = jax.make_jaxpr(
      lambda leaves, g: _compat.rebuild_vjp(saved.vjp_layout, leaves)(jax.tree.unflatten(g_tree, g))
    )(leaves, g_leaves)
    anchor = next((t for t in g_leaves if is_array(t) and is_float(t) and jnp.size(t)), None)
    grads = iter(
      evaluate_restoring(
        backward.jaxpr, backward.consts, leaves + g_leaves, restore, start=anchor, kept=kept
      )
    )
    return (None, *[next(grads) if d else None for d in differentiable])

  _compat.defvjp_batching_shared_outputs(op, fwd, bwd)
  return reverse_only(op, f"jact.compressed({config.name!r})")(seed, *inputs)
