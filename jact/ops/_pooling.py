"""Max and average pooling with minimal residuals (channels-last, Flax semantics).

`max_pool` keeps only the position of the maximum inside each window, packed
losslessly in the fewest bits (1 to 8) that hold K = prod(window)
positions (2x2 windows: 2 bits per output, 3x3: 4 bits, 5x5: 5 bits). `avg_pool` is linear
and keeps nothing. Both are exact: forward and gradients equal those of
`flax.linen.max_pool` / `avg_pool`, ties included (the first maximal position
of a window in row-major order gets the gradient, as in jax). They differ only
for windows whose maximum is NaN (here a NaN position gets the gradient) or
-inf with padding before the first -inf value (here the value gets it).

Windows are read as K strided slices of the input, one per window offset
(no padded copy of the input); the backward scatters through the linear
transpose of that slicing.

>>> import jax, jax.numpy as jnp
>>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
>>> max_pool(x, (2, 2), strides=(2, 2))[0, :, :, 0]
Array([[ 5.,  7.],
       [13., 15.]], dtype=float32)
>>> g = jax.grad(lambda x: max_pool(x, (2, 2), (2, 2)).sum())(x)
>>> int(g.sum()), float(g[0, 1, 1, 0])
(4, 1.0)
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jact._core.packing import SUPPORTED_BITS, pack_codes, unpack_codes
from jact._engine.names import check_name
from jact._engine.op import Save, compressed_op
from jact._engine.rounding import check_float

__all__ = ["max_pool", "avg_pool", "argmax_bits"]


def argmax_bits(window_size: int) -> int:
  """Fewest bits (1 to 8) that hold a position in a window of `window_size`.

  >>> argmax_bits(4), argmax_bits(9), argmax_bits(25), argmax_bits(256)
  (2, 4, 5, 8)
  """
  for bits in SUPPORTED_BITS:
    if bits <= 8 and window_size <= 1 << bits:  # positions are uint8 codes
      return bits
  raise ValueError(
    f"max_pool stores the arg-max position in at most 8 bits, so a window may hold at "
    f"most 256 positions; got {window_size}. Use a smaller window, or pool in two steps."
  )


def _geometry(x: jax.Array, window_shape, strides, padding, op: str):
  """Full-rank window, strides and explicit pads, like `flax.linen.pooling.pool`."""
  window = tuple(int(w) for w in window_shape)
  n = len(window)
  strides = tuple(int(s) for s in (strides or (1,) * n))
  if len(strides) != n:
    raise ValueError(f"{op}: window_shape {window} and strides {strides} need the same length")
  if x.ndim < n + 1:
    raise ValueError(f"{op}: input of shape {x.shape} needs (batch..., {n} spatial dims, features)")
  if any(w < 1 for w in window) or any(s < 1 for s in strides):
    raise ValueError(f"{op}: window_shape {window} and strides {strides} must be positive")
  batch = x.ndim - n - 1
  dims = (1,) * batch + window + (1,)
  full_strides = (1,) * batch + strides + (1,)
  if isinstance(padding, str):
    pads = tuple(lax.padtype_to_pads(x.shape, dims, full_strides, padding))
  else:
    padding = tuple(tuple(int(v) for v in p) for p in padding)
    if len(padding) != n or any(len(p) != 2 for p in padding):
      raise ValueError(
        f"{op}: padding must be 'SAME', 'VALID' or {n} (low, high) pairs, got {padding}"
      )
    pads = ((0, 0),) * batch + padding + ((0, 0),)
  pads = tuple((int(lo), int(hi)) for lo, hi in pads)
  return dims, full_strides, pads


def _out_shape(shape, dims, strides, pads):
  """Windows per dim; 0 where the window exceeds the padded input (as in lax)."""
  return tuple(
    max(0, (h + lo + hi - w) // s + 1) for h, w, s, (lo, hi) in zip(shape, dims, strides, pads)
  )


def _offsets(dims):
  """Window offsets in row-major order (position k of the arg-max code)."""
  return list(itertools.product(*(range(w) for w in dims)))


def _box(shape, offset, strides, pads, out_shape):
  """Where window offset `offset` reads x: (x start, x limit, output start, output limit).

  Output index i reads x at offset + stride * i - pad_lo; the indices where
  that lies inside x form the box [i0, i1) per dim (empty when i1 == i0).
  """
  x_start, x_limit, out_start, out_limit = [], [], [], []
  for h, o, s, (lo, _), m in zip(shape, offset, strides, pads, out_shape):
    i0 = min(max(0, -(-(lo - o) // s)), m)
    i1 = min(max(i0, -(-(h + lo - o) // s)), m)
    first = o + s * i0 - lo
    x_start.append(first)
    x_limit.append(first + s * max(i1 - i0 - 1, 0) + 1)
    out_start.append(i0)
    out_limit.append(i1)
  return x_start, x_limit, out_start, out_limit


def _argmax_codes(x, y, offsets, strides, pads, out_shape):
  """uint8 index of the window position plain JAX's max-pool gradient picks.

  That is XLA's select-and-scatter with `>=` over the padded window (padding
  is -inf): walking the window in order, the current pick is kept while it is
  >= the next value. Without NaN this is the first position holding the
  maximum y; after a NaN (never >= anything, and nothing is >= it) the pick
  moves to the next position, so in a window with NaN it is the first maximum
  *after the last NaN* (padding included), or that NaN when it comes last.
  Computed walking the offsets last to first with the state of each window's
  suffix (its pick, maximum, and whether it holds a NaN): elementwise over
  the output, which XLA fuses into one pass (no padded copy of x; pads are
  never fused on XLA:CPU). A pick in the padding gets no gradient.
  """
  del y
  ninf = jnp.array(-jnp.inf, x.dtype)
  code = jnp.zeros(out_shape, jnp.uint8)
  best = jnp.full(out_shape, ninf)
  has_nan = jnp.zeros(out_shape, bool)
  last = len(offsets) - 1
  for k in reversed(range(len(offsets))):
    x_start, x_limit, i0, i1 = _box(x.shape, offsets[k], strides, pads, out_shape)
    empty = any(a == b for a, b in zip(i0, i1))
    if not empty:
      c, m, n = (lax.slice(a, i0, i1) for a in (code, best, has_nan))
    if empty or any(a > 0 or b < size for a, b, size in zip(i0, i1, out_shape)):
      # Windows outside the box read padding (-inf) here: picked where the suffix is all -inf.
      pad_take = (~has_nan & (best == ninf)) if k < last else jnp.ones(out_shape, bool)
      code = jnp.where(pad_take, jnp.uint8(k), code)
    if empty:
      continue
    v = lax.slice(x, x_start, x_limit, strides)
    nan = jnp.isnan(v)
    take = (~nan & ~n & (v >= m)) if k < last else jnp.ones(v.shape, bool)
    code = lax.dynamic_update_slice(code, jnp.where(take, jnp.uint8(k), c), i0)
    best = lax.dynamic_update_slice(best, jnp.where(take, v, m), i0)
    has_nan = lax.dynamic_update_slice(has_nan, n | nan, i0)
  return code


def _scatter_to_argmax(g, code, shape, dims, strides, pads, out_shape, offsets):
  """dx[i] = sum over windows o containing i of g[o] * (code[o] == offset of i in o).

  The cotangent and the codes are upsampled onto the (padded) input grid with
  one interior-padded `lax.pad` each, shifted by window - 1, so that window
  offset k of every output reads one contiguous slice; the K slices are then
  summed in a single elementwise fusion. Off-grid positions hold a zero
  cotangent, so their codes do not matter. (Transposing the K strided window
  slices instead materializes K input-sized tensors at once on XLA:CPU.)
  """
  cfg = [
    (w - 1, (h + lo + hi) - s * (m - 1) - 1, s - 1)
    for h, w, s, (lo, hi), m in zip(shape, dims, strides, pads, out_shape)
  ]
  g_up = lax.pad(g, jnp.zeros((), g.dtype), cfg)
  code_up = lax.pad(code, jnp.uint8(0), cfg)
  # Accumulate like jax's select_and_scatter_add (windows in increasing output
  # order, i.e. decreasing offset, in g's dtype), so gradients match it bit for bit.
  dx = jnp.zeros(shape, g.dtype)
  for k in reversed(range(len(offsets))):
    start = [lo - o + w - 1 for (lo, _), o, w in zip(pads, offsets[k], dims)]
    hit = _read(code_up, start, shape) == jnp.uint8(k)
    dx = dx + jnp.where(hit, _read(g_up, start, shape), jnp.zeros((), g.dtype))
  return dx


def _read(a, start, shape):
  """a[start : start + shape], zero where that box leaves a (negative padding
  moves it off the upsampled grid): a plain slice whenever the box fits."""
  if all(0 <= s and s + n <= m for s, n, m in zip(start, shape, a.shape)):
    return lax.slice(a, start, [s + n for s, n in zip(start, shape)])
  cfg = [(-s, s + n - m, 0) for s, n, m in zip(start, shape, a.shape)]
  return lax.pad(a, jnp.zeros((), a.dtype), cfg)


def max_pool(
  x: jax.Array,
  window_shape: Sequence[int],
  strides: Sequence[int] | None = None,
  padding: Any = "VALID",
  *,
  name: str = "max_pool",
) -> jax.Array:
  """`flax.linen.max_pool` whose backward keeps only the arg-max position per window.

  Args:
    x: float array (batch..., spatial..., features).
    window_shape: window size per spatial dim (at most 256 positions in all).
    strides: inter-window strides (default 1 per spatial dim).
    padding: "VALID", "SAME" or one (low, high) pair per spatial dim; padding
      counts as -inf, a negative pad crops the input (as in `lax.reduce_window`).
    name: residual name prefix; the packed positions are tagged `f"{name}.argmax"`.

  Returns:
    The window maxima, in x's dtype. Ties send the gradient to the first
    (row-major) maximal position of the window. A window larger than the
    padded input gives an empty output and a zero gradient, as in Flax.
  """
  check_float(x, "max_pool")
  name = check_name(name)
  dims, full_strides, pads = _geometry(x, window_shape, strides, padding, "max_pool")
  bits = argmax_bits(math.prod(dims))
  out_shape = _out_shape(x.shape, dims, full_strides, pads)
  if not math.prod(out_shape):  # no window fits: an empty output, a zero gradient (as in Flax)
    return jnp.zeros(out_shape, x.dtype)
  offsets = _offsets(dims)
  shape, dtype = x.shape, x.dtype

  def forward(x):
    return lax.reduce_window(x, np.array(-np.inf, dtype), lax.max, dims, full_strides, pads)

  def storing_argmax(x):
    y = forward(x)
    code = _argmax_codes(x, y, offsets, full_strides, pads, out_shape)
    unpack = lambda packed: unpack_codes(packed, jnp.uint8)
    return y, {"argmax": Save(pack_codes(code, bits), unpack=unpack)}

  def backward(res, g):
    return (
      _scatter_to_argmax(g, res["argmax"], shape, dims, full_strides, pads, out_shape, offsets),
    )

  # the output waits for the packed codes, so x can die as soon as they exist
  return compressed_op(storing_argmax, backward, op="max_pool", name=name, primal=forward)(x)


def avg_pool(
  x: jax.Array,
  window_shape: Sequence[int],
  strides: Sequence[int] | None = None,
  padding: Any = "VALID",
  count_include_pad: bool = True,
  *,
  name: str = "avg_pool",
) -> jax.Array:
  """`flax.linen.avg_pool` that saves nothing for its backward (it is linear).

  Args:
    x: float array (batch..., spatial..., features).
    window_shape, strides, padding: as in `max_pool` (padding counts as 0).
    count_include_pad: divide by the full window size (True) or by the number
      of non-padding positions in each window (False).
    name: accepted for a uniform op signature; no residual is stored.

  Returns:
    The window means in x's dtype (Flax's result cast to x's dtype).

  >>> import jax, jax.numpy as jnp
  >>> x = jnp.ones((1, 3, 3, 2))
  >>> avg_pool(x, (2, 2), padding="SAME", count_include_pad=False)[0, :, :, 0]
  Array([[1., 1., 1.],
         [1., 1., 1.],
         [1., 1., 1.]], dtype=float32)
  """
  check_float(x, "avg_pool")
  dims, full_strides, pads = _geometry(x, window_shape, strides, padding, "avg_pool")
  shape, dtype = x.shape, x.dtype
  n = len(tuple(window_shape))

  def divisor():
    if count_include_pad:
      return None
    # Non-padding count per window, over the spatial dims only (broadcasts over batch/features).
    sp = slice(x.ndim - n - 1, x.ndim - 1)
    ones = jnp.ones(shape[sp], jnp.float32)
    return lax.reduce_window(ones, np.float32(0), lax.add, dims[sp], full_strides[sp], pads[sp])[
      ..., None
    ]

  def forward(x):
    y = lax.reduce_window(x, np.array(0, dtype), lax.add, dims, full_strides, pads)
    if count_include_pad:
      return y / jnp.asarray(np.prod(window_shape), dtype)
    return (y.astype(jnp.float32) / divisor()).astype(dtype)

  def backward(_, g):
    # No residual to tie to g, so no optimization barrier: one would only keep
    # XLA from simplifying the division exactly as it does for Flax's gradient.
    return jax.linear_transpose(forward, jax.ShapeDtypeStruct(shape, dtype))(g)

  return compressed_op(
    lambda x: (forward(x), {}), backward, op="avg_pool", name=name, primal=forward
  )(x)
