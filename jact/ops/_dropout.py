"""Dropout whose only residual is its key (a 4-byte seed, or the key's data).

Two ways to draw the keep mask (`draw=`):

* "hash" (default): a hash of (seed, flat element index) compared with a
  uint32 threshold (`jact.rng.element_bits`, which stays distinct past 2^32
  elements), computed inside the elementwise fusion, so no tensor-sized
  random temporaries exist; the residual is a uint32 seed derived from `key`.
* "flax": `jax.random.bernoulli(key, 1 - rate, mask_shape)`, exactly what
  `flax.linen.Dropout` and `flax.nnx.Dropout` draw from the same key, so the
  output is bit-identical to theirs; the residual is the key's data (8 bytes
  for the default threefry key).
* "flax_attention": the same mask applied as Flax's attention applies its
  weight dropout, `x * (keep / keep_prob)` in x's dtype (bit-identical to
  `flax.linen.dot_product_attention_weights`'s for the same key).

Either way the backward regenerates the very same mask from what it stored.
Kept values are scaled by 1 / (1 - rate), like `flax.linen.Dropout`.

>>> import jax, jax.numpy as jnp
>>> x = jnp.ones((4, 256))
>>> y = dropout(x, 0.25, key=jax.random.key(0))
>>> bool(jnp.isin(y, jnp.array([0.0, 1 / 0.75])).all())
True
>>> g = jax.grad(lambda x: dropout(x, 0.25, key=jax.random.key(0)).sum())(x)
>>> bool((g == y).all())
True
>>> keep = jax.random.bernoulli(jax.random.key(0), 0.75, x.shape)   # what Flax draws
>>> y = dropout(x, 0.25, key=jax.random.key(0), draw="flax")
>>> bool((y == jnp.where(keep, x / 0.75, 0.0)).all())
True
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jact._core import rng, xla_cpu
from jact._engine.names import check_name
from jact._engine.op import Save, compressed_op
from jact._engine.rounding import check_float
from jact._engine.sharding import pin_rows
from jact._core.packing import pack_codes, unpack_codes

__all__ = ["dropout", "keep_mask", "check_rate", "DRAWS", "SAVES"]

DRAWS = ("hash", "flax", "flax_attention")  # how the mask is drawn (see the module docstring)
SAVES = ("key", "mask")  # what the backward keeps to apply the mask again


def check_rate(rate, *, allow_one: bool = False) -> float:
  """Validates a dropout rate: a static number in [0, 1), or [0, 1] with
  `allow_one`; returns it as float."""
  interval = "[0, 1]" if allow_one else "[0, 1)"
  try:
    value = float(rate)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError(
      f"jact dropout rate must be a static Python number in {interval}, got {rate!r}"
    ) from e
  if not (0.0 <= value <= 1.0 if allow_one else 0.0 <= value < 1.0):
    raise ValueError(
      f"jact dropout rate must be in {interval}, got {value}: rate is the probability of "
      f"dropping a value (rate=0.0 disables dropout)."
    )
  return value


def _threshold(rate: float) -> np.uint32:
  # An element is kept when its 32 hash bits are >= threshold: P(keep) = 1 - threshold / 2**32.
  return np.uint32(min(int(round(rate * 2.0**32)), 2**32 - 1))


def keep_mask(seed: jax.Array, shape: Sequence[int], rate: float) -> jax.Array:
  """Boolean keep mask of `shape` from a uint32 seed (P(keep) = 1 - rate to 2**-32)."""
  return rng.element_bits(seed, shape) >= _threshold(rate)


def _stored_key(key):
  """(what the backward keeps of `key`, how to rebuild the key from it): the
  data of a typed key (its implementation is static), or a legacy key as is."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    impl = jax.random.key_impl(key)
    return jax.random.key_data(key), lambda data: jax.random.wrap_key_data(data, impl=impl)
  return key, lambda data: data


def _check_flax_key(key) -> None:
  shape, dtype = tuple(getattr(key, "shape", ())), getattr(key, "dtype", None)
  typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  if (typed and shape) or (not typed and (len(shape) != 1 or dtype != jnp.uint32)):
    raise ValueError(
      f"jact.ops.dropout(draw='flax') takes one PRNG key (jax.random.key(...) or a legacy "
      f"uint32 jax.random.PRNGKey), got {dtype} of shape {shape}; pass a single key."
    )


