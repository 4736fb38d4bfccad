"""Compressed activation functions and softmax (ActNN Appendix B.3).

An elementwise activation y = f(x) has the input gradient g * f'(x), which is
linear in f'(x). Storing a stochastically rounded copy of the *derivative*
(not of x) therefore keeps the input gradient unbiased. ReLU and leaky ReLU
need only the sign of x: a 1-bit packed mask, and their gradient is exact.
Softmax stores its quantized output y; its backward y * (g - sum(g * y)) is
quadratic in y, so it is only nearly unbiased (bias -Var(y_hat) * g).

The forward of every op is exactly the plain JAX function.

>>> import jax, jax.numpy as jnp
>>> x = jnp.linspace(-3.0, 3.0, 64).reshape(2, 32)
>>> bool((gelu(x, key=jax.random.key(0)) == jax.nn.gelu(x)).all())
True
>>> g = jax.grad(lambda x: relu(x).sum())(x)
>>> bool((g == (x > 0)).all())
True
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jact._core.packing import unpack_codes
from jact.kernels._relu_mask.api import relu_mask
from jact.kernels._relu_mask.reference import relu_mask_reference
from jact.compressors import Compressor
from jact._engine.op import Save, Store, compressed_op
from jact._engine.rounding import check_float, resolve_compressor
from jact._engine.sharding import pin_rows

__all__ = [
  "relu",
  "leaky_relu",
  "gelu",
  "silu",
  "tanh",
  "sigmoid",
  "softmax",
  "relu_mask_reference",
]


# ----------------------------------------------------------------------------- mask activations


def _mask_op(x, negative_slope, name: str, op: str, fn: Callable):
  x = check_float(x, op)

  def forward(x):
    y, mask = relu_mask(x, negative_slope=negative_slope)
    return y, {"mask": Save(mask, unpack=lambda m: pin_rows(unpack_codes(m)))}

  def backward(res, g):
    other = jnp.zeros_like(g) if negative_slope is None else g * negative_slope
    return (jnp.where(res["mask"], g, other),)

  return compressed_op(forward, backward, op=op, name=name, primal=fn, elementwise=True)(x)


def relu(x: jax.Array, *, name: str = "relu") -> jax.Array:
  """`jax.nn.relu` storing a 1-bit mask (x > 0) as its only residual (`name.mask`).

  The gradient equals `jax.grad` of `jax.nn.relu` exactly (0 at x == 0). No key needed.
  """
  return _mask_op(x, None, name, "relu", jax.nn.relu)


def leaky_relu(
  x: jax.Array, negative_slope: float = 0.01, *, name: str = "leaky_relu"
) -> jax.Array:
  """`jax.nn.leaky_relu` storing a 1-bit mask (x >= 0) as its only residual.

  `negative_slope` must be a static number. The gradient equals JAX's exactly.
  """
  try:
    negative_slope = float(negative_slope)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise TypeError("leaky_relu: negative_slope must be a static Python number") from e
  fn = lambda x: jax.nn.leaky_relu(x, negative_slope)
  return _mask_op(x, negative_slope, name, "leaky_relu", fn)


# ----------------------------------------------------------------------------- stored derivative


def _stored_derivative(f: Callable, x, *, key, bits, compressor, name: str, op: str) -> jax.Array:
  x = check_float(x, op)
  compressor = resolve_compressor(bits, compressor, f"jact.ops.{op}")

  def forward(x):
    x32 = x.astype(jnp.float32)
    _, dydx = jax.jvp(f, (x32,), (jnp.ones_like(x32),))
    return f(x), {"dydx": Store(dydx, dtype=jnp.float32, exact_dtype=x.dtype)}

  def backward(res, g):
    return ((g.astype(jnp.float32) * res["dydx"]).astype(g.dtype),)

  return compressed_op(
    forward, backward, op=op, name=name, compressor=compressor, key=key, primal=f, elementwise=True
  )(x)


def gelu(
  x: jax.Array,
  approximate: bool = True,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  name: str = "gelu",
) -> jax.Array:
  """`jax.nn.gelu` storing a quantized derivative (residual `name.dydx`); unbiased gradient.

  `bits` (a width, or None: exact) or `compressor` (a `jact.compressors`
  object, e.g. `PerGroup(4, group_size=128, stochastic=False)`) says how the
  derivative is stored, as in every jact op.
  """
  approximate = bool(approximate)
  return _stored_derivative(
    lambda x: jax.nn.gelu(x, approximate=approximate),
    x,
    key=key,
    bits=bits,
    compressor=compressor,
    name=name,
    op="gelu",
  )


def silu(
  x: jax.Array,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  name: str = "silu",
) -> jax.Array:
  """`jax.nn.silu` storing a quantized derivative (residual `name.dydx`); unbiased gradient."""
  return _stored_derivative(
    jax.nn.silu, x, key=key, bits=bits, compressor=compressor, name=name, op="silu"
  )


def tanh(
  x: jax.Array,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  name: str = "tanh",
) -> jax.Array:
  """`jnp.tanh` storing a quantized derivative (residual `name.dydx`); unbiased gradient."""
  return _stored_derivative(
    jnp.tanh, x, key=key, bits=bits, compressor=compressor, name=name, op="tanh"
  )


def sigmoid(
  x: jax.Array,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  name: str = "sigmoid",
) -> jax.Array:
  """`jax.nn.sigmoid` storing a quantized derivative (residual `name.dydx`); unbiased gradient."""
  return _stored_derivative(
    jax.nn.sigmoid, x, key=key, bits=bits, compressor=compressor, name=name, op="sigmoid"
  )


# ----------------------------------------------------------------------------- softmax


def softmax(
  x: jax.Array,
  axis: int | tuple[int, ...] = -1,
  *,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  name: str = "softmax",
) -> jax.Array:
  """`jax.nn.softmax` storing its quantized output (residual `name.y`).

  The backward is y_hat * (g - sum(g * y_hat, axis)). It is quadratic in the
  stored y_hat, so its expectation is off by -Var(y_hat) * g elementwise
  (at most step**2 / 4 * abs(g), step = group range / (2**bits - 1)): nearly
  unbiased, negligible at 8 bits.

  >>> import jax, jax.numpy as jnp
  >>> x = jnp.arange(12.0).reshape(3, 4)
  >>> bool(jnp.allclose(softmax(x, key=jax.random.key(0)), jax.nn.softmax(x)))
  True
  """
  x = check_float(x, "softmax")
  compressor = resolve_compressor(bits, compressor, "jact.ops.softmax")
  axis = axis if isinstance(axis, int) else tuple(axis)

  def forward(x):
    y = jax.nn.softmax(x, axis=axis)
    return y, {"y": Store(y, dtype=jnp.float32)}

  def backward(res, g):
    y, g32 = res["y"], g.astype(jnp.float32)
    return ((y * (g32 - jnp.sum(g32 * y, axis=axis, keepdims=True))).astype(g.dtype),)

  return compressed_op(
    forward,
    backward,
    op="softmax",
    name=name,
    compressor=compressor,
    key=key,
    primal=lambda x: jax.nn.softmax(x, axis=axis),
    elementwise=True,
  )(x)
