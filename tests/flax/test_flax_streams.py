"""Keys and RNG streams in jact's Flax integration (issue 31).

* Dropout masks come from the model's own 'dropout' stream, drawn as Flax
  draws them: a converted model's training forward is bit-identical to the
  plain model's for the same rngs (linen, nnx, inside `nn.scan`), with
  `broadcast_dims` and the `deterministic` flags; gradients close at 8 bits.
* Typed PRNG key arrays among a function's residuals (dropout keys that
  `nn.scan` splits per layer and `nn.remat` saves) pass through every jaxpr
  interpreter of `jact.compressed`: a big_vision-style ViT with `scan=True`,
  remat and dropout differentiates through `jact.convert` and whole-model
  `jact.compressed` (bits=None: plain's gradients exactly).
* A concrete `jact.nnx.use_key` key read while a jitted step is traced, with
  the block entered outside the step, raises (it would be baked into the
  compiled step); keys passed to the step, constants written inside it,
  eager and abstract traces are fine.
* Conversion reports list linen subclasses of supported layers (a
  weight-standardized `StdConv(nn.Conv)`) and nnx twins and plain layers.
"""

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
from jact import nn as jnn
from jact import nnx as jnnx
from jact._convert import ConversionWarning

KEY = jax.random.key(7)


def _normal(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def _rel_err(a, b) -> float:
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(a, b))
  return (num / sum(float(jnp.sum(y**2)) for y in b)) ** 0.5


def _assert_tree_equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


# ----------------------------------------------------------------------------- dropout twins


@pytest.mark.parametrize("rate, dims", [(0.3, ()), (0.5, (0,)), (0.25, (-1,)), (0.9, (0, 1))])
def test_linen_dropout_twin_draws_flax_masks(rate, dims):
  x = _normal((6, 5, 40))
  plain, twin = nn.Dropout(rate, broadcast_dims=dims), jnn.Dropout(rate, broadcast_dims=dims)
  rngs = {"dropout": jax.random.key(3)}
  run = lambda m, x: m.apply({}, x, deterministic=False, rngs=rngs)
  y = run(twin, x)
  np.testing.assert_array_equal(y, run(plain, x))
  # an explicit rng= too, and the backward applies the very same mask
  np.testing.assert_array_equal(
    twin.apply({}, x, False, jax.random.key(4)), plain.apply({}, x, False, jax.random.key(4))
  )
  probe = _normal(x.shape, 1)
  grad = lambda m: jax.grad(lambda x: jnp.sum(run(m, x) * probe))(x)
  np.testing.assert_array_equal(grad(twin), grad(plain))
  np.testing.assert_array_equal(twin.apply({}, x, deterministic=True), x)


def test_nnx_dropout_twin_draws_flax_masks():
  x = _normal((8, 64))
  for kwargs in (dict(rate=0.4), dict(rate=0.5, broadcast_dims=(0,))):
    plain = nnx.Dropout(**kwargs, rngs=nnx.Rngs(dropout=5))
    twin = jnnx.Dropout(**kwargs, rngs=nnx.Rngs(dropout=5))
    for _ in range(2):  # the stream advances alike
      np.testing.assert_array_equal(twin(x), plain(x))
    np.testing.assert_array_equal(twin(x, rngs=jax.random.key(2)), plain(x, rngs=jax.random.key(2)))
    np.testing.assert_array_equal(
      twin(x, rngs=nnx.Rngs(dropout=4)), plain(x, rngs=nnx.Rngs(dropout=4))
    )
    np.testing.assert_array_equal(twin(x, deterministic=True), x)
  with pytest.raises(TypeError, match=r"rngs must be an nnx.Rngs.*got int"):
    jnnx.Dropout(0.5)(x, rngs=3)


