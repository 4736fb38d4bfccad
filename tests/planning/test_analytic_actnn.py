"""ActNN's analytic sensitivity and width rule, pinned by hand on a conv-BN-ReLU net.

The values are derived here from ActNN's formula (Eq. 9 / Appendix B.1) with
numpy: c = G/6 * K/I * sum_n ||dL/dy_n||^2 * sum_groups(range^2)_n, where y is the
conv output, G the group size, K the kernel locations and I the positions per
sample; the output gradients come from a plain-JAX copy of the net.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact

BITS = 8  # the estimator's backward runs compressed: 8 bits keeps dL/dy within ~1e-3


def _conv(x, k):
  return jax.lax.conv_general_dilated(
    x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def _bn(h, scale, bias):
  mean = jnp.mean(h, axis=(0, 1, 2))
  var = jnp.var(h, axis=(0, 1, 2))
  return (h - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def jact_loss(p, x, key):
  k = jax.random.split(key, 3)
  h = jact.ops.conv(x, p["k1"], key=k[0], bits=BITS, name="conv1")
  h = jax.nn.relu(jact.ops.batch_norm(h, p["s"], p["b"], key=k[1], bits=BITS, name="bn1")[0])
  return jnp.sum(jnp.square(jact.ops.conv(h, p["k2"], key=k[2], bits=BITS, name="conv2")))


def _plain_outputs(p, x):
  """The two convs' outputs and the loss, as functions of added zero probes."""

  def loss(probe1, probe2):
    y1 = _conv(x, p["k1"]) + probe1
    h = jax.nn.relu(_bn(y1, p["s"], p["b"]))
    y2 = _conv(h, p["k2"]) + probe2
    return jnp.sum(jnp.square(y2)), h

  return loss


def _ranges_sq(a, group_size=256):
  """Per-sample sum of squared group ranges, groups of `group_size` consecutive values."""
  rows = np.asarray(a, np.float64).reshape(a.shape[0], -1, group_size)
  return np.sum(np.square(rows.max(-1) - rows.min(-1)), axis=1)


def test_conv_sensitivity_matches_actnn_formula_by_hand():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((4, 8, 8, 4)), jnp.float32)
  p = dict(
    k1=jnp.asarray(rng.standard_normal((3, 3, 4, 8)) / 6, jnp.float32),
    s=jnp.asarray(1 + 0.1 * rng.standard_normal(8), jnp.float32),
    b=jnp.asarray(0.1 * rng.standard_normal(8), jnp.float32),
    k2=jnp.asarray(rng.standard_normal((3, 3, 8, 4)) / 8, jnp.float32),
  )
  est = jact.sensitivity.analytic(jact_loss)
  state = est.update(est.init(p, x, jax.random.key(1)), p, x, jax.random.key(2))
  got = state.as_dict()

  plain = _plain_outputs(p, x)
  zeros1, zeros2 = jnp.zeros((4, 8, 8, 8)), jnp.zeros((4, 8, 8, 4))
  (g1, g2), h = jax.grad(plain, argnums=(0, 1), has_aux=True)(zeros1, zeros2)
  per_sample_sq = lambda g: np.sum(np.square(np.asarray(g, np.float64)).reshape(4, -1), axis=1)
  # conv1 stores x: 256 values per sample = one group; conv2 stores h: 512 = two groups.
  by_hand = {
    "conv1.lhs": 256 / 6 * 9 / 64 * np.sum(per_sample_sq(g1) * _ranges_sq(x)),
    "conv2.lhs": 256 / 6 * 9 / 64 * np.sum(per_sample_sq(g2) * _ranges_sq(h)),
  }
  for name, want in by_hand.items():
    np.testing.assert_allclose(got[name], want, rtol=5e-3, err_msg=name)
  assert np.isfinite(got["bn1.xhat"]) and got["bn1.xhat"] > 0
  # ActNN's rule: the batch norm takes the width of the conv that produced its input.
  assert dict(zip(state.names, state.follows)) == {
    "bn1.xhat": "conv1.lhs",
    "conv1.lhs": None,
    "conv2.lhs": None,
  }


