"""jact.convert on models written like ordinary Flax example code: recurrent cells
(inside nn.RNN, nn.Bidirectional, a hand-written nn.scan), layers with no twin
(DenseGeneral, Einsum, ConvTranspose, GroupNorm), activation and pooling
functions, and an nnx scan over blocks built with nnx.vmap. Each model is
compared with the same model unconverted, on the same variables: identical
forward, far fewer saved bytes at 2 bits, gradients within a few percent at 8
bits; and `conversion_report` lists every layer."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jact
from jact._convert import ConversionWarning

KEY = jax.random.key(1)
# Everything runs compiled (eagerly, each op of a jact model compiles on its own),
# without LLVM's optimizations: what is checked is values, not speed.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _rel_err(a, b) -> float:
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(a, b))
  return (num / sum(float(jnp.sum(y**2)) for y in b)) ** 0.5


# ----------------------------------------------------------------------------- linen models


class Classifier(nn.Module):
  """An SST-2 style BiLSTM: OptimizedLSTMCell forward, GRUCell backward."""

  @nn.compact
  def __call__(self, x):
    h = nn.Bidirectional(nn.RNN(nn.OptimizedLSTMCell(32)), nn.RNN(nn.GRUCell(32)))(x)
    return nn.Dense(2)(nn.relu(h.mean(axis=1)))


class Encoder(nn.Module):
  """A seq2seq-style encoder: an LSTMCell scanned by hand (split_rngs lists params only)."""

  @nn.compact
  def __call__(self, x):
    scan = nn.scan(
      nn.LSTMCell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1, out_axes=1
    )
    cell = scan(features=32)
    carry = cell.initialize_carry(jax.random.key(0), x[:, 0].shape)
    _, h = cell(carry, x)
    return nn.Dense(2)(h[:, -1])


class ConvNet(nn.Module):
  """Convolutions, GroupNorm, gelu/silu/relu, max and average pooling,
  ConvTranspose, DenseGeneral and Einsum."""

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.GroupNorm(num_groups=4)(nn.Conv(16, (3, 3))(x)))
    x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = nn.silu(nn.ConvTranspose(8, (2, 2), strides=(2, 2))(x))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.DenseGeneral((4, 8))(x)
    x = nn.Einsum((4, 8, 16), "...hd,hdf->...f")(x)
    return nn.relu(x).mean(axis=(1, 2))


LINEN = {
  "bilstm": (Classifier, (16, 8, 32)),
  "scan": (Encoder, (16, 8, 32)),
  "convnet": (ConvNet, (8, 16, 16, 8)),
}


def _linen(name):
  cls, shape = LINEN[name]
  x = jax.random.normal(jax.random.key(2), shape)
  variables = _jit(cls().init)(jax.random.key(0), x)
  plain = lambda v, x: jnp.sum(cls().apply(v, x) ** 2)

  def converted(**settings):
    model = jact.convert(cls(), **settings)
    return lambda v, x: jnp.sum(model.apply(v, x, rngs={"jact": KEY}) ** 2)

  return x, variables, plain, converted


@pytest.mark.slow
@pytest.mark.parametrize("name", LINEN)
def test_linen_forward_bytes_and_gradients(name):
  x, variables, plain, converted = _linen(name)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ConversionWarning)  # every layer is converted
    loss2 = converted(bits=2)
    np.testing.assert_array_equal(_jit(loss2)(variables, x), _jit(plain)(variables, x))
    # Measured: bilstm 381056 -> 25424 B (15x), scan 67712 -> 4616 (15x),
    # convnet 1403212 -> 90168 (16x) saved for the backward pass
    before = jact.residual_report(plain, variables, x).total_bytes
    after = jact.residual_report(loss2, variables, x).total_bytes
    assert after * 10 < before, (before, after)
    # 8 bits: within 2.4% (measured 1.6%, 1.3%, 2.4%)
    g_ref = _jit(jax.grad(plain))(variables, x)
    g = _jit(jax.grad(converted(bits=8)))(variables, x)
  assert _rel_err(g, g_ref) < 0.04


@pytest.mark.slow
def test_linen_functions_opt_out_and_report():
  x, variables, plain, converted = _linen("convnet")
  loss, layers_only = converted(bits=2), converted(bits=2, functions=False)
  report = jact.conversion_report(loss, variables, x)
  how = {r.path: r.how for r in report.rows}
  assert how == {
    "ConvNet": "model",
    "Conv_0": "twin",
    "GroupNorm_0": "engine",
    "ConvTranspose_0": "engine",
    "DenseGeneral_0": "engine",
    "Einsum_0": "engine",
  }, how
  engine = [r for r in report.rows if r.how == "engine"]
  assert all(r.saved_bytes < r.plain_bytes for r in engine if r.plain_bytes > 4096)
  # without the model's call through the engine, what gelu/silu/relu and the
  # pooling save stays: more bytes, fewer than the plain model
  saved = lambda f: jact.residual_report(f, variables, x).total_bytes
  assert saved(loss) < saved(layers_only) < saved(plain)
  assert "ConvNet" not in {r.path for r in jact.conversion_report(layers_only, variables, x).rows}


class OddNorm(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(64)(x)
    x = nn.LayerNorm(reduction_axes=(-2, -1))(x)  # no twin for several axes
    return nn.Dense(2)(x)


@pytest.mark.slow
def test_linen_report_warns_about_plain_layers_with_their_share():
  x = jnp.ones((4, 16, 32))
  variables = OddNorm().init(jax.random.key(0), x)
  loss = lambda model: lambda v, x: jnp.sum(model.apply(v, x, rngs={"jact": KEY}))
  layers_only = loss(jact.convert(OddNorm(), bits=2, functions=False))
  with pytest.warns(ConversionWarning, match=r"LayerNorm_0 .*runs uncompressed.*\d+% of"):
    report = jact.conversion_report(layers_only, variables, x)
  (row,) = report.plain()
  assert row.path == "LayerNorm_0" and row.layer == "LayerNorm"
  assert 0 < row.saved_bytes <= report.total_bytes
  assert "LayerNorm_0" in str(report) and "plain" in str(report)
  # inside the model's engine call (the default) its residuals are compressed
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = jact.conversion_report(loss(jact.convert(OddNorm(), bits=2)), variables, x)
  assert not report.plain()
  assert {(r.path, r.how) for r in report.rows if r.reason} == {("LayerNorm_0", "model")}
  assert not [w for w in caught if "% of" in str(w.message)]


@pytest.mark.slow
def test_linen_cell_without_key_runs_plain_for_inference():
  x, variables, plain, _ = _linen("scan")
  model = jact.convert(Encoder(), bits=2)
  np.testing.assert_array_equal(model.apply(variables, x), Encoder().apply(variables, x))


# ----------------------------------------------------------------------------- nnx models


class Block(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(32, 32, rngs=rngs)
    self.norm = nnx.LayerNorm(32, rngs=rngs)

  def __call__(self, x):
    return x + nnx.gelu(self.norm(self.fc(x)))


class Stack(nnx.Module):
  """Scan over layers: blocks built with nnx.vmap, run by nnx.scan."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)

    self.blocks = make(rngs)
    self.head = nnx.Linear(32, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return self.head(nnx.relu(body(x, self.blocks)))


class Tagger(nnx.Module):
  """nnx.RNN over an OptimizedLSTMCell, then LinearGeneral."""

  def __init__(self, rngs):
    self.rnn = nnx.RNN(nnx.OptimizedLSTMCell(32, 64, rngs=rngs))
    self.proj = nnx.LinearGeneral(64, (4, 8), rngs=rngs)
    self.out = nnx.Linear(32, 2, rngs=rngs)

  def __call__(self, x):
    h = self.rnn(x)[:, -1]
    return self.out(nnx.silu(self.proj(h).reshape(h.shape[0], -1)))


NNX = {"stack": (Stack, (64, 32)), "tagger": (Tagger, (16, 10, 32))}


@pytest.mark.slow
@pytest.mark.parametrize("name", NNX)
def test_nnx_forward_bytes_and_gradients(name):
  cls, shape = NNX[name]
  x = jax.random.normal(jax.random.key(2), shape)
  plain = cls(nnx.Rngs(0))
  loss = lambda m, x: jnp.sum(m(x) ** 2)

  def saved(model):
    graphdef, state = nnx.split(model)
    return jact.residual_report(lambda s, x: loss(nnx.merge(graphdef, s), x), state, x).total_bytes

  model2 = jact.convert(cls(nnx.Rngs(0)), bits=2, rngs=nnx.Rngs(jact=1))
  forward = nnx.jit(lambda m, x: m(x))
  np.testing.assert_array_equal(forward(model2, x), forward(plain, x))
  # Measured: stack 243584 -> 14320 B (17x), tagger 524416 -> 40680 B (13x)
  assert saved(model2) * 10 < saved(plain)
  model8 = jact.convert(cls(nnx.Rngs(0)), bits=8, rngs=nnx.Rngs(jact=1))
  g_ref = nnx.state(nnx.jit(nnx.grad(loss))(plain, x), nnx.Param)
  g = nnx.state(nnx.jit(nnx.grad(loss))(model8, x), nnx.Param)
  # measured 0.7% and 1.2%
  assert _rel_err(nnx.to_pure_dict(g), nnx.to_pure_dict(g_ref)) < 0.03


@pytest.mark.slow
def test_nnx_stacked_layers_get_stacked_streams():
  model = jact.convert(Stack(nnx.Rngs(0)), bits=2, rngs=nnx.Rngs(jact=1))
  assert model.blocks.fc.jact_rngs.key[...].shape == (3,)
  assert model.head.jact_rngs.key[...].shape == ()
  assert type(model.blocks.fc) is jact.nnx.Linear
  # the engine layers: the cell (its own Linear layers left to it) and LinearGeneral
  tagger = jact.convert(Tagger(nnx.Rngs(0)), bits=2, rngs=nnx.Rngs(jact=1))
  assert type(tagger.rnn.cell).__mro__[1] is nnx.OptimizedLSTMCell
  assert type(tagger.rnn.cell.dense_i) is nnx.Linear
  assert type(tagger.proj).__mro__[1] is nnx.LinearGeneral
  assert type(tagger).__mro__[1] is Tagger  # the model's call through the engine
  assert type(jact.convert(tagger, functions=False)) is Tagger
