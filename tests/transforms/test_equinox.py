"""Equinox models through `jact.compressed`, written as Equinox users write them.

Two recipes: wrap the loss of an `eqx.Module` (`jact.compressed(loss)`, then
`eqx.filter_grad`), or wrap the module itself (`jact.compressed(module)`, a
pytree holding the module, so gradients reach its parameters and Equinox's
`key=` still drives dropout).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact

eqx = pytest.importorskip("equinox", reason="the Equinox recipes need equinox (test extras)")

BATCH, CHANNELS, SIZE = 4, 3, 16
SEQ, DIM, HEADS = 16, 32, 4


# ----------------------------------------------------------------------------- models


class CNN(eqx.Module):
  """Conv -> GroupNorm -> relu -> max pool -> conv -> LayerNorm -> gelu -> mean -> Linear."""

  conv1: eqx.nn.Conv2d
  norm1: eqx.nn.GroupNorm
  pool: eqx.nn.MaxPool2d
  conv2: eqx.nn.Conv2d
  norm2: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, key, width=16, classes=10, size=SIZE):
    k1, k2, k3 = jax.random.split(key, 3)
    self.conv1 = eqx.nn.Conv2d(CHANNELS, width, 3, padding=1, key=k1)
    self.norm1 = eqx.nn.GroupNorm(4, width)
    self.pool = eqx.nn.MaxPool2d(2, 2)
    self.conv2 = eqx.nn.Conv2d(width, 2 * width, 3, padding=1, key=k2)
    self.norm2 = eqx.nn.LayerNorm((2 * width, size // 2, size // 2))
    self.head = eqx.nn.Linear(2 * width, classes, key=k3)

  def __call__(self, x):
    x = self.pool(jax.nn.relu(self.norm1(self.conv1(x))))
    x = jax.nn.gelu(self.norm2(self.conv2(x)))
    return self.head(jnp.mean(x, axis=(1, 2)))


class DoubleConv(eqx.Module):
  conv1: eqx.nn.Conv2d
  norm: eqx.nn.GroupNorm
  conv2: eqx.nn.Conv2d

  def __init__(self, cin, cout, key):
    k1, k2 = jax.random.split(key)
    self.conv1 = eqx.nn.Conv2d(cin, cout, 3, padding=1, key=k1)
    self.norm = eqx.nn.GroupNorm(2, cout)
    self.conv2 = eqx.nn.Conv2d(cout, cout, 3, padding=1, key=k2)

  def __call__(self, x):
    return jax.nn.silu(self.conv2(jax.nn.relu(self.norm(self.conv1(x)))))


class UNet(eqx.Module):
  """Two levels: down with average pooling, up with ConvTranspose2d, skips concatenated."""

  down1: DoubleConv
  pool: eqx.nn.AvgPool2d
  down2: DoubleConv
  up: eqx.nn.ConvTranspose2d
  up1: DoubleConv
  out: eqx.nn.Conv2d

  def __init__(self, key, width=8):
    k = jax.random.split(key, 5)
    self.down1 = DoubleConv(CHANNELS, width, k[0])
    self.pool = eqx.nn.AvgPool2d(2, 2)
    self.down2 = DoubleConv(width, 2 * width, k[1])
    self.up = eqx.nn.ConvTranspose2d(2 * width, width, 2, stride=2, key=k[2])
    self.up1 = DoubleConv(2 * width, width, k[3])
    self.out = eqx.nn.Conv2d(width, 1, 1, key=k[4])

  def __call__(self, x):
    skip = self.down1(x)
    h = self.up(self.down2(self.pool(skip)))
    return self.out(self.up1(jnp.concatenate([h, skip], axis=0)))


class TransformerBlock(eqx.Module):
  """Pre-norm attention + MLP on one sequence (vmap over tokens), dropout keyed by `key`."""

  norm1: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  norm2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP
  dropout: eqx.nn.Dropout

  def __init__(self, key, dim=DIM, heads=HEADS, p=0.1):
    k1, k2 = jax.random.split(key)
    self.norm1 = eqx.nn.LayerNorm(dim)
    self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
    self.norm2 = eqx.nn.LayerNorm(dim)
    self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, 1, activation=jax.nn.gelu, key=k2)
    self.dropout = eqx.nn.Dropout(p)

  def __call__(self, x, *, key=None):
    h = jax.vmap(self.norm1)(x)
    x = x + self.attn(h, h, h)
    h = jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
    return x + self.dropout(h, key=key, inference=key is None)


class CompressedStack(eqx.Module):
  """A model that holds compressed blocks as fields (the module-wrap recipe)."""

  blocks: list

  def __init__(self, key, depth=2, bits=8):
    self.blocks = [
      jact.compressed(TransformerBlock(k), bits=bits, name=f"block{i}")
      for i, k in enumerate(jax.random.split(key, depth))
    ]

  def __call__(self, x, *, key):
    for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
      x = block(x, key=k)
    return x


# ----------------------------------------------------------------------------- helpers


def _images(seed=1):
  return jax.random.normal(jax.random.key(seed), (BATCH, CHANNELS, SIZE, SIZE))


def _tokens(seed=1):
  return jax.random.normal(jax.random.key(seed), (BATCH, SEQ, DIM))


def _cnn_loss(model, x):
  logits = jax.vmap(model)(x)
  labels = jnp.arange(x.shape[0]) % logits.shape[-1]
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def _regression_loss(model, x):
  target = jnp.cos(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) / 7)
  return jnp.mean((jax.vmap(model)(x)[:, : x.shape[1]] - target[:, :1]) ** 2)


def _sequence_loss(model, x, key):
  keys = jax.random.split(key, x.shape[0])
  y = jax.vmap(lambda xi, k: model(xi, key=k))(x, keys)
  return jnp.mean((y - jnp.sin(x)) ** 2)


def _rel_error(a, b) -> float:
  flat = lambda t: jnp.concatenate([jnp.ravel(v) for v in jax.tree.leaves(t)])
  return float(jnp.linalg.norm(flat(a) - flat(b)) / jnp.linalg.norm(flat(b)))


def _params(model):
  return eqx.filter(model, eqx.is_array)


def _assert_same_finite_pattern_and_nonzero(got, want):
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    where = jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w), err_msg=where)
    assert bool(jnp.any(g != 0)) == bool(jnp.any(w != 0)), where


# ----------------------------------------------------------------------------- shared steps
# Compiling an Equinox training step takes seconds; the steps several tests
# compare against are compiled and run once (on the fixed models and inputs
# above; the results are arrays, never modified).


@functools.cache
def _plain_value_and_grads(make, loss):
  """Plain loss and gradients of `make(key 0)` on `_images()` (CNN or UNet)."""
  return eqx.filter_jit(eqx.filter_value_and_grad(loss))(make(jax.random.key(0)), _images())


@functools.cache
def _cnn_8_bit_value_and_grads():
  """The CNN's loss wrap at 8 bits under `eqx.filter_jit`, rounding key 2."""
  fast = jact.compressed(_cnn_loss, bits=8)
  return eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x, k: fast(m, x, key=k)))(
    CNN(jax.random.key(0)), _images(), jax.random.key(2)
  )


