"""Converted models and `jact.compressed` under JAX transforms and unusual dtypes.

Each case is written as a Flax/JAX user writes it and compared with the plain
model: gradients outside a named `jax.vmap` through linen and nnx batch norm
with `axis_name`, `jax.hessian` (exact at bits=None, a clear error where a
residual is lossy), a bfloat16 GRU, complex inputs and parameters, `jax.export`
with a symbolic batch, and (in an 8-device process) a sharded recurrent model's
rounding and `jact.sharded_batch` on a `jax.make_mesh` mesh.
"""

from __future__ import annotations

import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import jact
from jact._engine.store import SymbolicShapeWarning
from test_distributed import _run_on_eight_devices as run_on_eight_devices

KEY = jax.random.key(7)


def _relative(got, want) -> float:
  """||got - want|| / ||want|| over every leaf of two pytrees."""
  num = sum(
    float(jnp.sum(jnp.abs(a - b) ** 2)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )
  den = sum(float(jnp.sum(jnp.abs(b) ** 2)) for b in jax.tree.leaves(want))
  return (num / den) ** 0.5


def _assert_close(got, want, rtol=1e-5, atol=1e-6):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(
      np.asarray(a, np.complex128 if jnp.iscomplexobj(a) else np.float64),
      np.asarray(b, np.complex128 if jnp.iscomplexobj(b) else np.float64),
      rtol=rtol,
      atol=atol,
    )


# --------------------------------------------------------------------------- batch norm, axis_name


class LinenBN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=False, axis_name="batch")(x)
    return nn.Dense(2)(nn.relu(x))


XS = jax.random.normal(jax.random.key(0), (4, 8, 3))  # 4 "devices" x 8 samples


@functools.partial(jax.jit, static_argnums=(0,))  # one compile, not op-by-op under vmap
def _linen_bn_grads(model, variables, rngs):
  def loss(params):
    def one(x):
      y, stats = model.apply({**variables, "params": params}, x, rngs=rngs, mutable=["batch_stats"])
      return y, stats

    ys, stats = jax.vmap(one, axis_name="batch")(XS)
    return jnp.sum(ys**2), stats

  return jax.grad(loss, has_aux=True)(variables["params"])


@pytest.mark.slow  # compiles the converted model's backward under vmap: ~15 s on 2 busy cores
@pytest.mark.parametrize("bits", [None, 8])
def test_grad_outside_a_named_vmap_of_linen_batch_norm(bits):
  variables = LinenBN().init(jax.random.key(1), XS[0])
  want, want_stats = _linen_bn_grads(LinenBN(), variables, {})
  got, got_stats = _linen_bn_grads(jact.convert(LinenBN(), bits=bits), variables, {"jact": KEY})
  _assert_close(got_stats, want_stats)  # the statistics are computed exactly
  if bits is None:  # float reassociation only (the first layer's bias gradient is ~0)
    assert _relative(got, want) < 1e-5
  else:  # one 8-bit draw: well under a few percent
    assert _relative(got, want) < 0.05


class NnxBN(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(3, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, axis_name="batch", rngs=rngs)
    self.l2 = nnx.Linear(16, 2, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.bn(self.l1(x))))


def _nnx_vmap_loss(model):
  ys = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0), axis_name="batch")(model, XS)
  return jnp.sum(ys**2)


@pytest.mark.slow  # four conversions differentiated under nnx.vmap: ~5-10 s each
@pytest.mark.parametrize("functions", [True, False])
@pytest.mark.parametrize("bits", [None, 8])
def test_nnx_batch_norm_with_axis_name_under_nnx_vmap(bits, functions):
  plain = NnxBN(nnx.Rngs(0))
  want = nnx.jit(nnx.grad(_nnx_vmap_loss))(plain)  # jitted: one compile, not op-by-op
  model = jact.convert(NnxBN(nnx.Rngs(0)), bits=bits, functions=functions)

  @nnx.jit
  def grad(model, key):
    with jact.nnx.use_key(key):
      return nnx.grad(_nnx_vmap_loss)(model)

  got = grad(model, KEY)
  _assert_close(nnx.state(model, nnx.BatchStat), nnx.state(plain, nnx.BatchStat))
  if bits is None:  # float reassociation only (the first layer's bias gradient is ~0)
    assert _relative(got, want) < 1e-5
  else:
    assert _relative(got, want) < 0.05


