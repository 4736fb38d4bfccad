"""Bit allocation: which width each tensor (or sample) gets under a bit budget.

Minimizes sum_l c_l S(b_l), S(b) = (2**b - 1)**-2, subject to a bit budget
(ActNN Eq. 10): `greedy_allocate` (ActNN's heap greedy, host side),
`optimal_allocate` (the exact dynamic program, to check it),
`allocate_layers_and_samples` (ActNN's joint layer x sample allocation, the
L3 controller's) and `allocate_per_sample` (the greedy over one tensor's
samples in pure JAX, for ActNN L3 inside `jit`). Widths are any of 1..8 and
16; `UNCOMPRESSED` (32) means kept in full precision. The greedy's steps:
docs/design.md, "Bit allocation".

>>> greedy_allocate([1.0, 100.0], [64, 64], budget_bits=6 * 64)
(2, 4)
>>> optimal_allocate([1.0, 100.0], [64, 64], budget_bits=6 * 64)
(2, 4)
>>> import jax.numpy as jnp
>>> allocate_per_sample(jnp.array([0.0, 1.0, 1e4, 5.0]), avg_bits=2.5).tolist()
[1, 2, 4, 2]
"""

from __future__ import annotations

import functools
import heapq
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "UNCOMPRESSED",
  "variance_factor",
  "greedy_allocate",
  "optimal_allocate",
  "total_variance",
  "total_bits",
  "allocate_per_sample",
  "allocate_layers_and_samples",
  "ACTNN_WIDTHS",
]

UNCOMPRESSED = 32
_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 16, UNCOMPRESSED)
#: ActNN's integer widths (its `calc_precision` lowers a width by one bit per move).
ACTNN_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8)
_MAX_DP_CELLS = 50_000_000


def floor_bits(avg_bits: float, count: int) -> int:
  """floor(avg_bits * count), the product first rounded to 9 decimals, so that a
  mean of integer widths, s / N, gives back s (2.3 * 10 is 22.999999999999996).

  >>> floor_bits(2.3, 10), floor_bits(15 / 11, 11), floor_bits(2.5, 3)
  (23, 15, 7)
  """
  return math.floor(round(avg_bits * count, 9))


def variance_factor(bits: int) -> float:
  """S(b) = (2**b - 1)**-2, the variance factor of a b-bit quantizer (0 for 32).

  >>> variance_factor(1), variance_factor(2), variance_factor(32)
  (1.0, 0.1111111111111111, 0.0)
  """
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in _WIDTHS:
    raise ValueError(f"bits must be one of {_WIDTHS} (32 = uncompressed), got {bits!r}.")
  bits = int(bits)
  return 0.0 if bits == UNCOMPRESSED else 1.0 / float((1 << bits) - 1) ** 2


def _check_allowed(allowed, uncompressed: bool = True) -> tuple[int, ...]:
  """Sorted, distinct widths from (1, ..., 8, 16[, 32])."""
  try:
    widths = tuple(allowed)
  except TypeError:
    widths = None
  valid = _WIDTHS if uncompressed else _WIDTHS[:-1]
  if not widths or any(
    isinstance(b, bool) or not isinstance(b, (int, np.integer)) or int(b) not in valid
    for b in widths
  ):
    raise ValueError(
      f"allowed must be a non-empty sequence of widths from {valid}, got {allowed!r}."
    )
  return tuple(sorted({int(b) for b in widths}))


