"""Layer statistics for the analytic estimators (ActNN, AC-GC).

While a `Collector` is active, the compressed dense/conv and normalization
ops report, per residual name, what the closed-form variance and error
formulas need: the output gradient (through a zero *probe* added to the op
output, whose gradient is the output's), per-sample squared group ranges of
the stored residual, and the normalization scale and statistics. Values are
returned from the traced loss as auxiliary outputs, so the ops must be called
at the top level of the loss (not inside `lax.scan`, `jax.checkpoint` or
`jact.compressed`, whose inner traces cannot hand values out).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jact._engine import context as _context
from jact._core.quantize import group_ranges_sq
from jact.compressors import PerGroup

__all__ = [
  "Collector",
  "abs_max",
  "group_ranges_sq",
  "group_size_of",
  "observe_linear",
  "observe_norm",
]


class Collector:
  """Per-name layer info (static), forward statistics and probes of one trace.

  probes: name -> zero array added to the op output (None while discovering).
  """

  def __init__(self, probes: dict[str, jax.Array] | None = None):
    self.probes = probes
    self.info: dict[str, dict[str, Any]] = {}
    self.stats: dict[str, dict[str, jax.Array]] = {}
    self.shapes: dict[str, tuple[tuple[int, ...], Any]] = {}

  def probe(self, name: str, y: jax.Array) -> jax.Array:
    if name in self.shapes:
      raise ValueError(
        f"residual {name!r} is produced by two op calls: give every jact op its own "
        "name= so analytic estimators can tell the layers apart"
      )
    self.shapes[name] = (tuple(y.shape), y.dtype)
    if self.probes is None or name not in self.probes:
      return y
    return y + self.probes[name].astype(y.dtype)


def abs_max(x: jax.Array) -> jax.Array:
  """The largest finite |x| (the scale of a max-abs fixed-point quantizer)."""
  a = jnp.abs(jax.lax.stop_gradient(x).astype(jnp.float32))
  return jnp.max(jnp.where(jnp.isfinite(a), a, 0.0))


def observe_linear(
  collector: Collector,
  name: str,
  kind: str,
  x: jax.Array,
  y: jax.Array,
  *,
  group_size: int,
  kernel_locations: int = 1,
  stride: int = 1,
  feature_groups: int = 1,
) -> jax.Array:
  """Records a dense ('dense') or channels-last convolution ('conv') whose
  stored residual `name` is its input x; returns y with the probe added."""
  ranges_sq, range_max, g = group_ranges_sq(x, group_size)
  positions = max(1, x.size // (x.shape[0] * x.shape[-1])) if x.ndim >= 2 else 1
  collector.info[name] = dict(
    kind=kind,
    group_size=g,
    positions=positions,
    kernel_locations=kernel_locations,
    stride=stride,
    feature_groups=feature_groups,
    batch=x.shape[0] if x.ndim else 1,
    channels=x.shape[-1] if x.ndim else 1,
    samples_quantized=ranges_sq.shape[0],
  )
  collector.stats[name] = dict(ranges_sq=ranges_sq, range_max=range_max, abs_max=abs_max(x))
  return collector.probe(name, y)


def observe_norm(
  collector: Collector,
  name: str,
  kind: str,
  xhat: jax.Array,
  inv: jax.Array,
  scale,
  y: jax.Array,
  *,
  reduction_axes,
  group_size: int,
) -> jax.Array:
  """Records a batch/layer norm whose stored residual `name` is xhat = (x - mean) * inv."""
  xhat = jax.lax.stop_gradient(xhat).astype(jnp.float32)
  ranges_sq, range_max, g = group_ranges_sq(xhat, group_size)
  m = math.prod(xhat.shape[a] for a in reduction_axes)
  collector.info[name] = dict(
    kind=kind,
    group_size=g,
    reduction=m,
    batch=xhat.shape[0],
    samples_quantized=ranges_sq.shape[0],
    reduction_axes=tuple(reduction_axes),
    has_scale=scale is not None,
  )
  collector.stats[name] = dict(
    ranges_sq=ranges_sq,
    range_max=range_max,
    abs_max=abs_max(xhat),
    xhat=xhat,
    inv=jax.lax.stop_gradient(jnp.broadcast_to(inv, xhat.shape)).astype(jnp.float32),
    scale=(
      jnp.ones((), jnp.float32)
      if scale is None
      else jax.lax.stop_gradient(scale).astype(jnp.float32)
    ),
  )
  return collector.probe(name, y)


def active() -> Collector | None:
  return _context.current("stats")


def group_size_of(compressor) -> int:
  """The group size a stored activation's ranges are measured with: the
  per-group quantizer's own, its default (256) for any other compressor."""
  return compressor.group_size if isinstance(compressor, PerGroup) else PerGroup().group_size