def _eval_bn(rngs):
  model = NnxBN(rngs)
  model.bn.use_running_average = True  # evaluation: no statistics written
  return model


@pytest.mark.slow  # three models built, converted and run under vmap: ~5 s
def test_nnx_eval_batch_norm_under_a_closing_jax_vmap():
  """Under `jax.vmap` closing over the model, nnx forbids state updates: the
  plain model in evaluation mode updates none, nor does a model converted
  without streams; one converted with its own streams would advance them,
  which is refused with jact's error naming the fixes."""
  run = lambda m: jax.vmap(lambda x: m(x), axis_name="batch")(XS)
  want = run(_eval_bn(nnx.Rngs(0)))
  _assert_close(run(jact.convert(_eval_bn(nnx.Rngs(0)), bits=8)), want)
  streams = jact.convert(_eval_bn(nnx.Rngs(0)), bits=8, rngs=nnx.Rngs(jact=1))
  with pytest.raises(ValueError, match=r"own 'jact' stream.*nnx\.vmap.*jact\.nnx\.use_key"):
    run(streams)


# ----------------------------------------------------------------------------- second order


class ConvRNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=False)(x)
    x = nn.relu(x)
    x = nn.RNN(nn.GRUCell(4))(x.reshape(x.shape[0], -1, 4))
    return nn.Dense(1)(nn.gelu(nn.LayerNorm()(x)))


XH = jax.random.normal(jax.random.key(2), (2, 4, 4, 2))


def _scalar(model, variables, rngs):
  return lambda params, x: model.apply(
    {**variables, "params": params}, x, rngs=rngs, mutable=["batch_stats"]
  )[0].sum()


@pytest.mark.slow  # second derivatives of a conv + batch norm + GRU model: ~10 s
def test_hessian_of_a_converted_linen_model_at_bits_none_is_plain():
  """One jitted Hessian in (params, input): its blocks hold the params-params
  and input-input Hessians (once two eager tests) and the cross terms too."""
  variables = ConvRNN().init(jax.random.key(3), XH)
  hessian = lambda model, rngs: jax.jit(
    jax.hessian(_scalar(model, variables, rngs), argnums=(0, 1))
  )(variables["params"], XH)
  want = hessian(ConvRNN(), {})
  got = hessian(jact.convert(ConvRNN(), bits=None), {"jact": KEY})
  _assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # traces the second derivative of a conv + GRU model: ~8 s
def test_hessian_through_a_lossy_residual_names_the_fix():
  variables = ConvRNN().init(jax.random.key(3), XH)
  f = _scalar(jact.convert(ConvRNN(), bits=4), variables, {"jact": KEY})
  with pytest.raises(TypeError, match=r"cannot differentiate residual .* a second time.*bits=None"):
    jax.hessian(f, argnums=1)(variables["params"], XH)


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(3, 8, rngs=rngs)
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
    self.l2 = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.gelu(self.attention(self.ln(self.l1(x)))))


