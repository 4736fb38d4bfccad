"""`jact.fit`, `jact.segment` and `jact.largest_batch` on small stacks (compile-only budgets)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact._fit.model import Residual, allocate, stored_bytes
from jact._fit.segments import Layout
from jact._fit.steps import configure, step_peak
from jact._planning.plan import BitPlan

N = 8
# The searches below (remat, determinism, the smallest peak, largest_batch) check properties
# that do not depend on the depth: they run a stack half as deep, compiling about half as long.
SHORT = 4


def mlp(w, x):
  return x + jnp.tanh(x @ w[0]) @ w[1]


def stack(rematerializable: bool, n: int = N):
  argnums = (1,) if rematerializable else ()
  segs = [jact.segment(mlp, name=f"s{i}", compress_argnums=argnums) for i in range(n)]

  def loss(ws, x):
    for s, w in zip(segs, ws):
      x = s(w, x)
    return jnp.sum(x**2)

  return loss


def weights(hidden=256, n: int = N):
  return [(jnp.eye(64, hidden) * 0.5, jnp.eye(hidden, 64) * 0.5) for _ in range(n)]


X = jax.ShapeDtypeStruct((2048, 64), jnp.float32)


def peak_of(loss, plan, layout=None, n: int = N):
  layout = layout or Layout()
  return step_peak(configure(loss, layout, jact.BitPlan(plan)), (weights(n=n), X), (0,))


def test_allocation_gives_the_hand_computed_widths():
  # Two residuals of 1024 values, sensitivities 1e4 and 1; 1280 bytes (+ group stats) buy
  # 8 + 2 bits per value: the sensitive one gets 8, the other 2.
  table = [
    Residual("hot", 1024, 4, None, False, 1e4),
    Residual("cold", 1024, 4, None, False, 1.0),
  ]
  stats = 2 * 4 * 4  # 4 groups of 256 values, 4 bytes each, per residual
  c = allocate(table, {}, Layout(), 1024 + 256 + stats, (1, 2, 4, 8, None))
  assert dict(c.widths) == {"hot": 8, "cold": 2}
  assert c.stored == stored_bytes(table[0], 8) + stored_bytes(table[1], 2)
  assert c.variance == pytest.approx(1e4 / 255**2 + 1 / 9)
  assert allocate(table, {}, Layout(), 100, (1, 2, 4, 8, None)) is None  # below 1 bit each


def test_fit_gives_the_known_bits_and_respects_the_budget():
  loss = stack(rematerializable=False)
  hot = {f"s{i}" for i in range(4)}
  names = [f"s{i}.{p}" for i in range(N) for p in (3, 4)]  # the input is kept by reference
  sensitivity = {n: (1e6 if n.split(".")[0] in hot else 1.0) for n in names}
  known = {n: (8 if n.split(".")[0] in hot else 2) for n in names}
  budget = peak_of(loss, known)
  result = jact.fit(loss, weights(), X, budget_bytes=budget, sensitivity=sensitivity, widths=(2, 8))
  assert dict(result.plan.entries) == known
  assert result.peak_bytes <= budget and result.remat == ()
  assert result.compilations <= 2 + 6


@pytest.fixture(scope="module")
def remat_fit():
  """A budget that compression alone cannot meet, fitted on real arrays (sensitivities
  measured): the remat test reads the result, the determinism test fits it once more. Eight
  segments: at four, jax 0.12's XLA:CPU schedules remat at 8 bits above 2 bits everywhere."""
  loss = stack(rematerializable=True, n=N)
  remat_8 = {}
  layout = Layout(frozenset(f"s{i}" for i in range(N)))
  for i in range(N):
    remat_8[f"s{i}.remat.2"] = 8
    remat_8.update({f"s{i}.remat.body.{p}": 8 for p in (3, 4)})
  everything_remat = peak_of(loss, remat_8, layout, n=N)
  two_bits = peak_of(loss, {f"s{i}.{p}": 2 for i in range(N) for p in (2, 3, 4)}, n=N)
  assert everything_remat < two_bits  # the premise: remat at 8 bits beats 2 bits everywhere
  budget = (everything_remat + two_bits) // 2
  args = (weights(n=N), jax.random.normal(jax.random.key(0), X.shape))
  return loss, args, budget, jact.fit(loss, *args, budget_bytes=budget)


def test_fit_rematerializes_when_compression_alone_does_not_fit(remat_fit):
  _, _, budget, result = remat_fit
  assert result.remat, result.report()
  assert result.peak_bytes <= budget
  for s in result.remat:
    assert f"{s}.remat.2" in dict(result.plan.entries)
    assert f"{s}.2" not in dict(result.plan.entries)
  assert "rematerialized: s" in result.report()


