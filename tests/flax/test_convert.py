"""Tests of jact.convert: an unmodified Flax model, converted, keeps its
variables and its forward, gets close 8-bit gradients and small residuals."""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from digits import batches, load_digits
from flax import nnx
from stats import assert_same_tree, tree_rel_err

import jact
from jact import nnx as jnnx
from jact._convert import ConversionWarning, convert
from jact._report import residual_report
from jact.compressors import PerGroup

pytestmark = pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")

# 'rbg' keys: XLA:CPU compiles threefry for every new parameter shape in
# about a second; RngBitGenerator is far cheaper (and any impl works with jact).
KEY = jax.random.key(0, impl="rbg")
JACT = {"jact": jax.random.key(7, impl="rbg")}


def _rngs(params=0, **streams):
  return nnx.Rngs(
    params=jax.random.key(params, impl="rbg"),
    **{k: jax.random.key(v, impl="rbg") for k, v in streams.items()},
  )


# Every jitted function here runs once or a few times on tiny arrays: compile
# with LLVM's optimizations off (halves XLA:CPU's compile time; same buffers, sums may round
# differently: gradients here are compared with tolerances or with programs compiled alike).
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
# 8-bit gradients: relative L2 error of every gradient leaf against the plain
# model's (leaves whose exact gradient is ~0, e.g. a conv bias before batch
# norm, against 5% of the whole gradient's norm). Measured: <= 1%.
GRAD_RTOL = 5e-2