@pytest.mark.slow  # the hessian of an attention block through the engine: ~10-50 s
@pytest.mark.parametrize("functions", [True, False])
def test_hessian_of_a_converted_nnx_model_at_bits_none_is_plain(functions):
  x = jax.random.normal(jax.random.key(4), (2, 3, 3))

  def scalar(model):
    graphdef, state = nnx.split(model)
    return lambda x: nnx.merge(graphdef, state)(x).sum()

  # jitted: one compile of each second derivative instead of op-by-op dispatch
  want = jax.jit(jax.hessian(scalar(NnxBlock(nnx.Rngs(0)))))(x)
  got = jax.jit(
    jax.hessian(scalar(jact.convert(NnxBlock(nnx.Rngs(0)), bits=None, functions=functions)))
  )(x)
  _assert_close(got, want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- bfloat16 GRU


class Bf16GRU(nn.Module):
  param_dtype: object = jnp.bfloat16

  @nn.compact
  def __call__(self, x):
    cell = nn.GRUCell(64, dtype=jnp.bfloat16, param_dtype=self.param_dtype)
    return nn.Dense(1, dtype=jnp.bfloat16, param_dtype=self.param_dtype)(nn.RNN(cell)(x))


XB = jax.random.normal(jax.random.key(5), (16, 6, 8), jnp.bfloat16)


def _outcome(fn):
  try:
    return jax.tree.map(lambda a: (a.shape, a.dtype), fn())
  except Exception as err:  # noqa: BLE001 -- compared with the plain model's outcome
    return type(err), str(err)


@pytest.mark.slow  # initializes four GRU models: ~8 s
def test_bf16_gru_initializes_exactly_as_the_plain_model():
  """Conversion adds no failure: where Flax's own bf16 initializer works (or
  not: XLA:CPU's QR has no bfloat16), the converted model does the same."""
  for model in (Bf16GRU(), Bf16GRU(jnp.float32)):
    want = _outcome(lambda: model.init(jax.random.key(6), XB))
    got = _outcome(lambda: jact.convert(model, bits=4).init(jax.random.key(6), XB))
    assert got == want


@pytest.mark.slow  # a GRU scan through the engine, compiled per width: ~15-25 s
@pytest.mark.parametrize("bits", [None, 8])
def test_bf16_gru_gradients(bits):
  f32 = Bf16GRU(jnp.float32).init(jax.random.key(6), XB.astype(jnp.float32))
  variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16), f32)  # bf16 parameters

  def grads(model, rngs):
    loss = lambda p: model.apply({"params": p}, XB, rngs=rngs).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss))(variables["params"])  # one compile, not op-by-op

  want = grads(Bf16GRU(), {})
  got = grads(jact.convert(Bf16GRU(), bits=bits), {"jact": KEY})
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(got))
  if bits is None:
    _assert_close(got, want, rtol=0, atol=0)
  else:  # bf16 arithmetic plus one 8-bit draw
    assert (
      _relative(
        jax.tree.map(lambda a: a.astype(jnp.float32), got),
        jax.tree.map(lambda a: a.astype(jnp.float32), want),
      )
      < 0.03
    )


# ----------------------------------------------------------------------------- complex


def _complex(key, shape):
  re, im = jax.random.normal(key, (2, *shape))
  return (re + 1j * im).astype(jnp.complex64)


XC = _complex(jax.random.key(8), (32, 16))


class ComplexDense(nn.Module):
  param_dtype: object = jnp.complex64

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(32, param_dtype=self.param_dtype)(x)
    return nn.Dense(4, param_dtype=self.param_dtype)(h * jnp.tanh(jnp.abs(h)))


@pytest.mark.slow  # eight conversions differentiated: ~3-12 s each
@pytest.mark.parametrize("param_dtype", [jnp.complex64, jnp.float32])
@pytest.mark.parametrize("functions", [True, False])
@pytest.mark.parametrize("bits", [None, 8])
def test_gradients_of_complex_values(bits, functions, param_dtype):
  model = ComplexDense(param_dtype)
  variables = model.init(jax.random.key(9), XC)

  def grads(m, rngs):
    loss = lambda p, x: jnp.sum(jnp.abs(m.apply({"params": p}, x, rngs=rngs)) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(variables["params"], XC)

  want = grads(model, {})
  got = grads(jact.convert(model, bits=bits, functions=functions), {"jact": KEY})
  if bits is None or not functions:  # complex residuals (and a plain layer's) are exact
    _assert_close(got, want, rtol=1e-5, atol=1e-5)
  else:  # the model's call also stores real floats (|h|, tanh) at 8 bits
    assert _relative(got, want) < 0.02


@pytest.mark.parametrize("bits", [None, 8])
def test_compressed_keeps_complex_residuals_exact(bits):
  w = _complex(jax.random.key(10), (16, 300))
  f = lambda w, x: jnp.tanh(x @ w)
  block = jact.compressed(f, bits=bits, compress_argnums=(1,))
  loss = lambda fn: lambda w, x: jnp.sum(jnp.abs(fn(w, x)) ** 2)
  want = jax.grad(loss(f), argnums=(0, 1))(w, XC)
  got = jax.grad(loss(lambda w, x: block(w, x, key=KEY)), argnums=(0, 1))(w, XC)
  _assert_close(got, want, rtol=1e-5, atol=1e-5)


def _float8_block(w, x):
  h = (x @ w).astype(jnp.float8_e4m3fn)  # the product's residuals are float8
  return (h * h).astype(jnp.float32)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_compressed_keeps_float8_residuals_exact(bits):
  """float8 residuals are one byte a value already: kept exact (the quantizer used to
  reject them with a cast the user could not apply inside the function)."""
  w = jax.random.normal(jax.random.key(11), (64, 64)) / 8
  x = jax.random.normal(jax.random.key(12), (32, 64))
  r = jax.random.normal(jax.random.key(13), (32, 64))
  block = jact.compressed(_float8_block, bits=bits, min_size=1)
  loss = lambda fn: lambda w, x: jnp.sum(fn(w, x) * r)
  wrapped = loss(lambda w, x: block(w, x, key=KEY))
  stored = jact.residual_report(wrapped, w, x).residuals
  assert any(row.dtype == jnp.float8_e4m3fn for row in stored)  # the float8 residual, as is
  want = jax.grad(loss(_float8_block), argnums=(0, 1))(w, x)
  got = jax.grad(wrapped, argnums=(0, 1))(w, x)
  for g, e in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(e))  # nothing else is rounded


