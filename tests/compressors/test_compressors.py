"""The Compressor interface: every method plugs into ops, Flax layers,
`jact.compressed` and plans, with its stored bytes reported (the DIVISION
ablation and AC-GC fixed-point widths on real CIFAR-10 activations:
experiments/tests/test_compressor_papers.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact import _compat
from jact import compressors as C

ALL = [
  C.PerGroup(2),
  C.PerGroup(4, stochastic=False),
  C.Division(),
  C.Division(block=4, bits=4),
  C.BLPA(4),
  C.BLPA(8),
  C.Fixpoint(8),
  C.Fixpoint(2),
  C.ZeroValue(),
  C.ZeroValue(C.Fixpoint(4)),
  C.PerSample(2.5),
  C.PerSample(4, group_size=128, stochastic=False),
  C.PerSample(3.5, widths=range(1, 9)),
]


def _relu_like(shape, seed=0):
  return np.maximum(np.random.default_rng(seed).normal(size=shape) - 0.3, 0).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("c", ALL, ids=repr)
def test_interface_bytes_json_and_dense_op(c):
  x = jnp.asarray(_relu_like((8, 4, 4, 32)))
  w = jnp.asarray(np.random.default_rng(1).normal(size=(32, 5)).astype(np.float32))
  assert C.from_dict(c.to_dict()) == c and hash(C.from_dict(c.to_dict())) == hash(c)
  stored = jax.jit(c.compress)(x, jnp.uint32(3) if c.needs_key else None)
  assert stored.nbytes == c.stored_bytes(x.shape, x.dtype)
  x_hat = jax.jit(c.decompress)(stored)
  assert x_hat.shape == x.shape and x_hat.dtype == x.dtype and bool(jnp.all(jnp.isfinite(x_hat)))
  assert c.stored_bytes(x.shape, x.dtype) < x.nbytes

  key = jax.random.key(0) if c.needs_key else None

  def loss(w):
    return jnp.sum(jact.ops.dense(x, w, key=key, compressor=c, name="fc") ** 2)

  report = jact.residual_report(loss, w)
  assert report.by_name()["fc.lhs"].bytes == c.stored_bytes(x.shape, x.dtype)
  # The weight gradient is the exact formula at the reconstruction (same seed).
  g = jax.jit(jax.grad(loss))(w)  # jitted: op by op, the compressors dispatch for seconds
  y = x @ w
  if c.needs_key:
    site = jact._engine.rounding.site_seed(jact.rng.seed_from_key(key), 0, "fc.lhs")
    x_hat = jax.jit(lambda s: c.decompress(c.compress(x, s)))(site)
  expected = jnp.einsum("nhwc,nhwk->ck", x_hat, 2 * y)
  np.testing.assert_allclose(g, expected, rtol=2e-4, atol=2e-4 * float(jnp.abs(expected).max()))


def _conv(x, k):
  return jax.lax.conv_general_dilated(
    x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def _reconstruction(c, x, seed):
  """`c.decompress(c.compress(x, seed))` compiled as one program (op by op, the
  compressors dispatch for seconds)."""
  return jax.jit(lambda x, seed: c.decompress(c.compress(x, seed)))(x, seed)


def _vjp_at_reconstruction(f, args, names, c, seed, prefix):
  """Gradient of `f` from its own VJP with every residual named `prefix.i` in
  `names` replaced by `c`'s reconstruction (the seed jact gives site i)."""
  _, vjp = jax.vjp(f, *args)
  leaves, layout = _compat.vjp_residuals(vjp)
  for i, leaf in enumerate(leaves):
    name = f"{prefix}.{i}"
    if name in names:
      leaves[i] = _reconstruction(
        c, leaf, jact._engine.rounding.site_seed(seed, i, name) if c.needs_key else None
      )
  return _compat.rebuild_vjp(layout, leaves)(jnp.float32(1))


class _KeyOf(nn.Module):
  """The 'jact' key a layer at this path draws (probe for the layer's seed)."""

  @nn.compact
  def __call__(self):
    return self.make_rng("jact")


class _Probe(nn.Module):
  @nn.compact
  def __call__(self):
    return _KeyOf(name="Conv_0")()