def test_fit_is_deterministic(remat_fit):
  loss, args, budget, a = remat_fit
  b = jact.fit(loss, *args, budget_bytes=budget)
  assert (a.plan, a.remat, a.peak_bytes, a.predicted_variance) == (
    b.plan,
    b.remat,
    b.peak_bytes,
    b.predicted_variance,
  )


@pytest.fixture(scope="module")
def below_smallest():
  """fit's refusal of a budget below the smallest reachable peak (one search for both tests)."""
  loss = stack(rematerializable=True, n=SHORT)
  with pytest.raises(jact.FitError, match="smallest compiled peak") as e:
    jact.fit(loss, weights(n=SHORT), X, budget_bytes=10_000)
  return loss, e.value


def test_a_budget_below_the_smallest_reachable_peak_says_so(below_smallest):
  _, error = below_smallest
  assert error.smallest_peak_bytes > 10_000
  assert error.written_peak_bytes > error.smallest_peak_bytes


@pytest.mark.slow
def test_at_the_smallest_reachable_peak_something_fits(below_smallest):
  loss, error = below_smallest
  smallest = error.smallest_peak_bytes
  result = jact.fit(loss, weights(n=SHORT), X, budget_bytes=smallest, max_candidates=1)
  assert result.peak_bytes <= smallest


def test_a_budget_the_written_step_fits_keeps_it():
  loss = stack(rematerializable=True)
  budget = 2 * step_peak(configure(loss, None, None), (weights(), X), (0,))
  result = jact.fit(loss, weights(), X, budget_bytes=budget)
  assert result.plan == jact.BitPlan({}) and result.remat == ()
  assert result.peak_bytes == result.written_peak_bytes and result.compilations <= 3


def test_the_configured_gradient_is_close_to_exact_at_8_bits():
  loss = stack(rematerializable=True)
  w = weights()
  x = jax.random.normal(jax.random.key(0), (2048, 64))
  exact = jax.grad(loss)(w, x)
  budget = int(0.7 * step_peak(configure(loss, None, None), (w, x), (0,)))
  result = jact.fit(loss, w, x, budget_bytes=budget, widths=(8,))
  got = jax.jit(jax.grad(result.loss_fn))(w, x, key=jax.random.key(3))
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(exact)):
    np.testing.assert_allclose(g, e, rtol=0.02, atol=0.02 * float(jnp.abs(e).max()))


def test_a_segment_outside_fit_is_the_plain_function():
  seg = jact.segment(mlp, name="block", compress_argnums=(1,))
  w = weights()[0]
  x = jax.random.normal(jax.random.key(1), (8, 64))
  assert (seg(w, x) == mlp(w, x)).all()
  grad = lambda f: jax.grad(lambda w: f(w, x).sum())(w)
  assert all((a == b).all() for a, b in zip(grad(seg), grad(mlp)))


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(budget_bytes=-1), "positive"),
    (dict(budget_bytes=1e6), "int number of bytes"),
    (dict(budget_bytes=10**6, widths=(3,)), "widths"),
    (dict(budget_bytes=10**6, widths=(None,)), "compressed one"),
    (dict(budget_bytes=10**6, max_candidates=0), "max_candidates"),
  ],
)
def test_bad_arguments_name_the_fix(kwargs, message):
  with pytest.raises((ValueError, TypeError), match=message):
    jact.fit(stack(True), weights(), X, **kwargs)


@pytest.mark.parametrize("name", ["", "a.remat", "b."])
def test_bad_segment_names_are_refused(name):
  with pytest.raises(ValueError, match="name"):
    jact.segment(mlp, name=name)


def _bisect(loss, args_for_batch, budget, hi=1 << 13):
  lo = 1
  while hi - lo > 1:
    mid = (lo + hi) // 2
    fits = step_peak(loss, tuple(args_for_batch(mid)), (0,)) <= budget
    lo, hi = (mid, hi) if fits else (lo, mid)
  return lo


def test_largest_batch_is_within_five_percent_of_bisection():
  loss = stack(rematerializable=False)
  args = lambda b: (weights(), jax.ShapeDtypeStruct((b, 64), jnp.float32))
  budget = 6 * 2**20
  found = jact.largest_batch(loss, args, budget, start=64)
  true = _bisect(configure(loss, None, None), args, budget)
  assert found.batch <= true and found.batch >= true / 1.05, (found, true)
  assert found.failing_batch > true and found.compilations <= 10