def _normal(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# ============================================================================ linen models


class CNN(nn.Module):
  """Conv, BatchNorm, relu, Dense -- plain Flax, nothing jact in it."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
    return nn.Dense(10)(x.reshape((x.shape[0], -1)))


class Block(nn.Module):
  """Pre-norm transformer block: LayerNorm, SelfAttention, Dense, gelu."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.SelfAttention(num_heads=2, qkv_features=16)(nn.LayerNorm()(x))
    h = nn.Dense(32)(nn.LayerNorm()(x))
    return x + nn.Dense(16)(nn.gelu(h))


class TwinCNN(nn.Module):
  """CNN written by hand with jact's layers (plain relu, as in CNN)."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = jact.nn.Conv(8, (3, 3))(x)
    x = jact.nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = nn.relu(jact.nn.Conv(16, (3, 3), strides=2)(x))
    return jact.nn.Dense(10)(x.reshape((x.shape[0], -1)))


class TwinBlock(nn.Module):
  """Block written by hand with jact's layers (plain gelu, as in Block)."""

  @nn.compact
  def __call__(self, x):
    x = x + jact.nn.SelfAttention(num_heads=2, qkv_features=16)(jact.nn.LayerNorm()(x))
    h = jact.nn.Dense(32)(jact.nn.LayerNorm()(x))
    return x + jact.nn.Dense(16)(nn.gelu(h))


TWINS = {"cnn": TwinCNN(), "block": TwinBlock()}


# name -> (model, input, residual names the converted model must save)
LINEN = {
  "cnn": (
    CNN(),
    _normal((16, 8, 8, 1)),
    {"Conv_0.lhs", "BatchNorm_0.xhat", "Conv_1.lhs", "Dense_0.lhs"},
  ),
  "block": (
    Block(),
    _normal((4, 6, 16)),
    {
      "LayerNorm_0.xhat",
      "SelfAttention_0/query.lhs",
      "SelfAttention_0/attention.qk.lhs",
      "SelfAttention_0/out.lhs",
      "LayerNorm_1.xhat",
      "Dense_0.lhs",
      "Dense_1.lhs",
    },
  ),
}


@functools.cache
def _plain_variables(name):
  model, x, _ = LINEN[name]
  return _jit(model.init)(KEY, x)


def _linen_loss(model, variables, x, rngs):
  """sum(output * probe) of the training-mode forward; aux: (output, batch_stats)."""
  rest = {k: v for k, v in variables.items() if k != "params"}
  out = jax.eval_shape(lambda: model.apply(variables, x, rngs=rngs, mutable=["batch_stats"]))
  probe = _normal(out[0].shape, seed=3)

  def loss(params, x):
    y, updates = model.apply({"params": params, **rest}, x, rngs=rngs, mutable=["batch_stats"])
    return jnp.sum(y * probe), (y, updates)

  return loss


@pytest.mark.slow
@pytest.mark.parametrize("name", LINEN)
def test_linen_init_gives_the_plain_variables(name):
  model, x, _ = LINEN[name]
  ref = _plain_variables(name)
  assert_same_tree(_jit(convert(model).init)(KEY, x), ref)  # no 'jact' stream needed
  assert_same_tree(_jit(convert(model, bits=2).init)({"params": KEY, **JACT}, x), ref)


@pytest.mark.slow
@pytest.mark.parametrize("name", LINEN)
def test_linen_forward_exact_and_8bit_gradients_close(name):
  # plain variables into the converted model; one compilation per model for
  # the forward and the gradients
  model, x, _ = LINEN[name]
  variables = _plain_variables(name)

  def run(m, rngs):
    grad = jax.grad(_linen_loss(m, variables, x, rngs), argnums=(0, 1), has_aux=True)
    return _jit(grad)(variables["params"], x)

  g_ref, (y_ref, upd_ref) = run(model, None)
  g, (y, upd) = run(convert(model, bits=8), JACT)
  assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
  # Dense/Conv run the same lax op; norms and attention reassociate float32 sums
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(upd, upd_ref, rtol=1e-6, atol=1e-7)  # running statistics
  assert tree_rel_err(g, g_ref) < GRAD_RTOL


@pytest.mark.slow
@pytest.mark.parametrize("name", LINEN)
def test_linen_residuals_are_compressed(name):
  model, x, names = LINEN[name]
  variables = _plain_variables(name)
  scalar = lambda loss: lambda p, x: loss(p, x)[0]
  plain = residual_report(scalar(_linen_loss(model, variables, x, None)), variables["params"], x)
  # functions=False: the layers alone (the model's call through the engine,
  # the default, keeps the twins' pieces as they are under its own names)
  report = residual_report(
    scalar(_linen_loss(convert(model, functions=False), variables, x, JACT)), variables["params"], x
  )
  assert names <= set(report.by_name()), set(report.by_name())
  # Exactly what the same model written by hand with jact's layers saves,
  # residual group by residual group (the plain relu/gelu functions' residuals
  # are in both); and less than the plain model.
  twin = residual_report(
    scalar(_linen_loss(TWINS[name], variables, x, JACT)), variables["params"], x
  )
  sizes = lambda r: {n: g.bytes for n, g in r.by_name().items()}
  assert sizes(report) == sizes(twin)
  assert report.total_bytes < plain.total_bytes


def test_linen_without_jact_stream_runs_plain_and_grad_is_a_clear_error():
  model, x, _ = LINEN["cnn"]
  variables = _plain_variables("cnn")
  converted = convert(model)
  # inference, evaluation, decoding: no 'jact' stream, the plain model's outputs
  for train in (False, True):
    np.testing.assert_array_equal(
      converted.apply(variables, x, train=train, mutable=["batch_stats"])[0],
      model.apply(variables, x, train=train, mutable=["batch_stats"])[0],
    )
  loss = lambda m: lambda v: jnp.sum(m.apply(v, x, mutable=["batch_stats"])[0])
  with pytest.raises(
    ValueError,
    match=r"'Conv_0' was differentiated without an RNG stream "
    r"named 'jact'.*rngs=\{'jact'",
  ):
    jax.eval_shape(jax.grad(loss(converted)), variables)
  nearest = convert(model, compressor=PerGroup(4, stochastic=False))
  jax.eval_shape(jax.grad(loss(nearest)), variables)  # no key needed
  jax.eval_shape(jax.grad(loss(convert(model, bits=None))), variables)


def test_linen_inference_and_jit():
  model, x, _ = LINEN["cnn"]
  converted = convert(model)
  variables = _plain_variables("cnn")
  apply = _jit(lambda v, x, key: converted.apply(v, x, train=False, rngs={"jact": key}))
  np.testing.assert_allclose(
    apply(variables, x, jax.random.key(1)),
    model.apply(variables, x, train=False),
    rtol=1e-5,
    atol=1e-6,
  )


def test_linen_converted_module_is_the_model():
  model = CNN()
  converted = convert(model, compressor=PerGroup(2, group_size=64))
  assert isinstance(converted, CNN) and type(converted).__name__ == "CNN"
  assert type(model) is CNN  # the argument is left alone
  # one field holds how residuals are stored, resolved from bits= / compressor=
  assert converted.jact_compressor == PerGroup(2, group_size=64)
  assert convert(model, bits=2).jact_compressor == PerGroup(2)
  # one class per model class: equal settings give equal (hashable) modules
  assert convert(model, compressor=PerGroup(2, group_size=64)) == converted
  assert hash(convert(model, compressor=PerGroup(2, group_size=64))) == hash(converted)
  again = convert(converted, bits=8)  # re-converting changes the settings
  assert type(again) is type(converted) and again.jact_compressor == PerGroup(8)
  with pytest.raises(ValueError, match="unbound"):
    convert(model.bind(_plain_variables("cnn")))


class Shared(nn.Module):
  """setup-style model with a layer used twice and a second method."""

  def setup(self):
    self.fc = nn.Dense(6)
    self.norm = nn.RMSNorm()
    self.out = nn.Dense(2)

  def __call__(self, x):
    return self.out(self.fc(self.norm(self.fc(x))))

  def encode(self, x):
    return self.fc(x)


class Outer(nn.Module):
  inner: nn.Module

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(self.inner(x))


@pytest.mark.slow
def test_linen_shared_layers_setup_methods_and_submodules():
  x = _normal((4, 6))
  model, converted = Shared(), convert(Shared())
  variables = _jit(model.init)(KEY, x)
  assert_same_tree(_jit(converted.init)(KEY, x), variables)
  y = _jit(lambda v, x: converted.apply(v, x, rngs=JACT))(variables, x)
  np.testing.assert_allclose(y, model.apply(variables, x), rtol=1e-5, atol=1e-6)
  loss = lambda m, **kw: lambda p: jnp.sum(m.apply({"params": p}, x, rngs=JACT, **kw))
  names = set(residual_report(loss(converted), variables["params"]).by_name())
  assert {"fc.lhs", "norm.xhat", "out.lhs"} <= names, names
  # other methods, method= callables and bound modules run converted too
  assert (
    "fc.lhs" in residual_report(loss(converted, method="encode"), variables["params"]).by_name()
  )
  assert (
    "fc.lhs"
    in residual_report(loss(converted, method=lambda m, x: m.fc(x)), variables["params"]).by_name()
  )
  bound = converted.bind(variables, rngs=JACT)
  assert "out.lhs" in residual_report(lambda x: jnp.sum(bound(x)), x).by_name()
  # a converted model inside a plain one: its own layers are converted
  outer = Outer(inner=convert(Shared()))
  v_outer = outer.init(KEY, x)
  assert set(v_outer["params"]) == {"inner", "Dense_0"}
  names = set(
    residual_report(
      lambda p: jnp.sum(outer.apply({"params": p}, x, rngs=JACT)), v_outer["params"]
    ).by_name()
  )
  assert "inner/fc.lhs" in names and "Dense_0.lhs" not in names


@pytest.mark.slow
def test_linen_capture_intermediates_like_plain():
  x = _normal((4, 6))
  model = Shared()
  variables = model.init(KEY, x)
  _, ref = model.apply(variables, x, capture_intermediates=True)
  converted = convert(model)
  _, got = _jit(lambda v, x: converted.apply(v, x, capture_intermediates=True, rngs=JACT))(
    variables, x
  )
  assert jax.tree.structure(got) == jax.tree.structure(ref)


@pytest.mark.slow
def test_linen_bare_layers_and_attention_variants():
  x = _normal((2, 5, 8))
  for layer in (
    nn.Dense(4),
    nn.MultiHeadDotProductAttention(num_heads=2),
    nn.MultiHeadAttention(num_heads=2),
  ):
    variables = layer.init(KEY, x)
    converted = convert(layer)
    if isinstance(layer, nn.Dense):  # (attention's forward: see the block above)
      y = _jit(lambda v, x: converted.apply(v, x, rngs=JACT))(variables, x)
      np.testing.assert_allclose(y, layer.apply(variables, x), rtol=1e-5, atol=1e-6)
    report = residual_report(
      lambda p: jnp.sum(converted.apply({"params": p}, x, rngs=JACT)), variables["params"]
    )
    # a bare layer's residuals are named after its twin's class
    name = "Dense.lhs" if isinstance(layer, nn.Dense) else "MultiHeadDotProductAttention/query.lhs"
    assert name in report.by_name(), set(report.by_name())


class Tokens(nn.Module):
  """Embed (a setup-style Flax layer), Dropout and Embed.attend (not converted)."""

  @nn.compact
  def __call__(self, ids, train: bool = False):
    embed = nn.Embed(11, 8)
    return embed.attend(nn.Dropout(0.5, deterministic=not train)(embed(ids)))


@pytest.mark.slow
def test_linen_embed_dropout_and_sequential():
  ids = jnp.arange(6).reshape(2, 3)
  model, converted = Tokens(), convert(Tokens())
  variables = model.init(KEY, ids)
  assert_same_tree(converted.init(KEY, ids), variables)
  np.testing.assert_array_equal(converted.apply(variables, ids), model.apply(variables, ids))
  rngs = {"dropout": jax.random.key(1)}  # Embed and Dropout need no 'jact' stream
  report = residual_report(
    lambda p: jnp.sum(converted.apply({"params": p}, ids, True, rngs=rngs)), variables["params"]
  )
  assert {"Embed_0.ids", "Dropout_0.mask"} <= set(report.by_name()), set(report.by_name())
  seq = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
  x = _normal((3, 5))
  variables = seq.init(KEY, x)
  # functions=False: the layers alone, whose residuals keep the twins' names
  # (under the model's call see test_linen_model_call_keeps_twins_names)
  report = residual_report(
    lambda p: jnp.sum(convert(seq, functions=False).apply({"params": p}, x, rngs=JACT)),
    variables["params"],
  )
  assert {"layers_0.lhs", "layers_2.lhs"} <= set(report.by_name()), set(report.by_name())


@pytest.mark.slow
def test_linen_model_call_keeps_twins_names():
  seq = nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(2)])
  x = _normal((3, 5))
  variables = seq.init(KEY, x)
  report = residual_report(
    lambda p: jnp.sum(convert(seq).apply({"params": p}, x, rngs=JACT)), variables["params"]
  )
  assert {"layers_0.lhs", "layers_2.lhs"} <= set(report.by_name()), set(report.by_name())