def dropout(
  x: jax.Array,
  rate: float,
  *,
  key,
  deterministic: bool = False,
  broadcast_dims: Sequence[int] = (),
  name: str = "dropout",
  draw: str = "hash",
  out_sharding=None,
  saves: str = "key",
) -> jax.Array:
  """Zeroes each value with probability `rate` and scales the rest by 1 / (1 - rate).

  Args:
    x: float32, bfloat16 or float16 array.
    rate: drop probability, a static number in [0, 1]; 1 gives zeros (and a
      zero gradient), as in `flax.linen.Dropout`.
    key: JAX PRNG key (may be None when deterministic or rate is 0 or 1).
    deterministic: if True, return x unchanged (whatever the rate).
    broadcast_dims: axes that share one mask value (as in flax).
    name: residual name; the saved seed (or key data) is tagged `name.seed`.
    draw: "hash" (jact's counter-based hash, a 4-byte residual), "flax"
      (`jax.random.bernoulli` as Flax's Dropout draws it: the same mask as
      `flax.linen.Dropout` for the same key; the key's data is kept) or
      "flax_attention" (that mask applied as Flax's attention-weight dropout).
    out_sharding: with draw="flax", passed to `jax.random.bernoulli` (what
      `nnx.Dropout` passes: the input's sharding).
    saves: what the backward keeps: "key" (the seed or key data; the mask is
      drawn again in the backward) or "mask" (the mask, 1 bit per value packed
      row by row: the backward draws nothing, so no random bits of the forward
      stay alive for it; drawn once x is computed, also on the CPU).

  Returns:
    An array like x. Its backward keeps only the seed (or the key's data), or
    with saves="mask" the packed mask.
  """
  rate = check_rate(rate, allow_one=True)
  name = check_name(name)
  if saves not in SAVES:
    raise ValueError(
      f"jact.ops.dropout saves must be one of {SAVES}, got {saves!r}: 'key' (the backward "
      f"draws the mask again from the key) or 'mask' (the mask packed to 1 bit a value)."
    )
  if draw not in DRAWS:
    raise ValueError(
      f"jact.ops.dropout draw must be one of {DRAWS}, got {draw!r}: 'hash' "
      f"(jact's hash, a 4-byte residual), 'flax' (Flax's masks for the same "
      f"key) or 'flax_attention' (applied as Flax's attention dropout)."
    )
  if deterministic or rate == 0.0:
    return x
  x = check_float(x, "dropout")
  if rate == 1.0:
    return jnp.zeros_like(x)
  if key is None:
    raise ValueError(
      "jact.ops.dropout needs a PRNG key when deterministic=False and rate > 0: pass "
      "key=jax.random.key(...) (a fresh key per step), or deterministic=True."
    )
  dims = {d % x.ndim for d in broadcast_dims} if x.ndim else set()
  mask_shape = tuple(1 if d in dims else s for d, s in enumerate(x.shape))
  keep_prob = 1.0 - rate
  if draw != "hash":
    _check_flax_key(key)
    seed, rebuild_key = _stored_key(key)
    sharding = {} if out_sharding is None else {"out_sharding": out_sharding}

    def mask_of(seed):
      return jax.random.bernoulli(rebuild_key(seed), p=keep_prob, shape=mask_shape, **sharding)
  else:
    seed = rng.seed_from_key(key)

    def mask_of(seed):
      return keep_mask(seed, mask_shape, rate)

  def apply_keep(keep, v):
    if draw == "flax_attention":  # Flax's attention: one multiplier, 1 / keep_prob or 0
      return v * (keep.astype(v.dtype) / jnp.asarray(keep_prob, v.dtype))
    m = jnp.broadcast_to(keep, v.shape)
    return jax.lax.select(m, v / jnp.asarray(keep_prob, v.dtype), jnp.zeros_like(v))

  def apply_mask(seed, v):
    return apply_keep(mask_of(seed), v)

  def forward(seed, x):
    if saves == "key":
      return apply_mask(seed, x), {"seed": Save(seed)}
    # The mask depends on the key alone: XLA:CPU (which drops optimization
    # barriers) would draw every layer's mask at the start of the program, all
    # their random bits alive at once. It waits for x here.
    (seed,) = xla_cpu.on_cpu(xla_cpu.select_after_any_arrival, [seed], [x])
    keep = mask_of(seed)
    packed = pack_codes(keep, 1)
    return apply_keep(keep, x), {"mask": Save(packed, unpack=lambda m: pin_rows(unpack_codes(m)))}

  def backward(res, g):
    if saves == "key":
      return None, apply_mask(res["seed"], g)
    return None, apply_keep(res["mask"], g)

  return compressed_op(forward, backward, op="dropout", name=name, primal=apply_mask)(seed, x)