@pytest.mark.slow
def test_largest_batch_over_any_configuration():
  # config="fit": the smallest configuration fit can reach decides the batch (its failing batch
  # does not fit, compiled again here), and fit's own choice at that batch fits the budget.
  from jact._fit.batch import _smallest

  loss = stack(rematerializable=True, n=SHORT)
  args = lambda b: (weights(n=SHORT), jax.ShapeDtypeStruct((b, 64), jnp.float32))
  budget = 6 * 2**20
  # fit's choice at the batch found verifies one candidate (the smallest configuration, which
  # fits there, is its fallback): the property is that its choice fits, not which one it is
  found = jact.largest_batch(loss, args, budget, config="fit", start=64, max_candidates=1)
  # beyond the plain step's largest batch: the plain step does not fit at the batch found (one
  # compile, in place of largest_batch's search for the plain step)
  assert step_peak(configure(loss, None, None), tuple(args(found.batch)), (0,)) > budget, found
  assert found.fit.peak_bytes <= budget and found.fit.budget_bytes == budget
  assert found.failing_batch <= max(found.batch + 1, 1.05 * found.batch)
  smallest = _smallest(loss, tuple(args(64)), (1, 2, 4, 8, None))
  assert step_peak(smallest, tuple(args(found.failing_batch)), (0,)) > budget


def converted_mlp():
  """A linen MLP through jact.convert: its residuals are named by position."""
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for width in (256, 256, 256):
        x = nn.gelu(nn.Dense(width)(x))
      return nn.Dense(8)(x)

  model = jact.convert(MLP(), bits=4)
  x = jax.random.normal(jax.random.key(0), (4096, 64))
  variables = MLP().init(jax.random.key(1), x)

  def loss(params, x, key):
    return jnp.mean(model.apply({"params": params}, x, rngs={"jact": key}) ** 2)

  return loss, (variables["params"], x, jax.random.key(2))


def test_a_converted_linen_model_is_planned_by_names_that_hold():
  # Inside a converted model's generic engine, a layer's residual kept uncompressed shifts the
  # positional names after it: fit must not use "uncompressed" there, and every name it plans
  # must be traced (its compiles apply the plan strictly).
  loss, args = converted_mlp()
  as_written = step_peak(configure(loss, None, None), args, (0,))
  result = jact.fit(loss, *args, budget_bytes=int(0.95 * as_written))
  assert result.peak_bytes <= 0.95 * as_written
  assert None not in dict(result.plan.entries).values()
  with jact.use_plan(result.plan, strict=True):  # every name of the plan is traced
    jax.eval_shape(lambda *a: jax.grad(loss)(*a), *args)


def test_every_mix_of_compressed_widths_keeps_the_names():
  # fit checks one compressed width for renaming and takes it for all of them: any mix of
  # 1, 2, 4 and 8 bits must name the same residuals (uncompressed is what renames).
  from jact._fit.search import _discover

  loss, args = converted_mlp()
  sites, _ = _discover(loss, args, Layout())
  names = sorted(sites)
  mix = BitPlan({n: (1, 2, 4, 8)[i % 4] for i, n in enumerate(names)})
  for plan in [mix, *(BitPlan({n: w for n in names}) for w in (1, 2, 4, 8))]:
    with jact.use_plan(plan, strict=True):  # strict: a planned name not traced is an error
      traced = jax.eval_shape(lambda *a: jax.grad(loss)(*a), *args)
    assert jax.tree.structure(traced) == jax.tree.structure(args[0])
  with pytest.raises(ValueError, match="not traced|names residuals"):
    with jact.use_plan(BitPlan({n: None for n in names}), strict=True):
      jax.eval_shape(lambda *a: jax.grad(loss)(*a), *args)


def test_a_sensitivity_state_is_taken_as_estimates():
  # A jact.sensitivity state (what a Controller keeps) in place of a mapping: its names steer
  # the widths exactly as the mapping test above does.
  loss = stack(rematerializable=False)
  names = tuple(f"s{i}.{p}" for i in range(N) for p in (3, 4))
  hot = jnp.array([1e6 if n.split(".")[0] in {"s0", "s1", "s2", "s3"} else 1.0 for n in names])
  state = jact.sensitivity.SensitivityState(
    hot, jnp.zeros_like(hot), jnp.ones((), jnp.int32), names, (1,) * len(names), (4,) * len(names)
  )
  known = {n: (8 if c > 1 else 2) for n, c in zip(names, hot.tolist())}
  budget = peak_of(loss, known)
  result = jact.fit(loss, weights(), X, budget_bytes=budget, sensitivity=state, widths=(2, 8))
  assert dict(result.plan.entries) == known
