"""Compressed batch, layer and RMS normalization (ActNN Appendix B.2).

The forward matches `flax.linen.BatchNorm` (train mode), `LayerNorm` and
`RMSNorm` (statistics in float32). The residual is the quantized normalized
input x_hat (`name.xhat`) plus the small float32 1/std per feature (batch
norm) or per row (layer/RMS norm), `name.inv_std`. The backward uses the
closed-form formulas, with h = g * scale and means over the reduced axes:

  d_bias = sum(g),  d_scale = sum(g * x_hat)               (linear in x_hat: unbiased)
  d_x = inv_std * (h - mean(h) - x_hat * mean(h * x_hat))   (RMS norm: no mean(h))

d_x is quadratic in the single stored copy of x_hat, so its expectation is
off by -inv_std * scale * Var(x_hat) * g / N elementwise (N = reduced size):
nearly unbiased, as in ActNN.

>>> import jax, jax.numpy as jnp
>>> x = jax.random.normal(jax.random.key(1), (4, 64))
>>> y = layer_norm(x, jnp.ones(64), jnp.zeros(64), key=jax.random.key(0))
>>> bool(jnp.allclose(y.mean(-1), 0.0, atol=1e-5))
True
>>> y, mean, var = batch_norm(x, key=jax.random.key(0), bits=8)
>>> mean.shape, var.shape
((64,), (64,))
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jact import _compat
from jact._engine import probe as _probe
from jact.compressors import Compressor
from jact._engine.op import Keep, Save, Store, compressed_op, same_varying_axes
from jact._engine.rounding import check_float, resolve_compressor
from jact._engine.rows import axes_from_end

__all__ = ["batch_norm", "layer_norm", "rms_norm", "update_running_stats"]

_F32 = jnp.float32


def _axes(ndim: int, axes) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  for a in axes:
    if not -ndim <= a < ndim:
      raise ValueError(f"axis {a} is out of range for an input of rank {ndim}")
  return tuple(sorted({a % ndim for a in axes}))


def _check_param(p, feature_shape: tuple[int, ...], what: str, op: str):
  if p is None:
    return None
  p = check_float(p, op)
  size = 1
  for s in feature_shape:
    size *= s
  if p.size != size:
    raise ValueError(
      f"jact.ops.{op}: {what} has shape {p.shape}, expected {size} values for the "
      f"feature shape {tuple(s for s in feature_shape if s != 1) or (1,)}"
    )
  return p


def _normalize(
  x,
  scale,
  bias,
  *,
  reduction_axes,
  feature_axes,
  epsilon,
  use_mean,
  use_fast_variance,
  key,
  compressor,
  name,
  op,
  axis_name=None,
  axis_index_groups=None,
):
  """Shared custom_vjp: returns (y, mean, var); mean/var carry no gradient.

  With `axis_name`, the statistics (and the backward's means over the reduced
  axes) are averaged over that named axis too, as Flax's `_compute_stats` does."""
  x = check_float(x, op)
  red = reduction_axes
  # scale and bias broadcast over every axis but the feature axes
  bshape = tuple(s if a in feature_axes else 1 for a, s in enumerate(x.shape))
  param_red = tuple(a for a in range(x.ndim) if a not in feature_axes)
  scale = _check_param(scale, bshape, "scale", op)
  bias = _check_param(bias, bshape, "bias", op)
  epsilon = float(epsilon)

  def mean(*values, keepdims=False):
    """Means over the reduced axes and, with `axis_name`, over devices (one pmean)."""
    means = [jnp.mean(v, red, keepdims=keepdims) for v in values]
    if axis_name is not None:
      means = list(lax.pmean(jnp.stack(means), axis_name, axis_index_groups=axis_index_groups))
    return means if len(values) > 1 else means[0]

  clipped_variance = use_mean and use_fast_variance

  def stats(x32):
    """(mean, variance, d variance / d raw variance): the fast variance
    E[x^2] - E[x]^2 is clipped at 0 (it can come out negative, or far
    off, for inputs with a large offset); where it is, plain autodiff of
    that formula (what Flax computes) passes 0 (0.5 at exactly 0) of the
    variance's gradient on, and so does the backward here."""
    if not use_mean:
      var = mean(lax.square(x32))
      return jnp.zeros_like(var), var, None
    if use_fast_variance:
      mu, mu2 = mean(x32, lax.square(x32))
      raw = mu2 - lax.square(mu)
      var = jnp.maximum(0.0, raw)
      return mu, var, jnp.where(raw > 0, 1.0, jnp.where(raw == 0, 0.5, 0.0)).astype(_F32)
    mu = mean(x32)
    var = mean(lax.square(x32 - jnp.expand_dims(mu, red)))
    return mu, var, None

  def forward(x, scale, bias):
    x32 = x.astype(_F32)
    mu, var, slope = stats(x32)
    inv = lax.rsqrt(jnp.expand_dims(var, red) + epsilon)
    xc = x32 - jnp.expand_dims(mu, red)
    mul = inv if scale is None else inv * scale.astype(_F32).reshape(bshape)
    y = xc * mul
    if bias is not None:
      y = y + bias.astype(_F32).reshape(bshape)
    return y.astype(x.dtype), mu, var, xc, inv, slope

  bound = {}  # the sizes of the named axes where the forward rule ran

  def forward_storing(x, scale, bias):
    if axis_name is not None:
      bound["sizes"] = _compat.bound_axis_sizes(axis_name)
    y, mu, var, xc, inv, slope = forward(x, scale, bias)
    # RMS norm: x_hat keeps x's offset (1 + small deviations for x = 100 + noise), which
    # the backward needs: centered and scaled per row before rounding
    rows = None if use_mean else axes_from_end(red, x.ndim)
    residuals = {
      "xhat": Store(xc * inv, dtype=_F32, exact_dtype=x.dtype, rows=rows),
      "inv_std": Save(inv),
    }
    if clipped_variance:  # twice the slope per row: 2 where the fast variance was not clipped
      residuals["var_slope"] = Save(jnp.expand_dims(2 * slope, red).astype(jnp.uint8))
    residuals["scale"] = Keep(scale)
    return (y, mu, var), residuals

  def backward(res, g):
    # under jax.grad of jax.vmap(axis_name=...), JAX runs this rule without the axis bound
    with _compat.axes_bound(bound.get("sizes", ())):
      return _backward(res, g)

  def _backward(res, g):
    xhat, inv, scale = res["xhat"], res["inv_std"], res["scale"]
    g32 = g.astype(_F32)
    d_bias = None
    if bias_shape is not None:
      d_bias = jnp.sum(g32, param_red).reshape(bias_shape).astype(bias_dtype)
    d_scale = None
    h = g32
    if scale is not None:
      d_scale = jnp.sum(g32 * xhat, param_red).reshape(scale.shape)
      if all(inv.shape[a] == 1 for a in param_red):
        # Plain JAX multiplies the reduced sum by 1/std: a non-finite statistic (an empty
        # batch's NaN) makes its scale gradient NaN even where the sum is empty.
        d_scale = d_scale + (0.0 * inv).reshape(scale.shape)
      d_scale = d_scale.astype(scale.dtype)
      h = g32 * scale.astype(_F32).reshape(bshape)
    if use_mean:
      mean_hx, mean_h = mean(h * xhat, h, keepdims=True)
      if clipped_variance:
        mean_hx = mean_hx * (0.5 * res["var_slope"].astype(_F32))
      dx = h - xhat * mean_hx - mean_h
    else:
      dx = h - xhat * mean(h * xhat, keepdims=True)
    return (inv * dx).astype(g.dtype), d_scale, d_bias

  bias_shape = None if bias is None else bias.shape
  bias_dtype = None if bias is None else bias.dtype
  x, scale, bias = same_varying_axes((x, scale, bias))  # invariant parameters meet varying x
  # only y waits for the residuals: under shard_map the statistics of an axis_name are
  # invariant over it, and a flag from the (varying) residuals would make them vary
  y, mu, var = compressed_op(
    forward_storing,
    backward,
    op=op,
    name=name,
    compressor=compressor,
    key=key,
    primal=lambda x, scale, bias: forward(x, scale, bias)[:3],
    elementwise=True,
    statistics=2,
  )(x, scale, bias)
  collector = _probe.active()
  if collector is not None and compressor is not None:
    _, _, _, xc, inv, _ = forward(x, scale, bias)
    y = _probe.observe_norm(
      collector,
      f"{name}.xhat",
      op,
      xc * inv,
      inv,
      None if scale is None else scale.reshape(bshape),
      y,
      reduction_axes=red,
      group_size=_probe.group_size_of(compressor),
    )
  return y, mu, var


