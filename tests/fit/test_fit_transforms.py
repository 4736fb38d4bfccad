"""`jact.fit` finds `jact.segment` blocks behind JAX transformations: inside `lax.scan`, an
inner `jax.jit` or `jax.checkpoint`, and `jax.vmap` (each configured trace re-traces them)."""

import jax
import jax.numpy as jnp
import pytest

import jact
from jact._fit.search import _discover
from jact._fit.segments import Layout
from jact._fit.steps import configure, step_peak

N = 4


def mlp(w, x):
  return x + jnp.tanh(x @ w[0]) @ w[1]


def _weights():
  return [(jnp.eye(64, 256) / 2, jnp.eye(256, 64) / 2) for _ in range(N)]


SEGMENTS = [jact.segment(mlp, name=f"b{i}", compress_argnums=(1,)) for i in range(N)]
SCANNED = jact.segment(mlp, name="layer", compress_argnums=(1,))


def scan_loss(w, x):
  x, _ = jax.lax.scan(lambda c, wi: (SCANNED(wi, c), None), x, w)
  return jnp.sum(x**2)


def jit_loss(ws, x):
  for s, w in zip(SEGMENTS, ws):
    x = jax.jit(s)(w, x)
  return jnp.sum(x**2)


def checkpoint_loss(ws, x):
  for s, w in zip(SEGMENTS, ws):
    x = jax.checkpoint(s)(w, x)
  return jnp.sum(x**2)


def vmap_loss(ws, x):
  x = x.reshape(8, -1, 64)
  for s, w in zip(SEGMENTS, ws):
    x = jax.vmap(s, in_axes=(None, 0))(w, x)
  return jnp.sum(x**2)


X = jax.ShapeDtypeStruct((1024, 64), jnp.float32)
STACKED = jax.tree.map(lambda *a: jnp.stack(a), *_weights())
CASES = {
  "scan": (scan_loss, STACKED, ("layer",)),
  "jit": (jit_loss, _weights(), tuple(f"b{i}" for i in range(N))),
  "vmap": (vmap_loss, _weights(), tuple(f"b{i}" for i in range(N))),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_fit_meets_a_budget_through_the_transformation(kind):
  # The budget: the compiled peak of every segment residual at 4 bits (reachable, below the
  # step as written); fit must find the segments and return a configuration within it.
  loss, w, names = CASES[kind]
  sites, found = _discover(loss, (w, X), Layout())
  assert tuple(found.order) == names
  assert sites and all(any(n.startswith(s + ".") for s in names) for n in sites)
  written = step_peak(configure(loss, None, None), (w, X), (0,))
  plan = jact.BitPlan({n: 4 for n in sites})
  budget = step_peak(configure(loss, Layout(), plan, strict=True), (w, X), (0,))
  assert budget < written, (budget, written)
  result = jact.fit(loss, w, X, budget_bytes=budget, max_candidates=3)
  assert result.peak_bytes <= budget
  assert set(result.segments) == set(names)
  assert result.plan and all(any(n.startswith(s + ".") for s in names) for n in result.plan)


def test_segments_behind_jax_checkpoint_are_found():
  # An outer jax.checkpoint keeps no residual of its own, so compression cannot lower this
  # step; fit must still see the marked blocks (not ask to mark them) and say what it reached.
  w = _weights()
  _, found = _discover(checkpoint_loss, (w, X), Layout())
  assert tuple(found.order) == tuple(f"b{i}" for i in range(N))
  written = step_peak(configure(checkpoint_loss, None, None), (w, X), (0,))
  assert jact.fit(checkpoint_loss, w, X, budget_bytes=written).segments == tuple(found.order)
  with pytest.raises(jact.FitError) as e:
    jact.fit(checkpoint_loss, w, X, budget_bytes=written // 4, max_candidates=1)
  assert "mark the model's blocks" not in str(e.value)


def test_a_jitted_segment_outside_fit_is_still_the_plain_function():
  w, x = _weights()[0], jnp.ones((8, 64))
  assert (jax.jit(SEGMENTS[0])(w, x) == mlp(w, x)).all()