def _net(seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((4, 8, 8, 4)) * np.array([0.2, 1.0, 3.0, 0.5])[:, None, None, None]
  p = dict(
    k1=jnp.asarray(rng.standard_normal((3, 3, 4, 8)) / 6, jnp.float32),
    s=jnp.ones(8),
    b=jnp.zeros(8),
    k2=jnp.asarray(rng.standard_normal((3, 3, 8, 4)) / 8, jnp.float32),
  )
  return p, jnp.asarray(x, jnp.float32)


def test_controller_gives_a_normalization_its_producers_width_within_the_budget():
  p, x = _net(1)
  controller = jact.Controller(
    jact_loss, estimator="analytic", avg_bits=2.0, adapt_interval=1, alert_fraction=1e9
  )
  state = controller.update(controller.init(p, x, jax.random.key(0)), p, x, jax.random.key(1))
  plan, c = state.plan, state.estimates.as_dict()
  sizes = dict(plan.sizes)
  assert sizes == {"bn1.xhat": 2048, "conv1.lhs": 1024, "conv2.lhs": 2048}
  # conv1 and the batch norm it feeds share one width: 3072 values at c(conv1).
  want = jact.allocate.greedy_allocate(
    [c["conv1.lhs"], c["conv2.lhs"]], [3072, 2048], budget_bits=2 * 5120
  )
  assert (plan["conv1.lhs"], plan["conv2.lhs"]) == want
  assert plan["bn1.xhat"] == plan["conv1.lhs"]
  assert sum(plan[n] * d for n, d in sizes.items()) <= 2.0 * sum(sizes.values())
  # Competing on its own (jact's earlier rule) the batch norm's small closed form would
  # have bought conv1 4 bits with a 1-bit batch norm here.
  alone = jact.allocate.greedy_allocate(
    [c["bn1.xhat"], c["conv1.lhs"], c["conv2.lhs"]], [2048, 1024, 2048], budget_bits=2 * 5120
  )
  assert alone[0] == 1 and want != alone[1:]


def test_l3_controller_solves_actnn_joint_allocation():
  """ActNN L3: the joint layer x sample allocation on c_l times each sample's share
  (this batch's per-sample sensitivities), each layer's mean width as a per-sample
  PerSample entry at 1..8 that its normalization shares, within the budget."""
  p, x = _net(1)
  controller = jact.levels.get("actnn:L3").controller(jact_loss, adapt_interval=1)
  assert controller.allowed == jact.allocate.ACTNN_WIDTHS and controller.per_sample
  key = jax.random.key(1)
  state = controller.update(controller.init(p, x, jax.random.key(0)), p, x, key)
  plan, c = state.plan, state.estimates.as_dict()
  # The same allocation by hand, from the estimator's c_l and the per-sample sensitivities.
  k_est = jax.random.split(key)[0]
  w = jact._planning.sensitivity.analytic_per_sample(jact_loss)(p, x, k_est)
  assert set(w) == {"conv1.lhs", "conv2.lhs"} and all(v.shape == (4,) for v in w.values())
  share = {n: np.asarray(v, np.float64) / np.sum(np.asarray(v, np.float64)) for n, v in w.items()}
  assert np.ptp(share["conv1.lhs"]) > 0.1  # the samples differ: the shares matter
  c_ln = np.stack([c["conv1.lhs"] * share["conv1.lhs"], c["conv2.lhs"] * share["conv2.lhs"]])
  bits = jact.allocate.allocate_layers_and_samples(c_ln, [3072, 2048], 2.0)
  want = {"conv1.lhs": bits[0].mean(), "bn1.xhat": bits[0].mean(), "conv2.lhs": bits[1].mean()}
  assert dict(plan.budgets) == pytest.approx(want)
  for name, avg in want.items():
    assert plan[name] == jact.compressors.PerSample(avg, widths=jact.allocate.ACTNN_WIDTHS)
  sizes = dict(plan.sizes)
  assert sum(want[n] * d for n, d in sizes.items()) <= 2.0 * sum(sizes.values())
  assert len(set(bits.ravel().tolist())) > 1  # not uniform
  assert jact.BitPlan.from_json(plan.to_json()) == plan
  # The plan runs: the step splits each budget among its own samples at 1..8.
  grad = jax.jit(jact.planned(jax.grad(jact_loss)), static_argnames="plan")
  g = grad(p, x, jax.random.key(2), plan=plan)
  assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))


def test_per_sample_controller_errors():
  with pytest.raises(ValueError, match="from 1..8"):
    jact.Controller(jact_loss, estimator="analytic", per_sample=True, allowed=(1, 2, 4, 8, 32))
  with pytest.raises(ValueError, match="PerGroup"):
    jact.Controller(
      jact_loss, estimator="analytic", per_sample=True, compressor=jact.compressors.Fixpoint(4)
    )


def test_normalization_producers_rule():
  rule = jact.sensitivity.normalization_producers
  assert rule([("ln", "layer_norm")]) == {}
  assert rule(
    [("c1", "conv"), ("bn1", "batch_norm"), ("c2", "conv"), ("bn2", "batch_norm"), ("fc", "dense")]
  ) == {"bn1": "c1", "bn2": "c2"}
  assert rule([("bn0", "batch_norm"), ("c1", "conv"), ("bn1", "batch_norm")]) == {
    "bn0": "c1",
    "bn1": "c1",
  }


def test_acgc_controller_scale_bound_only_widens_normalizations():
  """`Controller(estimator="acgc", scale_bound=True)` also bounds the batch norm's scale
  gradient (not in AC-GC's Table 1): its width can only grow, the convs' stay."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((4, 8, 8, 4)), jnp.float32)
  p = dict(
    k1=jnp.asarray(rng.standard_normal((3, 3, 4, 8)) / 6, jnp.float32),
    s=jnp.ones(8),
    b=jnp.zeros(8),
    k2=jnp.asarray(rng.standard_normal((3, 3, 8, 4)) / 8, jnp.float32),
  )
  plans = {}
  for bound in (False, True):
    c = jact.Controller(jact_loss, estimator="acgc", error=0.05, scale_bound=bound)
    plans[bound] = c.update(c.init(p, x, jax.random.key(0)), p, x, jax.random.key(1)).plan
  width = lambda b: 32 if b is None else b
  assert width(plans[True]["bn1.xhat"]) >= width(plans[False]["bn1.xhat"])
  assert plans[True]["conv1.lhs"] == plans[False]["conv1.lhs"]
  assert plans[True]["conv2.lhs"] == plans[False]["conv2.lhs"]
  assert plans[True] != plans[False], plans  # here the scale bound binds