class Unsupported(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(6, dot_general=jax.lax.dot_general)(x)  # a custom dot_general
    return nn.LayerNorm(reduction_axes=0, feature_axes=0)(x)  # normalizes over axis 0


@pytest.mark.slow
def test_linen_unsupported_options_run_plain_with_a_warning():
  x = _normal((4, 6))
  model = Unsupported()
  variables = model.init(KEY, x)
  with pytest.warns(ConversionWarning) as record:
    y = convert(model).apply(variables, x, rngs=JACT)
  messages = " | ".join(str(r.message) for r in record)
  assert "Dense_0 (flax.linen.Dense) runs uncompressed: a custom 'dot_general'" in messages
  assert "LayerNorm_0 (flax.linen.LayerNorm) runs uncompressed" in messages
  np.testing.assert_array_equal(y, model.apply(variables, x))
  with pytest.raises(ValueError, match="Dense_0.*strict=True"):
    convert(model, strict=True).apply(variables, x, rngs=JACT)


def test_linen_call_time_options_fall_back():
  x = _normal((2, 5, 8))
  layer = nn.MultiHeadDotProductAttention(num_heads=2)
  variables = layer.init(KEY, x)
  with pytest.warns(ConversionWarning, match="sow_weights"):
    y, state = convert(layer).apply(
      variables, x, sow_weights=True, rngs=JACT, mutable=["intermediates"]
    )
  y_ref, state_ref = layer.apply(variables, x, sow_weights=True, mutable=["intermediates"])
  np.testing.assert_array_equal(y, y_ref)
  chex.assert_trees_all_equal(state, state_ref)


def test_convert_rejects_bad_arguments():
  for obj in (object(), lambda x: x, jnp.ones(3)):
    with pytest.raises(TypeError, match="flax.linen.Module .* or a flax.nnx.Module"):
      convert(obj)
  with pytest.raises(ValueError, match="bits"):
    convert(CNN(), bits=9)
  with pytest.raises(ValueError, match="group_size"):
    convert(CNN(), compressor=PerGroup(4, group_size=12))
  with pytest.raises(TypeError, match="unexpected keyword argument 'group_size'"):
    convert(CNN(), group_size=12)
  with pytest.raises(TypeError, match="'jact' stream of apply"):
    convert(CNN(), rngs=nnx.Rngs(jact=0))
  with pytest.raises(TypeError, match="rngs must be"):
    convert(nnx.Linear(2, 2, rngs=_rngs(0)), rngs=0)


# ============================================================================ nnx models


class NCNN(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.fc = nnx.Linear(8 * 8 * 8, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv(x)))
    return self.fc(x.reshape((x.shape[0], -1)))


class NBlock(nnx.Module):
  def __init__(self, rngs):
    self.ln1 = nnx.LayerNorm(16, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 16, 16, decode=False, normalize_qk=True, rngs=rngs)
    self.ln2 = nnx.LayerNorm(16, rngs=rngs)
    self.mlp = nnx.List([nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 16, rngs=rngs)])

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.mlp[1](nnx.gelu(self.mlp[0](self.ln2(x))))


