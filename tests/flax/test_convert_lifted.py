"""jact.convert (and jact.compressed) of linen models built with lifted
transforms the ordinary Flax way: a top-level `nn.vmap` class, cross-sample
batch norm under `nn.vmap(axis_name=)` / `jax.vmap(axis_name=)`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from stats import tree_rel_err

# 8-bit gradients against the plain model's (relative L2 per leaf, see tree_rel_err)
GRAD_RTOL = 5e-2


def _normal(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


class S5Layer(nn.Module):
  """One sequence's layer (an S5 script vmaps it over the batch)."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64)(nn.LayerNorm()(x))
    return x + nn.Dense(32)(nn.gelu(h))


VmappedS5 = nn.vmap(
  S5Layer,
  in_axes=0,
  out_axes=0,
  variable_axes={"params": None},
  split_rngs={"params": False},
)


@pytest.mark.parametrize("functions", [True, False])
def test_top_level_vmapped_class_converts(functions):
  x = _normal((4, 16, 32))
  variables = VmappedS5().init(jax.random.key(0), x)
  model = jact.convert(VmappedS5(), bits=8, functions=functions)
  assert isinstance(model, S5Layer)
  # the converted model makes the plain variables and runs the plain forward (eval: no key)
  assert jax.tree.map(jnp.shape, model.init(jax.random.key(0), x)) == jax.tree.map(
    jnp.shape, variables
  )
  np.testing.assert_array_equal(model.apply(variables, x), VmappedS5().apply(variables, x))
  keyed = model.apply(variables, x, rngs={"jact": jax.random.key(1)})
  np.testing.assert_array_equal(keyed, VmappedS5().apply(variables, x))

  def loss(m, v, **kw):
    return jnp.mean(m.apply(v, x, **kw) ** 2)

  grads = jax.grad(lambda v: loss(model, v, rngs={"jact": jax.random.key(1)}))(variables)
  plain = jax.grad(lambda v: loss(VmappedS5(), v))(variables)
  assert tree_rel_err(grads, plain) < GRAD_RTOL
  # and it does compress: fewer saved bytes than the plain model (8 bits: under
  # half the float32 bytes once the functions' residuals are compressed too)
  report = lambda m, **kw: jact.residual_report(lambda v: loss(m, v, **kw), variables)
  saved = report(model, rngs={"jact": jax.random.key(1)}).total_bytes
  assert saved < report(VmappedS5()).total_bytes / (2 if functions else 1)


class Normed(nn.Module):
  """Dense, cross-sample BatchNorm (axis_name='batch'), relu, Dense: one sample."""

  @nn.compact
  def __call__(self, x):
    x = nn.BatchNorm(use_running_average=False, axis_name="batch")(nn.Dense(64)(x))
    return nn.Dense(8)(nn.relu(x))


class VmapNormed(nn.Module):
  @nn.compact
  def __call__(self, x):
    per_sample = nn.vmap(
      Normed,
      in_axes=0,
      out_axes=0,
      variable_axes={"params": None, "batch_stats": None},
      split_rngs={"params": False},
      axis_name="batch",
    )
    return per_sample()(x)


@pytest.mark.parametrize("functions", [True, False])
def test_batch_norm_over_a_vmapped_axis_differentiates(functions):
  x = _normal((8, 16, 32))
  variables = VmapNormed().init(jax.random.key(0), x)

  def loss(m, v, **kw):
    y, updates = m.apply(v, x, mutable=["batch_stats"], **kw)
    return jnp.mean(y**2), updates

  model = jact.convert(VmapNormed(), bits=8, functions=functions)
  (_, updates), grads = jax.value_and_grad(
    lambda v: loss(model, v, rngs={"jact": jax.random.key(1)}), has_aux=True
  )(variables)
  (_, plain_updates), plain = jax.value_and_grad(lambda v: loss(VmapNormed(), v), has_aux=True)(
    variables
  )
  assert tree_rel_err(grads["params"], plain["params"]) < GRAD_RTOL
  # the running statistics are the cross-sample ones, as in plain Flax
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    updates,
    plain_updates,
  )


class Residual(nn.Module):
  @nn.compact
  def __call__(self, x):
    norm = lambda: nn.BatchNorm(use_running_average=False, axis_name="batch")
    h = nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
    h = norm()(nn.Conv(8, (3, 3), use_bias=False)(h))
    return nn.relu(h + x)


class SmallResNet(nn.Module):
  """A ResNet-18-like stem and block for one sample; batch norm over the vmapped axis."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=False, axis_name="batch")(x))
    x = Residual()(Residual()(x))
    return nn.Dense(10)(x.mean((0, 1)))


@pytest.mark.parametrize("how", ["compressed", "convert"])
def test_whole_model_under_a_named_vmap_over_samples(how):
  x = _normal((4, 8, 8, 3))
  variables = jax.vmap(lambda xi: SmallResNet().init(jax.random.key(0), xi), axis_name="batch")(x)
  variables = jax.tree.map(lambda a: a[0], variables)  # shared across samples
  key = jax.random.key(1)

  def loss(params, apply):
    def one(xi):
      y, _ = apply({**variables, "params": params}, xi)
      return jnp.sum(y**2)

    return jnp.mean(jax.vmap(one, axis_name="batch")(x))

  plain = lambda v, xi: SmallResNet().apply(v, xi, mutable=["batch_stats"])
  if how == "compressed":
    model = jact.compressed(SmallResNet(), bits=8)
    apply = lambda v, xi: model.apply(v, xi, mutable=["batch_stats"], key=key)
  else:
    model = jact.convert(SmallResNet(), bits=8)
    apply = lambda v, xi: model.apply(v, xi, mutable=["batch_stats"], rngs={"jact": key})
  grads = jax.grad(loss)(variables["params"], apply)
  expected = jax.grad(loss)(variables["params"], plain)
  assert tree_rel_err(grads, expected) < GRAD_RTOL


def test_fit_configures_a_converted_model_with_batch_norm_over_a_vmapped_axis():
  x = _normal((6, 5, 4))
  variables = VmapNormed().init(jax.random.key(0), x)
  model = jact.convert(VmapNormed(), bits=8)

  def loss(v, key):
    y, _ = model.apply(v, x, mutable=["batch_stats"], rngs={"jact": key})
    return jnp.mean(y**2)

  fitted = jact.fit(loss, variables, jax.random.key(2), budget_bytes=2**30)
  grads = jax.grad(fitted.loss_fn)(variables, jax.random.key(2), key=jax.random.key(3))
  plain = jax.grad(lambda v: jnp.mean(VmapNormed().apply(v, x, mutable=["batch_stats"])[0] ** 2))(
    variables
  )
  assert tree_rel_err(grads["params"], plain["params"]) < GRAD_RTOL