# ----------------------------------------------------------------------------- loss wrap


@pytest.mark.slow  # compiles an Equinox model's training step twice (plain and jact): ~5-30 s
def test_cnn_loss_wrap_gives_plain_loss_and_gradients_within_1_percent_at_8_bits():
  loss, grads = _cnn_8_bit_value_and_grads()
  plain_loss, plain = _plain_value_and_grads(CNN, _cnn_loss)
  assert loss == plain_loss  # the forward pass is exact
  _assert_same_finite_pattern_and_nonzero(grads, plain)
  assert _rel_error(grads, plain) < 0.01


@pytest.mark.slow  # compiles an Equinox model's training step twice (plain and jact): ~5-30 s
def test_partition_combine_and_filter_jit_recipes_agree():
  model, x = CNN(jax.random.key(0)), _images()
  params, static = eqx.partition(model, eqx.is_array)
  fast = jact.compressed(lambda p, x: _cnn_loss(eqx.combine(p, static), x), bits=8)
  by_partition = jax.jit(jax.grad(lambda p, x, k: fast(p, x, key=k)))(params, x, jax.random.key(2))
  _, by_filter = _cnn_8_bit_value_and_grads()  # jact.compressed(_cnn_loss, bits=8), key 2
  # The same residuals rounded with the same key: the same gradients.
  np.testing.assert_allclose(_rel_error(by_filter, by_partition), 0.0, atol=1e-6)
  assert _rel_error(by_partition, _plain_value_and_grads(CNN, _cnn_loss)[1]) < 0.01