# name -> (model class, input, converted layers by path, residual names)
NNX = {
  "cnn": (
    NCNN,
    _normal((16, 8, 8, 1)),
    {("conv",): jnnx.Conv, ("bn",): jnnx.BatchNorm, ("fc",): jnnx.Linear},
    {"conv.lhs", "bn.xhat", "fc.lhs"},
  ),
  "block": (
    NBlock,
    _normal((4, 6, 16)),
    {
      ("ln1",): jnnx.LayerNorm,
      ("attn",): jnnx.MultiHeadAttention,
      ("attn", "query_ln"): jnnx.LayerNorm,
      ("attn", "key_ln"): jnnx.LayerNorm,
      ("ln2",): jnnx.LayerNorm,
      ("mlp", 0): jnnx.Linear,
      ("mlp", 1): jnnx.Linear,
    },
    {
      "ln1.xhat",
      "attn/query.lhs",
      "attn/query_ln.xhat",
      "attn/attention.qk.lhs",
      "attn/out.lhs",
      "ln2.xhat",
      "mlp/0.lhs",
      "mlp/1.lhs",
    },
  ),
}
STATE = (nnx.Param, nnx.BatchStat)


def _variables(model):
  return {
    id(v)
    for _, v in nnx.iter_graph(model)
    if isinstance(v, nnx.Variable) and not isinstance(v, nnx.RngState)
  }


