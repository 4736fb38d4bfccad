"""The engine shared by the compressed ops.

`save_compressed(fn, *args, compress=...)` evaluates `fn(*args)` exactly and
keeps, for the backward pass, a quantized copy of each argument marked in
`compress` (the others are kept as they are: weights are alive anyway). The
backward starts with an optimization barrier that ties the residuals to the
incoming cotangent -- without it XLA hoists every dequantization into the
forward pass and the compiled step uses more memory than plain training --
and then runs the exact VJP of `fn` at the reconstructed arguments. For a
function that is linear in each compressed argument (matmul, convolution)
the resulting gradients are unbiased.

Every residual piece is tagged with `jax.ad_checkpoint.checkpoint_name`, so
`jax.checkpoint` policies such as `save_only_these_names` can select it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# Names, not the module: `jact.quantize` is rebound to the function by jact/__init__.
from jact.quantize import (FLOAT_DTYPES, Packed, PackedBits, check_bits, check_group_size,
                           dequantize)
from jact import _context, _probe, allocate, persample, rng
from jact.compressors import Compressed, Compressor, PerGroup
from jact.compressors.pergroup import as_rows
from jact.ops._derivatives import first_order_only, reverse_only
from jact.persample import PackedPerSample

__all__ = ["Rounding", "SaltedSeed", "NoKey", "NO_KEY", "as_compressor", "apply_plan_entry", "save_compressed", "make_seed", "tag", "JACT_NAME_PREFIX", "is_jact_name", "check_name", "check_float", "barrier",
           "after_residuals", "materialize", "finish_forward", "compress_residual",
           "restore_residual"]


@dataclasses.dataclass(frozen=True)
class Rounding:
  """Static compression settings of one op call.

  Attributes:
    bits: 1, 2, 4 or 8 (ActNN's per-group quantizer), a `jact.compressors`
      compressor (BLPA, DIVISION, fixpoint, zero-value, ...), or None to
      keep the residual uncompressed.
    group_size: values per quantization group (multiple of 8) of an integer `bits`.
    stochastic: stochastic (unbiased) or round-to-nearest rounding, for an integer `bits`.
  """
  bits: int | Compressor | None = 4
  group_size: int = 256
  stochastic: bool = True

  def __post_init__(self):
    if self.bits is not None and not isinstance(self.bits, Compressor):
      try:
        check_bits(self.bits)
      except ValueError as e:
        raise ValueError(f"{e} Or pass a compressor from jact.compressors "
                         "(e.g. bits=jact.compressors.Division()).") from None
    check_group_size(self.group_size)

  @property
  def compressor(self) -> Compressor | None:
    """The compressor `bits` stands for (None: uncompressed)."""
    return as_compressor(self.bits, self.group_size, self.stochastic)

  @property
  def needs_key(self) -> bool:
    c = self.compressor
    return c is not None and c.needs_key


def as_compressor(bits, group_size: int = 256, stochastic: bool = True) -> Compressor | None:
  """`bits` (an int, a compressor or None) as a compressor."""
  if bits is None or isinstance(bits, Compressor):
    return bits
  return PerGroup(bits, group_size, stochastic)


def apply_plan_entry(call_bits, entry):
  """What a plan entry makes of a call site's `bits`: an integer entry
  changes the width of the call site's method (`with_bits`), a compressor
  entry replaces it, None keeps the residual uncompressed."""
  if isinstance(entry, Compressor) or entry is None:
    return entry
  if isinstance(call_bits, Compressor):
    return call_bits.with_bits(entry)
  return entry


def check_name(name: Any) -> str:
  if not isinstance(name, str) or not name:
    raise ValueError(f"a residual name must be a non-empty string, got {name!r}")
  return name


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SaltedSeed:
  """An op's seed while a sensitivity estimator re-draws chosen residuals'
  noise: `salt[i]` is mixed into the seed of residual `names[i]` (0: no change).
  Passed into the custom VJPs as an ordinary input."""
  base: jax.Array
  salt: jax.Array
  names: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class NoKey:
  """The seed of an op called without a PRNG key (a pytree with no leaves)."""


NO_KEY = NoKey()


def make_seed(key, rounding: Rounding, op: str):
  """uint32 seed for an op call; a clear error when a needed key is missing.

  Without a key (and none needed) the seed is `NO_KEY`; inside a sensitivity
  estimator's salt scope the result is a `SaltedSeed`.
  """
  if key is None:
    if not rounding.needs_key:
      return NO_KEY
    raise ValueError(
        f"jact.ops.{op} quantizes its residuals with stochastic rounding and needs "
        f"a PRNG key: call it with key=jax.random.key(...) (a fresh key per step), "
        f"or pass stochastic=False for round-to-nearest, or bits=None to store "
        f"the residual uncompressed.")
  return salt_seed(rng.seed_from_key(key))


def salt_seed(seed):
  """`seed` with the active salt attached (unchanged outside a salt scope)."""
  salt = _context.current("salt")
  if salt is None:
    return seed
  return SaltedSeed(jnp.asarray(seed, jnp.uint32), salt.values, salt.names)


def site_seed(seed, site: int, name: str | None = None) -> jax.Array:
  """The uint32 seed of one residual of an op call."""
  if isinstance(seed, SaltedSeed):
    s = rng.split_seed(seed.base, site)
    if name is not None and name in seed.names:
      s = s ^ (seed.salt[seed.names.index(name)] * jnp.uint32(0x9E3779B9))
    return s
  return rng.split_seed(seed, site)


JACT_NAME_PREFIX = "jact:"
"""The namespace of jact's own checkpoint names: `tag` names each residual
piece `JACT_NAME_PREFIX + name`, which no user name shares by accident."""


def is_jact_name(name: Any) -> bool:
  """Whether a `checkpoint_name` is one jact's `tag` gave (its reserved namespace)."""
  return isinstance(name, str) and name.startswith(JACT_NAME_PREFIX)


def tag(tree, name: str):
  """Tags every array leaf of a residual with `name` (for checkpoint policies).

  Each leaf gets two `checkpoint_name`s: `JACT_NAME_PREFIX + name` inside,
  which jact's policies and an enclosing `compressed` select (a function of
  the name alone, whatever else the process traced), and `name` outside,
  which reports show and `jax.checkpoint_policies.save_only_these_names`
  selects. The name is also noted as traced for the enclosing plan blocks
  (which report plan entries naming no residual)."""
  _context.note_residual(name)
  return jax.tree.map(
      lambda a: checkpoint_name(checkpoint_name(a, JACT_NAME_PREFIX + name), name), tree)


def barrier(residuals, cotangent):
  """Orders a backward rule's decompression after the arrival of its cotangent.

  Two mechanisms, because one is not enough everywhere:
    * `jax.lax.optimization_barrier` ties the residuals to the cotangent;
    * XLA:CPU expands optimization barriers before fusion and scheduling, so
      the packed residuals (bytes and group statistics) are also given a real data
      dependency on the cotangent: they are selected by `_always(g0)` (g0 one
      element of the cotangent), which is True for every value g0 can hold
      (NaN and infinities included) and which XLA cannot fold. Without it
      the scheduler hoists every dequantization to the start of the
      backward pass and all reconstructions are alive at once.
  The values are never changed: a NaN or infinite gradient of one sample
  leaves the reconstructions of every sample intact.
  """
  residuals, cotangent = jax.lax.optimization_barrier((residuals, cotangent))
  leaves = [c for c in jax.tree.leaves(cotangent)
            if jnp.size(c) and c.dtype != jax.dtypes.float0]
  if not leaves:
    return residuals, cotangent
  arrived = _always(jnp.reshape(leaves[0], (-1,))[0])

  def tie(r):
    if isinstance(r, Packed):
      return dataclasses.replace(r, data=jnp.where(arrived, r.data, jnp.zeros_like(r.data)),
                                 scale=jnp.where(arrived, r.scale, jnp.zeros_like(r.scale)))
    if isinstance(r, (PackedBits, PackedPerSample)):
      return dataclasses.replace(r, data=jnp.where(arrived, r.data, jnp.zeros_like(r.data)))
    if isinstance(r, Compressed):
      return dataclasses.replace(r, arrays=jax.tree.map(
          lambda a: jnp.where(arrived, a, jnp.zeros_like(a)), r.arrays))
    return r

  residuals = jax.tree.map(
      tie, residuals, is_leaf=lambda r: isinstance(r, (Packed, PackedBits, PackedPerSample, Compressed)))
  return residuals, cotangent


def _always(v: jax.Array) -> jax.Array:
  """A boolean scalar that is True for every value of the scalar `v` (NaN
  and infinities included) but depends on it, so XLA keeps the data
  dependency: no float exceeds +inf, and `v == v` holds for any other dtype."""
  if jnp.issubdtype(v.dtype, jnp.complexfloating):
    v = jnp.real(v)
  if jnp.issubdtype(v.dtype, jnp.floating):
    return jnp.logical_not(v > jnp.asarray(jnp.inf, v.dtype))
  return v == v  # pylint: disable=comparison-with-itself


def after_residuals(out, residuals):
  """Makes a forward output depend on its op's compressed residuals.

  XLA schedules a computation whose result is only needed in the backward
  pass as late as it can, so the compression of a residual would run after
  the forward pass and keep the full-precision input alive until then (the
  optimization barrier that says otherwise is expanded away by XLA:CPU
  before scheduling). Selecting the output by `t == t`, with `t` a float made
  from one packed byte of every residual (never NaN, and not foldable),
  forces compression to finish before the output is used. The select fuses
  into the output's consumer: no extra memory pass.
  """
  ready = _ready(residuals)
  return jax.tree.map(lambda o: jnp.where(ready, o, jnp.zeros_like(o)), out)


def _ready(residuals) -> jax.Array:
  """A boolean scalar that is always True but depends on every packed residual."""
  packed = [r for r in jax.tree.leaves(residuals) if jnp.size(r) and r.dtype == jnp.uint8]
  if not packed:
    return jnp.bool_(True)
  t = sum(jnp.reshape(r, (-1,))[0].astype(jnp.float32) for r in packed)
  return t == t  # pylint: disable=comparison-with-itself


def materialize(x: jax.Array, residuals) -> jax.Array:
  """Returns x, as a value XLA materializes once instead of re-fusing it.

  XLA duplicates cheap elementwise producers into every consumer fusion; a
  residual stream such as x_i = relu(h_i + x_{i-1}) then gets recomputed from
  all earlier layer outputs inside later compression fusions, keeping all of
  them alive. XLA does not duplicate *expensive* producers, so an elementwise
  op whose output is materialized anyway (it feeds a matmul or convolution)
  divides it elementwise by a runtime 1.0 -- exact, not foldable (it is selected by a
  byte of the op's packed residuals, which also orders it after compression),
  and fused into the op's own single memory pass.
  """
  ready = _ready(residuals)
  # The divisor is per element (a scalar divisor is rewritten by XLA into a
  # cheap multiplication by its reciprocal).
  return jax.tree.map(lambda o: o / jnp.where(ready, jnp.ones_like(o), o), x)


def finish_forward(out, residuals, *, elementwise: bool = False):
  """Forward epilogue of every compressed op: the output waits for the
  compressed residuals (`barrier`, `after_residuals`), so the full-precision
  input dies in the forward pass. Elementwise outputs, which are materialized
  anyway, are emitted through `materialize` instead."""
  out, residuals = barrier(out, residuals)
  if elementwise:
    return materialize(out, residuals), residuals
  return after_residuals(out, residuals), residuals


def check_float(x, op: str) -> jax.Array:
  """x as an array, or a clear error if it is not float32, bfloat16 or float16."""
  x = jnp.asarray(x)
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
    raise TypeError(
        f"jact.ops.{op} takes a floating-point input (float32, bfloat16 or float16), got "
        f"{x.dtype}; cast it first (x.astype(jnp.float32)).")
  return x


def compress_residual(x: jax.Array, seed, site: int, rounding: Rounding, name: str | None = None):
  """Quantizes a float residual (or returns it unchanged when bits is None).

  `name` (the residual's name) lets the active bit plan change the width
  (`jact.use_plan`) and estimators find and re-seed the residual.

  `rounding.bits` may be a compressor (`jact.compressors`); a plan's integer
  entry changes its width, a compressor entry replaces it. The per-group
  quantizer quantizes a 1-D tensor, or samples shorter than a group, as a
  single row (see `jact.compressors.pergroup.as_rows`).
  """
  budget = None
  if name is not None and rounding.bits is not None:
    bits = apply_plan_entry(rounding.bits, _context.planned_bits(name, rounding.bits))
    if bits != rounding.bits:
      rounding = dataclasses.replace(rounding, bits=bits)
    _context.record(name, x, rounding.bits)
    if bits is not None:
      budget = _context.planned_budget(name)
  compressor = rounding.compressor
  if compressor is None:
    return x
  x = first_order_only(x, name, compressor)
  if budget is not None:
    if not isinstance(compressor, PerGroup):
      raise ValueError(
          f"the plan gives residual {name!r} a per-sample budget, which only the per-group "
          f"quantizer supports, but its compressor is {compressor!r}; drop the budget or "
          "give the residual an integer width.")
    rows = as_rows(tuple(x.shape), compressor.group_size)
    return _compress_per_sample(x.reshape(rows), site_seed(seed, site, name), rounding, budget)
  if not compressor.needs_key:
    return compressor.compress(x, None)
  if isinstance(seed, NoKey):
    raise ValueError(
        f"residual {name!r} is to be stored with {compressor!r}, which rounds stochastically "
        "and needs a PRNG key, but its op was called without one (its call site asked for "
        f"{rounding.bits if rounding.compressor is None else 'a deterministic method'}): pass "
        "key=jax.random.key(...) to the op (a Flax layer: an RNG stream named 'jact'), or "
        "give the residual a deterministic compressor in the plan.")
  return compressor.compress(x, site_seed(seed, site, name))


def _compress_per_sample(x, seed, rounding: Rounding, avg_bits: float):
  """ActNN L3 per-sample widths: samples with larger group ranges (per-sample
  sensitivity ||R_n||^2, the gradient factor being a per-layer moving average)
  get more bits; the widths are chosen here, inside the step, and the codes
  packed into a buffer sized for `avg_bits` on average."""
  ranges_sq, _, _ = _probe.group_ranges_sq(x, rounding.group_size)
  widths = allocate.allocate_per_sample(ranges_sq, avg_bits)
  capacity = persample.per_sample_capacity(x.shape, avg_bits, rounding.group_size)
  return persample.quantize_per_sample(x, widths, capacity_bytes=capacity,
                                       group_size=rounding.group_size,
                                       stochastic=rounding.stochastic, seed=seed)


def restore_residual(r, shape=None, dtype=None):
  """Inverse of `compress_residual`: the reconstruction, reshaped to `shape`."""
  if isinstance(r, PackedPerSample):
    r = persample.dequantize_per_sample(r, dtype)
  elif isinstance(r, Packed):
    r = dequantize(r, dtype)
  elif isinstance(r, Compressed):
    r = r.decompress(dtype)
  elif dtype is not None:
    r = r.astype(dtype)
  return r if shape is None else r.reshape(shape)


def save_compressed(fn: Callable[..., Any], *args: jax.Array, compress: Sequence[bool],
                    seed: jax.Array, rounding: Rounding, names: Sequence[str],
                    op: str = "save_compressed") -> Any:
  """Evaluates `fn(*args)` exactly, saving compressed copies of marked arguments.

  Args:
    fn: the primal function, differentiable in all of `args`.
    *args: floating-point arrays.
    compress: one flag per argument: quantize it (True) or keep it (False).
    seed: uint32 scalar seed (from `make_seed`).
    rounding: the compression settings.
    names: one residual name per argument (used for the compressed ones).
    op: the op's name, for error messages (`jact.ops.<op>`).

  Returns:
    `fn(*args)`, whose VJP uses the reconstructed arguments.
  """
  compress = tuple(bool(c) for c in compress)
  if len(compress) != len(args) or len(names) != len(args):
    raise ValueError("compress and names need one entry per argument")

  shapes = tuple(jnp.shape(a) for a in args)

  @jax.custom_vjp
  def call(seed, *args):
    return fn(*args)

  def fwd(seed, *args):
    out = fn(*args)
    residuals = tuple(
        tag(compress_residual(a, seed, i, rounding, names[i]), names[i]) if c else a
        for i, (a, c) in enumerate(zip(args, compress)))
    return finish_forward(out, residuals)

  def bwd(residuals, g):
    residuals, g = barrier(residuals, g)
    restored = tuple(restore_residual(r, shape) for r, shape in zip(residuals, shapes))
    _, vjp = jax.vjp(fn, *restored)
    return (None, *vjp(g))

  call.defvjp(fwd, bwd)
  return reverse_only(call, f"jact.ops.{op}")(seed, *args)