@pytest.mark.slow
@pytest.mark.parametrize("c", [C.Division(), C.Fixpoint(4), C.ZeroValue(C.Fixpoint(8))], ids=repr)
def test_compressed_function_and_flax_layer_take_a_compressor(c):
  x = jnp.asarray(_relu_like((4, 8, 8, 16), 2))
  f = lambda k, x: jnp.tanh(_conv(x, k)).sum()
  block = jact.compressed(f, compressor=c, name="blk")
  k = jnp.asarray(np.random.default_rng(3).normal(size=(3, 3, 16, 16)).astype(np.float32)) / 12
  key = jax.random.key(0) if c.needs_key else None
  g = jax.jit(jax.grad(block))(k, x, key=key)  # jitted: op by op, it dispatches for seconds
  names = jact.residual_report(lambda k: block(k, x, key=key), k).by_name()
  float_groups = [n for n in names if n and n.startswith("blk")]
  assert float_groups, names
  # The gradient is tanh∘conv's own VJP run on the compressor's reconstructions
  # of the named residuals (same seeds), to float32 rounding; and it is not the
  # exact gradient (the residuals are stored lossily).
  seed = jact.rng.seed_from_key(key) if c.needs_key else None
  want, _ = _vjp_at_reconstruction(f, (k, x), names, c, seed, "blk")
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
  exact = jax.jit(jax.grad(f))(k, x)
  assert float(jnp.abs(want - exact).max()) > 1e-3 * float(jnp.abs(exact).max())

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jact.nn.Conv(8, (3, 3), compressor=c)(x).sum()

  net = Net()
  rngs = {"params": jax.random.key(1), "jact": jax.random.key(2)}
  variables = jax.jit(net.init)(rngs, x)
  grads = jax.jit(jax.grad(lambda v: net.apply(v, x, rngs={"jact": jax.random.key(3)})))(variables)
  grads = grads["params"]["Conv_0"]
  # Bias gradient: one per output position (exact, needs no residual). Kernel
  # gradient: the conv's kernel VJP at the reconstruction of the input stored
  # as "Conv_0.lhs" (the layer's first hook call folds 0 into its key).
  np.testing.assert_array_equal(grads["bias"], np.full(8, 4 * 8 * 8, np.float32))
  layer_key = jax.random.fold_in(_Probe().apply({}, rngs={"jact": jax.random.key(3)}), 0)
  site = jact._engine.rounding.site_seed(jact.rng.seed_from_key(layer_key), 0, "Conv_0.lhs")
  x_hat = _reconstruction(c, x, site if c.needs_key else None)
  _, vjp = jax.vjp(lambda w: _conv(x_hat, w), variables["params"]["Conv_0"]["kernel"])
  (want,) = vjp(jnp.ones((4, 8, 8, 8), jnp.float32))
  np.testing.assert_allclose(
    grads["kernel"], want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max())
  )


def test_plan_entries_change_width_or_method_and_round_trip():
  x = jnp.asarray(_relu_like((8, 16, 16, 8), 4))
  w = jnp.ones((3, 3, 8, 4)) / 10
  key = jax.random.key(0)

  def loss(w, plan=None):
    with jact.use_plan(plan):
      return jact.ops.conv(x, w, key=key, compressor=C.Division(), name="c").sum()

  def stored(plan):
    return jact.residual_report(lambda w: loss(w, plan), w).by_name()["c.lhs"].bytes

  assert stored(None) == C.Division().stored_bytes(x.shape)
  assert stored(jact.BitPlan({"c.lhs": 4})) == C.Division(bits=4).stored_bytes(x.shape)
  assert stored(jact.BitPlan({"c.lhs": C.Fixpoint(8)})) == C.Fixpoint(8).stored_bytes(x.shape)
  assert stored(jact.BitPlan({"c.lhs": None})) == x.nbytes
  plan = jact.BitPlan(
    {"c.lhs": C.ZeroValue(C.Fixpoint(4), capacity=0.6), "d": 2}, default=C.Division(block=4)
  )
  assert jact.BitPlan.from_json(plan.to_json()) == plan
  assert "zero_value" in plan.replace(sizes={"c.lhs": x.size}).summary()

  traces = []

  def step(w, plan):
    traces.append(1)
    return jax.grad(loss)(w, plan)

  jitted = jax.jit(step, static_argnames="plan")
  for p in [
    jact.BitPlan({"c.lhs": C.Fixpoint(4)}),
    jact.BitPlan({"c.lhs": C.Fixpoint(4)}),
    jact.BitPlan({"c.lhs": C.Fixpoint(8)}),
  ]:
    jitted(w, p)
  assert len(traces) == 2