def _nnx_forward(model, x):
  """model(x), jitted (updates the model's state, e.g. running statistics)."""
  graphdef, state = nnx.split(model)

  def forward(state, x):
    model = nnx.merge(graphdef, state)
    return model(x), nnx.state(model)

  y, state = _jit(forward)(state, x)
  nnx.update(model, state)
  return y


def _split_loss(model, x):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  forward = lambda params, x: nnx.merge(graphdef, params, rest, copy=True)(x)
  probe = _normal(jax.eval_shape(forward, params, x).shape, seed=3)

  def loss(params, x):
    return jnp.sum(forward(params, x) * probe)

  return loss, params


@pytest.mark.slow
@pytest.mark.parametrize("name", NNX)
def test_nnx_convert_in_place_keeps_state_and_forward(name):
  make, x, layers, _ = NNX[name]
  plain, model = make(_rngs(0)), make(_rngs(0))
  before = nnx.state(model)
  variables = _variables(model)
  assert convert(model, bits=8, rngs=_rngs(jact=1)) is model  # in place
  for path, module in nnx.iter_modules(model):
    if path in layers:
      assert type(module) is layers[path], path
      assert module.residual_name == "/".join(map(str, path))
  # the very same Variable objects; Param/BatchStat state unchanged; the only
  # new state is each converted layer's 'jact' RNG stream, and the model's own
  # (its call runs through the generic engine)
  assert _variables(model) == variables
  for kind in STATE:
    assert_same_tree(
      nnx.to_pure_dict(nnx.state(model, kind)), nnx.to_pure_dict(nnx.state(plain, kind))
    )
  after = nnx.state(model, nnx.Not(nnx.RngState))
  assert jax.tree.structure(after) == jax.tree.structure(before)
  rng_paths = {p[:-2] for p, _ in nnx.to_flat_state(nnx.state(model, nnx.RngState))}
  assert rng_paths == set(layers) | {()}, rng_paths
  # same forward and same running statistics
  np.testing.assert_allclose(_nnx_forward(model, x), _nnx_forward(plain, x), rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(
    nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)),
    nnx.to_pure_dict(nnx.state(plain, nnx.BatchStat)),
    rtol=1e-6,
    atol=1e-7,
  )


