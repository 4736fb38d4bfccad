"""One skeleton for every compressed op: `compressed_op(forward, backward, ...)`.

An op supplies its exact forward, which returns the output and the residuals
its backward needs *by role*, and its backward formula, which receives the
restored residuals by role. The skeleton owns the rest, the same way for
every op:

* the seed of the rounding noise (`make_seed`: a clear error for a missing
  key) and one site per role, so each residual draws independent noise;
* residual names `f"{name}.{role}"` (`tag`, for `jax.checkpoint` policies,
  plans, reports and estimators);
* compression with the op's compressor (and the active plan), optionally
  centered and scaled per row first (`store_rows`);
* the forward epilogue (`finish_forward`: the output waits for the stored
  residuals, so the full-precision input dies in the forward pass);
* the backward prologue (`barrier`: reconstruction after the cotangent
  arrives; `kept_until_cotangent` for kept weights), reconstruction with
  rows pinned as `jact.sharded_batch` says (`restore_residual`);
* the forward-mode guard (`reverse_only`) and the cast of invariant inputs
  to the manual mesh axes the others vary over (`same_varying_axes`).

A residual's role says what happens to it:

* `Store(value)`: stored compressed with the op's compressor (exact when it
  is None), reconstructed before the backward runs;
* `Save(value)`: kept as given and named (exact statistics, a packed mask,
  a seed, integer ids); `unpack` rebuilds it after the barrier;
* `Keep(value)`: an input kept by reference (a weight, a bias, a mask),
  not named; `tie=True` makes it wait for the cotangent.

>>> import jax, jax.numpy as jnp
>>> from jact._engine.rounding import resolve_compressor
>>> def cube(x, *, key=None, bits=8, name="cube"):
...   def forward(x):   # exact output; the derivative is the only residual
...     return x ** 3, {"dydx": Store(3 * x ** 2)}
...   def backward(res, g):   # res["dydx"]: the reconstructed derivative
...     return (g * res["dydx"],)
...   compressor = resolve_compressor(bits, None, "cube", default_bits=8)
...   return compressed_op(forward, backward, op="cube", name=name,
...                        compressor=compressor, key=key, elementwise=True)(x)
>>> x = jnp.linspace(-1.0, 1.0, 256)
>>> bool((cube(x, key=jax.random.key(0)) == x ** 3).all())
True
>>> g = jax.grad(lambda x: cube(x, key=jax.random.key(0)).sum())(x)
>>> bool(jnp.allclose(g, 3 * x ** 2, atol=3 / 255))
True
>>> bool((jax.grad(lambda x: cube(x, bits=None).sum())(x) == 3 * x ** 2).all())
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jact import _compat
from jact._engine.derivatives import reverse_only
from jact._engine.names import check_name, tag
from jact.compressors import Compressor
from jact._engine.rounding import make_seed
from jact._engine.rows import store_rows
from jact._engine.scheduling import barrier, finish_forward, is_stored, kept_until_cotangent
from jact._engine.store import compress_residual, restore_residual

__all__ = [
  "Store",
  "Save",
  "Keep",
  "compressed_op",
  "same_varying_axes",
]


@dataclasses.dataclass(frozen=True)
class Store:
  """A residual stored with the op's compressor.

  Attributes:
    value: a floating-point array.
    dtype: the dtype of the reconstruction the backward receives (None:
      `value`'s own).
    exact_dtype: the dtype `value` is kept in when the op stores exactly
      (its compressor is None), e.g. the input's dtype for a float32 derivative.
    rows: axes of a row (counted from the end): the value is centered and
      scaled per row before it is rounded (`jact._engine.rows.store_rows`).
  """

  value: Any
  dtype: Any = None
  exact_dtype: Any = None
  rows: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Save:
  """A residual kept as given and named `name.role` (a statistic, a packed
  mask, a seed, ids); `unpack`, when given, rebuilds it after the barrier."""

  value: Any
  unpack: Callable[[Any], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Keep:
  """An op input kept by reference for the backward (a weight: alive anyway),
  not named; `tie=True` makes it wait for the cotangent
  (`jact._engine.scheduling.kept_until_cotangent`)."""

  value: Any
  tie: bool = False


def compressed_op(
  forward: Callable,
  backward: Callable,
  *,
  op: str,
  name: str,
  compressor: Compressor | None = None,
  key=None,
  primal: Callable | None = None,
  elementwise: bool = False,
  statistics: int = 0,
) -> Callable:
  """A reverse-mode function of the op's inputs with compressed residuals.

  Args:
    forward: `forward(*inputs) -> (out, residuals)`, `residuals` a dict from
      role (a string) to `Store`, `Save` or `Keep`, in a fixed order (the
      order gives each role its rounding-noise site).
    backward: `backward(res, g) -> cotangents`, one per input (None for an
      integer input or a seed); `res` maps each role to its reconstruction
      (`Store`), its unpacked value (`Save`) or the value itself (`Keep`);
      `g` is the output's cotangent (the first output's with `statistics`).
    op: the op's name in messages (`jact.ops.<op>`).
    name: the residual-name prefix (the op's `name=`).
    compressor: how `Store` residuals are stored (None: kept exact), the
      value `jact._engine.rounding.resolve_compressor` gives.
    key: the PRNG key of the rounding noise (None where none is needed).
    primal: the output alone, for evaluation without differentiation
      (default: `forward`'s output).
    elementwise: the output is materialized anyway (an elementwise op):
      it waits for the residuals through `materialize` rather than a select.
    statistics: the number of trailing outputs (of a tuple output) that are
      statistics without gradient (a batch mean, a variance): they do not
      wait for the residuals and are returned through `stop_gradient`.

  Returns:
    `apply(*inputs)`, the op's output with the backward `backward` gives.
  """
  name = check_name(name)
  seed = make_seed(key, compressor, op)
  primal = primal or (lambda *inputs: forward(*inputs)[0])
  layout = {}  # what the forward rule stored: roles, kinds, shapes (static)

  @jax.custom_vjp
  def apply(seed, *inputs):
    return primal(*inputs)

  def fwd(seed, *inputs):
    out, residuals = forward(*inputs)
    roles = tuple(residuals)
    kinds = tuple(residuals.values())
    values = tuple(
      _stored(kind, seed, site, compressor, f"{name}.{role}")
      for site, (role, kind) in enumerate(residuals.items())
    )
    # the static part only: the backward rule must not hold the forward's tracers
    layout.update(
      roles=roles,
      kinds=tuple(dataclasses.replace(k, value=None) for k in kinds),
      shapes=tuple(jnp.shape(k.value) if isinstance(k, Store) else None for k in kinds),
    )
    if _waits(kinds, values):
      out, values = _finish(out, kinds, values, elementwise, statistics)
    return out, values

  def bwd(values, cts):
    g = cts[0] if statistics else cts
    kinds = layout["kinds"]
    if values:
      values, g = barrier(values, g)
      values = _tied(kinds, values, g)
    res = {
      role: _restored(kind, value, shape)
      for role, kind, value, shape in zip(layout["roles"], kinds, values, layout["shapes"])
    }
    return (None, *backward(res, g))

  apply.defvjp(fwd, bwd)
  guarded = reverse_only(apply, f"jact.ops.{op}")

  def call(*inputs):
    out = guarded(seed, *same_varying_axes(inputs))
    if statistics:
      out = (*out[:-statistics], *(jax.lax.stop_gradient(s) for s in out[-statistics:]))
    return out

  return call


def _stored(kind, seed, site: int, compressor: Compressor | None, name: str):
  """What the forward rule keeps of one residual (named, compressed where asked)."""
  if isinstance(kind, Keep):
    return kind.value
  if isinstance(kind, Save):
    return tag(kind.value, name)
  if not isinstance(kind, Store):
    raise TypeError(
      f"a compressed op's residual {name!r} must be Store, Save or Keep, got {kind!r}"
    )
  value = kind.value
  compress = lambda v: compress_residual(v, seed, site, compressor, name)
  if compressor is None:
    if kind.exact_dtype is not None:
      value = value.astype(kind.exact_dtype)
    stored = compress(value)
  elif kind.rows is not None and jnp.size(value):
    stored = store_rows(value, kind.rows, compress)
  else:
    stored = compress(value)
  return tag(stored, name)


def _waits(kinds, values) -> bool:
  """Whether the output waits for the residuals: the op stores something
  (compressed or exact) or saves a packed form."""
  return any(
    isinstance(k, Store) or (isinstance(k, Save) and is_stored(v)) for k, v in zip(kinds, values)
  )


def _finish(out, kinds, values, elementwise: bool, statistics: int):
  """`finish_forward` of the output (its first part with `statistics`) and
  the named residuals; kept inputs pass untouched."""
  named = [i for i, k in enumerate(kinds) if not isinstance(k, Keep)]
  waiting = out[0] if statistics else out
  waiting, finished = finish_forward(
    waiting, tuple(values[i] for i in named), elementwise=elementwise
  )
  values = list(values)
  for i, v in zip(named, finished):
    values[i] = v
  if statistics:
    out = (waiting, *out[1:])
  else:
    out = waiting
  return out, tuple(values)


def _tied(kinds, values, g):
  """`values` with the kept inputs marked `tie` waiting for the cotangent
  (one `kept_until_cotangent` for all of them)."""
  tied = [i for i, k in enumerate(kinds) if isinstance(k, Keep) and k.tie]
  if not tied:
    return values
  values = list(values)
  for i, v in zip(tied, kept_until_cotangent(tuple(values[i] for i in tied), g)):
    values[i] = v
  return tuple(values)


def _restored(kind, value, shape):
  if isinstance(kind, Store):
    return restore_residual(value, shape, kind.dtype)
  if isinstance(kind, Save) and kind.unpack is not None:
    return kind.unpack(value)
  return value


def same_varying_axes(args) -> tuple:
  """`args` with the floating-point arrays cast to vary over every manual
  mesh axis any of them varies over.

  Inside `jax.shard_map` (with `check_vma`), a custom VJP's backward must
  return cotangents of its inputs' types: a replicated weight meeting a
  sharded activation would get a per-device (varying) gradient. Casting the
  invariant inputs first, as JAX does for its own operations, makes the
  whole call varying; the cast's transpose then sums the weight's gradient
  over the devices, exactly as for the plain operation. None entries (an
  absent bias) and non-float values (ids, seeds, masks) pass through.
  Outside shard_map nothing changes.
  """
  axes = _compat.union_of_varying_axes(args)
  if not axes:
    return tuple(args)
  return tuple(_compat.cast_varying(a, axes) if _is_float(a) else a for a in args)


def _is_float(a) -> bool:
  return _compat.is_jax_value(a) and jnp.issubdtype(jnp.result_type(a), jnp.floating)
