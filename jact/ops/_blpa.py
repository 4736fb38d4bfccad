"""BLPA's fused pre-activation block: batch norm -> scale & bias -> ReLU -> conv.

Chakrabarti & Moseley 2019, Sec. 3.1-3.3. The forward is exact; the backward
keeps only the K-bit BLPA codes of the normalized, scaled value (`name.a2`)
and the per-channel 1/sqrt(var + eps) (`name.inv`), so the input gradient
differs from the exact one only in its variance term. The equations:
docs/design.md, "BLPA's fused block".

>>> import jax, jax.numpy as jnp
>>> x, k = jnp.ones((2, 4, 4, 8)).at[0].set(-1.0), 0.1 * jnp.ones((3, 3, 8, 5))
>>> loss = lambda x, s, b: blpa_block(x, s, b, k, bits=4)[0].sum()
>>> dx, ds, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, jnp.ones(8), jnp.zeros(8))
>>> dx.shape, ds.shape, db.shape
((2, 4, 4, 8), (8,), (8,))
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jact.compressors import Compressor
from jact.compressors._blpa import BLPA, blpa_decode, blpa_encode, blpa_grid, check_blpa_bits
from jact._engine.derivatives import first_order_only
from jact._engine.op import Keep, Save, compressed_op
from jact._engine.rounding import check_float, resolve_compressor
from jact.ops._linear import _channels_last
from jact._core.packing import pack_codes, unpack_codes

__all__ = ["blpa_block", "blpa_block_reference", "block_conv"]

_F32 = jnp.float32


def _tuple(v, n: int, what: str) -> tuple[int, ...]:
  t = (int(v),) * n if isinstance(v, int) else tuple(int(i) for i in v)
  if len(t) != n:
    raise ValueError(
      f"jact.ops.blpa_block: {what} needs {n} values for a {n}-D convolution, got {v!r}"
    )
  return t


def block_conv(
  a: jax.Array,
  kernel: jax.Array,
  *,
  strides: int | Sequence[int] = 1,
  padding: Any = "SAME",
  dilation: int | Sequence[int] = 1,
) -> jax.Array:
  """The block's linear map: a channels-last convolution (a: N,[D,]H,W,C; kernel:
  [D,]H,W,I,O), or `a @ kernel` for a rank-2 `a` and a 2-D kernel."""
  if a.ndim == 2:
    return jnp.matmul(a, kernel)
  n = a.ndim - 2
  dims = _channels_last(a.ndim)
  pad = padding if isinstance(padding, str) else tuple(tuple(p) for p in padding)
  return lax.conv_general_dilated(
    a,
    kernel,
    _tuple(strides, n, "strides"),
    pad,
    rhs_dilation=_tuple(dilation, n, "dilation"),
    dimension_numbers=dims,
  )


def _check(x, scale, bias, kernel, conv_bias):
  x = check_float(x, "blpa_block")
  if not 2 <= x.ndim <= 5:
    raise ValueError(
      f"jact.ops.blpa_block takes a rank-2 (dense) or rank-3 to 5 (1-D to 3-D "
      f"channels-last convolution) input, got shape {x.shape}"
    )
  c = x.shape[-1]
  scale, bias, kernel = (check_float(p, "blpa_block") for p in (scale, bias, kernel))
  for p, what in ((scale, "scale"), (bias, "bias")):
    if p.shape != (c,):
      raise ValueError(
        f"jact.ops.blpa_block: {what} has shape {p.shape}, expected ({c},): one "
        f"value per channel (last axis) of x {x.shape}"
      )
  if kernel.ndim != x.ndim or kernel.shape[-2] != c:
    want = "(C, O)" if x.ndim == 2 else "(" + ", ".join(["k"] * (x.ndim - 2)) + ", C, O)"
    raise ValueError(
      f"jact.ops.blpa_block: kernel has shape {kernel.shape}, expected {want} "
      f"with C = {c} input channels (last axis of x {x.shape})"
    )
  if conv_bias is not None:
    conv_bias = check_float(conv_bias, "blpa_block")
    if conv_bias.shape != (kernel.shape[-1],):
      raise ValueError(
        f"jact.ops.blpa_block: conv_bias has shape {conv_bias.shape}, expected "
        f"({kernel.shape[-1]},): one value per output feature"
      )
  return x, scale, bias, kernel, conv_bias


def blpa_block(
  x: jax.Array,
  scale: jax.Array,
  bias: jax.Array,
  kernel: jax.Array,
  conv_bias: jax.Array | None = None,
  *,
  bits: int = 4,
  compressor: BLPA | None = None,
  strides: int | Sequence[int] = 1,
  padding: Any = "SAME",
  dilation: int | Sequence[int] = 1,
  epsilon: float = 1e-5,
  name: str = "blpa",
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Train-mode batch norm -> scale/bias -> ReLU -> conv, storing BLPA codes of A2.

  Args:
    x: N,[D,]H,W,C input (or N,C for a dense layer).
    scale, bias: BN's gamma and beta, shape (C,).
    kernel: [D,]H,W,C,O convolution kernel (C,O for a rank-2 x).
    conv_bias: optional (O,) bias added after the convolution.
    bits: 2, 4 or 8: width of the stored codes.
    compressor: a `jact.compressors.BLPA` instead of `bits` (its width is used).
    strides, padding, dilation: of the convolution (as `jact.ops.conv`).
    epsilon: BN's epsilon.
    name: residual names `name.a2` (codes) and `name.inv` (1/std per channel).

  Returns:
    (y, batch_mean, batch_var), like `jact.ops.batch_norm`: y in the dtype of
    x and kernel promoted; the statistics float32 (C,), without gradient, for
    `jact.ops.update_running_stats`. The variance is the biased two-pass one.
  """
  if compressor is not None or isinstance(bits, Compressor):
    compressor = resolve_compressor(bits, compressor, "jact.ops.blpa_block")
    if not isinstance(compressor, BLPA):
      raise TypeError(
        f"jact.ops.blpa_block stores BLPA codes: compressor= takes a "
        f"jact.compressors.BLPA, got {compressor!r}; for another compressor use "
        f"jact.ops.batch_norm, jact.ops.relu and jact.ops.conv."
      )
    bits = compressor.bits
  bits = check_blpa_bits(bits)
  x, scale, bias, kernel, conv_bias = _check(x, scale, bias, kernel, conv_bias)
  epsilon = float(epsilon)
  red = tuple(range(x.ndim - 1))
  out_dtype = jnp.result_type(x.dtype, kernel.dtype)

  def conv(a, w):
    return block_conv(
      a.astype(out_dtype), w.astype(out_dtype), strides=strides, padding=padding, dilation=dilation
    )

  def forward(x, scale, bias, kernel, conv_bias):
    x32 = x.astype(_F32)
    mu = jnp.mean(x32, red)
    xc = x32 - mu
    var = jnp.mean(jnp.square(xc), red)
    inv = lax.rsqrt(var + epsilon)
    a2 = xc * (inv * scale.astype(_F32)) + bias.astype(_F32)
    y = conv(jnp.maximum(a2, 0.0), kernel)
    if conv_bias is not None:
      y = y + conv_bias.astype(y.dtype)
    return (y, mu, var), a2, inv

  def storing_codes(x, scale, bias, kernel, conv_bias):
    out, a2, inv = forward(x, scale, bias, kernel, conv_bias)
    step, start = blpa_grid(bias, scale, bits)
    a2 = first_order_only(a2, f"{name}.a2", f"BLPA {bits}-bit")
    codes = pack_codes(blpa_encode(a2, step, start, bits), bits)
    return out, {
      "a2": Save(codes),
      "inv": Save(inv),
      "scale": Keep(scale),
      "bias": Keep(bias),
      "kernel": Keep(kernel, tie=True),
    }

  def backward(res, g):
    codes, inv, scale, bias, kernel = (res[r] for r in ("a2", "inv", "scale", "bias", "kernel"))
    step, start = blpa_grid(bias, scale, bits)
    a2 = blpa_decode(unpack_codes(codes, jnp.uint8), step, start, bits)
    mask = a2 > 0  # == (A2 > 0), exactly
    a3 = jnp.where(mask, a2, 0.0)
    gamma, beta = scale.astype(_F32), bias.astype(_F32)
    nonzero = gamma != 0
    a1 = jnp.where(nonzero, (a2 - beta) / jnp.where(nonzero, gamma, 1.0), 0.0)
    _, conv_vjp = jax.vjp(conv, a3, kernel)
    d_a3, d_kernel = conv_vjp(g.astype(out_dtype))
    d_a2 = jnp.where(mask, d_a3.astype(_F32), 0.0)
    d_bias = jnp.sum(d_a2, red)
    d_scale = jnp.sum(a1 * d_a2, red)
    d_a1 = gamma * d_a2
    dx = inv * (d_a1 - jnp.mean(d_a1, red) - a1 * jnp.mean(a1 * d_a1, red))
    d_conv_bias = None
    if has_conv_bias:
      d_conv_bias = jnp.sum(g.astype(_F32), tuple(range(g.ndim - 1))).astype(conv_bias_dtype)
    return (
      dx.astype(x_dtype),
      d_scale.astype(scale.dtype),
      d_bias.astype(bias.dtype),
      d_kernel.astype(kernel.dtype),
      d_conv_bias,
    )

  has_conv_bias = conv_bias is not None
  conv_bias_dtype = None if conv_bias is None else conv_bias.dtype
  x_dtype = x.dtype
  return compressed_op(
    storing_codes,
    backward,
    op="blpa_block",
    name=name,
    primal=lambda *args: forward(*args)[0],
    statistics=2,
  )(x, scale, bias, kernel, conv_bias)