@pytest.mark.slow
@pytest.mark.parametrize("name", NNX)
def test_nnx_8bit_gradients_close_and_residuals_compressed(name):
  make, x, _, names = NNX[name]
  plain = make(_rngs(0))
  # functions=False: the layers alone, whose residuals keep the twins' names
  model = convert(make(_rngs(0)), bits=8, functions=False, rngs=_rngs(jact=1))
  (f_ref, p_ref), (f, p) = _split_loss(plain, x), _split_loss(model, x)
  if name == "cnn":  # the attention block's routing is checked by its forward and
    # residuals (compiling its backward is slow); the twins' own tests check its gradients
    g_ref = _jit(jax.grad(f_ref, argnums=(0, 1)))(p_ref, x)
    g = _jit(jax.grad(f, argnums=(0, 1)))(p, x)
    assert tree_rel_err(nnx.to_pure_dict(g[0]), nnx.to_pure_dict(g_ref[0])) < GRAD_RTOL
    assert tree_rel_err(g[1], g_ref[1]) < GRAD_RTOL
  report = residual_report(f, p, x)
  assert names <= set(report.by_name()), set(report.by_name())
  # Measured at 8 bits: cnn 136.8 -> 57.9 KiB (42%), block 51.6 -> 23.0 KiB
  # (45%); the rest is mostly the plain relu/gelu functions' residuals.
  assert report.total_bytes < 0.6 * residual_report(f_ref, p_ref, x).total_bytes


@pytest.mark.slow
def test_nnx_jit_train_step_draws_fresh_keys():
  make, x, _, _ = NNX["cnn"]
  model = convert(make(_rngs(0)), rngs=_rngs(jact=1))
  optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
  labels = jnp.arange(16) % 10

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(3)]
  assert losses[-1] < losses[0]
  assert int(model.conv.jact_rngs.count[...]) == 3


