"""How an op rounds its residuals: the `Rounding` settings, the compressor they
stand for, and the uint32 seeds (per call, per residual site, salted by the
estimators) that make the rounding noise reproducible and independent.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import jax.numpy as jnp

from jact._core import rng
from jact._core.quantize import FLOAT_DTYPES, check_bits, check_group_size
from jact.compressors import Compressor, PerGroup
from jact._engine import context as _context

__all__ = [
  "Rounding",
  "SaltedSeed",
  "NoKey",
  "NO_KEY",
  "residual_method",
  "op_rounding",
  "op_keywords",
  "as_compressor",
  "resolve_compressor",
  "compressor_keywords",
  "apply_plan_entry",
  "make_seed",
  "salt_seed",
  "site_seed",
  "check_float",
]


@dataclasses.dataclass(frozen=True)
class Rounding:
  """Static compression settings of one op call.

  Attributes:
    bits: 1, 2, 4 or 8 (ActNN's per-group quantizer), a `jact.compressors`
      compressor (BLPA, DIVISION, fixpoint, zero-value, ...), or None to
      keep the residual uncompressed. Public calls take the width as `bits=`
      and the compressor as `compressor=`; `residual_method` merges the two
      into this one field (a plan entry may replace it by either).
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
        raise ValueError(
          f"{e} Or pass a compressor from jact.compressors "
          "(e.g. compressor=jact.compressors.Division())."
        ) from None
    check_group_size(self.group_size)
    if not isinstance(self.stochastic, (bool, np.bool_)):
      raise TypeError(
        f"stochastic must be True (unbiased stochastic rounding, needs a key) or False "
        f"(round-to-nearest), got {type(self.stochastic).__name__} {self.stochastic!r}."
      )

  @property
  def compressor(self) -> Compressor | None:
    """The compressor `bits` stands for (None: uncompressed)."""
    return as_compressor(self.bits, self.group_size, self.stochastic)

  @property
  def needs_key(self) -> bool:
    c = self.compressor
    return c is not None and c.needs_key


def residual_method(bits, compressor, api: str, default_bits: int | None = 4):
  """What `Rounding.bits` holds for a call's `bits=` and `compressor=`.

  `bits=` is an int width (or None: uncompressed) and `compressor=` a
  `jact.compressors` object; the result is `compressor` when one is given,
  else `bits`. A compressor passed as `bits=` is a TypeError naming
  `compressor=`; a compressor together with a width other than the call's
  default (`default_bits`) is a ValueError, since the compressor sets its own
  width. `api` names the call in the messages ("jact.ops.dense").
  """
  if isinstance(bits, Compressor):
    raise TypeError(
      f"{api}: bits= takes an int width (1, 2, 4 or 8) or None, got the "
      f"compressor {bits!r}; pass it as compressor={bits!r}."
    )
  if compressor is None:
    return bits
  if not isinstance(compressor, Compressor):
    raise TypeError(
      f"{api}: compressor= takes a jact.compressors object (e.g. "
      f"jact.compressors.Division()) or None, got {compressor!r}; pass a width "
      f"as bits={compressor!r}."
    )
  if bits != default_bits:
    raise ValueError(
      f"{api}: got both bits={bits!r} and compressor={compressor!r}, which "
      f"conflict: the compressor sets its own width. Pass compressor= alone "
      f"(compressor.with_bits(n) changes its width), or bits= alone."
    )
  return compressor


def op_rounding(api: str, bits, compressor, default_bits: int | None = 4) -> Rounding:
  """The `Rounding` of an op call's `bits=` and `compressor=` (see
  `residual_method`). A plain `PerGroup` compressor is held as its width,
  group size and rounding mode (exactly what `bits=` alone gives for the
  defaults), so plans, reports and seeds treat both spellings alike.

  >>> op_rounding("jact.ops.gelu", 4, PerGroup(2, group_size=64, stochastic=False))
  Rounding(bits=2, group_size=64, stochastic=False)
  >>> op_rounding("jact.ops.gelu", 4, None) == op_rounding("jact.ops.gelu", 4, PerGroup(4))
  True
  """
  method = residual_method(bits, compressor, api, default_bits)
  if isinstance(method, PerGroup) and method.implementation is None:
    return Rounding(method.bits, method.group_size, method.stochastic)
  return Rounding(method)


def op_keywords(
  bits, group_size: int = 256, stochastic: bool = True, compressor: Compressor | None = None
) -> dict:
  """The ops' `bits=` / `compressor=` keywords for settings spelled out (a
  Flax layer's or a conversion's `bits`, `group_size`, `stochastic`,
  `compressor` fields): a non-default group size or rounding mode becomes
  the per-group compressor.

  >>> op_keywords(4, 64, False)
  {'compressor': PerGroup(bits=4, group_size=64, stochastic=False, implementation=None)}
  >>> op_keywords(2)
  {'bits': 2, 'compressor': None}
  """
  if (
    compressor is None
    and bits is not None
    and not isinstance(bits, Compressor)
    and (group_size, stochastic) != (256, True)
  ):
    return dict(compressor=PerGroup(bits, group_size, stochastic))
  return dict(bits=bits, compressor=compressor)


def as_compressor(bits, group_size: int = 256, stochastic: bool = True) -> Compressor | None:
  """`bits` (an int, a compressor or None) as a compressor."""
  if bits is None or isinstance(bits, Compressor):
    return bits
  return PerGroup(bits, group_size, stochastic)


def resolve_compressor(bits, compressor, api: str, default_bits: int | None = 4):
  """The one value that says how a residual is stored, from a public call's
  `bits=` and `compressor=`: a `Compressor`, or None (kept exact). Resolved
  once at the public boundary (an op, a twin, `jact.convert`,
  `jact.compressed`); everything below carries this value.

  >>> resolve_compressor(2, None, "jact.ops.gelu")
  PerGroup(bits=2, group_size=256, stochastic=True, implementation=None)
  >>> resolve_compressor(None, None, "jact.ops.gelu") is None
  True
  """
  return as_compressor(residual_method(bits, compressor, api, default_bits))


def compressor_keywords(compressor) -> dict:
  """An op's keywords for a resolved value (`resolve_compressor`): the inverse
  direction, for code that calls a public op with a value it already holds.

  >>> compressor_keywords(None)
  {'bits': None}
  """
  return {"bits": None} if compressor is None else {"compressor": compressor}


def apply_plan_entry(call_bits, entry):
  """What a plan entry makes of a call site's `bits`: an integer entry
  changes the width of the call site's method (`with_bits`), a compressor
  entry replaces it, None keeps the residual uncompressed."""
  if isinstance(entry, Compressor) or entry is None:
    return entry
  if isinstance(call_bits, Compressor):
    return call_bits.with_bits(entry)
  return entry


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
      f"or round to nearest (compressor=jact.compressors.PerGroup(bits, "
      f"stochastic=False)), or pass bits=None to store the residual uncompressed."
    )
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


def check_float(x, op: str) -> jax.Array:
  """x as an array, or a clear error if it is not float32, bfloat16 or float16."""
  x = jnp.asarray(x)
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
    raise TypeError(
      f"jact.ops.{op} takes a floating-point input (float32, bfloat16 or float16), got "
      f"{x.dtype}; cast it first (x.astype(jnp.float32))."
    )
  return x