def test_checkpoint_keeps_a_float8_activation_exact():
  """A float8 activation in compress_argnums is kept as it is (by reference): the
  recomputation starts from the exact input, as jax.checkpoint's."""
  w = jax.random.normal(jax.random.key(11), (64, 64)) / 8
  x8 = jax.random.normal(jax.random.key(12), (32, 64)).astype(jnp.float8_e5m2)
  f = lambda w, x8: jnp.tanh(x8.astype(jnp.float32) @ w)
  ckpt = jact.checkpoint(f, bits=None, compress_argnums=(1,))
  got = jax.grad(lambda w, x8: ckpt(w, x8, key=KEY).sum())(w, x8)
  want = jax.grad(lambda w, x8: jax.checkpoint(f)(w, x8).sum())(w, x8)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  lossy = jact.checkpoint(f, bits=4, compress_argnums=(1,))  # runs: the input needs no cast
  assert jnp.isfinite(jax.grad(lambda w, x8: lossy(w, x8, key=KEY).sum())(w, x8)).all()


@pytest.mark.parametrize("bits", [None, 4])
def test_ops_reject_complex_operands_with_the_fix(bits):
  with pytest.raises(TypeError, match=r"jact\.ops\.dense .*complex64.*jact\.compressed"):
    jact.ops.dense(XC, jnp.ones((16, 4)), key=KEY, bits=bits)


# ----------------------------------------------------------------------------- jax.export


class ExportModel(nn.Module):
  recurrent: bool = True  # a GRU, whose scan stacks a time-major residual (batch on axis 1)

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=False)(x)
    x = nn.max_pool(nn.relu(x), (2, 2), (2, 2))
    x = nn.SelfAttention(2)(x.reshape(x.shape[0], -1, 8))
    x = nn.LayerNorm()(x)
    x = nn.RNN(nn.GRUCell(16))(x) if self.recurrent else nn.Dense(16)(x)
    return nn.Dense(2)(nn.gelu(x[:, -1]))


XE = jax.random.normal(jax.random.key(11), (4, 8, 8, 3))
# the smallest batch the export allows is the batch it is called with: `jact.compressed`'s
# min_size is decided for that batch, as the direct call decides it (see `at_least`)
(BATCH,) = export.symbolic_shape("b", constraints=("b >= 4",))
EXPORT_RTOL = 1e-5  # exported vs direct, same key: the same program up to XLA's float reordering


def _export_grads(model, variables, rngs):
  def grads(params, x, key):
    loss = lambda p: jnp.sum(
      model.apply({**variables, "params": p}, x, rngs=rngs(key), mutable=["batch_stats"])[0] ** 2
    )
    return jax.grad(loss)(params)

  return grads