@pytest.mark.slow  # compiles an Equinox model's training step twice (plain and jact): ~5-30 s
@pytest.mark.parametrize(
  "make,loss", [(CNN, _cnn_loss), (UNet, _regression_loss)], ids=["cnn", "unet"]
)
def test_bits_none_is_plain(make, loss):
  model, x = make(jax.random.key(0)), _images()
  kept = jact.compressed(loss, bits=None)
  value, grads = eqx.filter_jit(eqx.filter_value_and_grad(kept))(model, x)
  plain_value, plain = _plain_value_and_grads(make, loss)
  np.testing.assert_allclose(value, plain_value, rtol=1e-6)  # fused differently under jit
  # rtol/atol 1e-5: float32 reassociation between jax's VJP and the replayed jaxpr, nothing else.
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(plain)):
    np.testing.assert_allclose(g, p, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # compiles an Equinox model's training step twice (plain and jact): ~5-30 s
def test_batch_norm_state_through_a_loss_wrap_matches_plain():
  class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.conv = eqx.nn.Conv2d(CHANNELS, 16, 3, padding=1, key=k1)
      self.norm = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
      self.head = eqx.nn.Linear(16, 10, key=k2)

    def __call__(self, x, state):
      x, state = self.norm(self.conv(x), state)
      return self.head(jax.nn.relu(x).mean((1, 2))), state

  model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
  x = _images()

  def loss(model, state, x):
    out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return jnp.mean(out**2), state

  fast = jact.compressed(loss, bits=8)
  (value, new_state), grads = eqx.filter_jit(
    eqx.filter_value_and_grad(lambda m, s, x: fast(m, s, x, key=jax.random.key(3)), has_aux=True)
  )(model, state, x)
  (plain_value, plain_state), plain = eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))(
    model, state, x
  )
  assert value == plain_value
  for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(plain_state)):
    np.testing.assert_array_equal(a, b)
  _assert_same_finite_pattern_and_nonzero(grads, plain)
  assert _rel_error(grads, plain) < 0.01


# ----------------------------------------------------------------------------- module wrap


@pytest.mark.slow  # compiles an Equinox model's training step twice (plain and jact): ~5-30 s
def test_a_wrapped_module_is_a_pytree_whose_parameters_get_gradients():
  """The U-Net case: a closure over the module would hide its weights (zero gradient)."""
  unet, x = UNet(jax.random.key(0)), _images()
  fast = jact.compressed(unet, bits=8)
  assert len(jax.tree.leaves(_params(fast))) == len(jax.tree.leaves(_params(unet)))
  key = jax.random.key(4)  # UNet takes no key: it is the rounding key
  grads = eqx.filter_jit(
    eqx.filter_grad(lambda m, x: _regression_loss(functools.partial(m, key=key), x))
  )(fast, x)
  plain = _plain_value_and_grads(UNet, _regression_loss)[1]
  _assert_same_finite_pattern_and_nonzero(grads.module, plain)
  assert _rel_error(grads.module, plain) < 0.01
  # Optimizer updates apply to the wrapper like to the module.
  stepped = eqx.apply_updates(fast, jax.tree.map(lambda g: -0.1 * g, grads))
  assert isinstance(stepped, type(fast)) and isinstance(stepped.module, UNet)


@pytest.mark.slow  # compiles an Equinox model's training step twice (plain and jact): ~5-30 s
def test_transformer_block_module_wrap_passes_the_dropout_key_on():
  block, x, key = TransformerBlock(jax.random.key(0)), _tokens(), jax.random.key(5)
  fast = jact.compressed(block, bits=8)
  keys = jax.random.split(key, BATCH)
  # Training mode: the module gets `key` (Equinox's dropout key), so the forward pass is plain's.
  forward = lambda m, x, k: jax.vmap(lambda x, k: m(x, key=k))(x, k)
  np.testing.assert_array_equal(
    eqx.filter_jit(forward)(fast, x, keys), eqx.filter_jit(forward)(block, x, keys)
  )
  grads = eqx.filter_jit(eqx.filter_grad(_sequence_loss))(fast, x, key)
  plain = eqx.filter_jit(eqx.filter_grad(_sequence_loss))(block, x, key)
  _assert_same_finite_pattern_and_nonzero(grads.module, plain)
  assert _rel_error(grads.module, plain) < 0.01


