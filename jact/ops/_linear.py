"""Compressed matmuls and convolutions (ActNN Appendix B.1).

The forward is exact; the backward uses a stochastically rounded copy of the
activation operand(s), so weight and input gradients are unbiased.

>>> import jax, jax.numpy as jnp
>>> x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
>>> y = dense(x, w, key=jax.random.key(0), bits=2)
>>> y.shape
(8, 4)
>>> gw = jax.grad(lambda w: dense(x, w, key=jax.random.key(0), bits=2).sum())(w)
>>> bool(jnp.allclose(gw, 8.0))
True
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jact._engine import probe as _probe
from jact.compressors import Compressor
from jact._engine.op import Keep, Store, compressed_op
from jact._engine.rounding import check_float, resolve_compressor

__all__ = ["dot_general", "dense", "einsum", "conv_general_dilated", "conv", "conv_transpose"]


def _check_compressed(args, compress, compressor, op: str) -> None:
  """A clear error at the call for an operand that would be stored compressed but
  has a dtype the compressors do not take (float64, integers): under `grad`
  it would otherwise fail deep inside the backward pass's residual storage."""
  if compressor is not None:
    for a, c in zip(args, tuple(compress)):
      if c:
        check_float(a, op)


def _check_real(args, op: str) -> None:
  """A clear error for a complex operand, at every width (bits=None too): the
  op's residual storage and backward rule are written for real floats."""
  for a in args:
    if jnp.iscomplexobj(a):
      raise TypeError(
        f"jact.ops.{op} takes real floating-point operands, got {jnp.asarray(a).dtype}: "
        f"complex values are not supported by jact's ops. Use the plain op (lax / jnp) for "
        f"complex values, or wrap the computation in jact.compressed, which keeps complex "
        f"residuals exact."
      )


def _apply(fn, args, *, compress, key, compressor, name, op, layer=None):
  """`fn` of `args` storing the operands marked in `compress` with
  `compressor` (resolved: a `Compressor` or None). `layer`: (kind, info) for
  the analytic estimators when the lhs is the stored activation of a dense
  layer or a channels-last convolution."""
  _check_real(args, op)
  _check_compressed(args, compress, compressor, op)
  compress = tuple(bool(c) for c in compress)
  if len(compress) != len(args):
    raise ValueError(
      f"jact.ops.{op}: compress needs one flag per operand ({len(args)}), got {compress}"
    )
  y = compressed_op(
    *_stored_operands(fn, compress), op=op, name=name, compressor=compressor, key=key, primal=fn
  )(*args)
  collector = _probe.active()
  if collector is not None and layer is not None and compress[0] and compressor is not None:
    kind, info = layer
    y = _probe.observe_linear(
      collector,
      f"{name}.lhs",
      kind,
      args[0],
      y,
      group_size=_probe.group_size_of(compressor),
      **info,
    )
  return y


def _stored_operands(fn, compress):
  """(forward, backward) of `fn` storing the operands marked in `compress`
  compressed (`name.lhs`, `name.rhs`) and keeping the others (weights, alive
  anyway); the backward is the exact VJP of `fn` at the reconstructions. For
  a function linear in each stored operand the gradients are unbiased."""
  roles = ("lhs", "rhs", "arg2")[: len(compress)]

  def forward(*args):
    return fn(*args), {
      role: Store(a) if c else Keep(a, tie=True) for role, a, c in zip(roles, args, compress)
    }

  def backward(res, g):
    _, vjp = jax.vjp(fn, *res.values())
    return vjp(g)

  return forward, backward


def _dense_layer(lhs, dimension_numbers, compress):
  """('dense', {}) when lhs is an activation contracted over its last axis."""
  (lc, _), (lb, _) = dimension_numbers
  if tuple(compress)[:2] == (True, False) and tuple(lc) == (lhs.ndim - 1,) and not tuple(lb):
    return ("dense", {})
  return None


