"""Many tests compile their small programs with `xla_backend_optimization_level=0`
(LLVM's optimizations off: a third to a half less XLA:CPU compile time, measured). What that
keeps and what it does not, checked on the same lowering compiled both ways:

* jact's quantizer and dequantizer (every width, every float dtype, non-finite
  values, ranges near float32's limits) compute the same bits: kernel and
  reference bit-exactness checked unoptimized holds optimized;
* a model's gradients hold the same buffers (compiled temp bytes) but are *not*
  bit-identical: sums are rounded differently (measured: up to 7e-7 absolute on
  gradients of order 1). So an unoptimized program may be compared with a
  tolerance, or exactly with another program compiled the same way (same
  arithmetic), never exactly with a default-compiled one.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact._core import rng

QUICK = {"xla_backend_optimization_level": 0}


def _both(fn, *args):
  """(default outputs, quick outputs, default temp bytes, quick temp bytes) of one lowering."""
  lowered = jax.jit(fn).lower(*args)
  default, quick = lowered.compile(), lowered.compile(QUICK)
  return (
    default(*args),
    quick(*args),
    default.memory_analysis().temp_size_in_bytes,
    quick.memory_analysis().temp_size_in_bytes,
  )


def _assert_same_bits(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _awkward_values(dtype):
  x = jax.random.normal(jax.random.key(0), (4, 600), jnp.float32)
  x = x.at[0].multiply(1e-30).at[1].multiply(3e37).at[2, :300].add(1000.0)
  x = x.at[3, 5].set(jnp.nan).at[3, 77].set(jnp.inf).at[2, 400].set(-jnp.inf)
  return x.astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_quantize_and_dequantize_compute_the_same_bits_unoptimized(dtype):
  x = _awkward_values(dtype)

  def roundtrip(x, seed):
    out = []
    for bits in (1, 2, 4, 8):
      for stochastic in (True, False):
        packed = jact.quantize(
          x, bits=bits, group_size=64, stochastic=stochastic, seed=seed if stochastic else None
        )
        out.append((packed.data, packed.minimum, packed.scale, jact.dequantize(packed)))
    return out

  default, quick, temp_default, temp_quick = _both(
    roundtrip, x, rng.seed_from_key(jax.random.key(3))
  )
  _assert_same_bits(default, quick)
  assert temp_default == temp_quick


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.gelu(nn.BatchNorm(use_running_average=not train)(x))
    tokens = x.reshape(x.shape[0], -1, 8)
    tokens = tokens + nn.SelfAttention(num_heads=2, deterministic=True)(nn.LayerNorm()(tokens))
    return nn.Dense(3)(jnp.tanh(tokens.mean(axis=1)))


@pytest.mark.slow  # compiles a converted model's gradient twice: ~6 s of one core
def test_model_gradients_keep_their_buffers_and_agree_to_rounding_unoptimized():
  bits = 4
  x = jax.random.normal(jax.random.key(1), (4, 6, 6, 3))
  model = _Net() if bits is None else jact.convert(_Net(), bits=bits)
  variables = _Net().init(jax.random.key(2), x)

  def loss(params, key):
    y, _ = model.apply(
      {**variables, "params": params}, x, rngs={"jact": key}, mutable=["batch_stats"]
    )
    return jnp.sum(y**2)

  default, quick, temp_default, temp_quick = _both(
    jax.value_and_grad(loss), variables["params"], jax.random.key(4)
  )
  assert temp_default == temp_quick
  for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(quick), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
  # measured at 4 bits: up to 4.8e-7 absolute