@pytest.mark.slow  # compiles an Equinox model's training step twice (plain and jact): ~5-30 s
def test_checkpointed_module_keeps_a_compressed_copy_of_its_input_and_gets_gradients():
  block, x, key = TransformerBlock(jax.random.key(0)), _tokens()[0], jax.random.key(9)
  remat = jact.checkpoint(block, bits=8, compress_argnums=(0,))  # x is the module call's arg 0

  def loss(m, x, key):
    return jnp.mean((m(x, key=key) - 1.0) ** 2)

  grads = eqx.filter_jit(eqx.filter_grad(loss))(remat, x, key)
  plain = eqx.filter_jit(eqx.filter_grad(loss))(block, x, key)
  _assert_same_finite_pattern_and_nonzero(grads.module, plain)
  assert _rel_error(grads.module, plain) < 0.01
  saved = jact.residual_report(loss, remat, x, key).by_name()
  assert saved and all(name.startswith("checkpoint") for name in saved if name is not None)


@pytest.mark.slow  # compiles an Equinox model's training step twice (plain and jact): ~5-30 s
def test_model_holding_compressed_blocks_trains_under_filter_jit():
  model, x, key = CompressedStack(jax.random.key(0)), _tokens(), jax.random.key(6)
  plain_model = eqx.tree_at(lambda m: m.blocks, model, [b.module for b in model.blocks])

  def loss(m, x, key):
    return jnp.mean((jax.vmap(functools.partial(m, key=key))(x) - 1.0) ** 2)

  grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x, key)
  plain = eqx.filter_jit(eqx.filter_grad(loss))(plain_model, x, key)
  got = [b.module for b in grads.blocks]
  _assert_same_finite_pattern_and_nonzero(got, plain.blocks)
  assert _rel_error(got, plain.blocks) < 0.01


class TinyLM(eqx.Module):
  """Embedding -> transformer block -> LayerNorm -> vocabulary logits, per sequence."""

  embed: eqx.nn.Embedding
  block: TransformerBlock
  norm: eqx.nn.LayerNorm
  unembed: eqx.nn.Linear

  def __init__(self, key, vocab=64):
    k1, k2, k3 = jax.random.split(key, 3)
    self.embed = eqx.nn.Embedding(vocab, DIM, key=k1)
    self.block = TransformerBlock(k2)
    self.norm = eqx.nn.LayerNorm(DIM)
    self.unembed = eqx.nn.Linear(DIM, vocab, key=k3)

  def __call__(self, tokens, *, key=None):
    h = self.block(jax.vmap(self.embed)(tokens), key=key)
    return jax.vmap(lambda t: self.unembed(self.norm(t)))(h)


def _next_token_loss(model, tokens, key):
  logits = jax.vmap(lambda t, k: model(t, key=k))(
    tokens[:, :-1], jax.random.split(key, tokens.shape[0])
  )
  log_p = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(log_p, tokens[:, 1:, None], axis=-1))


@pytest.mark.slow  # compiles an Equinox model's training step twice (plain and jact): ~5-30 s
def test_language_model_loss_wrap_within_1_percent_at_8_bits():
  model, key = TinyLM(jax.random.key(0)), jax.random.key(7)
  tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, 64)
  fast = jact.compressed(_next_token_loss, bits=8)
  grads = eqx.filter_jit(eqx.filter_grad(lambda m, t, k: fast(m, t, k, key=jax.random.key(8))))(
    model, tokens, key
  )
  plain = eqx.filter_jit(eqx.filter_grad(_next_token_loss))(model, tokens, key)
  _assert_same_finite_pattern_and_nonzero(grads, plain)
  assert _rel_error(grads, plain) < 0.01


# ----------------------------------------------------------------------------- what it saves