def test_dropout_op_flax_draw_keeps_only_the_key():
  x = _normal((16, 256))
  key = jax.random.key(9)
  y = jact.ops.dropout(x, 0.5, key=key, draw="flax")
  flax_dropout = nn.Dropout(0.5, deterministic=False)
  np.testing.assert_array_equal(y, flax_dropout.apply({}, x, rng=key))
  report = jact.residual_report(
    lambda x: jnp.sum(jact.ops.dropout(x, 0.5, key=key, draw="flax", name="d")), x
  )
  assert report.by_name()["d.seed"].bytes == 8  # a threefry key's data, nothing tensor-sized
  assert report.total_bytes == 8
  legacy = jax.random.PRNGKey(9)  # a raw uint32[2] key works the same way
  np.testing.assert_array_equal(
    jact.ops.dropout(x, 0.5, key=legacy, draw="flax"), flax_dropout.apply({}, x, rng=legacy)
  )
  with pytest.raises(
    ValueError, match=r"draw must be one of \('hash', 'flax', 'flax_attention'\), got 'numpy'"
  ):
    jact.ops.dropout(x, 0.5, key=key, draw="numpy")
  with pytest.raises(ValueError, match=r"one PRNG key .*shape \(2,\)"):
    jact.ops.dropout(x, 0.5, key=jax.random.split(key), draw="flax")


@pytest.mark.slow  # compiles a converted and a plain attention gradient per case: ~8 s
@pytest.mark.parametrize("broadcast", [True, False])
def test_attention_dropout_draws_flax_masks(broadcast):
  """Attention-weight dropout of the converted attention layers (linen, nnx)
  is Flax's: the same training forward, gradients close at 8 bits."""
  x = _normal((2, 6, 16))
  layer = nn.MultiHeadDotProductAttention(
    2, dropout_rate=0.3, broadcast_dropout=broadcast, deterministic=False
  )
  variables = layer.init(KEY, x)
  rngs = {"dropout": jax.random.key(2)}
  probe = _normal(x.shape, 3)

  def value_and_grad(m, rngs):
    return jax.jit(jax.value_and_grad(lambda v: jnp.sum(m.apply(v, x, rngs=rngs) * probe)))(
      variables
    )

  (y, g), (y_ref, g_ref) = (
    value_and_grad(jact.convert(layer, bits=8), {**rngs, "jact": KEY}),
    value_and_grad(layer, rngs),
  )
  np.testing.assert_array_equal(y, y_ref)
  assert _rel_err(g, g_ref) < 0.03, _rel_err(g, g_ref)  # measured 1.1%
  make = lambda: nnx.MultiHeadAttention(
    2,
    16,
    dropout_rate=0.3,
    broadcast_dropout=broadcast,
    decode=False,
    deterministic=False,
    rngs=nnx.Rngs(0, dropout=4),
  )
  plain, twin = make(), jact.convert(make(), bits=8, rngs=nnx.Rngs(jact=1))
  run = nnx.jit(lambda m: m(x))
  for _ in range(2):
    np.testing.assert_array_equal(run(twin), run(plain))