def _conv_layer(lhs, rhs, window_strides, dimension_numbers, feature_group_count):
  """('conv', info) for a channels-last convolution (Flax's layout)."""
  if dimension_numbers != _channels_last(lhs.ndim) or lhs.ndim < 3:
    return None
  return (
    "conv",
    dict(
      kernel_locations=math.prod(rhs.shape[:-2]),
      stride=math.prod(window_strides),
      feature_groups=feature_group_count,
    ),
  )


def dot_general(
  lhs: jax.Array,
  rhs: jax.Array,
  dimension_numbers,
  precision=None,
  preferred_element_type=None,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  compress: tuple[bool, bool] = (True, True),
  name: str = "dot_general",
  **kwargs,
) -> jax.Array:
  """`lax.dot_general` whose backward uses compressed copies of its operands.

  Signature-compatible with `lax.dot_general` (so it can be a Flax
  `dot_general`), plus the compression keywords: `bits` (1 to 8, 16 or None
  for uncompressed) or a `jact.compressors` object as `compressor` (PerGroup
  with its group size and rounding mode, BLPA, DIVISION, fixpoint, ...; then
  leave `bits` at its default), as in every jact op. `compress` says which
  operand is an activation to be compressed; a weight (alive anyway) should be kept.
  Residual names are `f"{name}.lhs"` and `f"{name}.rhs"`.
  """
  return _dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision,
    preferred_element_type,
    key=key,
    compressor=resolve_compressor(bits, compressor, "jact.ops.dot_general"),
    compress=compress,
    name=name,
    **kwargs,
  )


def _dot_general(
  lhs,
  rhs,
  dimension_numbers,
  precision,
  preferred_element_type,
  *,
  key,
  compressor,
  compress,
  name,
  **kwargs,
):
  """`dot_general` with its compressor resolved."""
  fn = functools.partial(
    lax.dot_general,
    dimension_numbers=dimension_numbers,
    precision=precision,
    preferred_element_type=preferred_element_type,
    **kwargs,
  )
  return _apply(
    fn,
    (lhs, rhs),
    compress=compress,
    key=key,
    compressor=compressor,
    name=name,
    op="dot_general",
    layer=_dense_layer(lhs, dimension_numbers, compress),
  )


def dense(
  x: jax.Array,
  kernel: jax.Array,
  bias: jax.Array | None = None,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  precision=None,
  name: str = "dense",
) -> jax.Array:
  """`x @ kernel + bias` over the last axis of x, storing x compressed (residual `name.lhs`)."""
  _check_real((x, kernel), "dense")
  compressor = resolve_compressor(bits, compressor, "jact.ops.dense")
  _check_compressed((x,), (True,), compressor, "dense")
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  y = _dot_general(
    x,
    kernel,
    dims,
    precision,
    None,
    key=key,
    compressor=compressor,
    compress=(True, False),
    name=name,
  )
  return y if bias is None else y + bias


def einsum(
  subscripts: str,
  a: jax.Array,
  b: jax.Array,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  compress: tuple[bool, bool] = (True, True),
  precision=None,
  name: str = "einsum",
) -> jax.Array:
  """Two-operand `jnp.einsum` storing compressed operands (attention's q·k, p·v)."""
  fn = functools.partial(jnp.einsum, subscripts, precision=precision)
  return _apply(
    fn,
    (a, b),
    compress=compress,
    key=key,
    compressor=resolve_compressor(bits, compressor, "jact.ops.einsum"),
    name=name,
    op="einsum",
  )


def conv_general_dilated(
  lhs: jax.Array,
  rhs: jax.Array,
  window_strides: Sequence[int],
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count: int = 1,
  batch_group_count: int = 1,
  precision=None,
  preferred_element_type=None,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  compress: tuple[bool, bool] = (True, False),
  name: str = "conv",
) -> jax.Array:
  """`lax.conv_general_dilated` storing the input compressed (1-D/2-D/3-D, any stride,
  dilation, padding and feature groups). Signature-compatible with the lax function."""
  return _conv_general_dilated(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation,
    rhs_dilation,
    dimension_numbers,
    feature_group_count,
    batch_group_count,
    precision,
    preferred_element_type,
    key=key,
    compressor=resolve_compressor(bits, compressor, "jact.ops.conv_general_dilated"),
    compress=compress,
    name=name,
  )