def test_nnx_rngs_shared_layers_and_bare_layers():
  make, x, _, _ = NNX["cnn"]
  with pytest.raises(ValueError, match=r"stream named 'jact'.*rngs=nnx.Rngs\(jact=0\)"):
    convert(make(_rngs(0)), rngs=_rngs(0))  # rngs without a 'jact' or 'default' stream
  # round-to-nearest needs no stream; Embed and Dropout never do
  convert(make(_rngs(0)), compressor=PerGroup(4, stochastic=False))
  seq = convert(
    nnx.Sequential(nnx.Embed(5, 4, rngs=_rngs(0)), nnx.Dropout(0.5, rngs=_rngs(dropout=1)))
  )
  assert [type(m) for m in seq.layers] == [jnnx.Embed, jnnx.Dropout]
  # a bare supported layer is returned as its twin, with the same Variables
  layer = nnx.Linear(3, 2, rngs=_rngs(0))
  twin = convert(layer, rngs=_rngs(jact=1))
  assert type(twin) is jnnx.Linear and twin.kernel is layer.kernel
  # a layer referenced twice becomes one twin referenced twice
  shared = nnx.Linear(4, 4, rngs=_rngs(0))
  model = nnx.Sequential(shared, nnx.relu, shared)
  convert(model, rngs=nnx.Rngs(jact=1))
  assert model.layers[0] is model.layers[2] and type(model.layers[0]) is jnnx.Linear


@pytest.mark.slow
@pytest.mark.parametrize("name", NNX)
def test_nnx_without_rngs_state_is_the_plain_models_and_inference_needs_no_key(name):
  make, x, _, _ = NNX[name]
  plain, model = make(_rngs(0)), convert(make(_rngs(0)), bits=2)
  # the full state (every Variable, not only Param/BatchStat) is the plain model's
  assert_same_tree(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(plain)))
  assert jax.tree.structure(
    nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable)
  ) == jax.tree.structure(nnx.state(plain), is_leaf=lambda v: isinstance(v, nnx.Variable))
  # ... so it loads both ways: nnx.update, and nnx.merge of the other's graphdef
  other = make(_rngs(5))
  nnx.update(other, nnx.state(model))
  assert_same_tree(nnx.to_pure_dict(nnx.state(other)), nnx.to_pure_dict(nnx.state(plain)))
  converted_other = convert(make(_rngs(5)), bits=2)
  nnx.update(converted_other, nnx.state(plain))
  assert_same_tree(nnx.to_pure_dict(nnx.state(converted_other)), nnx.to_pure_dict(nnx.state(plain)))
  assert type(nnx.merge(nnx.graphdef(plain), nnx.state(model))) is type(plain)
  merged = nnx.merge(nnx.graphdef(model), nnx.state(plain))
  assert {type(m) for _, m in nnx.iter_modules(merged)} == {
    type(m) for _, m in nnx.iter_modules(model)
  }
  # inference without a key: the plain model's output (and running statistics)
  np.testing.assert_array_equal(model(x), plain(x))
  chex.assert_trees_all_equal(
    nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(plain))
  )
  # differentiating without a key names the fixes
  f, params = _split_loss(model, x)
  with pytest.raises(
    ValueError,
    match=r"differentiated without a rounding key.*"
    r"jact.nnx.use_key.*rngs=nnx.Rngs\(jact=0\)",
  ):
    jax.eval_shape(jax.grad(f), params, x)


