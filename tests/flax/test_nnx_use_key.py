"""`jact.nnx.use_key` takes one key: a batch of keys is a clear error at the call,
and one key per example works inside `nnx.vmap` (each example's gradient is the
one its key gives alone)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jact

X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16)), jnp.float32)


def _model():
  return jact.convert(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), bits=2)


def _grad(model, x, key):
  with jact.nnx.use_key(key):
    return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model).kernel[...]


@pytest.mark.parametrize("raw", [False, True])
def test_a_batch_of_keys_is_a_clear_error_at_the_call(raw):
  keys = jax.random.split(jax.random.key(1), 4)
  keys = jax.random.key_data(keys) if raw else keys
  with pytest.raises(ValueError, match=r"use_key: key must be one PRNG key.*shape \(4,(\)| 2\))"):
    with jact.nnx.use_key(keys):
      pass
  with pytest.raises(TypeError, match=r"use_key: key must be a PRNG key.*float32 array"):
    with jact.nnx.use_key(jnp.ones(2)):
      pass


def test_a_raw_key_is_the_typed_key_it_holds():
  key = jax.random.key(1)
  model = _model()
  np.testing.assert_array_equal(_grad(model, X, jax.random.key_data(key)), _grad(model, X, key))


def test_one_key_per_example_inside_nnx_vmap():
  keys = jax.random.split(jax.random.key(1), X.shape[0])
  model = _model()
  step = lambda m, x, key: _grad(m, x[None], key)
  batched = nnx.vmap(step, in_axes=(None, 0, 0))(model, X, keys)
  alone = jnp.stack([step(model, x, key) for x, key in zip(X, keys)])
  # the same keys give the same rounding: equal up to float reassociation
  np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-6)
  assert not np.allclose(batched[0], batched[1])  # one gradient per example