def _exported_matches_direct(grads, args, at: int, plain=None):
  """Exports `grads` with the argument `at` given a symbolic batch, calls it
  with the concrete one and compares with the direct call (same key); returns
  the direct call's distance from `plain` (the same gradients uncompressed)."""
  x = args[at]
  spec = [*args]
  spec[at] = jax.ShapeDtypeStruct((BATCH, *x.shape[1:]), x.dtype)
  with warnings.catch_warnings():
    warnings.simplefilter("error", SymbolicShapeWarning)  # nothing falls back to exact
    exported = export.export(jax.jit(grads))(*spec)
  direct = jax.jit(grads)(*args)
  assert _relative(exported.call(*args), direct) < EXPORT_RTOL
  return None if plain is None else _relative(direct, jax.jit(plain)(*args))


@pytest.mark.slow  # exports a conv/attention/GRU model's gradient: ~6 s
@pytest.mark.parametrize("functions", [True, False])
def test_export_with_a_symbolic_batch_of_a_converted_model_matches_the_direct_call(functions):
  model = ExportModel(recurrent=False)
  variables = model.init(jax.random.key(12), XE)
  grads = _export_grads(
    jact.convert(model, bits=2, functions=functions), variables, lambda k: {"jact": k}
  )
  plain = _export_grads(model, variables, lambda k: {})
  # compressed (not plain JAX's gradients), exactly as the direct call compresses
  assert _exported_matches_direct(grads, (variables["params"], XE, KEY), 1, plain) > 1e-3


def test_export_with_a_symbolic_batch_of_a_compressed_function_matches_the_direct_call():
  w = jax.random.normal(jax.random.key(13), (16, 300)) / 4
  block = jact.compressed(lambda w, x: jnp.tanh(x @ w), bits=2, compress_argnums=(1,))
  grads = lambda w, x, key: jax.grad(lambda w: jnp.sum(block(w, x, key=key) ** 2))(w)
  plain = lambda w, x, key: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
  x = jax.random.normal(jax.random.key(14), (4, 16))
  assert _exported_matches_direct(grads, (w, x, KEY), 1, plain) > 1e-3


@pytest.mark.slow  # exports an attention block's gradient through the engine: ~15 s
def test_export_with_a_symbolic_batch_of_a_converted_nnx_model_matches_the_direct_call():
  x = jax.random.normal(jax.random.key(15), (4, 3, 3))

  def grads_of(model):
    graphdef, state = nnx.split(model)

    def grads(state, x, key):
      def loss(state):
        with jact.nnx.use_key(key):
          return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

      return jax.grad(loss)(state)

    return grads, state

  plain, _ = grads_of(NnxBlock(nnx.Rngs(0)))
  grads, state = grads_of(jact.convert(NnxBlock(nnx.Rngs(0)), bits=2))
  assert _exported_matches_direct(grads, (state, x, KEY), 1, plain) > 1e-3


# ----------------------------------------------------------------------------- 8 devices