def test_a_per_sample_budget_is_the_per_sample_compressor():
  """A plan's per-sample budget on a per-group call site stores exactly what
  `PerSample` (with the call site's group size and rounding) stores, as a
  plan entry or as the call site's own compressor."""
  x = jnp.asarray(_relu_like((8, 512), 7)) * jnp.arange(1.0, 9.0)[:, None]
  w = jnp.asarray(np.random.default_rng(8).normal(size=(512, 4)).astype(np.float32))
  key = jax.random.key(3)

  def grad(compressor, plan=None):
    loss = lambda w: jnp.sum(jact.ops.dense(x, w, key=key, compressor=compressor, name="fc") ** 2)
    with jact.use_plan(plan):
      return jax.jit(jax.grad(loss))(w)

  per_sample = C.PerSample(2.5, group_size=128)
  budget = grad(C.PerGroup(4, group_size=128), jact.BitPlan(budgets={"fc.lhs": 2.5}))
  np.testing.assert_array_equal(budget, grad(C.PerGroup(4), jact.BitPlan({"fc.lhs": per_sample})))
  np.testing.assert_array_equal(budget, grad(per_sample))
  assert not np.array_equal(budget, grad(C.PerGroup(4, group_size=128)))
  assert C.PerGroup(2, group_size=64, stochastic=False).with_budget(3) == C.PerSample(3, 64, False)
  assert C.registered()["per_sample"] is C.PerSample


def test_clear_errors():
  x, w = jnp.ones((4, 256)), jnp.ones((256, 2))
  with pytest.raises(ValueError, match="jact.compressors"):
    jact.ops.dense(x, w, key=jax.random.key(0), bits=9)

  def no_key(w):  # a deterministic call site, a plan asking for stochastic rounding
    with jact.use_plan(jact.BitPlan({"fc.lhs": C.Division()})):
      return jact.ops.dense(x, w, compressor=C.Fixpoint(8), name="fc").sum()

  with pytest.raises(ValueError, match="needs a PRNG key"):
    jax.grad(no_key)(w)
  with pytest.raises(ValueError, match="per-sample budget"):
    with jact.use_plan(jact.BitPlan({"fc.lhs": C.Fixpoint(8)}, budgets={"fc.lhs": 2})):
      jax.grad(lambda w: jact.ops.dense(x, w, compressor=C.Fixpoint(8), name="fc").sum())(w)
  with pytest.raises(ValueError, match="unknown compressor method"):
    C.from_dict({"method": "jpeg"})
  with pytest.raises(ValueError, match="Fixpoint|bits"):
    jact.BitPlan({"a": C.Fixpoint(8)}).bits_for("a").with_bits(1)


def test_numeric_estimator_probes_deterministic_sites_with_the_per_group_quantizer():
  """GACT's estimate is for stochastic per-group rounding; a Fixpoint call site
  (deterministic: re-drawing its noise would change nothing) is probed with it."""
  x = jnp.asarray(_relu_like((16, 256), 5))
  w = jnp.asarray(np.random.default_rng(6).normal(size=(256, 8)).astype(np.float32)) / 16

  def loss(w, x, key):
    return jnp.sum(
      jnp.tanh(jact.ops.dense(x, w, key=key, compressor=C.Fixpoint(8), name="fc")) ** 2
    )

  est = jact.sensitivity.numeric(loss)
  state = est.update(est.init(w, x, jax.random.key(0)), w, x, jax.random.key(1))
  assert state.names == ("fc.lhs",) and float(state.sensitivity[0]) > 0