class DropoutMLP(nn.Module):
  """Dropout as ordinary linen code uses it: after activations, broadcast over
  the batch, a `train` flag."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.gelu(nn.Dense(64)(x))
    x = nn.Dropout(0.3, deterministic=not train)(x)
    x = nn.LayerNorm()(nn.Dense(64)(x))
    x = nn.Dropout(0.5, broadcast_dims=(0,))(nn.relu(x), deterministic=not train)
    return nn.Dense(4)(x)


@pytest.mark.slow  # compiles a converted model's and the plain one's gradients: ~6 s
def test_converted_linen_training_forward_is_plain():
  x = _normal((8, 32))
  model, converted = DropoutMLP(), jact.convert(DropoutMLP(), bits=8)
  variables = model.init(KEY, x)
  rngs = {"dropout": jax.random.key(2)}

  @functools.partial(jax.jit, static_argnums=(0, 3))
  def loss_and_grad(m, v, rngs, train):
    return jax.value_and_grad(lambda v: jnp.sum(m.apply(v, x, train, rngs=rngs) ** 2))(v)

  (loss, g), (loss_ref, g_ref) = (
    loss_and_grad(converted, variables, {**rngs, "jact": KEY}, True),
    loss_and_grad(model, variables, rngs, True),
  )
  np.testing.assert_array_equal(loss, loss_ref)  # the same masks: the same training loss
  y = jax.jit(lambda v: converted.apply(v, x, rngs={**rngs, "jact": KEY}))(variables)
  np.testing.assert_array_equal(y, jax.jit(lambda v: model.apply(v, x, rngs=rngs))(variables))
  np.testing.assert_array_equal(
    converted.apply(variables, x, False), model.apply(variables, x, False)
  )
  assert _rel_err(g, g_ref) < 0.01, _rel_err(g, g_ref)  # measured 0.5%


class NnxDropoutMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(32, 64, rngs=rngs)
    self.drop1 = nnx.Dropout(0.3, rngs=rngs)
    self.fc2 = nnx.Linear(64, 64, rngs=rngs)
    self.drop2 = nnx.Dropout(0.5, broadcast_dims=(0,), rngs=rngs)
    self.out = nnx.Linear(64, 4, rngs=rngs)

  def __call__(self, x):
    x = self.drop1(nnx.gelu(self.fc1(x)))
    return self.out(self.drop2(nnx.relu(self.fc2(x))))


@pytest.mark.slow  # compiles converted and plain nnx training steps per case: ~4 s
@pytest.mark.parametrize("streams", [True, False])
def test_converted_nnx_training_forward_is_plain(streams):
  x = _normal((8, 32))
  plain = NnxDropoutMLP(nnx.Rngs(0, dropout=3))
  model = NnxDropoutMLP(nnx.Rngs(0, dropout=3))
  model = jact.convert(model, bits=8, **(dict(rngs=nnx.Rngs(jact=1)) if streams else {}))
  assert type(model.drop2) is jnnx.Dropout

  @nnx.jit
  def step(m, key):
    with jact.nnx.use_key(key) if not streams else _nothing():
      return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(m)

  for _ in range(2):  # the dropout streams advance alike
    (loss, g), (loss_ref, g_ref) = step(model, KEY), step(plain, KEY)
    np.testing.assert_array_equal(loss, loss_ref)
    assert _rel_err(nnx.state(g, nnx.Param), nnx.state(g_ref, nnx.Param)) < 0.01
  np.testing.assert_array_equal(nnx.jit(lambda m: m(x))(model), nnx.jit(lambda m: m(x))(plain))
  model.eval(), plain.eval()
  np.testing.assert_array_equal(model(x), plain(x))


class _nothing:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


# ----------------------------------------------------------------------------- scan, remat, dropout


class Block(nn.Module):
  """A pre-norm transformer block as big_vision writes it: attention and MLP,
  dropout after each, the carry API that `nn.scan` wants."""

  dim: int = 16
  heads: int = 2
  rate: float = 0.1

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(self.heads, deterministic=True)(y, y)
    x = x + nn.Dropout(self.rate)(y, deterministic=not train)
    y = nn.Dense(self.dim * 2)(nn.LayerNorm()(x))
    y = nn.Dropout(self.rate)(nn.gelu(y), deterministic=not train)
    y = nn.Dense(self.dim)(y)
    return x + nn.Dropout(self.rate)(y, deterministic=not train), None


class ScanViT(nn.Module):
  depth: int = 2

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(16)(x)
    blocks = nn.scan(
      nn.remat(Block, static_argnums=(2,)),
      variable_axes={"params": 0},
      split_rngs={"params": True, "dropout": True},
      length=self.depth,
      in_axes=nn.broadcast,
    )
    x, _ = blocks(name="encoder")(x, train)
    return nn.Dense(3)(nn.LayerNorm()(x).mean(axis=1))


@pytest.mark.slow  # five wrapped scan+remat ViT gradients and a report: ~30 s of one CPU core
def test_scan_remat_dropout_vit_differentiates_through_convert_and_compressed():
  x = _normal((4, 8, 12))
  model = ScanViT()
  variables = model.init(KEY, x, False)
  rngs = {"dropout": jax.random.key(5), "jact": jax.random.key(6)}

  def grads(m):
    return jax.jit(jax.grad(lambda v: jnp.sum(m.apply(v, x, rngs=rngs) ** 2)))(variables)

  g_ref = grads(model)
  # uncompressed: plain's gradients, exactly through the engine; the twins'
  # own backward rules (attention, norms) reassociate a few sums (measured 1.4e-7)
  _assert_tree_equal(grads(jact.compressed(ScanViT(), bits=None)), g_ref)
  assert _rel_err(grads(jact.convert(ScanViT(), bits=None)), g_ref) < 1e-5
  y_ref = model.apply(variables, x, rngs=rngs)  # the plain forward, once for both
  for wrapped in (jact.convert(ScanViT(), bits=8), jact.compressed(ScanViT(), bits=8)):
    g = grads(wrapped)
    assert _rel_err(g, g_ref) < 0.03, _rel_err(g, g_ref)  # measured 1.1% (convert), 0.9%
    np.testing.assert_array_equal(  # the same dropout masks: the same forward
      wrapped.apply(variables, x, rngs=rngs), y_ref
    )
  # the report reads the scanned masks too: each scanned dropout keeps its mask
  # packed to 1 bit a value (4 rows of 8 x width bits) per layer
  converted = jact.convert(ScanViT(), bits=4)
  report = jact.conversion_report(lambda v: jnp.sum(converted.apply(v, x, rngs=rngs)), variables)
  drops = [r for r in report.rows if r.layer == "Dropout"]
  widths = sorted([16, 32, 16])  # attention's output, the MLP's hidden, the MLP's output
  assert len(drops) == 3 and all(r.how == "twin" for r in drops), str(report)
  assert sorted(r.saved_bytes for r in drops) == [
    ScanViT.depth * 4 * (8 * w // 8) for w in widths
  ], str(report)


class NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.fc = nnx.Linear(16, 16, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(nnx.gelu(self.fc(self.norm(x))))


class NnxStack(nnx.Module):
  """Blocks built with nnx.vmap (stacked dropout streams), run by nnx.scan
  over nnx.remat: the nnx form of a scanned ViT."""

  def __init__(self, rngs: nnx.Rngs, depth: int = 3):
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return NnxBlock(rngs)

    self.blocks = blocks(rngs)
    self.head = nnx.Linear(16, 2, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, block):
      return block(x)

    return self.head(body(x, self.blocks))


@pytest.mark.slow  # compiles three nnx scan+remat training steps: ~10 s of one CPU core
def test_nnx_scan_remat_dropout_stack_trains_like_plain():
  x = _normal((4, 8, 16))
  loss = lambda m: jnp.sum(m(x) ** 2)
  plain = NnxStack(nnx.Rngs(0, dropout=1))
  value, g_ref = nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(plain)
  with_streams = jact.convert(NnxStack(nnx.Rngs(0, dropout=1)), bits=8, rngs=nnx.Rngs(jact=3))
  without = jact.convert(NnxStack(nnx.Rngs(0, dropout=1)), bits=8)

  @nnx.jit
  def step(m, key):
    with jact.nnx.use_key(key):
      return nnx.value_and_grad(loss)(m)

  for model in (with_streams, without):
    converted_value, g = step(model, KEY)
    np.testing.assert_array_equal(converted_value, value)  # the same masks, per layer
    assert _rel_err(nnx.state(g, nnx.Param), nnx.state(g_ref, nnx.Param)) < 0.02


@pytest.mark.slow  # compiles a wrapped scanned stack twice (bits None and 8): ~4 s
def test_key_residuals_pass_through_the_engine():
  """A function whose VJP saves typed keys (dropout keys split over a scanned,
  rematerialized stack, one more at the top level and inside a jitted call)
  next to a gelu chain (folded) and max pooling (exact selections)."""
  w = _normal((3, 16, 16), 1) / 4
  x = _normal((4, 16))

  def layer(h, wk):
    w, key = wk
    h = jax.nn.gelu(h @ w)
    return jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0.0), None

  @jax.jit
  def head(h, key):
    return h * jax.random.uniform(key, h.shape)

  def f(w, x, rng):
    keys = jax.random.split(jax.random.fold_in(rng, 1), 3)  # derived keys: residuals
    h, _ = jax.lax.scan(jax.checkpoint(layer), x, (w, keys))
    h = head(h, jax.random.fold_in(rng, 2))
    pooled = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2), (1, 2), "VALID")
    return jnp.sum(pooled**2)

  rng = jax.random.key(3)
  g_ref = jax.jit(jax.grad(f))(w, x, rng)  # jitted: one compile, not op-by-op
  for bits, tol in ((None, 0.0), (8, 0.02)):
    wrapped = jact.compressed(f, bits=bits, min_size=1, compress_argnums=(1,))
    g = jax.jit(jax.grad(lambda w: wrapped(w, x, rng, key=KEY)))(w)
    assert _rel_err(g, g_ref) <= tol, (bits, _rel_err(g, g_ref))


class DropoutLayer(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return nn.Dropout(0.4, deterministic=False)(nn.relu(nn.Dense(32)(h))), None


class ScannedDropout(nn.Module):
  """A stack scanned with per-layer dropout keys, no remat."""

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(
      DropoutLayer,
      variable_axes={"params": 0},
      split_rngs={"params": True, "dropout": True},
      length=3,
    )
    h, _ = stack(name="stack")(nn.Dense(32)(x), None)
    return nn.Dense(2)(h)


@pytest.mark.slow  # compiles a converted and a plain scanned stack's gradients: ~4 s
def test_converted_dropout_inside_nn_scan_is_plain():
  x = _normal((8, 16))
  model, converted = ScannedDropout(), jact.convert(ScannedDropout(), bits=8)
  variables = model.init(KEY, x)
  rngs = {"dropout": jax.random.key(4)}
  loss = lambda m, r: jax.jit(jax.value_and_grad(lambda v: jnp.sum(m.apply(v, x, rngs=r) ** 2)))(
    variables
  )
  (value, g), (value_ref, g_ref) = loss(converted, {**rngs, "jact": KEY}), loss(model, rngs)
  np.testing.assert_array_equal(value, value_ref)
  assert _rel_err(g, g_ref) < 0.01, _rel_err(g, g_ref)


# -------------------------------------------------------------------------- keys baked into a step


def _linear_and_loss():
  model = jact.convert(nnx.Linear(256, 8, rngs=nnx.Rngs(0)), bits=2)
  x = _normal((4, 256))
  return model, lambda m: jnp.sum(m(x) ** 2)


def test_use_key_entered_outside_a_jitted_step_raises():
  model, loss = _linear_and_loss()

  @nnx.jit
  def step(m):
    return nnx.grad(loss)(m)

  for key in (jax.random.key(0), nnx.Rngs(jact=0)):
    with pytest.raises(
      ValueError,
      match=r"use_key block entered outside the jitted function.*"
      r"baked.*pass the key \(or an nnx.Rngs\) as an argument",
    ):
      with jact.nnx.use_key(key):
        step(model)
  with pytest.raises(ValueError, match="baked"):  # jax.jit too
    with jact.nnx.use_key(jax.random.key(0)):
      graphdef, state = nnx.split(model)
      jax.jit(lambda s: jax.grad(lambda s: loss(nnx.merge(graphdef, s)))(s))(state)


@pytest.mark.slow  # compiles three steps, one eager gradient and two abstract traces: ~4 s
def test_use_key_inside_the_step_draws_fresh_noise_per_key():
  model, loss = _linear_and_loss()

  @nnx.jit
  def step(m, key):
    with jact.nnx.use_key(key):
      return nnx.grad(loss)(m).kernel[...]

  a, b, again = (
    step(model, jax.random.key(1)),
    step(model, jax.random.key(2)),
    step(model, jax.random.key(1)),
  )
  assert not np.array_equal(a, b)
  np.testing.assert_array_equal(a, again)
  fixed = jax.random.key(3)  # a constant written inside the step: the caller's choice

  @nnx.jit
  def fixed_step(m):
    with jact.nnx.use_key(fixed):
      return nnx.grad(loss)(m).kernel[...]

  np.testing.assert_array_equal(fixed_step(model), step(model, fixed))
  # eager differentiation and abstract traces compile nothing: fine outside a step
  graphdef, state = nnx.split(model)
  with jact.nnx.use_key(fixed):  # the same key: the same noise (2-bit noise differs by far more)
    np.testing.assert_allclose(nnx.grad(loss)(model).kernel[...], step(model, fixed), rtol=1e-5)
    nnx.eval_shape(nnx.grad(loss), model)
    jax.make_jaxpr(jax.grad(lambda s: loss(nnx.merge(graphdef, s))))(state)


@pytest.mark.slow  # compiles four gradients of converted and compressed functions: ~3 s
def test_linen_and_compressed_constant_keys_in_a_step_are_the_callers_constant():
  """A key written inside a jitted step (linen's rngs=, jact.compressed's key=)
  is a constant of that step as in JAX and Flax: the same as passing it in."""
  x = _normal((8, 32))
  converted = jact.convert(DropoutMLP(), bits=2)
  variables = converted.init(KEY, x)
  loss = lambda v, key: jnp.sum(converted.apply(v, x, False, rngs={"jact": key}) ** 2)
  const = jax.jit(jax.grad(lambda v: loss(v, KEY)))(variables)
  _assert_tree_equal(const, jax.jit(jax.grad(loss))(variables, KEY))
  f = jact.compressed(lambda w, x: jnp.tanh(x @ w), bits=2, compress_argnums=(1,))
  w = _normal((32, 64), 2)
  const = jax.jit(jax.grad(lambda w: jnp.sum(f(w, x, key=KEY))))(w)
  np.testing.assert_array_equal(
    const, jax.jit(jax.grad(lambda w, k: jnp.sum(f(w, x, key=k))))(w, KEY)
  )


# ----------------------------------------------------------------------------- reports


class StdConv(nn.Conv):
  """A weight-standardized convolution in big_vision's style: it overrides
  `param`, not `__call__`."""

  def param(self, name, *args, **kwargs):
    value = super().param(name, *args, **kwargs)
    if name == "kernel":
      mean = jnp.mean(value, axis=(0, 1, 2), keepdims=True)
      value = (value - mean) / jnp.sqrt(jnp.var(value, axis=(0, 1, 2), keepdims=True) + 1e-5)
    return value


class StdConvNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = StdConv(8, (3, 3), name="conv_root")(x)
    x = nn.relu(nn.GroupNorm(num_groups=2)(x))
    x = nn.Conv(8, (3, 3))(x)
    return nn.Dense(3)(x.mean(axis=(1, 2)))


@pytest.mark.slow  # traces and measures every layer of two converted models: ~4 s
def test_linen_report_lists_subclasses_of_supported_layers():
  x = _normal((2, 8, 8, 3))
  variables = StdConvNet().init(KEY, x)
  loss = lambda m: lambda v, x: jnp.sum(m.apply(v, x, rngs={"jact": KEY}))
  report = jact.conversion_report(loss(jact.convert(StdConvNet(), bits=4)), variables, x)
  rows = {r.path: r for r in report.rows}
  assert {p: r.how for p, r in rows.items()} == {
    "StdConvNet": "model",
    "conv_root": "model",
    "GroupNorm_0": "engine",
    "Conv_0": "twin",
    "Dense_0": "twin",
  }, str(report)
  root = rows["conv_root"]
  assert root.layer == "StdConv" and "subclass of flax.linen.Conv" in root.reason
  assert root.plain_bytes > 0
  with pytest.warns(ConversionWarning, match=r"conv_root .*StdConv.*subclass of flax.linen.Conv"):
    report = jact.conversion_report(
      loss(jact.convert(StdConvNet(), bits=4, functions=False)), variables, x
    )
  assert [r.path for r in report.plain()] == ["conv_root"]


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.fc = nnx.Linear(16, 32, rngs=rngs)
    self.norm = nnx.LayerNorm(32, rngs=rngs)
    self.odd = nnx.LayerNorm(32, reduction_axes=(-2, -1), rngs=rngs)  # no twin for two axes
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.proj = nnx.LinearGeneral(32, 8, rngs=rngs)

  def __call__(self, x):
    return self.proj(self.drop(nnx.gelu(self.odd(self.norm(self.fc(x))))))


@pytest.mark.parametrize("functions", [True, False])
def test_nnx_report_lists_twins_engine_and_plain_layers(functions):
  with pytest.warns(ConversionWarning, match=r"odd .*reduction_axes"):
    model = jact.convert(
      NnxNet(nnx.Rngs(0, dropout=1)), bits=4, rngs=nnx.Rngs(jact=2), functions=functions
    )
  x = _normal((2, 4, 16))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = jact.conversion_report(lambda m, x: jnp.sum(m(x)), model, x)
  how = {(r.path, r.layer): r.how for r in report.rows}
  expected = {
    ("fc", "Linear"): "twin",
    ("norm", "LayerNorm"): "twin",
    ("drop", "Dropout"): "twin",
    ("proj", "LinearGeneral"): "engine",
    ("odd", "LayerNorm"): "model" if functions else "plain",
  }
  if functions:
    expected[("NnxNet", "NnxNet")] = "model"
  assert how == expected, str(report)
  assert all(r.calls == 1 for r in report.rows)
  assert ("odd" in str(report)) and "reduction_axes" in str(report)
  plain_warned = [w for w in caught if "odd (flax LayerNorm) runs uncompressed" in str(w.message)]
  assert len(plain_warned) == (0 if functions else 1)
