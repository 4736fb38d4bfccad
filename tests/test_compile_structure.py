"""Structural guards on what jact hands to XLA (compile time, issue 16).

Not timing tests: each checks a property whose loss made compiled gradients
of converted models several times slower to compile -- a quantizer that XLA
can constant-fold, a PRNG loop per call site, a quantizer that grew.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact._core import rng
from jact.kernels._quantize.reference import dequantize_reference, quantize_reference

# 204 equations today: 129 before non-finite values got their flagged groups
# (issue 31: the flag, the reserved code, the kind bits), 161 before the
# quantizer lost its nested `where` / `clip` calls and per-axis index iotas;
# a model holds one per residual. Cutting it back is compile-time work.
MAX_QUANTIZE_EQNS = 210


def count_eqns(jaxpr) -> int:
  """Equations of a jaxpr, those of nested jaxprs (jit, custom_vjp, scan...) included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(inner, "eqns"):
          n += count_eqns(inner)
  return n


@pytest.mark.slow
def test_constant_residual_is_quantized_at_run_time_not_folded():
  """A residual that is a constant (the zeros a JVP instantiates) keeps its
  statistics reduce in the optimized HLO: XLA's constant folder interprets
  such a reduce at tens of microseconds per value."""

  def quantize_constant(seed):
    return quantize_reference(jnp.ones((4, 1024), jnp.float32), seed, bits=2, group_size=256)

  hlo = jax.jit(quantize_constant).lower(jnp.uint32(3)).compile().as_text()
  assert " reduce(" in hlo
  packed = jax.jit(quantize_constant)(jnp.uint32(3))
  np.testing.assert_array_equal(np.asarray(dequantize_reference(packed)), np.ones((4, 1024)))


def test_seed_from_key_runs_no_prng_loop():
  # fold_in + bits lowered to two rolled threefry while loops on CPU.
  text = jax.jit(lambda k: rng.seed_from_key(k, 3)).lower(jax.random.key(0)).as_text()
  assert "while" not in text


def test_seed_from_key_rejects_key_arrays():
  with pytest.raises(ValueError, match=r"takes one PRNG key.*keys\[i\].*jax\.vmap"):
    rng.seed_from_key(jax.random.split(jax.random.key(0), 3))


@pytest.mark.slow
def test_seed_from_key_takes_traced_sites_and_vmaps_over_keys():
  key = jax.random.key(7)
  assert int(jax.jit(rng.seed_from_key)(key, jnp.uint32(2))) == int(rng.seed_from_key(key, 2))
  keys = jax.random.split(key, 4)
  seeds = jax.vmap(rng.seed_from_key)(keys)
  assert [int(s) for s in seeds] == [int(rng.seed_from_key(k)) for k in keys]


def test_quantizer_size_is_bounded():
  x = jnp.ones((16, 64, 128), jnp.float32)
  jaxpr = jax.make_jaxpr(
    lambda x, s: quantize_reference(x.reshape(16, -1), s, bits=2, group_size=256)
  )(x, jnp.uint32(1))
  assert count_eqns(jaxpr.jaxpr) <= MAX_QUANTIZE_EQNS