def batch_norm(
  x: jax.Array,
  scale: jax.Array | None = None,
  bias: jax.Array | None = None,
  *,
  axis: int | Sequence[int] = -1,
  epsilon: float = 1e-5,
  use_fast_variance: bool = True,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  name: str = "batch_norm",
  axis_name: str | None = None,
  axis_index_groups=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Train-mode batch norm over all axes except the feature `axis`.

  Matches `flax.linen.BatchNorm(use_running_average=False)` with output dtype
  x.dtype. Returns (y, batch_mean, batch_var); the statistics are float32,
  shaped like the feature axes and carry no gradient (feed them to
  `update_running_stats`). `bits` (a width, or None: exact) or `compressor`
  (a `jact.compressors` object, e.g. `PerGroup(8, group_size=128)`) says how
  x_hat is stored.
  `axis_name` / `axis_index_groups`: cross-device statistics, as in Flax (one
  `lax.pmean` of the local means under `pmap`, `shard_map` or a named `vmap`);
  the backward averages over the same devices, so the input gradient is that
  of the statistics of the whole (all-device) batch.
  """
  x = check_float(x, "batch_norm")
  feature = _axes(x.ndim, axis)
  red = tuple(a for a in range(x.ndim) if a not in feature)
  return _normalize(
    x,
    scale,
    bias,
    reduction_axes=red,
    feature_axes=feature,
    epsilon=epsilon,
    use_mean=True,
    use_fast_variance=use_fast_variance,
    key=key,
    compressor=resolve_compressor(bits, compressor, "jact.ops.batch_norm"),
    name=name,
    op="batch_norm",
    axis_name=axis_name,
    axis_index_groups=axis_index_groups,
  )


def update_running_stats(
  ra_mean: jax.Array,
  ra_var: jax.Array,
  batch_mean: jax.Array,
  batch_var: jax.Array,
  momentum: float = 0.99,
) -> tuple[jax.Array, jax.Array]:
  """Flax's running-average update: momentum * running + (1 - momentum) * batch.

  >>> import jax.numpy as jnp
  >>> update_running_stats(jnp.zeros(2), jnp.ones(2), jnp.ones(2), jnp.zeros(2), 0.9)[0]
  Array([0.1, 0.1], dtype=float32)
  """
  new_mean = momentum * ra_mean + (1 - momentum) * batch_mean.astype(ra_mean.dtype)
  new_var = momentum * ra_var + (1 - momentum) * batch_var.astype(ra_var.dtype)
  return new_mean, new_var


def layer_norm(
  x: jax.Array,
  scale: jax.Array | None = None,
  bias: jax.Array | None = None,
  *,
  epsilon: float = 1e-6,
  use_fast_variance: bool = True,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  name: str = "layer_norm",
) -> jax.Array:
  """Layer norm over the last axis, matching `flax.linen.LayerNorm` (output dtype x.dtype)."""
  x = check_float(x, "layer_norm")
  return _normalize(
    x,
    scale,
    bias,
    reduction_axes=(x.ndim - 1,),
    feature_axes=(x.ndim - 1,),
    epsilon=epsilon,
    use_mean=True,
    use_fast_variance=use_fast_variance,
    key=key,
    compressor=resolve_compressor(bits, compressor, "jact.ops.layer_norm"),
    name=name,
    op="layer_norm",
  )[0]


def rms_norm(
  x: jax.Array,
  scale: jax.Array | None = None,
  *,
  epsilon: float = 1e-6,
  key=None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  name: str = "rms_norm",
) -> jax.Array:
  """RMS norm over the last axis, matching `flax.linen.RMSNorm` (output dtype x.dtype).

  The residual row statistic is 1/rms, tagged `name.inv_std`.
  """
  x = check_float(x, "rms_norm")
  return _normalize(
    x,
    scale,
    None,
    reduction_axes=(x.ndim - 1,),
    feature_axes=(x.ndim - 1,),
    epsilon=epsilon,
    use_mean=False,
    use_fast_variance=True,
    key=key,
    compressor=resolve_compressor(bits, compressor, "jact.ops.rms_norm"),
    name=name,
    op="rms_norm",
  )[0]