def test_residual_report_shows_what_a_2_bit_cnn_saves():
  model, x = CNN(jax.random.key(0)), _images()
  fast = jact.compressed(_cnn_loss, bits=2, name="cnn")
  report = jact.residual_report(lambda m, x: fast(m, x, key=jax.random.key(0)), model, x)
  plain = jact.residual_report(_cnn_loss, model, x)
  names = [n for n in report.by_name() if n is not None]
  assert names and all(n.startswith("cnn.") for n in names)
  assert report.total_bytes < plain.total_bytes / 4
  assert "saved for backward" in str(report)
  # The model's parameters are arguments, kept by reference, not counted as saved.
  assert report.argument_bytes > 0


@pytest.mark.slow  # compiles two CNN training steps (~5 s each on a shared CPU)
def test_compiled_temp_memory_of_the_cnn_step_falls_at_2_bits():
  model = CNN(jax.random.key(0), width=32, size=32)
  x = jax.ShapeDtypeStruct((16, CHANNELS, 32, 32), jnp.float32)
  fast = jact.compressed(_cnn_loss, bits=2)

  def step(loss):
    return eqx.filter_grad(loss)

  plain = jact.compiled_memory(step(_cnn_loss), model, x)
  small = jact.compiled_memory(step(lambda m, x: fast(m, x, key=jax.random.key(0))), model, x)
  assert small.temp_bytes < 0.6 * plain.temp_bytes, (small.temp_bytes, plain.temp_bytes)


# ------------------------------------------------------------------------ module wrap: arguments


class Gate(eqx.Module):
  """Two activation arguments; no key."""

  proj: eqx.nn.Linear

  def __init__(self, key):
    self.proj = eqx.nn.Linear(8, 8, key=key)

  def __call__(self, x, y):
    return jnp.tanh(jax.vmap(self.proj)(x)) * y


class NoisyBlock(eqx.Module):
  """Equinox's dropout convention, with the key a positional parameter."""

  proj: eqx.nn.Linear
  drop: eqx.nn.Dropout

  def __init__(self, key):
    self.proj = eqx.nn.Linear(8, 8, key=key)
    self.drop = eqx.nn.Dropout(0.25)

  def __call__(self, x, key):
    return self.drop(jax.nn.gelu(jax.vmap(self.proj)(x)), key=key)


class KeywordKeyBlock(NoisyBlock):
  def __call__(self, x, *, key):
    return super().__call__(x, key)


_X8 = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32)


@pytest.mark.parametrize("wrap", [jact.compressed, jact.checkpoint])
def test_module_wrap_errors_count_the_modules_own_arguments(wrap):
  gate = wrap(Gate(jax.random.key(0)), bits=2, compress_argnums=(2,))
  with pytest.raises(ValueError, match=r"compress_argnums=\(2,\) but Gate got 2 positional"):
    gate(_X8, _X8, key=jax.random.key(1))


def test_module_key_in_its_position_seeds_the_rounding_as_key_does():
  block, key = NoisyBlock(jax.random.key(0)), jax.random.key(3)
  fast = jact.compressed(block, bits=2)
  np.testing.assert_array_equal(fast(_X8, key), block(_X8, key))  # dropout: plain's mask
  grad = lambda call: eqx.filter_grad(lambda m: jnp.sum(call(m) ** 2))(fast).module.proj.weight
  positional, keyword = grad(lambda m: m(_X8, key)), grad(lambda m: m(_X8, key=key))
  np.testing.assert_array_equal(positional, keyword)


def test_module_key_conflicts_are_explained():
  block, key = NoisyBlock(jax.random.key(0)), jax.random.key(3)
  with pytest.raises(TypeError, match=r"NoisyBlock got its `key` twice: positionally \(argument 1"):
    jact.compressed(block, bits=2)(_X8, key, key=key)
  with pytest.raises(
    TypeError, match=r"NoisyBlock's call needs its `key`.*key= \(or as argument 1"
  ):
    jact.compressed(block, bits=2)(_X8)
  keyword_only = jact.checkpoint(KeywordKeyBlock(jax.random.key(0)), compress_argnums=(0,))
  with pytest.raises(TypeError, match=r"KeywordKeyBlock's call needs its `key`.*Pass it as key=:"):
    keyword_only(_X8)
