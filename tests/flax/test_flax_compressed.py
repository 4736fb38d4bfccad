"""`jact.compressed` on whole Flax modules (jact._flax.compressed): linen
classes and instances, nnx classes and instances. Same variables as the plain
module, same forward and batch statistics, close 8-bit gradients, small 2-bit
residuals, clear errors, nnx transforms, and real-data training."""

from __future__ import annotations

from typing import Callable

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
from jact._flax import compressed as flax_compressed
from jact._transforms.compressed import ResidualConfig

# Relative L2 error of each 8-bit gradient leaf against the plain module's
# (leaves whose exact gradient is ~0, such as a bias before BatchNorm, are
# measured against 5% of the whole gradient's norm). Measured: < 1%.
GRAD_RTOL = 5e-2
# Residual bytes at 2 bits against the plain module's. Measured: 12-15x.
MIN_SAVING = 6


def _key(seed):
  # RBG keys: XLA:CPU compiles threefry-based initializers ~3x slower
  return jax.random.key(seed, impl="rbg")


def _rngs(**streams):
  return nnx.Rngs(**{name: _key(seed) for name, seed in streams.items()})


def _normal(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _saved_bytes(loss, params, x):
  return jact.residual_report(loss, params, x).total_bytes


X = _normal((64, 16))


# ----------------------------------------------------------------------------- linen


# relu keeps the compiled test programs small; the residual-size tests use gelu
# (several full-size residuals per block, as in a transformer MLP).


class LinenBlock(nn.Module):
  """Residual MLP block, optionally with BatchNorm (mutable batch_stats)."""

  width: int = 256
  norm: bool = False
  act: Callable = nn.relu

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Dense(self.width)(x)
    if self.norm:
      h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(h)
    return x + nn.Dense(x.shape[-1])(self.act(h))


class LinenNet(nn.Module):
  block: type = LinenBlock
  act: Callable = nn.relu

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = self.block(norm=True, act=self.act)(x, train)
    return self.block(width=128, act=self.act)(x, train)


def _linen_loss(net, batch_stats, rngs=None, *, has_aux=False):
  probe = _normal((X.shape[0], X.shape[1]), seed=3)

  def loss(params, x):
    y, new = net.apply(
      {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"], rngs=rngs
    )
    return (jnp.mean(y * probe), new) if has_aux else jnp.mean(y * probe)

  return loss


@pytest.fixture(scope="module")
def linen_variables():
  return jax.jit(LinenNet().init)(_key(0), X)


@pytest.mark.slow
def test_linen_variables_equal_plain(linen_variables):
  decorated = LinenNet(block=jact.compressed(LinenBlock, bits=2))
  # without a 'jact' stream init runs the plain module; with one, the compressed
  # path; both give exactly the plain variables (autonames "LinenBlock_0", ...)
  assert_same_tree(jax.jit(decorated.init)(_key(0), X), linen_variables)
  assert_same_tree(
    jax.jit(decorated.init)({"params": _key(0), "jact": _key(1)}, X), linen_variables
  )
  assert set(linen_variables["params"]) == {"LinenBlock_0", "LinenBlock_1"}
  top = jact.compressed(LinenBlock, bits=2)
  assert top.__name__ == "LinenBlock" and issubclass(top, LinenBlock)
  assert top.residual_config.compressor == jact.compressors.PerGroup(2)


@pytest.mark.slow
def test_linen_forward_and_batch_stats_equal_plain(linen_variables):
  y_ref, s_ref = LinenNet().apply(linen_variables, X, mutable=["batch_stats"])
  net = LinenNet(block=jact.compressed(LinenBlock, bits=2))
  y, s = net.apply(linen_variables, X, mutable=["batch_stats"], rngs={"jact": _key(1)})
  np.testing.assert_array_equal(y, y_ref)
  assert_same_tree(s, s_ref)
  mean = lambda v: v["batch_stats"]["LinenBlock_0"]["BatchNorm_0"]["mean"]
  assert not np.allclose(mean(s), mean(linen_variables))  # the statistics did move
  # inference (no mutable collection) runs too
  y_eval = net.apply(linen_variables, X, False, rngs={"jact": _key(1)})
  np.testing.assert_array_equal(y_eval, LinenNet().apply(linen_variables, X, False))


@pytest.mark.slow
def test_linen_8bit_gradients_close_and_2bit_residuals_small(linen_variables):
  params, stats = linen_variables["params"], linen_variables["batch_stats"]
  plain = _linen_loss(LinenNet(), stats)
  c8 = _linen_loss(
    LinenNet(block=jact.compressed(LinenBlock, bits=8)), stats, {"jact": _key(1)}, has_aux=True
  )
  g_ref, s_ref = jax.jit(jax.grad(_linen_loss(LinenNet(), stats, has_aux=True), has_aux=True))(
    params, X
  )
  g, s = jax.jit(jax.grad(c8, has_aux=True))(params, X)
  assert tree_rel_err(g, g_ref) < GRAD_RTOL
  # batch statistics flow out of the compressed call under jit(grad)
  chex.assert_trees_all_close(s, s_ref, rtol=1e-6, atol=1e-7)
  plain = _linen_loss(LinenNet(act=nn.gelu), stats)
  c2 = _linen_loss(
    LinenNet(block=jact.compressed(LinenBlock, bits=2), act=nn.gelu), stats, {"jact": _key(1)}
  )
  report = jact.residual_report(c2, params, X)
  assert _saved_bytes(plain, params, X) >= MIN_SAVING * report.total_bytes
  # residual names default to the block's module path
  names = {name for name in report.by_name() if name}
  assert any(n.startswith("LinenBlock_0.") for n in names)
  assert any(n.startswith("LinenBlock_1.") for n in names)


@pytest.mark.slow
def test_compress_argnums_stores_block_inputs_compressed(linen_variables):
  # the second block's input is the first block's output: an activation
  params, stats = linen_variables["params"], linen_variables["batch_stats"]

  def saved(argnums):
    block = flax_compressed.wrap(
      LinenBlock, ResidualConfig(jact.compressors.PerGroup(2)), None, argnums
    )
    loss = _linen_loss(LinenNet(block=block, act=nn.gelu), stats, {"jact": _key(1)})
    return _saved_bytes(loss, params, X)

  assert saved((0,)) < saved(()) - X.nbytes // 2
  model = NnxNet(NnxBlock, nnx.gelu, rngs=_rngs(default=0))
  shift = _normal(X.shape, seed=8)
  loss = lambda m, x: jnp.mean(m(2.0 * x + shift, key=_key(1)))  # the input: an activation
  default, compress = (
    _saved_bytes(
      loss,
      flax_compressed.wrap(model, ResidualConfig(jact.compressors.PerGroup(2)), None, argnums),
      X,
    )
    for argnums in ((), (0,))
  )
  assert compress < default - X.nbytes // 2
  with pytest.raises(ValueError, match="compress_argnums"):
    flax_compressed.wrap(
      LinenBlock, ResidualConfig(jact.compressors.PerGroup(2)), None, (3,)
    )().init({"params": _key(0), "jact": _key(1)}, X)


@pytest.mark.slow
def test_linen_missing_stream_explicit_key_and_instances(linen_variables):
  variables = {"params": linen_variables["params"]["LinenBlock_1"]}
  block = jact.compressed(LinenBlock, bits=2)(width=128)
  y_ref = LinenBlock(width=128).apply(variables, X)
  # no stream: inference runs the plain module; differentiating it names the fixes
  np.testing.assert_array_equal(block.apply(variables, X), y_ref)
  with pytest.raises(
    ValueError,
    match=r"jact.compressed\(LinenBlock 'LinenBlock'\) was "
    r"differentiated.*rngs=\{'jact': key\}.*key=",
  ):
    jax.grad(lambda v: jnp.sum(block.apply(v, X)))(variables)
  # no key needed with round-to-nearest
  nearest = jact.compressed(LinenBlock, compressor=jact.compressors.PerGroup(2, stochastic=False))(
    width=128
  )
  np.testing.assert_array_equal(nearest.apply(variables, X), y_ref)
  # an explicit key= instead of the stream
  np.testing.assert_array_equal(block.apply(variables, X, key=_key(2)), y_ref)
  # an unbound instance keeps its attributes
  inst = jact.compressed(LinenBlock(width=128), bits=2)
  assert isinstance(inst, LinenBlock) and inst.width == 128
  assert_same_tree(inst.init(_key(0), X), LinenBlock(width=128).init(_key(0), X))

  class Parent(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jact.compressed(nn.Dense(3))(x)

  with pytest.raises(TypeError, match="decorate the class"):
    Parent().init(_key(0), X)


@pytest.mark.slow
def test_linen_composes_with_remat_and_dropout():
  class Drop(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dropout(0.5, deterministic=False)(nn.relu(nn.Dense(128)(x)))

  variables = Drop().init(_key(0), X)
  rngs = {"dropout": _key(3), "jact": _key(4)}
  # the 'dropout' stream is lifted unchanged: same mask as the plain module
  remat = nn.remat(jact.compressed(Drop, bits=8))
  loss = lambda p, net: jnp.sum(net.apply({"params": p}, X, rngs=rngs) ** 2)
  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  l_ref, g_ref = value_and_grad(variables["params"], Drop())
  l, g = value_and_grad(variables["params"], remat())
  np.testing.assert_allclose(l, l_ref, rtol=1e-6)
  assert tree_rel_err(g, g_ref) < GRAD_RTOL


# ----------------------------------------------------------------------------- nnx


class NnxBlock(nnx.Module):
  """Residual MLP block, optionally with BatchNorm (nnx.BatchStat state)."""

  def __init__(self, d: int, width: int, norm: bool = False, act=nnx.relu, *, rngs: nnx.Rngs):
    self.act = act
    self.fc1 = nnx.Linear(d, width, rngs=rngs)
    self.bn = nnx.BatchNorm(width, momentum=0.9, rngs=rngs) if norm else None
    self.fc2 = nnx.Linear(width, d, rngs=rngs)

  def __call__(self, x):
    h = self.fc1(x)
    if self.bn is not None:
      h = self.bn(h)
    return x + self.fc2(self.act(h))


class NnxNet(nnx.Module):
  def __init__(self, block, act=nnx.relu, *, rngs: nnx.Rngs):
    self.b0 = block(16, 256, True, act, rngs=rngs)
    self.b1 = block(16, 128, False, act, rngs=rngs)

  def __call__(self, x):
    return self.b1(self.b0(x))


def _pure(model, kind):
  return nnx.to_pure_dict(nnx.state(model, kind))


def _nnx_loss_of_params(model):
  """(loss(params, x), params) for residual_report / jax.grad."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  probe = _normal(X.shape, seed=3)

  def loss(params, x):
    # fresh Variables inside the trace (merge reuses the State's Variable objects)
    m = nnx.merge(graphdef, params, jax.tree.map(lambda v: v, rest))
    return jnp.mean(m(x) * probe)

  return loss, params


@pytest.mark.slow
@pytest.mark.parametrize(
  "rngs",
  [lambda: _rngs(default=0), lambda: _rngs(params=0, jact=1)],
  ids=["default-stream", "jact-stream"],
)
def test_nnx_class_state_equals_plain(rngs):
  plain = NnxNet(NnxBlock, rngs=_rngs(default=0))
  model = NnxNet(jact.compressed(NnxBlock, bits=2), rngs=rngs())
  for kind in (nnx.Param, nnx.BatchStat):
    assert_same_tree(_pure(model, kind), _pure(plain, kind))
  assert isinstance(model.b0, NnxBlock) and type(model.b0).__name__ == "NnxBlock"
  assert model.b0.residual_name == "NnxBlock" and model.b0.jact_rngs is not None


def test_nnx_forward_and_batch_stats_equal_plain():
  plain = NnxNet(NnxBlock, rngs=_rngs(default=0))
  model = NnxNet(jact.compressed(NnxBlock, bits=2), rngs=_rngs(params=0, jact=1))
  np.testing.assert_array_equal(model(X), plain(X))
  assert_same_tree(_pure(model, nnx.BatchStat), _pure(plain, nnx.BatchStat))
  assert np.abs(model.b0.bn.mean[...]).max() > 0  # the statistics did move
  assert int(model.b0.jact_rngs.count[...]) == 1  # one key drawn


@pytest.mark.slow
def test_nnx_8bit_gradients_close_and_2bit_residuals_small():
  plain_loss, params = _nnx_loss_of_params(NnxNet(NnxBlock, rngs=_rngs(default=0)))
  loss8, params8 = _nnx_loss_of_params(
    NnxNet(jact.compressed(NnxBlock, bits=8), rngs=_rngs(params=0, jact=1))
  )
  g_ref, g = jax.jit(jax.grad(plain_loss))(params, X), jax.jit(jax.grad(loss8))(params8, X)
  assert tree_rel_err(nnx.to_pure_dict(g), nnx.to_pure_dict(g_ref)) < GRAD_RTOL
  plain_loss, params = _nnx_loss_of_params(NnxNet(NnxBlock, nnx.gelu, rngs=_rngs(default=0)))
  loss2, params2 = _nnx_loss_of_params(
    NnxNet(jact.compressed(NnxBlock, bits=2), nnx.gelu, rngs=_rngs(params=0, jact=1))
  )
  assert _saved_bytes(plain_loss, params, X) >= MIN_SAVING * _saved_bytes(loss2, params2, X)


@pytest.mark.slow
def test_nnx_instance_wrapper_and_missing_stream():
  block = NnxBlock(16, 64, True, rngs=_rngs(default=0))
  plain = NnxBlock(16, 64, True, rngs=_rngs(default=0))
  wrapped = jact.compressed(block, bits=2)
  assert isinstance(wrapped, flax_compressed.CompressedModule) and wrapped.module is block
  assert_same_tree(_pure(wrapped, nnx.Param)["module"], _pure(plain, nnx.Param))
  # no stream, no key: inference runs the plain module; differentiating it names the fixes
  np.testing.assert_array_equal(wrapped(X), plain(X))
  with pytest.raises(ValueError, match=r"differentiated without a rounding key.*use_key.*key="):
    nnx.grad(lambda m: jnp.sum(m(X)))(wrapped)
  np.testing.assert_array_equal(wrapped(X, key=_key(0)), plain(X))
  assert_same_tree(_pure(block, nnx.BatchStat), _pure(plain, nnx.BatchStat))
  with jact.nnx.use_key(_key(0)):  # or a use_key block's key
    nnx.grad(lambda m: jnp.sum(m(X)))(wrapped)
  # key= also takes an nnx.Rngs; a stream can be kept on the wrapper
  wrapped(X, key=_rngs(jact=3))
  kept = flax_compressed.CompressedModule(block, rngs=_rngs(jact=3), bits=2)
  kept(X)
  assert int(kept.jact_rngs.count[...]) == 1
  # round-to-nearest needs no key
  jact.compressed(block, compressor=jact.compressors.PerGroup(2, stochastic=False))(X)


def test_nnx_jit_grad_step_changes_params():
  model = jact.compressed(NnxBlock, bits=2)(16, 64, rngs=_rngs(params=0, jact=1))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  before = _pure(model, nnx.Param)
  traces = []

  @nnx.jit
  def step(model, optimizer, x):
    traces.append(1)
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, X)) for _ in range(3)]
  assert len(traces) == 1 and losses[-1] < losses[0]
  after = _pure(model, nnx.Param)
  assert all(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)))
  assert int(model.jact_rngs.count[...]) == 3  # a fresh key every step


def test_nnx_remat_composition():
  model = jact.compressed(NnxBlock, bits=8)(16, 64, rngs=_rngs(params=0, jact=1))
  plain = NnxBlock(16, 64, rngs=_rngs(default=0))
  loss = lambda m, x: jnp.mean(m(x) * _normal((64, 16), seed=5))
  g = nnx.jit(nnx.grad(nnx.remat(loss)))(model, X)
  g_ref = nnx.jit(nnx.grad(loss))(plain, X)
  assert tree_rel_err(nnx.to_pure_dict(g), nnx.to_pure_dict(g_ref)) < GRAD_RTOL
  assert int(model.jact_rngs.count[...]) == 1  # the key drawn inside remat is written back


@pytest.mark.slow
def test_nnx_scan_over_a_stack_of_blocks():
  layers, d = 3, 16

  def stack(cls, rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return cls(d, 64, rngs=rngs)

    return make(rngs)

  def forward(blocks, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def body(x, block):
      return block(x)

    return body(x, blocks)

  model = stack(jact.compressed(NnxBlock, bits=8), _rngs(params=0, jact=1))
  # the plain stack, with the same parameters (shapes only: no second initialization)
  abstract = nnx.eval_shape(lambda: stack(NnxBlock, _rngs(default=0)))
  assert jax.tree.map(jnp.shape, _pure(abstract, nnx.Param)) == jax.tree.map(
    jnp.shape, _pure(model, nnx.Param)
  )
  plain = nnx.merge(nnx.graphdef(abstract), nnx.state(model, nnx.Param))
  loss = lambda m, x: jnp.mean(forward(m, x) * _normal((64, d), seed=6))
  value_and_grad = nnx.jit(nnx.value_and_grad(loss))
  (l, g), (l_ref, g_ref) = value_and_grad(model, X), value_and_grad(plain, X)
  np.testing.assert_allclose(l, l_ref, rtol=1e-6)  # same forward
  assert tree_rel_err(nnx.to_pure_dict(g), nnx.to_pure_dict(g_ref)) < GRAD_RTOL
  counts = np.asarray(model.jact_rngs.count[...])
  assert counts.shape == (layers,) and (counts == 1).all()  # per-layer streams, advanced
  keys = jax.random.key_data(model.jact_rngs.key[...])
  assert len({tuple(np.asarray(k).ravel()) for k in keys}) == layers


@pytest.mark.slow
def test_nnx_call_function_writes_state_back():
  bn, plain = nnx.BatchNorm(4, rngs=_rngs(default=0)), nnx.BatchNorm(4, rngs=_rngs(default=0))
  x = _normal((2048, 4), seed=7)
  assert flax_compressed.has_graph_nodes((bn, x), {})
  assert not flax_compressed.has_graph_nodes((x,), {})
  drop = nnx.Dropout(0.5)
  fn = lambda m, x, s, rngs: drop(m(x), rngs=rngs) * s
  rngs, rngs_ref = _rngs(dropout=2), _rngs(dropout=2)
  y = flax_compressed.call_function(
    fn, (bn, x, 2.0, rngs), {}, key=_key(0), config=ResidualConfig(jact.compressors.PerGroup(8))
  )
  np.testing.assert_array_equal(y, fn(plain, x, 2.0, rngs_ref))
  assert_same_tree(_pure(bn, nnx.BatchStat), _pure(plain, nnx.BatchStat))
  assert int(rngs.dropout.count[...]) == 1  # an nnx.Rngs argument advances too


def test_is_flax():
  assert flax_compressed.is_flax(LinenBlock) and flax_compressed.is_flax(LinenBlock())
  assert flax_compressed.is_flax(NnxBlock)
  assert flax_compressed.is_flax(nnx.Linear(2, 2, rngs=_rngs(default=0)))
  assert not flax_compressed.is_flax(jnp.tanh)
  assert not flax_compressed.is_flax(lambda x: x)


# ----------------------------------------------------------------------------- real data


@pytest.fixture(scope="module")
def digits():
  x_train, y_train, _, _ = load_digits()  # real 8x8 handwritten digits
  return x_train.reshape(len(x_train), -1), y_train


def _ce(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


STEPS = 40


@pytest.mark.slow
def test_linen_training_on_digits_lowers_the_loss(digits):
  class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jact.compressed(LinenBlock, bits=2)(width=128)(nn.Dense(64)(x))
      return nn.Dense(10)(x)

  x_train, y_train = digits
  variables = jax.jit(Classifier().init)(_key(0), x_train[:128])
  tx = optax.adam(3e-3)
  opt_state = tx.init(variables["params"])

  @jax.jit
  def step(params, opt_state, x, y, key):
    loss_fn = lambda p: _ce(Classifier().apply({"params": p}, x, rngs={"jact": key}), y)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  params, losses = variables["params"], []
  for i, (xb, yb) in zip(range(STEPS), batches(x_train, y_train, 128, seed=0)):
    params, opt_state, loss = step(params, opt_state, xb, yb, _key(i))
    losses.append(float(loss))
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3]), losses


@pytest.mark.slow
def test_nnx_training_on_digits_lowers_the_loss(digits):
  class Classifier(nnx.Module):
    def __init__(self, rngs):
      self.inp = nnx.Linear(64, 64, rngs=rngs)
      self.block = jact.compressed(NnxBlock, bits=2)(64, 128, rngs=rngs)
      self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
      return self.out(self.block(self.inp(x)))

  x_train, y_train = digits
  model = Classifier(_rngs(params=0, jact=1))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: _ce(m(x), y))(model)
    optimizer.update(model, grads)
    return loss

  losses = [
    float(step(model, optimizer, xb, yb))
    for _, (xb, yb) in zip(range(STEPS), batches(x_train, y_train, 128, seed=0))
  ]
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3]), losses
  assert int(model.block.jact_rngs.count[...]) == STEPS


@pytest.mark.slow
def test_function_path_writes_back_nnx_state_of_module_arguments():
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(64, 64, rngs=rngs)
      self.bn = nnx.BatchNorm(64, rngs=rngs)

    def __call__(self, x):
      return jax.nn.relu(self.bn(self.linear(x)))

  fast, plain = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (32, 64))
  y = jact.compressed(lambda m, x: m(x), bits=2)(fast, x, key=jax.random.key(0))
  np.testing.assert_array_equal(y, plain(x))
  assert float(jnp.abs(plain.bn.mean[...]).max()) > 0  # the call did update the statistics ...
  np.testing.assert_array_equal(fast.bn.mean[...], plain.bn.mean[...])  # ... and they came back
