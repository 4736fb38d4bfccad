"""Structural guards on what jact hands to XLA (compile time, issue 16).

Not timing tests: each checks a property whose loss made compiled gradients
of converted models several times slower to compile -- a quantizer that XLA
can constant-fold, a PRNG loop per call site, a quantizer that grew.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact

from experiments.compile_time import count_eqns
from jact.core import rng
from jact.kernels.quantize.reference import dequantize_reference, quantize_reference

# 204 equations today: 129 before non-finite values got their flagged groups
# (issue 31: the flag, the reserved code, the kind bits), 161 before the
# quantizer lost its nested `where` / `clip` calls and per-axis index iotas;
# a model holds one per residual. Cutting it back is compile-time work.
MAX_QUANTIZE_EQNS = 210


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
      lambda x, s: quantize_reference(x.reshape(16, -1), s, bits=2, group_size=256))(x, jnp.uint32(1))
  assert count_eqns(jaxpr.jaxpr) <= MAX_QUANTIZE_EQNS


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_converted_models_derive_rounding_keys_without_threefry(framework):
  """A converted model draws one rounding key per layer call; `make_rng` /
  `stream()` (threefry `fold_in`) made each a rolled while loop of small
  kernels on XLA:CPU. jact derives them by integer hashing: the compiled
  gradient holds no loop at all."""
  import flax.linen as nn
  from flax import nnx
  x = jnp.ones((4, 16), jnp.float32)
  if framework == "linen":
    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(nn.relu(nn.Dense(16)(x)))))

    model = jact.convert(MLP(), bits=4)
    params = model.init(jax.random.key(0), x)

    def loss(params, key):
      return jnp.sum(model.apply(params, x, rngs={"jact": key}) ** 2)
    lowered = jax.jit(jax.grad(loss)).lower(params, jax.random.key(1))
  else:
    class MLP(nnx.Module):
      def __init__(self, rngs):
        self.a, self.b = nnx.Linear(16, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

      def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))

    model = jact.convert(MLP(nnx.Rngs(0)), bits=4, rngs=nnx.Rngs(jact=1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(params, rest):  # merged in the jitted step, differentiated by nnx.grad
      return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(nnx.merge(graphdef, params, rest))
    lowered = jax.jit(step).lower(params, rest)
  assert "while" not in lowered.as_text()
