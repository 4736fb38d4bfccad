"""Tests of the linen twins (jact.nn): same variables, same forward,
close 8-bit gradients, clear errors, one trace per jitted step, small residuals."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jact.compressors import PerGroup
from jact._compat.testing import saved_residuals

from jact import nn as jnn
from jact._report import residual_report
from stats import DRAWS, assert_same_tree, assert_unbiased, over_keys, tree_rel_err

KEY = jax.random.key(0)
JACT = {"jact": jax.random.key(7)}
# 8-bit gradients: relative L2 error of every gradient leaf against the plain
# layer's gradient (see _rel_err). Measured errors are 0.5-1.5%; 5% leaves a
# margin while a wrong formula or a 2-bit copy (~25x the 8-bit error) fails.
GRAD_RTOL = 5e-2


def _normal(shape, seed=0):
  # numpy, not jax.random: no compilation per shape (keeps collection fast)
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _ids(shape, n, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, n, shape), jnp.int32)


# name -> (plain layer, twin layer, input, apply kwargs)
LAYERS = {
  "Dense": (nn.Dense(5), jnn.Dense(5, bits=8), _normal((6, 7)), {}),
  "Conv": (
    nn.Conv(4, (3, 3), strides=2, padding="CIRCULAR"),
    jnn.Conv(4, (3, 3), strides=2, padding="CIRCULAR", bits=8),
    _normal((2, 6, 6, 3)),
    {},
  ),
  "BatchNorm": (
    nn.BatchNorm(use_running_average=False, momentum=0.9),
    jnn.BatchNorm(use_running_average=False, momentum=0.9, bits=8),
    _normal((8, 4, 4, 3)) * 2.0 + 1.0,
    {"mutable": ["batch_stats"]},
  ),
  "LayerNorm": (nn.LayerNorm(), jnn.LayerNorm(bits=8), _normal((6, 16)) + 0.5, {}),
  "RMSNorm": (nn.RMSNorm(), jnn.RMSNorm(bits=8), _normal((6, 16)) + 0.5, {}),
  "MultiHeadDotProductAttention": (
    nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8),
    jnn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, bits=8),
    _normal((2, 5, 6)),
    {},
  ),
  "SelfAttention": (
    nn.SelfAttention(num_heads=2, qkv_features=8),
    jnn.SelfAttention(num_heads=2, qkv_features=8, bits=8),
    _normal((2, 5, 6)),
    {},
  ),
}
EMBED = (nn.Embed(11, 4), jnn.Embed(11, 4), _ids((3, 5), 11), {})


def _apply(layer, variables, x, rngs=None, mutable=False):
  out = layer.apply(variables, x, rngs=rngs, mutable=mutable)
  return out[0] if mutable else out


@pytest.mark.slow
@pytest.mark.parametrize("name", [*LAYERS, "Embed"])
def test_variables_equal_plain(name):
  plain, twin, x, _ = EMBED if name == "Embed" else LAYERS[name]
  ref = plain.init(KEY, x)
  # init with a single key (no 'jact' stream) falls back to the plain op ...
  assert_same_tree(twin.init(KEY, x), ref)
  # ... and init with the stream creates the very same variables.
  assert_same_tree(twin.init({"params": KEY, **JACT}, x), ref)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*LAYERS, "Embed"])
def test_forward_equals_plain_with_plain_variables(name):
  plain, twin, x, kw = EMBED if name == "Embed" else LAYERS[name]
  variables = plain.init(KEY, x)
  y_ref = _apply(plain, variables, x, **kw)
  y = _apply(twin, variables, x, rngs=JACT, **kw)
  assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
  # Dense/Conv/Embed call the very same lax op: bit-equal. Norms and attention
  # reassociate float32 reductions: equal to float32 rounding.
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)


def test_batch_norm_running_stats_update_like_flax():
  plain, twin, x, _ = LAYERS["BatchNorm"]
  variables = plain.init(KEY, x)
  _, upd_ref = plain.apply(variables, x, mutable=["batch_stats"])
  _, upd = twin.apply(variables, x, rngs=JACT, mutable=["batch_stats"])
  chex.assert_trees_all_close(upd["batch_stats"], upd_ref["batch_stats"], rtol=1e-6, atol=1e-7)
  # the inference path is Flax's own, using the running averages
  infer = {**variables, **upd}
  y_ref = nn.BatchNorm(momentum=0.9).apply(infer, x, use_running_average=True)
  np.testing.assert_array_equal(
    jnn.BatchNorm(momentum=0.9).apply(infer, x, use_running_average=True), y_ref
  )


# SelfAttention runs the same code as MultiHeadDotProductAttention: forward only.
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYERS if n != "SelfAttention"])
def test_8bit_gradients_close_to_plain(name):
  plain, twin, x, kw = LAYERS[name]
  variables = plain.init(KEY, x)
  params, rest = variables["params"], {k: v for k, v in variables.items() if k != "params"}
  probe = _normal(_apply(plain, variables, x, **kw).shape, seed=3)

  def loss(layer, rngs):
    def f(p, x):
      return jnp.sum(_apply(layer, {"params": p, **rest}, x, rngs=rngs, **kw) * probe)

    return jax.jit(jax.grad(f, argnums=(0, 1)))(params, x)

  g_ref = loss(plain, None)
  g = loss(twin, JACT)
  assert tree_rel_err(g, g_ref) < GRAD_RTOL


@pytest.mark.slow
def test_dense_weight_gradient_unbiased_at_2_bits():
  # The key plumbing gives independent noise per key: averaging over keys
  # recovers the exact gradient (tests.stats tolerances: pooled |z| < 4,
  # mean z^2 < 1.6).
  x = _normal((16, 8))
  layer = jnn.Dense(3, bits=2)
  variables = nn.Dense(3).init(KEY, x)
  probe = _normal((16, 3), seed=5)

  def grad_kernel(key):
    f = lambda p: jnp.sum(layer.apply({"params": p}, x, rngs={"jact": key}) * probe)
    return jax.grad(f)(variables["params"])["kernel"]

  samples = over_keys(grad_kernel, jax.random.split(jax.random.key(11), DRAWS))  # stats.py
  exact = jax.grad(lambda p: jnp.sum(nn.Dense(3).apply({"params": p}, x) * probe))(
    variables["params"]
  )["kernel"]
  assert_unbiased(samples, exact)
  # and the noise really changes with the key
  assert not np.allclose(samples[0], samples[1])


@pytest.mark.parametrize(
  "twin, fn",
  [
    (jnn.ReLU(), jax.nn.relu),
    (jnn.LeakyReLU(0.1), lambda x: jax.nn.leaky_relu(x, 0.1)),
    (jnn.GELU(False, bits=8), lambda x: jax.nn.gelu(x, approximate=False)),
    (jnn.SiLU(bits=8), jax.nn.silu),
    (jnn.Tanh(bits=8), jnp.tanh),
    (jnn.Sigmoid(bits=8), jax.nn.sigmoid),
    (jnn.Softmax(0, bits=8), lambda x: jax.nn.softmax(x, axis=0)),
  ],
)
@pytest.mark.slow
def test_activation_modules(twin, fn):
  x = _normal((8, 32))
  probe = _normal((8, 32), seed=4)
  assert twin.init(KEY, x) == {}
  np.testing.assert_array_equal(twin.apply({}, x, rngs=JACT), fn(x))
  np.testing.assert_array_equal(twin.apply({}, x), fn(x))  # no key: the plain function
  if not isinstance(twin, (jnn.ReLU, jnn.LeakyReLU)):  # these need no key at all
    with pytest.raises(ValueError, match="differentiated without an RNG stream"):
      jax.grad(lambda x: jnp.sum(twin.apply({}, x)))(x)
  g = jax.jit(jax.grad(lambda x: jnp.sum(twin.apply({}, x, rngs=JACT) * probe)))(x)
  g_ref = jax.grad(lambda x: jnp.sum(fn(x) * probe))(x)
  if isinstance(twin, (jnn.ReLU, jnn.LeakyReLU)):
    np.testing.assert_array_equal(g, g_ref)  # 1-bit masks are exact
  else:
    assert tree_rel_err(g, g_ref) < GRAD_RTOL


@pytest.mark.parametrize(
  "twin, fn",
  [
    (jnn.MaxPool((2, 2), (2, 2)), lambda x: nn.max_pool(x, (2, 2), (2, 2))),
    (jnn.MaxPool((3, 3), (1, 1), "SAME"), lambda x: nn.max_pool(x, (3, 3), (1, 1), "SAME")),
    (jnn.AvgPool((2, 2), (2, 2)), lambda x: nn.avg_pool(x, (2, 2), (2, 2))),
    (
      jnn.AvgPool((3, 3), (1, 1), "SAME", count_include_pad=False),
      lambda x: nn.avg_pool(x, (3, 3), (1, 1), "SAME", count_include_pad=False),
    ),
  ],
)
@pytest.mark.slow
def test_pooling_modules_exact(twin, fn):
  x = _normal((2, 6, 6, 3))
  probe = _normal(fn(x).shape, seed=4)
  np.testing.assert_allclose(twin.apply({}, x), fn(x), rtol=1e-6, atol=1e-7)
  g = jax.jit(jax.grad(lambda x: jnp.sum(twin.apply({}, x) * probe)))(x)
  g_ref = jax.grad(lambda x: jnp.sum(fn(x) * probe))(x)
  np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-6)


def test_dropout_twin():
  x = jnp.ones((64, 64))
  twin = jnn.Dropout(0.25)
  np.testing.assert_array_equal(twin.apply({}, x, deterministic=True), x)
  apply = jax.jit(
    lambda x: twin.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
  )
  y = apply(x)
  kept = np.asarray(y != 0)
  np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.75)
  # keep fraction within 5 binomial standard deviations of 0.75
  n = kept.size
  assert abs(kept.mean() - 0.75) < 5 * np.sqrt(0.75 * 0.25 / n)
  # the backward applies the forward's mask
  g = jax.jit(jax.grad(lambda x: apply(x).sum()))(x)
  np.testing.assert_array_equal(g, y)
  # it uses Flax's 'dropout' stream, not 'jact'
  with pytest.raises(Exception, match="dropout"):
    twin.apply({}, x, deterministic=False, rngs=JACT)


@pytest.mark.slow
def test_bfloat16_like_flax():
  x = _normal((4, 16)).astype(jnp.bfloat16)
  pairs = [
    (nn.Dense(8, dtype=jnp.bfloat16), jnn.Dense(8, dtype=jnp.bfloat16)),
    (nn.LayerNorm(), jnn.LayerNorm()),
  ]  # bf16 input, f32 params: f32 output
  variables = [plain.init(KEY, x) for plain, _ in pairs]

  @jax.jit
  def run(variables, x):
    out = []
    for (plain, twin), v in zip(pairs, variables):
      for layer, rngs in ((plain, None), (twin, JACT)):
        f = lambda x: layer.apply(v, x, rngs=rngs)
        y, vjp = jax.vjp(f, x)
        out.append((y, vjp(jnp.ones_like(y))[0]))
    return out

  out = run(variables, x)
  for (y_ref, g_ref), (y, g) in zip(out[::2], out[1::2]):
    assert y.dtype == y_ref.dtype and g.dtype == g_ref.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y, y_ref)


@pytest.mark.slow
@pytest.mark.parametrize(
  "name", ["Dense", "Conv", "BatchNorm", "LayerNorm", "RMSNorm", "MultiHeadDotProductAttention"]
)
def test_without_stream_forward_is_plain_and_differentiating_is_a_clear_error(name):
  plain, twin, x, kw = LAYERS[name]
  variables = plain.init(KEY, x)
  # inference needs no 'jact' stream: the plain layer's output, bit for bit
  np.testing.assert_array_equal(_apply(twin, variables, x, **kw), _apply(plain, variables, x, **kw))
  loss = lambda v, x: jnp.sum(_apply(twin, v, x, **kw))
  message = (
    rf"jact.nn.{name} .*differentiated without an RNG stream named 'jact'.*rngs=\{{'jact': key\}}"
  )
  with pytest.raises(ValueError, match=message):
    jax.grad(loss)(variables, x)  # parameters only (the input is data)
  with pytest.raises(ValueError, match=message):
    jax.vjp(lambda x: _apply(twin, variables, x, **kw), x)  # the input only
  with pytest.raises(ValueError, match=message):  # forward mode too
    jax.jvp(lambda x: _apply(twin, variables, x, **kw), (x,), (x,))
  # nothing differentiated through the layer: no key needed
  jax.grad(lambda v, x: loss(jax.lax.stop_gradient(v), x) + jnp.sum(x))(variables, x)


@pytest.mark.slow
def test_decoding_without_stream_is_flax_decoding():
  make = lambda cls: cls(num_heads=2, qkv_features=8, decode=True)
  x = _normal((1, 4, 8))
  variables = make(nn.SelfAttention).init(KEY, x)
  caches = [variables["cache"]] * 2
  for t in range(x.shape[1]):  # token by token, through the key/value cache
    out = [
      make(cls).apply(
        {"params": variables["params"], "cache": cache}, x[:, t : t + 1], mutable=["cache"]
      )
      for cls, cache in zip((nn.SelfAttention, jnn.SelfAttention), caches)
    ]
    np.testing.assert_array_equal(out[1][0], out[0][0])
    caches = [o[1]["cache"] for o in out]


def test_no_stream_needed_without_stochastic_rounding():
  x = _normal((6, 7))
  variables = nn.Dense(5).init(KEY, x)
  plain = nn.Dense(5).apply(variables, x)
  for twin in (jnn.Dense(5, compressor=PerGroup(4, stochastic=False)), jnn.Dense(5, bits=None)):
    np.testing.assert_array_equal(twin.apply(variables, x), plain)  # no rngs; exact forward
  np.testing.assert_allclose(
    jnn.GELU(bits=None).apply({}, x), jax.nn.gelu(x, approximate=True), rtol=1e-6, atol=1e-7
  )


def test_bad_settings_are_clear_errors():
  x = _normal((6, 7))
  with pytest.raises(ValueError, match="bits"):
    jnn.Dense(5, bits=9).init({"params": KEY, **JACT}, x)
  with pytest.raises(TypeError, match="unexpected keyword argument 'group_size'"):
    jnn.GELU(group_size=7).init(JACT, x)
  with pytest.raises(TypeError, match="dot_general"):
    jnn.Dense(5, dot_general=jax.lax.dot_general).init(KEY, x)


def test_residual_names_follow_module_paths():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jnn.LayerNorm(name="ln")(x)
      return jnn.Dense(4, name="fc")(jnn.GELU(name="act")(x))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Block(name="block")(x)

  x = _normal((4, 16))
  variables = Net().init(KEY, x)
  f = lambda p, x: Net().apply({"params": p}, x, rngs=JACT).sum()
  names = set(residual_report(f, variables["params"], x).by_name())
  assert {"block/ln.xhat", "block/act.dydx", "block/fc.lhs"} <= names, names


# ----------------------------------------------------------------------------- whole models


class PlainCNN(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.relu(x)
    x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.Conv(8, (3, 3))(x)
    x = nn.gelu(x)
    x = nn.avg_pool(x, (2, 2), (2, 2))
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(10)(x)


class TwinCNN(nn.Module):
  bits: int = 4

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = jnn.Conv(8, (3, 3), bits=self.bits)(x)
    x = jnn.BatchNorm(use_running_average=not train, bits=self.bits)(x)
    x = jnn.ReLU()(x)
    x = jnn.MaxPool((2, 2), (2, 2))(x)
    x = jnn.Conv(8, (3, 3), bits=self.bits)(x)
    x = jnn.GELU(bits=self.bits)(x)
    x = jnn.AvgPool((2, 2), (2, 2))(x)
    x = x.reshape(x.shape[0], -1)
    return jnn.Dense(10, bits=self.bits)(x)


def _random_like(shapes, seed=0):
  """Values for a variable tree (Flax's initializers are slow to compile on CPU)."""
  leaves, treedef = jax.tree.flatten(shapes)
  return jax.tree.unflatten(
    treedef, [0.3 * _normal(s.shape, seed + i) for i, s in enumerate(leaves)]
  )


@pytest.fixture(scope="module")
def cnn_variables():
  variables = _random_like(jax.eval_shape(PlainCNN().init, KEY, _normal((8, 8, 8, 3))))
  variables["batch_stats"] = jax.tree.map(jnp.abs, variables["batch_stats"])  # var > 0
  return variables


def test_plain_checkpoint_loads_into_twin_model(cnn_variables):
  x = _normal((8, 8, 8, 3))
  shapes = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)
  assert shapes(jax.eval_shape(TwinCNN().init, KEY, x)) == shapes(cnn_variables)

  @jax.jit
  def forward(variables, x):
    return [
      m.apply(variables, x, rngs=JACT, mutable=["batch_stats"]) for m in (PlainCNN(), TwinCNN())
    ]

  (y_ref, stats_ref), (y, stats) = forward(cnn_variables, x)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(stats, stats_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_jitted_train_step_traces_once(cnn_variables):
  x = _normal((8, 8, 8, 3))
  labels = jnp.arange(8) % 10
  model = TwinCNN()
  variables = cnn_variables
  tx = optax.sgd(0.05)
  opt_state = tx.init(variables["params"])

  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, batch_stats, opt_state, key):
    def loss_fn(params):
      logits, upd = model.apply(
        {"params": params, "batch_stats": batch_stats},
        x,
        rngs={"jact": key},
        mutable=["batch_stats"],
      )
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), upd

    (loss, upd), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), upd["batch_stats"], opt_state, loss

  params, stats = variables["params"], variables["batch_stats"]
  losses = []
  for key in jax.random.split(jax.random.key(1), 4):
    params, stats, opt_state, loss = step(params, stats, opt_state, key)
    losses.append(float(loss))
  assert all(np.isfinite(losses))
  assert losses[-1] < losses[0]  # a few SGD steps on one batch reduce its loss
  assert not jnp.allclose(
    stats["BatchNorm_0"]["mean"], variables["batch_stats"]["BatchNorm_0"]["mean"]
  )


def _residual_bytes(fn, *args):
  return sum(
    np.prod(a.shape) * a.dtype.itemsize
    for a, d in saved_residuals(fn, *args)
    if not d.startswith("from the argument")
  )


def test_residual_bytes_at_2_bits_at_most_an_eighth():
  # residuals are traced abstractly: the values do not matter
  x = jnp.zeros((16, 16, 16, 3))
  shapes = jax.eval_shape(PlainCNN().init, KEY, x)
  variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  def loss(model, rngs):
    def f(params, x):
      y, _ = model.apply(
        {"params": params, "batch_stats": variables["batch_stats"]},
        x,
        rngs=rngs,
        mutable=["batch_stats"],
      )
      return y.sum()

    return f

  plain = _residual_bytes(loss(PlainCNN(), None), variables["params"], x)
  twin = _residual_bytes(loss(TwinCNN(bits=2), JACT), variables["params"], x)
  assert twin <= plain / 8, (twin, plain)
