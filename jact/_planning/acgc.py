"""AC-GC: bit widths from an allowed loss increase (AC-GC Sec. 3-5, Table 1).

An allowed loss increase (1 + e^2) becomes, per dense, convolution and
normalization residual, a tolerance on each stored value's squared error and
then the smallest width of jact's quantizer (or of a fixed-point
`compressor=`) that meets it; other residuals keep their call site's width.
`scale_bound=True` also bounds normalization scale gradients (not the
paper's). The bounds and how widths follow: docs/design.md, "AC-GC error
bounds".

>>> import jax, jax.numpy as jnp, jact
>>> def loss(w, x, key):
...   return jnp.sum(jnp.tanh(jact.ops.dense(x, w, key=key, name="fc")) ** 2)
>>> w, x = jnp.ones((256, 8)) / 16, jax.random.normal(jax.random.key(0), (16, 256))
>>> bounds = jact.acgc.error_bounded(loss, error=0.5)
>>> state = bounds.update(bounds.init(w, x, jax.random.key(1)), w, x, jax.random.key(2))
>>> bounds.plan(state)["fc.lhs"] in (1, 2, 3, 4, 5, 6, 7, 8, 16, None)
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jact.compressors import Fixpoint, ZeroValue
from jact.compressors._fixed_point import FIXPOINT_BITS
from jact._core import packing
from jact._planning.plan import BitPlan
from jact._planning.sensitivity import collect_layer_stats, find_residuals

__all__ = ["ACGCState", "ErrorBounded", "error_bounded", "tolerance", "bits_for_levels"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ACGCState:
  """Last `window` recalculations of the needed quantization steps B^2 per residual.

  Attributes:
    levels_sq: float32[window, L] ring buffer of (R_max / (2 dx*))^2 (NaN:
      residual without a bound, or slot not yet filled).
    count: int32, recalculations so far.
    names: static residual names.
  """

  levels_sq: jax.Array
  count: jax.Array
  names: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))


def tolerance(
  info: dict,
  stats: dict,
  grad_y: jax.Array,
  grad_scale,
  v_sq,
  error: float,
  scale_bound: bool = False,
):
  """Table 1's tolerance dx*^2 for one residual (in the stored residual's units);
  `scale_bound`: a normalization's also keeps its scale's gradient error below
  e^2 V^2 / 2 (not in Table 1)."""
  grad_y = grad_y.astype(jnp.float32)
  if info["kind"] == "dense":
    rows = info["batch"] * info["positions"]
    return error * v_sq / (2.0 * rows * info["channels"] * jnp.sum(jnp.square(grad_y)))
  if info["kind"] == "conv":
    m = info["batch"] * info["positions"]
    t_sq = info["stride"]  # product of the strides = T^2 for a square stride T
    return (
      error
      * v_sq
      * t_sq
      / (2.0 * info["kernel_locations"] * m * info["channels"] * jnp.sum(jnp.square(grad_y)))
    )
  # Normalization: dx*^2 = e^2 V^2 M s^4 / (C gamma^2 g^2); stored xhat = dx / s.
  xhat, inv, scale = stats["xhat"], stats["inv"], stats["scale"]
  m = info["reduction"]
  c = xhat.size / m
  gamma_sq = jnp.broadcast_to(jnp.square(scale), xhat.shape)
  g_sq = jnp.broadcast_to(jnp.square(grad_scale), xhat.shape)
  per_value = error * v_sq * m / (c * jnp.maximum(gamma_sq * g_sq, 1e-30) * jnp.square(inv))
  if not scale_bound or grad_scale is None or not info.get("has_scale", True):
    return jnp.min(per_value)
  # Beyond Table 1 (which bounds only the input gradient, and warns that BN's own
  # parameter gradients are unbounded): d gamma = sum over `terms` values of
  # dY * xhat, so its error is at most terms * dx^2 * ||dY||^2 (Cauchy-Schwarz);
  # keep it below e^2 V^2 / 2 as for a dense layer.
  terms = xhat.size / max(int(grad_scale.size), 1)
  param = error * v_sq / (2.0 * terms * jnp.maximum(jnp.sum(jnp.square(grad_y)), 1e-30))
  return jnp.minimum(jnp.min(per_value), param)


def bits_for_levels(levels_sq: float, signed: bool = False) -> int | None:
  """The smallest width of jact's quantizer (`SUPPORTED_BITS`: 1..8, 16)
  with 2^b - 1 >= sqrt(levels_sq) -- or, `signed` (fixed point), of
  `Fixpoint` (2..16, each stored in exactly b bits) with
  2^(b-1) - 1 >= sqrt(levels_sq); None if wider than 16 (kept exact).

  >>> bits_for_levels(9.0, signed=True), bits_for_levels(1e6, signed=True), bits_for_levels(1e6)
  (3, 11, 16)
  """
  if not np.isfinite(levels_sq):
    return None
  need = math.sqrt(max(float(levels_sq), 0.0))
  for b in FIXPOINT_BITS if signed else packing.SUPPORTED_BITS:
    levels = (1 << (b - 1)) - 1 if signed else (1 << b) - 1
    if levels >= max(need, 1e-30 if signed else 0.0):
      return b
  return None


def _is_fixpoint(compressor) -> bool:
  """Whether `compressor` is a max-abs fixed-point method (possibly inside ZVC)."""
  if isinstance(compressor, ZeroValue):
    return compressor.inner is None or isinstance(compressor.inner, Fixpoint)
  return isinstance(compressor, Fixpoint)


class ErrorBounded(NamedTuple):
  """init(params, batch, key) -> state; update(state, params, batch, key) -> state;
  plan(state) -> BitPlan."""

  init: Callable[..., ACGCState]
  update: Callable[..., ACGCState]
  plan: Callable[[ACGCState], BitPlan]


def error_bounded(
  loss_fn: Callable[..., Any],
  *,
  error: float = 0.5,
  window: int = 10,
  summary: str = "mean",
  compressor=None,
  scale_bound: bool = False,
) -> ErrorBounded:
  """AC-GC bounds as an estimator producing a `BitPlan`.

  Args:
    loss_fn: `loss_fn(params, batch, key) -> scalar` written with jact ops
      called at the top level (not inside scan / checkpoint / compressed).
    error: e^2, the allowed relative loss increase (AC-GC's default 0.5).
    window: recalculations summarized (10 in AC-GC).
    summary: "mean" (AC-GC's choice, more compression) or "max".
    compressor: None (plan entries are widths of jact's per-group
      quantizer), or a compressor whose `with_bits` the widths are applied to:
      for `Fixpoint` / `ZeroValue(Fixpoint(...))` the widths follow the
      fixed-point error bound (see the module docstring).
    scale_bound: also bound each normalization's scale gradient (jact's
      addition to Table 1; off: the paper's bounds).
  """
  if compressor is not None and not hasattr(compressor, "with_bits"):
    raise TypeError(f"compressor must be a jact.compressors compressor, got {compressor!r}")
  signed = compressor is not None and _is_fixpoint(compressor)
  if not error > 0:
    raise ValueError(f"error (e^2) must be positive, got {error!r}")
  if summary not in ("mean", "max"):
    raise ValueError(f"summary must be 'mean' or 'max', got {summary!r}")
  if not isinstance(window, int) or window < 1:
    raise ValueError(f"window must be a positive int, got {window!r}")

  def init(params, batch, key) -> ACGCState:
    names = tuple(sorted(find_residuals(loss_fn, params, batch, key)))
    return ACGCState(
      jnp.full((window, len(names)), jnp.nan, jnp.float32), jnp.zeros((), jnp.int32), names
    )

  @jax.jit
  def update(state: ACGCState, params, batch, key) -> ACGCState:
    probes = collect_layer_stats(loss_fn, params, batch, key)
    g_params, g_probes, info, stats = collect_layer_stats(loss_fn, params, batch, key, probes)
    v_sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(g_params))
    row = []
    for name in state.names:
      if name not in info:
        row.append(jnp.float32(jnp.nan))
        continue
      grad_scale = None
      if info[name]["kind"] not in ("dense", "conv"):
        xhat = stats[name]["xhat"]
        gy = g_probes[name].astype(jnp.float32)
        red = info[name]["reduction_axes"]
        # d gamma = sum of dy * xhat over the non-feature axes (the parameter's gradient)
        grad_scale = jnp.sum(
          gy * xhat, axis=_param_axes(xhat.ndim, red, info[name]["kind"]), keepdims=True
        )
      tol = tolerance(info[name], stats[name], g_probes[name], grad_scale, v_sq, error, scale_bound)
      spread = stats[name]["abs_max"] if signed else stats[name]["range_max"]
      row.append(jnp.square(spread) / (4.0 * tol))
    slot = state.count % window
    return dataclasses.replace(
      state, levels_sq=state.levels_sq.at[slot].set(jnp.stack(row)), count=state.count + 1
    )

  def plan(state: ACGCState) -> BitPlan:
    history = np.asarray(state.levels_sq, np.float64)
    filled = min(int(state.count), window)
    if filled == 0:
      raise ValueError("no statistics yet: call update at least once before plan")
    bits = {}
    for i, name in enumerate(state.names):
      column = history[:filled, i] if int(state.count) <= window else history[:, i]
      if np.all(np.isnan(column)):
        continue  # no bound for this residual: its call site decides
      value = np.nanmean(column) if summary == "mean" else np.nanmax(column)
      b = bits_for_levels(value, signed)
      bits[name] = compressor.with_bits(b) if compressor is not None and b is not None else b
    return BitPlan(bits)

  return ErrorBounded(init, update, plan)


def _param_axes(ndim: int, reduction_axes, kind: str):
  """Axes summed to get the scale's gradient: batch norm sums over its reduction
  axes; layer / RMS norm (scale over the last axis) over every other axis."""
  if kind == "batch_norm":
    return tuple(reduction_axes)
  return tuple(range(ndim - 1))
