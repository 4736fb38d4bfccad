"""Every registered compressor (`jact.compressors.registered()`) meets the interface's
generic properties, each on its own example: adding a compressor to the registry without
an example here fails, naming it.

Properties: the reconstruction keeps the input's shape and dtype; `stored_bytes` is the
bytes of the arrays actually stored; `to_dict` / `from_dict` round-trips (through JSON);
an `unbiased` compressor's reconstructions average to the input over `stats.DRAWS` seeds
(`stats.assert_unbiased`: pooled |z| < 4, mean z^2 < 1.6); non-finite inputs come back
non-finite exactly where they were, as plain JAX keeps them.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact import compressors as C
from stats import DRAWS, assert_unbiased

# method -> an example instance (a non-default setting where one exists).
EXAMPLES = {
  "per_group": C.PerGroup(2),
  "per_sample": C.PerSample(avg_bits=2.5),
  "division": C.Division(block=4, bits=2),
  "blpa": C.BLPA(4),
  "fixpoint": C.Fixpoint(4),
  "float8": C.Float8("e4m3", stochastic=True),
  "zero_value": C.ZeroValue(C.Fixpoint(4)),
}
# method -> why its reconstruction is not non-finite exactly where the input is.
NON_FINITE_EXCEPTIONS = {
  "blpa": "no spare code: the value comes back finite (a documented limit; "
  "tests/test_nonfinite.py checks that no other sample is affected)",
}
SHAPE = (4, 8, 8, 32)  # NHWC: four samples of 2048 values


def _input(seed=0):
  """ReLU-like activations (zeros and a positive tail), like the residuals stored."""
  x = np.random.default_rng(seed).normal(size=SHAPE) - 0.3
  return jnp.asarray(np.maximum(x, 0).astype(np.float32))


def _roundtrip(c, x, seed):
  return jax.jit(lambda x, s: c.decompress(c.compress(x, s)))(x, seed)


def test_every_registered_compressor_has_an_example():
  missing = sorted(set(C.registered()) - set(EXAMPLES))
  assert not missing, (
    f"registered compressors {missing} have no example in tests/compressors/test_registry.py's "
    "EXAMPLES: add one instance each, so the generic properties check them"
  )
  stale = sorted(set(EXAMPLES) - set(C.registered()))
  assert not stale, f"EXAMPLES names {stale}, which are not registered: remove them"
  for method, c in EXAMPLES.items():
    assert c.method == method and isinstance(c, C.registered()[method]), (method, c)


@pytest.mark.parametrize("method", sorted(EXAMPLES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_reconstruction_keeps_shape_and_dtype_and_stored_bytes_are_the_arrays(method, dtype):
  c = EXAMPLES[method]
  x = _input().astype(dtype)
  seed = jnp.uint32(3) if c.needs_key else None
  stored = jax.jit(c.compress)(x, seed)
  arrays = sum(a.nbytes for a in jax.tree.leaves(stored))
  assert c.stored_bytes(x.shape, x.dtype) == arrays == stored.nbytes, (method, arrays)
  assert arrays < x.nbytes, f"{c!r} stores {arrays} bytes for {x.nbytes} plain"
  x_hat = jax.jit(c.decompress)(stored)
  assert (x_hat.shape, x_hat.dtype) == (x.shape, x.dtype), (x_hat.shape, x_hat.dtype)
  assert bool(jnp.all(jnp.isfinite(x_hat)))


@pytest.mark.parametrize("method", sorted(EXAMPLES))
def test_to_dict_from_dict_round_trips_through_json(method):
  c = EXAMPLES[method]
  again = C.from_dict(json.loads(json.dumps(c.to_dict())))
  assert again == c and hash(again) == hash(c) and type(again) is type(c)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(m for m, c in EXAMPLES.items() if c.unbiased))
def test_an_unbiased_compressor_averages_to_its_input_over_seeds(method):
  c = EXAMPLES[method]
  x = _input(1)
  draw = jax.jit(jax.vmap(lambda s: c.decompress(c.compress(x, s))))
  seeds = jnp.arange(DRAWS, dtype=jnp.uint32)
  samples = np.concatenate([np.asarray(draw(seeds[i : i + 256])) for i in range(0, DRAWS, 256)])
  # A value whose rounding probability is below 10/K shows no spread in K draws
  # ((1 - 10/K)^K ~ 5e-5) and is off by that probability times a step: elements no draw
  # moved are held within 10/K of the input's range rather than exactly.
  assert_unbiased(samples, np.asarray(x), atol=10 / DRAWS * float(jnp.abs(x).max()))


def test_the_examples_cover_biased_and_unbiased_compressors():
  """The unbiasedness check above runs on some examples and is skipped for others."""
  kinds = {c.unbiased for c in EXAMPLES.values()}
  assert kinds == {True, False}, kinds


@pytest.mark.parametrize("method", sorted(EXAMPLES))
def test_non_finite_inputs_come_back_non_finite_where_they_were(method):
  c = EXAMPLES[method]
  x = np.array(_input(2))
  x[0, 1, 1, 0], x[1, 5, 5, 2], x[2, 0, 7, 3] = np.nan, np.inf, -np.inf  # one per sample
  y = np.asarray(_roundtrip(c, jnp.asarray(x), jnp.uint32(5) if c.needs_key else None))
  if method in NON_FINITE_EXCEPTIONS:
    assert np.isfinite(y[3]).all(), "a non-finite value spread to a sample without one"
    return
  np.testing.assert_array_equal(np.isfinite(y), np.isfinite(x))
  assert np.isnan(y[0, 1, 1, 0]) and y[1, 5, 5, 2] == np.inf and y[2, 0, 7, 3] == -np.inf
