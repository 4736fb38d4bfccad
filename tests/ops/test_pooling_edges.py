"""Edge cases of max_pool / avg_pool (issue 14): negative padding and windows
larger than the (padded) input.

Oracles are Flax / jax: forward values come from `flax.linen.max_pool` /
`avg_pool`. jax's own gradient of a max `reduce_window` with negative padding
fails (it slices at a negative index), so there the gradient oracle uses that
negative padding crops the input: pooling x with pads (lo, hi) equals pooling
x[max(0, -lo) : h - max(0, -hi)] with pads (max(lo, 0), max(hi, 0)), whose
jax gradient is then placed back at the cropped positions.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact.ops import _pooling as P


def _data(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _vjp(pool, x, ct, *args):
  y, vjp = jax.vjp(lambda x: pool(x, *args), x)
  return y, vjp(ct)[0]


def _cropped_flax_grad(x, ct, window, strides, pads):
  """jax's gradient of Flax's max_pool on the cropped input, zero where cropped away."""
  crop = [(max(0, -lo), max(0, -hi)) for lo, hi in pads]
  box = tuple(slice(a, x.shape[1 + i] - b) for i, (a, b) in enumerate(crop))
  inner = tuple((max(lo, 0), max(hi, 0)) for lo, hi in pads)
  xc = x[(slice(None),) + box]
  y, gc = _vjp(nn.max_pool, xc, ct, window, strides, inner)
  return y, jnp.zeros_like(x).at[(slice(None),) + box].set(gc)


NEGATIVE_PADS = {
  # name: (window, strides, padding) on a (2, 6, 7, 2) input
  "low_and_high_cropped": ((2, 2), (1, 2), ((-1, 0), (0, -2))),
  "crop_one_side_pad_other": ((2, 2), (1, 2), ((-1, 1), (2, -1))),
  "strided_3x2": ((3, 2), (2, 1), ((1, -2), (-3, 0))),
  "crop_more_than_window": ((2, 2), (1, 1), ((-3, 4), (0, 0))),
  "overlapping_3x3": ((3, 3), (1, 1), ((-1, -1), (-2, 1))),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(NEGATIVE_PADS))
def test_max_pool_negative_padding_gradient(case):
  window, strides, pads = NEGATIVE_PADS[case]
  x = _data(0, (2, 6, 7, 2))
  y_ref = nn.max_pool(x, window, strides, pads)
  ct = _data(1, y_ref.shape)
  y, g = jax.jit(lambda x, ct: _vjp(P.max_pool, x, ct, window, strides, pads))(x, ct)
  y_crop, g_ref = _cropped_flax_grad(x, ct, window, strides, pads)
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(y_crop, y_ref)  # the oracle's premise
  np.testing.assert_array_equal(g, g_ref)


@pytest.mark.slow
def test_max_pool_padding_that_only_reads_padding():
  """A negative low pad past the input: every window reads padding (-inf), no gradient."""
  x = _data(2, (1, 4, 3, 1))
  pads = ((-6, 5), (0, 0))
  y, g = _vjp(P.max_pool, x, jnp.ones((1, 2, 2, 1)), (2, 2), (1, 1), pads)
  np.testing.assert_array_equal(y, nn.max_pool(x, (2, 2), (1, 1), pads))
  assert bool(jnp.all(y == -jnp.inf))
  np.testing.assert_array_equal(g, jnp.zeros_like(x))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["crop_one_side_pad_other", "overlapping_3x3"])
@pytest.mark.parametrize("count_include_pad", [True, False])
def test_avg_pool_negative_padding_matches_flax(case, count_include_pad):
  window, strides, pads = NEGATIVE_PADS[case]
  x = _data(3, (2, 6, 7, 2))
  args = (window, strides, pads, count_include_pad)
  y_ref = nn.avg_pool(x, *args)
  ct = _data(4, y_ref.shape)
  y, g = _vjp(P.avg_pool, x, ct, *args)
  _, g_ref = _vjp(nn.avg_pool, x, ct, *args)
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(g, g_ref)


WINDOW_TOO_LARGE = [
  ((4, 1), (1, 1), "VALID"),  # one dim empty, the other not
  ((3, 3), (1, 1), "VALID"),
  ((5, 2), (2, 1), ((0, 1), (0, 0))),
  ((2, 2), (1, 1), ((-2, -1), (0, 0))),  # padded size negative
]


@pytest.mark.slow
@pytest.mark.parametrize("window, strides, padding", WINDOW_TOO_LARGE)
@pytest.mark.parametrize("pool", ["max_pool", "avg_pool"])
def test_window_larger_than_input(pool, window, strides, padding):
  """Like Flax: an empty output and a zero gradient of the input's shape."""
  x = _data(5, (2, 2, 3, 1))
  ref = getattr(nn, pool)(x, window, strides, padding)
  assert ref.size == 0
  y, g = jax.jit(
    lambda x: _vjp(getattr(P, pool), x, jnp.ones(ref.shape), window, strides, padding)
  )(x)
  assert y.shape == ref.shape and y.dtype == x.dtype
  assert g.shape == x.shape and g.dtype == x.dtype
  np.testing.assert_array_equal(g, jnp.zeros_like(x))
  # The same function under a loss: jax.grad works and is zero.
  loss = lambda x: jnp.sum(getattr(P, pool)(x, window, strides, padding) ** 2) + jnp.sum(x)
  np.testing.assert_array_equal(jax.grad(loss)(x), jnp.ones_like(x))
