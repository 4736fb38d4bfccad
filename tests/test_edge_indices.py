"""Edge cases of element indices and dropout rates (issue 14).

The noise and dropout hash takes each element's row-major flat index; arrays
of 2^32 or more elements need more than 32 bits of it. Nothing here allocates
a large array: index functions are evaluated on chosen coordinates, large ops
are only lowered, and the one large dropout that runs is sliced inside jit
(XLA then computes only the slice; the test checks that before running it).
"""

from __future__ import annotations

import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact

D = importlib.import_module("jact.ops.dropout")  # `jact.ops.dropout` is the function
X = jnp.asarray(np.random.default_rng(0).normal(size=(4, 33)), jnp.float32)


# ----------------------------------------------------------------------------- dropout rate 1


def test_dropout_rate_one_deterministic_is_identity():
  y, vjp = jax.vjp(lambda x: jact.ops.dropout(x, 1.0, key=None, deterministic=True), X)
  np.testing.assert_array_equal(y, X)
  np.testing.assert_array_equal(vjp(jnp.ones_like(X))[0], jnp.ones_like(X))


@pytest.mark.parametrize("key", [None, jax.random.key(3)])
def test_dropout_rate_one_drops_everything_like_flax(key):
  ref = nn.Dropout(rate=1.0).apply({}, X, deterministic=False)  # Flax needs no key either
  y, vjp = jax.vjp(lambda x: jact.ops.dropout(x, 1.0, key=key), X)
  np.testing.assert_array_equal(y, ref)
  np.testing.assert_array_equal(y, jnp.zeros_like(X))
  g = vjp(jnp.ones_like(X))[0]
  assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(g == 0))
  lin = jact.nn.Dropout(rate=1.0).apply({}, X, deterministic=False)
  np.testing.assert_array_equal(lin, ref)


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan")])
def test_dropout_rate_outside_unit_interval_is_a_clear_error(bad):
  for deterministic in (False, True):
    with pytest.raises(ValueError, match=r"jact dropout rate must be in \[0, 1\], got"):
      jact.ops.dropout(X, bad, key=jax.random.key(0), deterministic=deterministic)
