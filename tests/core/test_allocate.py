"""Tests for jact.allocate: variance factors, the exact DP against brute force,
the greedy against the DP (measured bounds), the JAX per-sample allocator
against the host greedy, and errors."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact._core.allocate import (
  UNCOMPRESSED,
  allocate_per_sample,
  greedy_allocate,
  optimal_allocate,
  total_bits,
  total_variance,
  variance_factor,
)

ALLOWED = ((1, 2, 4, 8), (1, 2, 4, 8, 32), (2, 4, 8), (1, 8), (1, 2), (4,))


def _instance(rng, allowed, max_len=8, max_size=64):
  """Random sensitivities (spread over decades, some zero), sizes and a feasible budget."""
  length = int(rng.integers(2, max_len + 1))
  c = rng.lognormal(0.0, 3.0, length) * (rng.random(length) > 0.1)
  d = rng.integers(1, max_size + 1, length)
  budget = int(rng.integers(min(allowed) * d.sum(), max(allowed) * d.sum() + 1))
  return c, d, budget


def _gap(c, got, best):
  """Relative variance excess of `got` over the optimum `best` (0 when equal)."""
  v, v_opt = total_variance(c, got), total_variance(c, best)
  assert v >= v_opt * (1 - 1e-12), "the DP is not optimal"
  return 0.0 if v <= v_opt * (1 + 1e-12) else (v - v_opt) / v_opt


def test_variance_factor():
  assert variance_factor(1) == 1.0
  assert variance_factor(2) == 1 / 9
  assert variance_factor(4) == 1 / 225
  assert variance_factor(8) == 1 / 255**2
  assert variance_factor(np.int32(8)) == 1 / 255**2
  assert variance_factor(UNCOMPRESSED) == 0.0
  for bad in (0, 3, 16, 2.0, True, None):
    with pytest.raises(ValueError, match="bits must be one of"):
      variance_factor(bad)


def test_totals():
  assert total_bits([10, 3], [4, 32]) == 136
  assert total_variance([1.0, 9.0, 5.0], [1, 2, 32]) == 2.0
  with pytest.raises(ValueError):
    total_bits([1, 2], [4])


def test_dp_equals_brute_force():
  rng = np.random.default_rng(1)
  for i in range(120):
    allowed = ALLOWED[i % len(ALLOWED)]
    length = int(rng.integers(1, 5))
    c = rng.lognormal(0.0, 2.0, length) * (rng.random(length) > 0.2)
    d = rng.integers(1, 7, length)
    budget = int(rng.integers(min(allowed) * d.sum(), max(allowed) * d.sum() + 1))
    best = min(
      total_variance(c, b)
      for b in itertools.product(allowed, repeat=length)
      if total_bits(d, b) <= budget
    )
    got = optimal_allocate(c, d, budget, allowed)
    assert total_bits(d, got) <= budget and set(got) <= set(allowed)
    assert total_variance(c, got) == pytest.approx(best, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("allowed", ALLOWED[:4])
def test_greedy_close_to_optimal(allowed):
  # 300 random small instances each (L in 2..8, sizes 1..64, budgets anywhere
  # between the all-narrowest and all-widest allocations, sensitivities
  # log-normal with sigma 3 and 10% zeros). Measured with these seeds:
  #   (1, 2, 4, 8):     96.3% optimal, worst gap 44%, mean 0.38%
  #   (1, 2, 4, 8, 32): 98.3% optimal, worst gap 20%, mean 0.13%
  #   (2, 4, 8):        98.0% optimal, worst gap 9.6%, mean 0.08%
  #   (1, 8):           99.3% optimal, worst gap 26%, mean 0.09%
  # Without the single-tensor alternative to the crossing step it was 89%
  # optimal with a 367% worst gap for (1, 2, 4, 8). The bounds below leave
  # margin: >= 93% optimal, worst gap <= 60%, mean gap <= 1%. Large worst
  # gaps come from a few tensors whose steps are lumpy against the budget.
  rng = np.random.default_rng(0)
  gaps = []
  for _ in range(300):
    c, d, budget = _instance(rng, allowed)
    got = greedy_allocate(c, d, budget, allowed)
    best = optimal_allocate(c, d, budget, allowed)
    assert total_bits(d, got) <= budget and set(got) <= set(allowed)
    assert total_bits(d, best) <= budget
    gaps.append(_gap(c, got, best))
  gaps = np.array(gaps)
  assert (gaps == 0).mean() >= 0.93, (gaps == 0).mean()
  assert gaps.max() <= 0.60, gaps.max()
  assert gaps.mean() <= 0.01, gaps.mean()


def test_greedy_close_to_optimal_large_tensors():
  # 30 tensors of 64..12736 values: the budget is large against every step,
  # so the greedy is near the optimum. Measured: 13/20 optimal, worst 4.3%,
  # mean 0.6%; asserted: worst <= 8%, mean <= 1.5%.
  rng = np.random.default_rng(0)
  gaps = []
  for _ in range(20):
    c = rng.lognormal(0.0, 3.0, 30)
    d = 64 * rng.integers(1, 200, 30)
    budget = int(rng.uniform(1.2, 6.0) * d.sum())
    got = greedy_allocate(c, d, budget)
    assert total_bits(d, got) <= budget
    gaps.append(_gap(c, got, optimal_allocate(c, d, budget)))
  assert max(gaps) <= 0.08 and np.mean(gaps) <= 0.015, gaps


def test_greedy_edges():
  c, d = [3.0, 0.0, 1.0], [10, 20, 30]
  assert greedy_allocate(c, d, 8 * 60) == (8, 8, 8)
  assert greedy_allocate(c, d, 10**9, (1, 4, 32)) == (32, 32, 32)
  assert greedy_allocate(c, d, 60) == (1, 1, 1)
  # One bit short: the insensitive tensor is lowered, no other.
  assert greedy_allocate(c, d, 8 * 60 - 1) == (8, 4, 8)
  assert greedy_allocate([], [], 0) == ()
  # Sequences, numpy arrays and numpy scalars are all accepted.
  assert greedy_allocate(np.array(c), np.array(d), np.int64(200)) == greedy_allocate(c, d, 200)
  # The crossing step alone would overshoot: lowering the big sensitive
  # tensor (17 values) from 8 to 4 bits saves 68 bits when 6 were missing.
  c, d = [0.204, 0.367, 585.264], [8, 7, 17]
  assert greedy_allocate(c, d, 152) == optimal_allocate(c, d, 152) == (1, 1, 8)


def test_greedy_errors():
  with pytest.raises(ValueError, match="at least 60"):
    greedy_allocate([1.0, 1.0], [20, 40], 59)
  with pytest.raises(ValueError, match="at least 120"):
    optimal_allocate([1.0, 1.0], [20, 40], 100, allowed=(2, 8))
  with pytest.raises(ValueError, match="finite and >= 0"):
    greedy_allocate([1.0, -1.0], [1, 1], 8)
  with pytest.raises(ValueError, match="finite and >= 0"):
    greedy_allocate([1.0, float("nan")], [1, 1], 8)
  with pytest.raises(ValueError, match="one of each"):
    greedy_allocate([1.0, 2.0], [1, 1, 1], 8)
  for sizes in ([1, 0], [1.5, 2.0], [[1, 2]]):
    with pytest.raises(ValueError, match="positive ints"):
      greedy_allocate([1.0, 2.0], sizes, 8)
  for allowed in ((), (3,), (1, 16), "8"):
    with pytest.raises(ValueError, match="allowed"):
      greedy_allocate([1.0], [1], 8, allowed)
  with pytest.raises(ValueError, match="small instances"):
    optimal_allocate([1.0, 1.0], [10**7 + 1, 10**7], 8 * 10**8)


# ----------------------------------------------------------------------------- per sample


@pytest.mark.parametrize(
  "n,avg_bits,allowed",
  [
    (24, 2.5, (1, 2, 4, 8)),
    (20, 1.3, (1, 4, 8)),
  ],
)
@pytest.mark.slow
def test_per_sample_equals_host_greedy(n, avg_bits, allowed):
  traces = []

  @jax.jit
  def alloc(w):  # weights traced, widths decided inside jit
    traces.append(1)
    return allocate_per_sample(w, avg_bits, allowed)

  rng = np.random.default_rng(n)
  w = np.concatenate(
    [
      rng.lognormal(0.0, 3.0, (20, n)),  # spread over decades
      rng.integers(0, 4, (10, n)).astype(float),  # many exact ties and zeros
      np.where(rng.random((10, n)) < 0.25, 100.0, 1.0),  # ties decided in the fill
      rng.lognormal(0.0, 2.0, (10, n)) * (rng.random((10, n)) > 0.3),
    ]
  ).astype(np.float32)
  w[-1, :3] = np.nan, -1.0, np.inf  # NaN and negative count as 0, +inf as the largest float32
  budget = math.floor(avg_bits * n)
  for row in w:
    out = np.asarray(alloc(jnp.asarray(row)))
    assert out.dtype == np.int32 and out.shape == (n,)
    assert out.sum() <= budget and set(out.tolist()) <= set(allowed)
    c = np.where(np.isnan(row) | (row < 0), 0.0, np.minimum(row, np.finfo(np.float32).max))
    assert tuple(out.tolist()) == greedy_allocate(c.astype(np.float64), [1] * n, budget, allowed)
  assert len(traces) == 1


def test_per_sample_edges():
  w = jnp.array([0.0, 1.0, 1e4, 5.0])
  assert allocate_per_sample(w, 8.0).tolist() == [8, 8, 8, 8]
  assert allocate_per_sample(w, 20).tolist() == [8, 8, 8, 8]
  assert allocate_per_sample(w, 4.0, (4,)).tolist() == [4, 4, 4, 4]
  assert allocate_per_sample(jnp.zeros((0,)), 2.0).shape == (0,)


def test_per_sample_errors():
  w = jnp.ones((4,))
  for avg in (0.5, float("nan"), float("inf"), None, True):
    with pytest.raises(ValueError, match="avg_bits"):
      allocate_per_sample(w, avg)
  with pytest.raises(ValueError, match=">= 2"):
    allocate_per_sample(w, 1.5, (2, 4))
  with pytest.raises(ValueError, match="allowed"):
    allocate_per_sample(w, 4.0, (1, 2, 4, 8, 32))
  with pytest.raises(ValueError, match="1-D"):
    allocate_per_sample(jnp.ones((2, 2)), 4.0)
