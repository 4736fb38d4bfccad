"""Tests of the nnx twins (jact.nnx): same state, same forward, close
8-bit gradients, clear errors, one trace per nnx.jit step, small residuals."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jact.compressors import PerGroup
from jact._compat.testing import saved_residuals

from jact import nnx as jnnx
from jact._report import residual_report
from stats import assert_same_tree, tree_rel_err

# Relative L2 error of each 8-bit gradient leaf against the plain layer's
# (leaves whose exact gradient is ~0 are measured against 5% of the whole
# gradient's norm). Measured: 0.5-1.5%; a 2-bit copy is ~25x worse.
GRAD_RTOL = 5e-2


def _normal(shape, seed=0):
  # numpy, not jax.random: no compilation per shape (keeps collection fast)
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _rngs(seed=0):
  return nnx.Rngs(params=seed, jact=seed + 100)


# name -> (plain factory, twin factory, input); factories take an Rngs
LAYERS = {
  "Linear": (
    lambda r: nnx.Linear(7, 5, rngs=r),
    lambda r: jnnx.Linear(7, 5, bits=8, rngs=r),
    _normal((6, 7)),
  ),
  "Conv": (
    lambda r: nnx.Conv(3, 4, (3, 3), strides=2, padding="CIRCULAR", rngs=r),
    lambda r: jnnx.Conv(3, 4, (3, 3), strides=2, padding="CIRCULAR", bits=8, rngs=r),
    _normal((2, 6, 6, 3)),
  ),
  "BatchNorm": (
    lambda r: nnx.BatchNorm(3, momentum=0.9, rngs=r),
    lambda r: jnnx.BatchNorm(3, momentum=0.9, bits=8, rngs=r),
    _normal((8, 4, 4, 3)) * 2.0 + 1.0,
  ),
  "LayerNorm": (
    lambda r: nnx.LayerNorm(16, rngs=r),
    lambda r: jnnx.LayerNorm(16, bits=8, rngs=r),
    _normal((6, 16)) + 0.5,
  ),
  "RMSNorm": (
    lambda r: nnx.RMSNorm(16, rngs=r),
    lambda r: jnnx.RMSNorm(16, bits=8, rngs=r),
    _normal((6, 16)) + 0.5,
  ),
  "MultiHeadAttention": (
    lambda r: nnx.MultiHeadAttention(2, 6, 8, decode=False, rngs=r),
    lambda r: jnnx.MultiHeadAttention(2, 6, 8, decode=False, bits=8, rngs=r),
    _normal((2, 5, 6)),
  ),
  "Embed": (
    lambda r: nnx.Embed(11, 4, rngs=r),
    lambda r: jnnx.Embed(11, 4, rngs=r),
    jnp.asarray(np.random.default_rng(0).integers(0, 11, (3, 5)), jnp.int32),
  ),
}
STATE = (nnx.Param, nnx.BatchStat)


def _assert_same_state(a, b):
  assert_same_tree(nnx.to_pure_dict(a), nnx.to_pure_dict(b))


@pytest.mark.parametrize("name", [*LAYERS])
def test_state_equals_plain_and_plain_weights_load(name):
  make_plain, make_twin, _ = LAYERS[name]
  plain, twin = make_plain(nnx.Rngs(params=0)), make_twin(_rngs(0))
  # same Param/BatchStat names, shapes, dtypes and initial values
  for kind in STATE:
    _assert_same_state(nnx.state(twin, kind), nnx.state(plain, kind))
  # a differently initialized plain layer's weights load into the twin
  other = make_plain(nnx.Rngs(params=5))
  nnx.update(twin, *nnx.state(other, *STATE))
  for kind in STATE:
    _assert_same_state(nnx.state(twin, kind), nnx.state(other, kind))


def test_full_state_loads_both_ways_without_the_jact_streams():
  twin = jnnx.Linear(7, 5, bits=8, rngs=_rngs(0))  # a stream: RNG state tagged 'jact'
  own = nnx.state(twin, nnx.Not(nnx.WithTag("jact")))
  plain = nnx.Linear(7, 5, rngs=nnx.Rngs(params=5))
  nnx.update(plain, own)  # what convert's docstring tells a plain model to load
  _assert_same_state(nnx.state(plain), own)
  other = nnx.Linear(7, 5, rngs=nnx.Rngs(params=6))
  nnx.update(twin, nnx.state(other))  # a plain model's full state loads as is
  _assert_same_state(nnx.state(twin, nnx.Not(nnx.WithTag("jact"))), nnx.state(other))


@pytest.mark.parametrize("name", [*LAYERS])
def test_forward_equals_plain(name):
  make_plain, make_twin, x = LAYERS[name]
  plain, twin = make_plain(nnx.Rngs(params=0)), make_twin(_rngs(0))
  y_ref, y = plain(x), twin(x)
  assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
  # Linear/Conv/Embed run the same lax op (bit-equal); norms and attention
  # reassociate float32 reductions.
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  # batch norm's running statistics are updated identically
  _assert_close_state(nnx.state(twin, nnx.BatchStat), nnx.state(plain, nnx.BatchStat))


def _assert_close_state(a, b):
  chex.assert_trees_all_close(nnx.to_pure_dict(a), nnx.to_pure_dict(b), rtol=1e-6, atol=1e-7)


def test_batch_norm_inference_path_is_flax():
  make_plain, make_twin, x = LAYERS["BatchNorm"]
  plain, twin = make_plain(nnx.Rngs(params=0)), make_twin(_rngs(0))
  plain(x), twin(x)  # one training step of statistics
  np.testing.assert_array_equal(
    twin(x, use_running_average=True), plain(x, use_running_average=True)
  )


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYERS if n != "Embed"])
def test_8bit_gradients_close_to_plain(name):
  make_plain, make_twin, x = LAYERS[name]
  probe = _normal(make_plain(nnx.Rngs(params=0))(x).shape, seed=3)

  @nnx.jit
  def grads(model, x):
    return nnx.grad(lambda m, x: jnp.sum(m(x) * probe), argnums=(0, 1))(model, x)

  g_ref = grads(make_plain(nnx.Rngs(params=0)), x)
  g = grads(make_twin(_rngs(0)), x)
  assert tree_rel_err(nnx.to_pure_dict(g[0]), nnx.to_pure_dict(g_ref[0])) < GRAD_RTOL
  assert tree_rel_err(g[1], g_ref[1]) < GRAD_RTOL


def test_embed_gradient_exact():
  make_plain, make_twin, ids = LAYERS["Embed"]
  probe = _normal((3, 5, 4), seed=3)
  loss = lambda m: jnp.sum(m(ids) * probe)
  g = nnx.grad(loss)(make_twin(_rngs(0)))
  g_ref = nnx.grad(loss)(make_plain(nnx.Rngs(params=0)))
  np.testing.assert_allclose(g["embedding"][...], g_ref["embedding"][...], rtol=1e-6, atol=1e-7)


def test_fresh_key_per_call():
  layer = jnnx.Linear(8, 3, bits=2, rngs=_rngs(0))
  x = _normal((16, 8))
  grad = nnx.jit(lambda m: nnx.grad(lambda m: jnp.sum(m(x) ** 2))(m)["kernel"][...])
  g1, g2 = grad(layer), grad(layer)
  assert not np.allclose(g1, g2)  # the stream advanced: new rounding noise
  assert int(layer.jact_rngs.count[...]) == 2


@pytest.mark.parametrize(
  "twin, fn",
  [
    (jnnx.ReLU(), jax.nn.relu),
    (jnnx.LeakyReLU(0.1), lambda x: jax.nn.leaky_relu(x, 0.1)),
    (jnnx.GELU(False, bits=8, rngs=_rngs()), lambda x: jax.nn.gelu(x, approximate=False)),
    (jnnx.SiLU(bits=8, rngs=_rngs()), jax.nn.silu),
    (jnnx.Tanh(bits=8, rngs=_rngs()), jnp.tanh),
    (jnnx.Sigmoid(bits=8, rngs=_rngs()), jax.nn.sigmoid),
    (jnnx.Softmax(axis=0, bits=8, rngs=_rngs()), lambda x: jax.nn.softmax(x, axis=0)),
  ],
)
@pytest.mark.slow
def test_activation_modules(twin, fn):
  x = _normal((8, 32))
  probe = _normal((8, 32), seed=4)
  assert nnx.state(twin, nnx.Param) == nnx.State({})
  np.testing.assert_array_equal(twin(x), fn(x))
  g = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) * probe), argnums=1))(twin, x)
  g_ref = jax.grad(lambda x: jnp.sum(fn(x) * probe))(x)
  if isinstance(twin, (jnnx.ReLU, jnnx.LeakyReLU)):
    np.testing.assert_array_equal(g, g_ref)  # 1-bit masks are exact
  else:
    assert tree_rel_err(g, g_ref) < GRAD_RTOL


@pytest.mark.parametrize(
  "twin, fn",
  [
    (jnnx.MaxPool((2, 2), (2, 2)), lambda x: nnx.max_pool(x, (2, 2), (2, 2))),
    (jnnx.MaxPool((3, 3), (1, 1), "SAME"), lambda x: nnx.max_pool(x, (3, 3), (1, 1), "SAME")),
    (jnnx.AvgPool((2, 2), (2, 2)), lambda x: nnx.avg_pool(x, (2, 2), (2, 2))),
  ],
)
@pytest.mark.slow
def test_pooling_modules_exact(twin, fn):
  x = _normal((2, 6, 6, 3))
  probe = _normal(fn(x).shape, seed=4)
  np.testing.assert_allclose(twin(x), fn(x), rtol=1e-6, atol=1e-7)
  g = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) * probe), argnums=1))(twin, x)
  g_ref = jax.grad(lambda x: jnp.sum(fn(x) * probe))(x)
  np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_dropout_twin():
  x = jnp.ones((64, 64))
  twin = jnnx.Dropout(0.25, rngs=nnx.Rngs(dropout=3))
  np.testing.assert_array_equal(twin(x, deterministic=True), x)
  y = twin(x)
  kept = np.asarray(y != 0)
  np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.75)
  # keep fraction within 5 binomial standard deviations of 0.75
  assert abs(kept.mean() - 0.75) < 5 * np.sqrt(0.75 * 0.25 / kept.size)
  # the backward applies the forward's mask (same key => same mask)
  key = jax.random.key(9)
  y = twin(x, rngs=key)
  g = jax.grad(lambda x: twin(x, rngs=key).sum())(x)
  np.testing.assert_array_equal(g, y)
  with pytest.raises(ValueError, match="rngs"):
    jnnx.Dropout(0.25)(x)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYERS if n != "Embed"])
def test_without_stream_forward_is_plain_and_differentiating_is_a_clear_error(name):
  make_plain, make_twin, x = LAYERS[name]
  plain, twin = make_plain(nnx.Rngs(params=0)), make_twin(nnx.Rngs(params=0))  # no 'jact'
  assert twin.jact_rngs is None
  assert_same_tree(nnx.to_pure_dict(nnx.state(twin)), nnx.to_pure_dict(nnx.state(plain)))
  np.testing.assert_array_equal(twin(x), plain(x))  # inference: Flax's own computation
  with pytest.raises(
    ValueError,
    match=rf"jact.nnx.{name} '{name}' was differentiated without "
    r"a rounding key.*jact.nnx.use_key",
  ):
    nnx.eval_shape(nnx.grad(lambda m: jnp.sum(m(x))), twin)  # raises while tracing
  with jnnx.use_key(jax.random.key(0)):  # the keys of a use_key block
    nnx.eval_shape(nnx.grad(lambda m: jnp.sum(m(x))), twin)


@pytest.mark.parametrize(
  "twin, fn",
  [
    (jnnx.GELU(), lambda x: jax.nn.gelu(x, approximate=True)),
    (jnnx.SiLU(), jax.nn.silu),
    (jnnx.Tanh(), jnp.tanh),
    (jnnx.Sigmoid(), jax.nn.sigmoid),
    (jnnx.Softmax(0), lambda x: jax.nn.softmax(x, axis=0)),
  ],
)
def test_activations_without_stream(twin, fn):
  x = _normal((8, 32))
  np.testing.assert_array_equal(twin(x), fn(x))
  with pytest.raises(ValueError, match="differentiated without a rounding key"):
    jax.grad(lambda x: jnp.sum(twin(x)))(x)


@pytest.mark.slow
def test_decoding_without_stream_is_flax_decoding():
  make = lambda cls: cls(2, 8, 8, decode=True, rngs=nnx.Rngs(params=0))
  plain, twin = make(nnx.MultiHeadAttention), make(jnnx.MultiHeadAttention)  # no 'jact'
  x = _normal((1, 4, 8))
  plain.init_cache(x.shape)
  twin.init_cache(x.shape)
  for t in range(x.shape[1]):  # token by token, through the key/value cache
    np.testing.assert_array_equal(twin(x[:, t : t + 1]), plain(x[:, t : t + 1]))


def test_use_key_replaces_the_layers_stream():
  layer = jnnx.Linear(8, 3, bits=2, rngs=_rngs(0))
  x = _normal((16, 8))

  @nnx.jit
  def grad(layer, key):
    with jnnx.use_key(key):
      return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)["kernel"][...]

  g1, g2 = grad(layer, jax.random.key(1)), grad(layer, jax.random.key(1))
  np.testing.assert_array_equal(g1, g2)  # the block's key, not the stream's next one
  assert int(layer.jact_rngs.count[...]) == 0


def test_no_stream_needed_without_stochastic_rounding():
  x = _normal((6, 7))
  plain = nnx.Linear(7, 5, rngs=nnx.Rngs(params=0))(x)  # same init: same weights
  for layer in (
    jnnx.Linear(7, 5, compressor=PerGroup(4, stochastic=False), rngs=nnx.Rngs(params=0)),
    jnnx.Linear(7, 5, bits=None, rngs=nnx.Rngs(params=0)),
  ):
    np.testing.assert_array_equal(layer(x), plain)  # the forward is exact
  np.testing.assert_allclose(
    jnnx.GELU(bits=None)(x), jax.nn.gelu(x, approximate=True), rtol=1e-6, atol=1e-7
  )


def test_bad_settings_are_clear_errors():
  with pytest.raises(ValueError, match="bits"):
    jnnx.Linear(3, 2, bits=9, rngs=_rngs())
  with pytest.raises(TypeError, match="unexpected keyword argument 'group_size'"):
    jnnx.GELU(group_size=7, rngs=_rngs())
  with pytest.raises(TypeError, match="dot_general"):
    jnnx.Linear(3, 2, dot_general=jax.lax.dot_general, rngs=_rngs())


class _Block(nnx.Module):
  def __init__(self, rngs):
    self.ln = jnnx.LayerNorm(16, rngs=rngs)
    self.act = jnnx.GELU(rngs=rngs)

  def __call__(self, x):
    return self.act(self.ln(x))


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.block = _Block(rngs)

  def __call__(self, x):
    return self.block(x)


def _split_loss(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def f(params, x):
    return nnx.merge(graphdef, params, rest, copy=True)(x).sum()

  return f, params


def test_residual_names_follow_attribute_paths():
  net = jnnx.name_residuals(_Net(_rngs()))
  assert net.block.ln.residual_name == "block/ln"
  f, params = _split_loss(net)
  names = set(residual_report(f, params, _normal((4, 16))).by_name())
  assert {"block/ln.xhat", "block/ln.inv_std", "block/act.dydx"} <= names, names


# ----------------------------------------------------------------------------- whole models


class CNN(nnx.Module):
  def __init__(self, rngs, *, twin: bool, bits: int = 4):
    kw = {"bits": bits} if twin else {}
    lib = jnnx if twin else nnx
    self.twin = twin
    self.conv1 = lib.Conv(3, 8, (3, 3), rngs=rngs, **kw)
    self.bn = lib.BatchNorm(8, rngs=rngs, **kw)
    self.conv2 = lib.Conv(8, 8, (3, 3), rngs=rngs, **kw)
    self.fc = lib.Linear(8 * 2 * 2, 10, rngs=rngs, **kw)
    if twin:
      self.relu, self.gelu = jnnx.ReLU(), jnnx.GELU(bits=bits, rngs=rngs)
      self.max_pool, self.avg_pool = jnnx.MaxPool((2, 2), (2, 2)), jnnx.AvgPool((2, 2), (2, 2))

  def __call__(self, x):
    if self.twin:
      relu, gelu, max_pool, avg_pool = self.relu, self.gelu, self.max_pool, self.avg_pool
    else:
      relu, gelu = jax.nn.relu, jax.nn.gelu
      max_pool = lambda x: nnx.max_pool(x, (2, 2), (2, 2))
      avg_pool = lambda x: nnx.avg_pool(x, (2, 2), (2, 2))
    x = max_pool(relu(self.bn(self.conv1(x))))
    x = avg_pool(gelu(self.conv2(x)))
    return self.fc(x.reshape(x.shape[0], -1))


@pytest.mark.slow
def test_nnx_jit_train_step_traces_once():
  x = _normal((8, 8, 8, 3))
  labels = jnp.arange(8) % 10
  model = CNN(_rngs(), twin=True)
  optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
  chex.clear_trace_counter()

  @nnx.jit
  @chex.assert_max_traces(n=1)
  def step(model, optimizer, x, labels):
    def loss_fn(model):
      logits = model(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, x, labels)) for _ in range(4)]
  assert all(np.isfinite(losses))
  assert losses[-1] < losses[0]
  assert int(model.conv1.jact_rngs.count[...]) == 4  # a fresh key every step


def _residual_bytes(f, *args):
  return sum(
    np.prod(a.shape) * a.dtype.itemsize
    for a, d in saved_residuals(f, *args)
    if not d.startswith("from the argument")
  )


@pytest.mark.slow
def test_residual_bytes_at_2_bits_at_most_an_eighth():
  x = _normal((32, 8, 8, 3))
  plain = CNN(nnx.Rngs(params=0), twin=False)
  twin = CNN(_rngs(), twin=True, bits=2)
  nnx.update(twin, *nnx.state(plain, *STATE))
  f_plain, p_plain = _split_loss(plain)
  f_twin, p_twin = _split_loss(twin)
  plain_bytes = _residual_bytes(f_plain, p_plain, x)
  twin_bytes = _residual_bytes(f_twin, p_twin, x)
  assert twin_bytes <= plain_bytes / 8, (twin_bytes, plain_bytes)
  # and it computes the same function
  np.testing.assert_allclose(twin(x), plain(x), rtol=1e-5, atol=1e-5)
