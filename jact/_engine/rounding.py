"""How an op stores its residuals: the one value that says so (a
`jact.compressors.Compressor`, or None: kept exact), resolved once from a
public call's `bits=` / `compressor=` (`resolve_compressor`), what a plan
entry makes of it (`apply_plan_entry`), and the uint32 seeds (per call, per
residual site, salted by the estimators) that make the rounding noise
reproducible and independent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jact._core import rng
from jact._core.quantize import FLOAT_DTYPES, check_bits
from jact.compressors import Compressor, PerGroup
from jact._engine import context as _context

__all__ = [
  "SaltedSeed",
  "NoKey",
  "NO_KEY",
  "resolve_compressor",
  "compressor_keywords",
  "apply_plan_entry",
  "site_width",
  "make_seed",
  "salt_seed",
  "site_seed",
  "check_float",
]


def _checked(bits, compressor, api: str, default_bits: int | None):
  """A call's `bits=` and `compressor=` checked: the compressor when one is
  given, else the width (an int, or None: uncompressed).

  A compressor passed as `bits=` is a TypeError naming `compressor=`; a
  compressor together with a width other than the call's default
  (`default_bits`) is a ValueError, since the compressor sets its own width.
  `api` names the call in the messages ("jact.ops.dense").
  """
  if isinstance(bits, Compressor):
    raise TypeError(
      f"{api}: bits= takes an int width (1 to 8, or 16) or None, got the "
      f"compressor {bits!r}; pass it as compressor={bits!r}."
    )
  if compressor is None:
    if bits is not None:
      try:
        check_bits(bits)
      except ValueError as e:
        raise ValueError(
          f"{e} Or pass a compressor from jact.compressors "
          "(e.g. compressor=jact.compressors.Division())."
        ) from None
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
  method = _checked(bits, compressor, api, default_bits)
  return method if method is None or isinstance(method, Compressor) else PerGroup(method)


def compressor_keywords(compressor) -> dict:
  """An op's keywords for a resolved value (`resolve_compressor`): the inverse
  direction, for code that calls a public op with a value it already holds.

  >>> compressor_keywords(None)
  {'bits': None}
  """
  return {"bits": None} if compressor is None else {"compressor": compressor}


def apply_plan_entry(compressor: Compressor | None, entry) -> Compressor | None:
  """What a plan entry makes of a call site's compressor: an integer entry
  changes its width (`compressor.with_bits(n)`; the per-group quantizer's for
  a site kept exact), a compressor entry replaces it, None keeps the residual
  uncompressed.

  >>> apply_plan_entry(PerGroup(4, group_size=64), 2)
  PerGroup(bits=2, group_size=64, stochastic=True, implementation=None)
  """
  if isinstance(entry, Compressor) or entry is None:
    return entry
  if compressor is None:
    return PerGroup(entry)
  return compressor.with_bits(entry)


def site_width(compressor: Compressor | None):
  """How reports and estimators list a residual's storage
  (`jact._engine.context.Site.bits`): the per-group quantizer as its width
  (an int), any other compressor as itself, None (kept exact) as None.

  >>> site_width(PerGroup(2, group_size=64)), site_width(None)
  (2, None)
  """
  if isinstance(compressor, PerGroup) and compressor.implementation is None:
    return compressor.bits
  return compressor


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


def make_seed(key, compressor: Compressor | None, op: str):
  """uint32 seed for an op call; a clear error when a needed key is missing.

  Without a key (and none needed) the seed is `NO_KEY`; inside a sensitivity
  estimator's salt scope the result is a `SaltedSeed`.
  """
  if key is None:
    if compressor is None or not compressor.needs_key:
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
      + (
        " To keep its residual in FP8, cast it to bfloat16 (x.astype(jnp.bfloat16)) and pass "
        "compressor=jact.compressors.Float8()."
        if jnp.dtype(x.dtype).itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating)
        else ""
      )
    )
  return x