@pytest.mark.slow
def test_nnx_without_rngs_trains_under_use_key():
  make, x, _, names = NNX["cnn"]
  model = convert(make(_rngs(0)), bits=4, functions=False)  # the twins' residual names
  optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
  labels = jnp.arange(16) % 10
  rngs = nnx.Rngs(jact=jax.random.key(3, impl="rbg"))

  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()

  @nnx.jit
  def step(model, optimizer, rngs):
    with jact.nnx.use_key(rngs):  # one key drawn from rngs per step
      loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, rngs)) for _ in range(3)]
  assert losses[-1] < losses[0]
  assert int(rngs.jact.count[...]) == 3
  # the residuals under use_key are the compressed ones
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, key):
    with jact.nnx.use_key(key):
      return loss_fn(nnx.merge(graphdef, params, rest, copy=True))

  assert names <= set(residual_report(loss, params, KEY).by_name())


def test_nnx_use_key_draws_one_key_per_layer_and_call():
  layer = convert(nnx.Linear(256, 8, rngs=_rngs(0)), bits=1)
  x = _normal((4, 256))
  graphdef, state = nnx.split(layer)

  @_jit
  def grads(
    state, key
  ):  # the kernel's gradient reads the stored input: equal gradients, equal noise
    grad = lambda: nnx.grad(lambda m: jnp.sum(m(x) * jnp.arange(8.0)))(
      nnx.merge(graphdef, state)
    ).kernel[...]
    with jact.nnx.use_key(key):
      return grad(), grad()  # the layer's second call inside the block: a new key

  first, second = grads(state, KEY)
  again, _ = grads(state, KEY)
  other, _ = grads(state, jax.random.key(1, impl="rbg"))
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first, second) and not np.array_equal(first, other)
  with pytest.raises(TypeError, match="PRNG key"):
    with jact.nnx.use_key(0):
      pass
  with pytest.raises(ValueError, match="neither a 'jact' nor a 'default'"):
    with jact.nnx.use_key(nnx.Rngs(params=0)):
      pass


def test_nnx_unsupported_layers_stay_plain():
  custom = lambda *a, **k: jax.lax.dot_general(*a, **k)
  model = nnx.Sequential(
    nnx.Linear(3, 3, dot_general=custom, rngs=_rngs(0)),
    nnx.LayerNorm(3, reduction_axes=0, feature_axes=0, rngs=_rngs(0)),
    nnx.Linear(3, 3, rngs=_rngs(0)),
  )
  with pytest.raises(ValueError, match="layers/0 .*strict=True"):
    convert(model, strict=True, rngs=_rngs(jact=1))
  assert type(model.layers[2]) is nnx.Linear  # nothing converted on error
  with pytest.warns(ConversionWarning) as record:
    convert(model, rngs=_rngs(jact=1))
  assert len(record) == 2 and "custom 'dot_general'" in str(record[0].message)
  assert [type(m) for m in model.layers] == [nnx.Linear, nnx.LayerNorm, jnnx.Linear]


# ============================================================================ training on real data


@pytest.mark.slow
def test_linen_training_on_digits_lowers_the_loss():
  x_train, y_train, _, _ = load_digits()  # real 8x8 digits
  model = convert(CNN(), bits=4)
  variables = _jit(CNN().init)(KEY, x_train[:2])
  params, batch_stats = variables["params"], variables["batch_stats"]
  tx = optax.adam(3e-3)
  opt_state = tx.init(params)

  def loss_fn(params, batch_stats, x, y, key):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats}, x, rngs={"jact": key}, mutable=["batch_stats"]
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

  @_jit
  def step(params, batch_stats, opt_state, x, y, key):
    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, batch_stats, x, y, key
    )
    change, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, change), updates["batch_stats"], opt_state, loss

  data = batches(x_train, y_train, 64, seed=0)
  losses = []
  for i in range(30):
    xb, yb = next(data)
    params, batch_stats, opt_state, loss = step(
      params, batch_stats, opt_state, xb, yb, jax.random.fold_in(KEY, i)
    )
    losses.append(float(loss))
  # the first loss is that of the initial parameters; measured: 2.49, and
  # 0.55 averaged over the last five steps
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.6 * losses[0], losses