def _conv_general_dilated(
  lhs,
  rhs,
  window_strides,
  padding,
  lhs_dilation,
  rhs_dilation,
  dimension_numbers,
  feature_group_count,
  batch_group_count,
  precision,
  preferred_element_type,
  *,
  key,
  compressor,
  compress,
  name,
):
  """`conv_general_dilated` with its compressor resolved."""
  fn = functools.partial(
    lax.conv_general_dilated,
    window_strides=tuple(window_strides),
    padding=padding if isinstance(padding, str) else tuple(tuple(p) for p in padding),
    lhs_dilation=None if lhs_dilation is None else tuple(lhs_dilation),
    rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
    dimension_numbers=dimension_numbers,
    feature_group_count=feature_group_count,
    batch_group_count=batch_group_count,
    precision=precision,
    preferred_element_type=preferred_element_type,
  )
  layer = None
  if tuple(compress)[:2] == (True, False) and lhs_dilation is None and batch_group_count == 1:
    layer = _conv_layer(lhs, rhs, tuple(window_strides), dimension_numbers, feature_group_count)
  return _apply(
    fn,
    (lhs, rhs),
    compress=compress,
    key=key,
    compressor=compressor,
    name=name,
    op="conv_general_dilated",
    layer=layer,
  )


def _channels_last(ndim: int):
  spatial = "DHW"[3 - (ndim - 2) :] if ndim <= 5 else None
  if spatial is None:
    raise ValueError(f"conv supports 1-D, 2-D and 3-D inputs, got rank {ndim}")
  return ("N" + spatial + "C", spatial + "IO", "N" + spatial + "C")


def _tuple(v, n):
  return (v,) * n if isinstance(v, int) else tuple(v)


def conv(
  x: jax.Array,
  kernel: jax.Array,
  bias: jax.Array | None = None,
  *,
  strides: int | Sequence[int] = 1,
  padding: Any = "SAME",
  dilation: int | Sequence[int] = 1,
  feature_group_count: int = 1,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  precision=None,
  name: str = "conv",
) -> jax.Array:
  """Channels-last convolution (x: N,[D,]H,W,C; kernel: [D,]H,W,I,O), Flax's layout."""
  _check_real((x, kernel), "conv")
  compressor = resolve_compressor(bits, compressor, "jact.ops.conv")
  _check_compressed((x,), (True,), compressor, "conv")
  n = x.ndim - 2
  y = _conv_general_dilated(
    x,
    kernel,
    _tuple(strides, n),
    padding,
    None,
    _tuple(dilation, n),
    _channels_last(x.ndim),
    feature_group_count,
    1,
    precision,
    None,
    key=key,
    compressor=compressor,
    compress=(True, False),
    name=name,
  )
  return y if bias is None else y + bias


def conv_transpose(
  x: jax.Array,
  kernel: jax.Array,
  strides: Sequence[int],
  padding,
  rhs_dilation=None,
  dimension_numbers=None,
  transpose_kernel: bool = False,
  precision=None,
  preferred_element_type=None,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  name: str = "conv_transpose",
) -> jax.Array:
  """`lax.conv_transpose` storing the input compressed (ActNN: a convolution with
  inverse stride, so the same unbiasedness holds)."""
  if dimension_numbers is None:
    dimension_numbers = _channels_last(x.ndim)
  fn = functools.partial(
    lax.conv_transpose,
    strides=tuple(strides),
    padding=padding if isinstance(padding, str) else tuple(tuple(p) for p in padding),
    rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
    dimension_numbers=dimension_numbers,
    transpose_kernel=transpose_kernel,
    precision=precision,
    preferred_element_type=preferred_element_type,
  )
  return _apply(
    fn,
    (x, kernel),
    compress=(True, False),
    key=key,
    compressor=resolve_compressor(bits, compressor, "jact.ops.conv_transpose"),
    name=name,
    op="conv_transpose",
  )