_EIGHT_DEVICES = r"""
import json
import jax, jax.numpy as jnp
import flax.linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P
import jact

result = {"devices": jax.device_count()}


class Recurrent(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.RNN(nn.GRUCell(64))(x)[:, -1])


def grads(model):  # the key an argument: one compile serves both keys
  loss = lambda p, x, key: jnp.mean(model.apply({"params": p}, x, rngs={"jact": key}) ** 2)
  return jax.jit(jax.grad(loss))


def distance(a, b):
  pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
  return sum(float(jnp.sum((u - v) ** 2)) for u, v in pairs) ** 0.5


key = jax.random.key(2)
x = jax.random.normal(jax.random.key(0), (16, 5, 8))
params = Recurrent().init(jax.random.key(1), x)["params"]
auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
sharded = jax.device_put(x, NamedSharding(auto, P("data")))
converted, plain = grads(jact.convert(Recurrent(), bits=2)), grads(Recurrent())
one = converted(params, x, key)
result["rnn"] = {"sharded_vs_one": distance(converted(params, sharded, key), one),
                 "noise": distance(one, plain(params, x, key)),
                 "other_key_vs_one": distance(converted(params, x, jax.random.key(3)), one)}

w = jax.random.normal(jax.random.key(3), (8, 64)) / 3
xs = jax.random.normal(jax.random.key(4), (64, 8))
stack = lambda w, x: jnp.mean(jact.ops.relu(jact.ops.dense(x, w, key=key, bits=2)) ** 2)
plain_stack = lambda w, x: jnp.mean(jax.nn.relu(x @ w) ** 2)
want = jax.jit(jax.grad(stack))(w, xs)


def outcome(fn, mesh, set_mesh, block):
  x = jax.device_put(xs, NamedSharding(mesh, P("data")))
  try:
    if set_mesh:
      with jax.set_mesh(mesh), (jact.sharded_batch("data") if block else jax.named_scope("x")):
        got = jax.jit(jax.grad(fn))(w, x)
    else:
      with (jact.sharded_batch("data", mesh) if block else jax.named_scope("x")):
        got = jax.jit(jax.grad(fn))(w, x)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
  except Exception as e:
    return type(e).__name__


default = jax.make_mesh((8,), ("data",))
result["default_axis_types"] = [str(t) for t in default.axis_types]
result["recipes"] = {
    f"{name}/{'set_mesh' if s else 'argument'}": {
        "jact": outcome(stack, mesh, s, True), "plain": outcome(plain_stack, mesh, s, False)}
    for name, mesh in (("default", default), ("auto", auto)) for s in (False, True)}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
  return run_on_eight_devices(_EIGHT_DEVICES, tmp_path_factory.mktemp("transforms"))


@pytest.mark.slow  # a process on 8 simulated devices: ~15 s
def test_a_sharded_gru_rounds_as_on_one_device(eight_devices):
  rnn = eight_devices["rnn"]
  # the noise is that of a 2-bit draw; another key moves the gradients by as much
  assert rnn["other_key_vs_one"] > 0.3 * rnn["noise"] > 0
  # the same key on a batch sharded 8 ways: the same draw, float-reduction differences only
  assert rnn["sharded_vs_one"] < 1e-4 * rnn["noise"]


@pytest.mark.slow  # a process on 8 simulated devices: ~15 s
def test_sharded_batch_on_a_make_mesh_mesh(eight_devices):
  assert eight_devices["default_axis_types"] == ["AxisType.Explicit"]
  for recipe, got in eight_devices["recipes"].items():
    if isinstance(got["plain"], str):  # plain JAX fails too (explicit mode without set_mesh)
      assert got["jact"] == got["plain"], recipe
    else:
      assert isinstance(got["jact"], float) and got["jact"] < 1e-5, (recipe, got)


def test_float64_residual_error_names_the_residual_and_fixes_that_apply():
  """A float64 residual inside the wrapped function cannot be cast by the caller: the
  error names the residual, the dtype and the fixes (float32 arguments, or keep it
  exact with bits=None / overrides), and the fixes it suggests work."""
  f = lambda w, x: jnp.tanh(x @ w)
  with jax.enable_x64(True):
    w = jnp.ones((64, 64), jnp.float64) / 64
    x = jnp.linspace(-1.0, 1.0, 32 * 64, dtype=jnp.float64).reshape(32, 64)
    grad = lambda block, w=w, x=x: jax.grad(lambda w, x: block(w, x, key=KEY).sum())(w, x)
    with pytest.raises(TypeError, match=r"'f64\.\d+' is float64.*float32 values.*bits=None") as e:
      grad(jact.compressed(f, bits=4, name="f64"))
    [name] = re.findall(r"overrides=\{'(f64\.\d+)': None\}", str(e.value))
    try:  # the override keeps that residual: an error now names another one, if any
      grad(jact.compressed(f, bits=4, name="f64", overrides={name: None}))
    except TypeError as other:
      assert f"'{name}'" not in str(other)
    want = jax.grad(lambda w, x: f(w, x).sum())(w, x)
    np.testing.assert_allclose(grad(jact.compressed(f, bits=None)), want, rtol=1e-12)
    as32 = grad(jact.compressed(f, bits=4), w.astype(jnp.float32), x.astype(jnp.float32))
    assert as32.dtype == jnp.float32