def _check_problem(sensitivity, sizes, budget_bits, allowed):
  c = np.asarray(sensitivity, dtype=np.float64)
  d = np.asarray(sizes)
  if c.ndim != 1:
    raise ValueError(f"sensitivity must be a 1-D sequence (one per tensor), got shape {c.shape}.")
  if d.ndim != 1 or (d.size and (d.dtype.kind not in "iu" or (d <= 0).any())):
    raise ValueError(f"sizes must be a 1-D sequence of positive ints, got {sizes!r}.")
  if c.shape != d.shape:
    raise ValueError(
      f"sensitivity has {c.size} entries but sizes has {d.size}; give one of each per tensor."
    )
  if not np.isfinite(c).all() or (c < 0).any():
    raise ValueError(
      "sensitivities must be finite and >= 0 (a variance scale); got "
      f"{c[~(np.isfinite(c) & (c >= 0))][:4].tolist()} among them."
    )
  if isinstance(budget_bits, bool) or not isinstance(
    budget_bits, (int, float, np.integer, np.floating)
  ):
    raise ValueError(f"budget_bits must be a number of bits, got {budget_bits!r}.")
  widths = _check_allowed(allowed)
  d = [int(v) for v in d]
  minimum = widths[0] * sum(d)
  if not budget_bits >= minimum:
    raise ValueError(
      f"budget_bits={budget_bits} is below the smallest possible allocation (every tensor "
      f"at {widths[0]} bits): raise the budget to at least {minimum} bits."
    )
  return [float(v) for v in c], d, widths


def total_variance(sensitivity: Sequence[float], bits: Sequence[int]) -> float:
  """sum_l c_l * S(b_l).

  >>> total_variance([1.0, 9.0], [1, 2])
  2.0
  """
  return float(sum(float(c) * variance_factor(b) for c, b in zip(sensitivity, bits, strict=True)))


def total_bits(sizes: Sequence[int], bits: Sequence[int]) -> int:
  """sum_l b_l * D_l.

  >>> total_bits([10, 3], [4, 32])
  136
  """
  return int(sum(int(d) * int(b) for d, b in zip(sizes, bits, strict=True)))


def greedy_allocate(
  sensitivity: Sequence[float],
  sizes: Sequence[int],
  budget_bits: int,
  allowed: Sequence[int] = (1, 2, 4, 8),
) -> tuple[int, ...]:
  """ActNN's greedy for min sum c_l S(b_l) s.t. sum b_l D_l <= budget_bits.

  Downward pass: every tensor starts at the widest allowed width; a binary
  heap holds each tensor's next step down keyed by the variance it adds per
  bit it saves, c_l (S(lower) - S(cur)) / ((cur - lower) D_l), and the
  cheapest step is applied while the budget is not met. The step that would
  meet it can save far more bits than are missing, so it is compared with
  the cheapest way to save the missing bits by lowering any single tensor
  (one or more steps). Fill pass, on both: the bits left over go to the
  upgrades that still fit, largest variance reduction per bit first (ties:
  lower tensor index first); the one with less variance is returned (the
  plain greedy on a tie). S is convex over the widths, so each tensor's steps
  come out of the heap in order. O(L log L) for a fixed allowed set.

  Args:
    sensitivity: c_l >= 0 per tensor.
    sizes: D_l, positive ints (values per tensor).
    budget_bits: total bits allowed; at least min(allowed) * sum(D).
    allowed: widths from 1..8, 16 and 32; 32 keeps a tensor uncompressed.

  Returns:
    One width per tensor; their total never exceeds the budget.
  """
  c, d, widths = _check_problem(sensitivity, sizes, budget_bits, allowed)
  s = [variance_factor(b) for b in widths]
  top = len(widths) - 1

  def ratio(l, lo):  # variance per bit between levels lo and lo + 1 of tensor l
    return c[l] * (s[lo] - s[lo + 1]) / ((widths[lo + 1] - widths[lo]) * d[l])

  def fill(level):
    level = list(level)
    used = total_bits(d, [widths[k] for k in level])
    heap = [(-ratio(l, level[l]), l) for l in range(len(c)) if level[l] < top and c[l] > 0]
    heapq.heapify(heap)
    while heap:
      _, l = heapq.heappop(heap)
      cost = (widths[level[l] + 1] - widths[level[l]]) * d[l]
      if used + cost <= budget_bits:  # else its further steps cost more: drop the tensor
        used += cost
        level[l] += 1
        if level[l] < top:
          heapq.heappush(heap, (-ratio(l, level[l]), l))
    return level

  level = [top] * len(c)
  used = widths[top] * sum(d)
  heap = [(ratio(l, top - 1), l) for l in range(len(c))] if top else []
  heapq.heapify(heap)
  while used > budget_bits:
    _, l = heapq.heappop(heap)
    step = (widths[level[l]] - widths[level[l] - 1]) * d[l]
    if used - step > budget_bits:
      level[l] -= 1
      used -= step
      if level[l]:
        heapq.heappush(heap, (ratio(l, level[l] - 1), l))
      continue
    # The crossing step, and the cheapest single-tensor way to save the missing bits.
    missing, best = used - budget_bits, None
    for m in range(len(c)):
      lower = max(
        (k for k in range(level[m]) if (widths[level[m]] - widths[k]) * d[m] >= missing),
        default=None,
      )
      if lower is not None and (best is None or c[m] * (s[lower] - s[level[m]]) < best[0]):
        best = (c[m] * (s[lower] - s[level[m]]), m, lower)
    plain = list(level)
    plain[l] -= 1
    plain = fill(plain)
    level[best[1]] = best[2]
    level = fill(level)
    if not sum(c[m] * (s[plain[m]] - s[level[m]]) for m in range(len(c))) > 0:
      level = plain
    break
  return tuple(widths[k] for k in level)


