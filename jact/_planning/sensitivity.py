"""Sensitivity estimators: how much each compressed residual adds to the gradient's variance.

Var[gradient] = sampling variance + sum_l c_l S(b_l), S(b) = (2^b - 1)^-2;
the estimators give the c_l, the allocators (`jact.allocate`) the widths.
`numeric` is GACT's Algorithm 1 (one gradient per residual), `analytic`
ActNN's closed forms from one gradient pass. Both are optax-style
`init` / `update` pairs over a small state. The theory and the estimators'
details: docs/design.md, "Sensitivity estimators".

>>> import jax, jax.numpy as jnp, jact
>>> def loss(w, x, key):
...   k1, k2 = jax.random.split(key)
...   h = jnp.tanh(jact.ops.dense(x, w[0], key=k1, name="fc1"))
...   return jnp.sum(jact.ops.dense(h, w[1], key=k2, name="fc2") ** 2)
>>> w = (jnp.ones((256, 256)) / 16, jnp.ones((256, 8)) / 16)
>>> x = jax.random.normal(jax.random.key(1), (16, 256))
>>> est = jact.sensitivity.numeric(loss)
>>> state = est.init(w, x, jax.random.key(2))
>>> state.names
('fc1.lhs', 'fc2.lhs')
>>> state = est.update(state, w, x, jax.random.key(3))
>>> bool((state.sensitivity > 0).all())
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jact import _compat
from jact._engine import context as _context, probe as _probe
from jact.compressors import PerGroup
from jact._planning.plan import BitPlan, use_plan

__all__ = [
  "SensitivityState",
  "Estimator",
  "find_residuals",
  "numeric",
  "analytic",
  "normalization_producers",
  "predicted_variance",
  "sampling_variance",
  "variance_factors",
]


def variance_factors(bits) -> np.ndarray:
  """S(b) = (2^b - 1)^-2 per width (0 for None / 32: uncompressed)."""
  return np.array([0.0 if b in (None, 32) else (2.0**b - 1.0) ** -2 for b in bits])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SensitivityState:
  """Estimator state: a moving average of c_l per residual name.

  Attributes:
    sensitivity: float32[L], c_l (NaN where an estimator has no formula).
    grad_sq: float32[L], moving average of the squared output-gradient norm
      per sample (analytic estimator; zeros for the numeric one).
    count: int32, number of updates so far.
    names, sizes, bits: static residual names, their numbers of values and
      their call sites' widths or compressors (what `numeric` probes them with
      follows from these, so `update` needs nothing but the state).
    follows: per name, the residual whose width it takes instead of being
      allocated one (the analytic estimator's normalizations), or None;
      empty: every residual is allocated on its own.
  """

  sensitivity: jax.Array
  grad_sq: jax.Array
  count: jax.Array
  names: tuple[str, ...] = dataclasses.field(metadata=dict(static=True))
  sizes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  bits: tuple[Any, ...] = dataclasses.field(metadata=dict(static=True))
  follows: tuple[str | None, ...] = dataclasses.field(default=(), metadata=dict(static=True))

  def as_dict(self) -> dict[str, float]:
    return dict(zip(self.names, np.asarray(self.sensitivity).tolist()))


class Estimator(NamedTuple):
  """init(params, batch, key) -> state; update(state, params, batch, key) -> state.

  Both are pure: everything an update needs is in the state it is given (no
  cache in the estimator), so either may be called under jit, and a state
  from one estimator (or a checkpoint) updates the same in another built
  with the same settings.
  """

  init: Callable[..., SensitivityState]
  update: Callable[..., SensitivityState]


def find_residuals(
  loss_fn: Callable[..., Any], params, batch, key, *, plan: BitPlan | None = None
) -> dict[str, _context.Site]:
  """The compressed residuals of `loss_fn`'s gradient: name -> Site (shape, dtype, bits).

  Traces only (no computation). Masks and other lossless residuals are not listed.
  """
  with _context.recording() as recorder, use_plan(plan):
    # A fresh function: jit's trace cache would skip the trace (and the recording).
    jax.eval_shape(lambda *a: jax.grad(loss_fn)(*a), params, batch, key)
  if not recorder.sites:
    raise ValueError(
      "no compressed residuals found: the loss must use jact ops or jact.compressed "
      "with bits set (a residual kept uncompressed has no sensitivity to estimate)"
    )
  return dict(recorder.sites)


def _ema(state: SensitivityState, c, grad_sq, decay: float) -> SensitivityState:
  first = state.count == 0
  mix = lambda old, new: jnp.where(first, new, decay * old + (1.0 - decay) * new)
  return dataclasses.replace(
    state,
    sensitivity=mix(state.sensitivity, c),
    grad_sq=mix(state.grad_sq, grad_sq),
    count=state.count + 1,
  )


def _empty_state(sites, follows: dict[str, str] | None = None) -> SensitivityState:
  names = tuple(sorted(sites))
  n = len(names)
  return SensitivityState(
    jnp.zeros((n,), jnp.float32),
    jnp.zeros((n,), jnp.float32),
    jnp.zeros((), jnp.int32),
    names,
    tuple(sites[k].size for k in names),
    tuple(sites[k].bits for k in names),
    tuple(follows.get(k) for k in names) if follows else (),
  )


def _sq_norm(tree) -> jax.Array:
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def _check_decay(decay):
  if not 0.0 <= decay < 1.0:
    raise ValueError(f"decay must be in [0, 1), got {decay!r}")


# ----------------------------------------------------------------------------- GACT numeric


def numeric(
  loss_fn: Callable[..., Any],
  *,
  probe_bits: int = 4,
  decay: float = 0.9,
  chunk_size: int | None = None,
) -> Estimator:
  """GACT's numeric sensitivity (Algorithm 1): one gradient per residual variant.

  Args:
    loss_fn: `loss_fn(params, batch, key) -> scalar` using jact compression.
    probe_bits: width every residual is quantized to while estimating (c_l
      does not depend on it to first order; higher is more linear).
    decay: moving-average decay of the estimates.
    chunk_size: how many residual variants are differentiated in one
      computation (memory and compile time grow with it); None: one at a time.

  Cost of one update: 1 + L gradient evaluations (L residuals). Called
  eagerly (as `jact.Controller` does), the variants are dispatched as
  `L / chunk_size` calls of one compiled function, each chunk unrolled; under
  an enclosing `jit` they are a `jax.lax.map` (XLA:CPU runs convolutions inside
  a loop body about 20x slower than the same convolutions unrolled, so the
  eager form is the fast one there; both give the same estimate).
  """
  _check_decay(decay)
  if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
    raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
  grad_fn = jax.grad(loss_fn)

  def init(params, batch, key) -> SensitivityState:
    return _empty_state(find_residuals(loss_fn, params, batch, key))

  def grads(state, params, batch, key, salt):
    # Sensitivity is measured for the per-group stochastic quantizer: a site with
    # another (possibly deterministic) compressor is probed with PerGroup.
    probe = BitPlan(
      {
        n: probe_bits if isinstance(b, (int, PerGroup)) else PerGroup(probe_bits)
        for n, b in zip(state.names, state.bits)
      }
    )
    with use_plan(probe), _context.salted(state.names, salt):
      return grad_fn(params, batch, key)

  def reference(state, params, batch, key):
    return grads(state, params, batch, key, jnp.zeros((len(state.names),), jnp.uint32))

  def spread(state, g0, params, batch, key, salt):
    g1 = grads(state, params, batch, key, salt)
    return 0.5 * _sq_norm(jax.tree.map(jnp.subtract, g1, g0))

  def redraws(n):
    # Variant l re-draws residual l's rounding noise only.
    return jnp.uint32(0x2545F491) * jnp.eye(n, dtype=jnp.uint32)

  def finish(state, sq):
    c = sq / jnp.float32((2.0**probe_bits - 1.0) ** -2)
    return _ema(state, c, jnp.zeros_like(c), decay)

  @jax.jit
  def update_traced(state, params, batch, key):
    g0 = reference(state, params, batch, key)
    sq = jax.lax.map(
      lambda salt: spread(state, g0, params, batch, key, salt),
      redraws(len(state.names)),
      batch_size=chunk_size,
    )
    return finish(state, sq)

  @jax.jit
  def spread_chunk(state, g0, params, batch, key, salts):
    return jnp.stack([spread(state, g0, params, batch, key, s) for s in salts])

  # One compiled gradient serves the reference and every variant (one at a
  # time), so an update compiles the model's gradient once, not twice.
  grads_jit, finish_jit = jax.jit(grads), jax.jit(finish)
  half_sq_distance = jax.jit(lambda g1, g0: 0.5 * _sq_norm(jax.tree.map(jnp.subtract, g1, g0)))

  def update(state: SensitivityState, params, batch, key) -> SensitivityState:
    if any(map(_compat.is_tracer, jax.tree.leaves((state, params, batch, key)))):
      return update_traced(state, params, batch, key)
    n = len(state.names)
    g0 = grads_jit(state, params, batch, key, jnp.zeros((n,), jnp.uint32))
    salts = redraws(n)
    if (chunk_size or 1) == 1:
      sq = jnp.stack(
        [half_sq_distance(grads_jit(state, params, batch, key, salts[i]), g0) for i in range(n)]
      )
    else:
      sq = jnp.concatenate(
        [
          spread_chunk(state, g0, params, batch, key, salts[i : i + chunk_size])
          for i in range(0, n, chunk_size)
        ]
      )
    return finish_jit(state, sq)

  return Estimator(init, update)


# ----------------------------------------------------------------------------- ActNN analytic


def _linear_factor(info) -> float:
  """G/6 * K/(I*A) of ActNN Eq. 9 (dense) and B.1 (conv)."""
  return (
    info["group_size"]
    / 6.0
    * info["kernel_locations"]
    / (info["positions"] * info["feature_groups"])
  )


def _layer_sensitivity(info, stats, grad) -> tuple[jax.Array, jax.Array]:
  """(c for the whole tensor at the measured gradient, mean per-sample ||grad||^2)."""
  g = info["group_size"]
  grad = grad.astype(jnp.float32)
  per_sample_grad = jnp.sum(jnp.square(grad).reshape(grad.shape[0], -1), axis=1)
  if info["kind"] in ("dense", "conv"):
    # ActNN Eq. 9 (dense) and B.1 (conv): G/6 * K/(I*A) * sum_n ||grad_n||^2 ||R_n||^2,
    # I = positions per sample (1 for a plain dense layer), K = kernel locations.
    ranges_sq = stats["ranges_sq"]
    if ranges_sq.shape[0] != per_sample_grad.shape[0]:  # small samples grouped as one row
      total = jnp.sum(ranges_sq) * jnp.mean(per_sample_grad)
    else:
      total = jnp.sum(ranges_sq * per_sample_grad)
    return _linear_factor(info) * total, jnp.mean(per_sample_grad)
  # Normalization storing xhat (jact.ops._norm): first-order error of the parameter and
  # input gradients, per element: v * (g^2 + inv^2 (a^2 + h^2 / M)), v = R_group^2 / 6.
  xhat, inv, scale = stats["xhat"], stats["inv"], stats["scale"]
  red = info["reduction_axes"]
  h = grad * scale
  a = jnp.mean(h * xhat, axis=red, keepdims=True)
  weight = jnp.square(grad) + jnp.square(inv) * (jnp.square(a) + jnp.square(h) / info["reduction"])
  mean_weight = jnp.mean(weight)
  # sum_e v_e w_e ~ (sum over groups of G R^2 / 6) * mean(w)
  return g / 6.0 * jnp.sum(stats["ranges_sq"]) * mean_weight, jnp.mean(per_sample_grad)


def analytic_per_sample(loss_fn: Callable[..., Any]) -> Callable[..., dict]:
  """ActNN's per-sample sensitivities w_n^(l) of one batch (Eq. 9 / B.1, not summed over n).

  Returns a jitted `f(params, batch, key) -> {name: float32[N]}` over the
  dense and conv residuals whose group ranges are measured per sample (not
  small samples grouped into one row); one gradient pass. ActNN's joint
  layer x sample allocation (`jact.allocate.allocate_layers_and_samples`)
  takes them.
  """

  @jax.jit
  def per_sample(params, batch, key):
    probes = collect_layer_stats(loss_fn, params, batch, key)
    _, g_probes, info, stats = collect_layer_stats(loss_fn, params, batch, key, probes)
    out = {}
    for name, layer in info.items():
      grad = g_probes[name].astype(jnp.float32)
      ranges_sq = stats[name]["ranges_sq"]
      if layer["kind"] not in _LINEAR_KINDS or ranges_sq.shape[0] != grad.shape[0]:
        continue
      grad_sq = jnp.sum(jnp.square(grad).reshape(grad.shape[0], -1), axis=1)
      out[name] = _linear_factor(layer) * ranges_sq * grad_sq
    return out

  return per_sample


def _discover_layers(loss_fn, params, batch, key) -> _probe.Collector:
  """A shape-only trace of the loss with a probe-less collector: the observed ops, in
  forward order (`info`), and their output shapes."""
  collector = _probe.Collector(None)
  with _context.collecting(collector):
    jax.eval_shape(lambda *a: loss_fn(*a), params, batch, key)  # fresh: no trace-cache hit
  return collector


def collect_layer_stats(loss_fn, params, batch, key, probes=None):
  """One gradient pass with probes: (param grads, probe grads, info, stats)."""

  def with_probes(params, probes):
    collector = _probe.Collector(probes)
    with _context.collecting(collector):
      loss = loss_fn(params, batch, key)
    return loss, (collector.info, collector.stats)

  if probes is None:
    shapes = _discover_layers(loss_fn, params, batch, key).shapes
    return {n: jnp.zeros(s, d) for n, (s, d) in shapes.items()}
  try:
    (g_params, g_probes), (info, stats) = jax.grad(with_probes, argnums=(0, 1), has_aux=True)(
      params, probes
    )
  except jax.errors.UnexpectedTracerError as e:
    raise ValueError(
      "analytic estimators need the jact ops at the top level of the loss (not inside "
      "lax.scan, jax.checkpoint or jact.compressed); use jact.sensitivity.numeric there"
    ) from e
  return g_params, g_probes, info, stats


def normalization_producers(kinds: Sequence[tuple[str, str]]) -> dict[str, str]:
  """ActNN's width rule for normalizations: name -> the residual whose width it takes.

  `kinds` lists (residual name, op kind) in forward order. ActNN's code
  (`QBNScheme`) gives a batch norm the bits of the last quantized conv/linear
  layer that ran before it -- the layer that produced its input -- and leaves
  it out of the per-layer allocation. A normalization with no dense/conv
  layer before it (jact's models may keep the stem exact, where ActNN's
  compress it) takes the width of the first one after it instead, so it stays
  inside the budget (ActNN's fallback, 8 bits, would spend a fifth of a
  ResNet-20's 2-bit budget on one tensor).

  >>> normalization_producers([("bn0", "batch_norm"), ("conv0", "conv"),
  ...                          ("bn1", "batch_norm"), ("fc", "dense")])
  {'bn0': 'conv0', 'bn1': 'conv0'}
  """
  linear = [i for i, (_, kind) in enumerate(kinds) if kind in _LINEAR_KINDS]
  follows = {}
  for i, (name, kind) in enumerate(kinds):
    if kind in _LINEAR_KINDS or not linear:
      continue
    before = [j for j in linear if j < i]
    follows[name] = kinds[before[-1] if before else linear[0]][0]
  return follows


_LINEAR_KINDS = ("dense", "conv")


def analytic(loss_fn: Callable[..., Any], *, decay: float = 0.9) -> Estimator:
  """ActNN's analytic sensitivity for dense, conv and normalization residuals.

  One gradient pass per update. The squared output-gradient norm per sample
  is kept as a moving average (ActNN Sec. 4.3); residuals of other ops get
  NaN (not estimated). Normalizations are estimated too (their closed form
  is reported) but take their producer's width (`normalization_producers`).
  """
  _check_decay(decay)

  def init(params, batch, key) -> SensitivityState:
    sites = find_residuals(loss_fn, params, batch, key)
    layers = _discover_layers(loss_fn, params, batch, key).info
    kinds = [(name, info["kind"]) for name, info in layers.items() if name in sites]
    return _empty_state(sites, normalization_producers(kinds))

  @jax.jit
  def update(state: SensitivityState, params, batch, key) -> SensitivityState:
    probes = collect_layer_stats(loss_fn, params, batch, key)
    _, g_probes, info, stats = collect_layer_stats(loss_fn, params, batch, key, probes)
    c, gsq = [], []
    for name in state.names:
      if name not in info:
        c.append(jnp.float32(jnp.nan))
        gsq.append(jnp.float32(0.0))
        continue
      total, mean_grad = _layer_sensitivity(info[name], stats[name], g_probes[name])
      c.append(total)
      gsq.append(mean_grad)
    c, gsq = jnp.stack(c), jnp.stack(gsq)
    # Moving average of the gradient magnitude: c scales with it linearly.
    new = _ema(state, c, gsq, decay)
    scaled = jnp.where(gsq > 0, c * new.grad_sq / jnp.where(gsq > 0, gsq, 1.0), c)
    first = state.count == 0
    sensitivity = jnp.where(first, scaled, decay * state.sensitivity + (1 - decay) * scaled)
    return dataclasses.replace(new, sensitivity=sensitivity)

  return Estimator(init, update)


# ----------------------------------------------------------------------------- variance


def predicted_variance(state: SensitivityState, plan: BitPlan) -> float:
  """sum_l c_l S(b_l) for the plan's widths (per-sample budgets: their average)."""
  c = np.nan_to_num(np.asarray(state.sensitivity, np.float64))
  bits = []
  for n in state.names:
    avg = plan.budget_for(n)
    bits.append(avg if avg is not None else plan.bits_for(n, None))
  factors = np.array([0.0 if b in (None, 32) else (2.0**b - 1.0) ** -2 for b in bits])
  return float(np.sum(c * factors))


def sampling_variance(loss_fn: Callable[..., Any], params, batch, key) -> jax.Array:
  """Minibatch-sampling variance of the gradient, from two half batches.

  The two half-batch gradients g_a, g_b each have twice the full batch's
  variance, so E||g_a - g_b||^2 = 4 Var[g]. Every leaf of `batch` must have
  the batch on axis 0 (an even number of samples).
  """
  leaves = jax.tree.leaves(batch)
  n = leaves[0].shape[0]
  if n < 2 or any(x.shape[0] != n for x in leaves):
    raise ValueError(
      "sampling_variance needs every batch leaf to share a batch axis 0 of size >= 2"
    )
  half = n // 2
  a = jax.tree.map(lambda x: x[:half], batch)
  b = jax.tree.map(lambda x: x[half : 2 * half], batch)
  grad = jax.grad(loss_fn)
  ka, kb = jax.random.split(key)
  with use_plan(BitPlan(default=None)):  # exact gradients: sampling noise only
    ga, gb = grad(params, a, ka), grad(params, b, kb)
  return 0.25 * _sq_norm(jax.tree.map(jnp.subtract, ga, gb))