def blpa_block_reference(
  x: jax.Array,
  scale: jax.Array,
  bias: jax.Array,
  kernel: jax.Array,
  conv_bias: jax.Array | None = None,
  *,
  mean: jax.Array | None = None,
  var: jax.Array | None = None,
  strides: int | Sequence[int] = 1,
  padding: Any = "SAME",
  dilation: int | Sequence[int] = 1,
  epsilon: float = 1e-5,
) -> jax.Array:
  """The same block with plain autodiff (no compression): batch statistics, or
  the given `mean` and `var` (inference with running averages).

  >>> import jax, jax.numpy as jnp
  >>> jax.jit(blpa_block_reference)(jnp.ones((2, 3)), jnp.ones(3), jnp.ones(3), jnp.ones((3, 1)))
  Array([[3.],
         [3.]], dtype=float32)
  """
  x, scale, bias, kernel, conv_bias = _check(x, scale, bias, kernel, conv_bias)
  red = tuple(range(x.ndim - 1))
  x32 = x.astype(_F32)
  if mean is None or var is None:
    mean = jnp.mean(x32, red)
    var = jnp.mean(jnp.square(x32 - mean), red)
  a1 = (x32 - mean.astype(_F32)) * lax.rsqrt(var.astype(_F32) + float(epsilon))
  a3 = jax.nn.relu(scale.astype(_F32) * a1 + bias.astype(_F32))
  out_dtype = jnp.result_type(x.dtype, kernel.dtype)
  y = block_conv(
    a3.astype(out_dtype),
    kernel.astype(out_dtype),
    strides=strides,
    padding=padding,
    dilation=dilation,
  )
  return y if conv_bias is None else y + conv_bias.astype(y.dtype)