def optimal_allocate(
  sensitivity: Sequence[float],
  sizes: Sequence[int],
  budget_bits: int,
  allowed: Sequence[int] = (1, 2, 4, 8),
) -> tuple[int, ...]:
  """The exact optimum by dynamic programming (a multiple-choice knapsack).

  Costs are counted in units of g = gcd(D_l), so the table has
  L * (budget / g + 1) cells; it is meant for small instances (checking
  `greedy_allocate`) and refuses tables over 5e7 cells. Ties go to the
  narrower width. Same arguments and result as `greedy_allocate`.
  """
  c, d, widths = _check_problem(sensitivity, sizes, budget_bits, allowed)
  if not c:
    return ()
  g = math.gcd(*d)
  cap = int(min(budget_bits // g, widths[-1] * sum(d) // g))
  if len(c) * (cap + 1) > _MAX_DP_CELLS:
    raise ValueError(
      f"optimal_allocate is for small instances: its table would have "
      f"{len(c) * (cap + 1):.3g} cells (limit {_MAX_DP_CELLS:.0e}); use greedy_allocate."
    )
  s = np.array([variance_factor(b) for b in widths])
  best = np.zeros(cap + 1)  # least variance of the tensors so far within a capacity
  choice = np.zeros((len(c), cap + 1), np.uint8)
  for l in range(len(c)):
    options = np.full((len(widths), cap + 1), np.inf)
    for k, b in enumerate(widths):
      cost = b * d[l] // g
      if cost <= cap:
        options[k, cost:] = best[: cap + 1 - cost] + c[l] * s[k]
    choice[l] = np.argmin(options, axis=0)
    best = options[choice[l], np.arange(cap + 1)]
  out, rest = [], cap
  for l in reversed(range(len(c))):
    k = int(choice[l, rest])
    out.append(widths[k])
    rest -= widths[k] * d[l] // g
  return tuple(reversed(out))


def allocate_layers_and_samples(
  sensitivity,
  sizes: Sequence[int],
  avg_bits: float,
  allowed: Sequence[int] = ACTNN_WIDTHS,
  *,
  exact: bool = False,
) -> np.ndarray:
  """ActNN's joint allocation: one width per layer and sample (Prob. 10).

  Minimizes sum_{l,n} c[l, n] S(b[l, n]) subject to
  sum_{l,n} D_l b[l, n] <= floor_bits(avg_bits, N * sum_l D_l): every (layer,
  sample) pair is one item of D_l values. The greedy (default) is ActNN's
  `calc_precision` -- start at the widest width, lower the item whose next
  step adds the least variance per bit saved, until the budget holds --
  with `greedy_allocate`'s two refinements (the single-item alternative to
  the crossing step, then the fill with the bits left over). With equal
  sizes and consecutive widths it is exact (each step saves D bits and S is
  convex); with unequal sizes it is a knapsack heuristic: on 2 layers x 3
  samples, widths 1..4, sizes 1..5, it was optimal on 155 of 156 random
  instances, 4.6% above the optimum on the other. `exact=True` solves it with
  `optimal_allocate`'s dynamic program instead (small instances only).
  Host-side numpy: the L3 controller runs it between steps and keeps each
  layer's mean width as the layer's per-sample budget (ActNN Sec. 4.3 step
  2, b^(l) <- sum_n b_n^(l)); the step splits that budget among its own
  samples (`PerSample`).

  >>> allocate_layers_and_samples([[1.0, 1.0], [1.0, 900.0]], [4, 4], 2.0).tolist()
  [[1, 1], [1, 5]]

  Args:
    sensitivity: float[L, N], c[l, n] >= 0 (layer l, sample n).
    sizes: D_l, values per sample of layer l (positive ints).
    avg_bits: average bits per value, at least min(allowed).
    allowed: widths from 1..8 and 16 (default: ActNN's 1..8).
    exact: the exact optimum by dynamic programming instead of the greedy.

  Returns:
    int32[L, N] widths; their bits never exceed the budget.
  """
  c = np.asarray(sensitivity, dtype=np.float64)
  if c.ndim != 2:
    raise ValueError(
      f"sensitivity must be a 2-D array c[layer, sample], got shape {c.shape}; a single "
      "layer's per-sample sensitivities are c[None, :]."
    )
  d = np.asarray(sizes)
  if d.shape != (c.shape[0],):
    raise ValueError(
      f"sizes must give one number of values per sample for each of the {c.shape[0]} "
      f"layers, got {sizes!r}."
    )
  widths = _check_allowed(allowed, uncompressed=False)
  if (
    isinstance(avg_bits, bool)
    or not isinstance(avg_bits, (int, float, np.integer, np.floating))
    or not math.isfinite(avg_bits)
    or not avg_bits >= widths[0]
  ):
    raise ValueError(
      f"avg_bits must be a finite number >= {widths[0]} (the narrowest allowed width), "
      f"got {avg_bits!r}."
    )
  layers, n = c.shape
  items = np.repeat(d, n)
  budget = floor_bits(avg_bits, n * int(d.sum())) if d.size else 0
  solve = optimal_allocate if exact else greedy_allocate
  bits = solve(c.reshape(-1), items, budget, widths)
  return np.asarray(bits, np.int32).reshape(layers, n)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _allocate_per_sample(w, avg_bits, widths):
  n = w.shape[0]
  budget = floor_bits(avg_bits, n)
  top = len(widths) - 1  # also the number of steps down per sample
  if n == 0 or top == 0 or widths[-1] * n <= budget:
    return jnp.full((n,), widths[-1], jnp.int32)
  s = jnp.array([variance_factor(b) for b in widths], jnp.float32)
  width = jnp.array(widths, jnp.int32)
  # Step m of a sample lowers it from level top - m to top - m - 1.
  dbits = [widths[top - m] - widths[top - m - 1] for m in range(top)]
  dvar = [
    (variance_factor(widths[top - m - 1]) - variance_factor(widths[top - m])) / dbits[m]
    for m in range(top)
  ]
  w = jnp.asarray(w, jnp.float32)
  w = jnp.where(jnp.isnan(w) | (w < 0), 0.0, jnp.minimum(w, jnp.finfo(jnp.float32).max))
  # The heap pops steps in (key, sample) order and each sample's keys grow
  # with every step, so the downward pass takes a prefix of the stably sorted
  # steps: up to the first one whose running saving meets the budget.
  key = (w[:, None] * jnp.array(dvar, jnp.float32)).reshape(-1)
  order = jnp.argsort(key, stable=True)
  key = key[order]
  cost = jnp.tile(jnp.array(dbits, jnp.int32), n)[order]
  owner = order // top
  step = order % top
  saved = jnp.cumsum(cost)
  pos = jnp.arange(n * top, dtype=jnp.int32)
  cross = jnp.sum(saved < widths[-1] * n - budget)
  level = top - jnp.zeros((n,), jnp.int32).at[owner].add((pos < cross).astype(jnp.int32))
  missing = widths[-1] * n - jnp.where(cross > 0, saved[cross - 1], 0) - budget
  # Alternative to the crossing step: the cheapest single sample that saves
  # the missing bits alone, at its highest level that does.
  below = jnp.arange(top + 1)[None, :] < level[:, None]
  enough = width[level][:, None] - width[None, :] >= missing
  lower = jnp.max(jnp.where(below & enough, jnp.arange(top + 1), -1), axis=1)
  extra = jnp.where(lower >= 0, w * (s[jnp.maximum(lower, 0)] - s[level]), jnp.inf)
  m = jnp.argmin(extra)
  plain = level.at[owner[cross]].add(-1)
  alt = level.at[m].set(lower[m])
  in_plain = pos <= cross
  in_alt = (pos < cross) | ((owner == m) & (step >= top - level[m]) & (step < top - lower[m]))

  # Fill: the host heap visits the upgrades (undoing taken steps) by
  # decreasing key, ties by sample index -- the order of a stable sort of
  # -key over the sorted steps. Each sample's upgrades appear in it in the
  # order the heap offers them, each costlier than the one before, so
  # scanning the taken steps in this order and undoing every one that fits
  # is the heap (once one does not fit, the sample's later ones cannot).
  # Fewer than max(dbits) bits are left and each undo spends >= 1, so
  # max(dbits) - 1 rounds of "the next one that fits" finish it.
  back = jnp.argsort(-key, stable=True)
  key, cost, owner = key[back], cost[back], owner[back]

  def fill(level, taken):
    def body(_, state):
      level, left, last = state
      i = jnp.min(jnp.where(taken & (pos > last) & (cost <= left) & (key > 0), pos, n * top))
      hit = i < n * top
      j = jnp.minimum(i, n * top - 1)
      level = level + ((jnp.arange(n) == owner[j]) & hit).astype(jnp.int32)
      return level, left - jnp.where(hit, cost[j], 0), jnp.where(hit, i, last)

    left = budget - jnp.sum(width[level])
    return jax.lax.fori_loop(0, max(dbits) - 1, body, (level, left, -1))[0]

  plain, alt = jax.vmap(fill)(jnp.stack([plain, alt]), jnp.stack([in_plain[back], in_alt[back]]))
  better = jnp.sum(w * (s[plain] - s[alt])) > 0
  return width[jnp.where(better, alt, plain)]


def allocate_per_sample(
  weights: jax.Array, avg_bits: float, allowed: Sequence[int] = (1, 2, 4, 8)
) -> jax.Array:
  """Per-sample widths for one tensor under an average-bits budget, in JAX.

  The result equals `greedy_allocate(weights, [1] * N, floor_bits(avg_bits, N),
  allowed)` (up to float32 ties among the sort keys): every sample has the
  same size, so the budget is floor_bits(avg_bits, N) bits per value summed over
  the samples. Instead of heap loops, the downward pass is one stable sort
  of the N * (len(allowed) - 1) possible steps and a prefix sum, the
  single-sample alternative is a masked argmin, and each fill pass is
  max(gap between widths) - 1 (3 by default) rounds of masked min over the
  steps re-sorted by decreasing key: O(N log N) work, static shapes, no
  data-dependent loop, deterministic. Runs under `jax.jit` and `vmap`.

  Args:
    weights: float[N] per-sample sensitivity (e.g. ||grad_n||^2 ||R_n||^2);
      NaN and negative weights count as 0, +inf as the largest float32.
    avg_bits: static Python number >= min(allowed).
    allowed: widths from 1..8 and 16 (no 32: a sample is never kept raw);
      the default (1, 2, 4, 8) is the one `PerSample` used before integer
      widths (ActNN's are `ACTNN_WIDTHS`).

  Returns:
    int32[N] widths with sum <= floor_bits(avg_bits, N).
  """
  widths = _check_allowed(allowed, uncompressed=False)
  if (
    isinstance(avg_bits, bool)
    or not isinstance(avg_bits, (int, float, np.integer, np.floating))
    or not avg_bits >= widths[0]
    or not math.isfinite(avg_bits)
  ):
    raise ValueError(
      f"avg_bits must be a static finite number >= {widths[0]} (the narrowest "
      f"allowed width), got {avg_bits!r}."
    )
  if jnp.ndim(weights) != 1:
    raise ValueError(
      f"weights must be a 1-D array (one per sample), got shape {jnp.shape(weights)}."
    )
  return _allocate_per_sample(weights, float(avg_bits), widths)
