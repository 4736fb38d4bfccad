"""`jax.export` with a symbolic batch: residuals whose only symbolic size is the
leading (batch) axis are stored as a concrete batch stores them, so the exported
gradient equals the direct call's with the same key; other symbolic layouts are
kept exact with a `SymbolicShapeWarning`."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import export

import jact
from jact._engine.store import SymbolicShapeWarning
from jact._transforms._vjp_residuals import at_least

KEY = jax.random.key(7)
RTOL = 1e-5  # exported vs direct, same key: the same program up to XLA's float reordering
X = jax.random.normal(jax.random.key(1), (6, 64))
W = jax.random.normal(jax.random.key(2), (64, 64)) / 8


def _relative(got, want) -> float:
  num = sum(
    float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )
  return (num / sum(float(jnp.sum(b**2)) for b in jax.tree.leaves(want))) ** 0.5


def _exported(grads, w, x, batch, strict=True):
  spec = jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype)
  with warnings.catch_warnings():
    if strict:
      warnings.simplefilter("error", SymbolicShapeWarning)
    return export.export(jax.jit(grads))(w, spec, KEY)


def _dense_relu_gelu(w, x, key, bits=2):
  k1, k2 = jax.random.split(key)
  h = jact.ops.relu(jact.ops.dense(x, w, key=k1, bits=bits))
  return jnp.sum(jact.ops.gelu(h, key=k2, bits=bits) ** 2)


def _dense_layer_norm(w, x, key, bits=2):
  k1, k2 = jax.random.split(key)
  h = jact.ops.layer_norm(jact.ops.dense(x, w, key=k1, bits=bits), key=k2, bits=bits)
  return jnp.sum(jnp.sin(h))


@pytest.mark.parametrize("loss", [_dense_relu_gelu, _dense_layer_norm])
def test_exported_ops_gradient_with_a_symbolic_batch_is_the_direct_calls(loss):
  grads = jax.grad(loss)
  plain = jax.grad(lambda w, x, key: loss(w, x, key, bits=None))
  (b,) = export.symbolic_shape("b")
  exported = _exported(grads, W, X, b)
  direct = jax.jit(grads)(W, X, KEY)
  for n in (6, 2):  # any concrete batch: the ops compress every residual
    x = X[:n]
    assert _relative(exported.call(W, x, KEY), jax.jit(grads)(W, x, KEY)) < RTOL
  assert _relative(direct, plain(W, X, KEY)) > 1e-3  # compressed, not plain JAX's


def test_min_size_with_a_symbolic_batch_is_decided_for_the_smallest_batch_allowed():
  (b,) = export.symbolic_shape("b")
  (b4,) = export.symbolic_shape("b", constraints=("b >= 4",))
  assert at_least((b, 1024), 1024) and not at_least((b, 300), 1024)
  assert at_least((b4, 300), 1024) == at_least((4, 300), 1024) and at_least((b4, 300), 1024)
  assert not at_least((b4, 200), 1024) and not at_least((4, 200), 1024)


def test_a_symbolic_batch_below_min_size_keeps_the_residual_exact_as_that_batch_does():
  w = jax.random.normal(jax.random.key(13), (64, 300)) / 4
  block = jact.compressed(lambda w, x: jnp.tanh(x @ w), bits=2)
  grads = lambda w, x, key: jax.grad(lambda w: jnp.sum(block(w, x, key=key) ** 2))(w)
  plain = jax.grad(lambda w, x, key: jnp.sum(jnp.tanh(x @ w) ** 2))
  (b,) = export.symbolic_shape("b")
  exported = _exported(grads, w, X, b)  # 300 values per sample < min_size=1024 at b = 1
  x = X[:3]  # 900 values: the direct call keeps it exact too
  assert _relative(exported.call(w, x, KEY), jax.jit(grads)(w, x, KEY)) < RTOL
  assert _relative(exported.call(w, x, KEY), plain(w, x, KEY)) < RTOL


@pytest.mark.parametrize("shape", [(16, "b", 16), ("b", 4)])
def test_a_symbolic_size_off_the_batch_or_a_tiny_sample_is_kept_exact_with_a_warning(shape):
  """A batch on axis 1 (a time-major scan output) or fewer than 8 values per
  sample: the layout spans samples, which a symbolic size cannot express."""
  (b,) = export.symbolic_shape("b")
  dims = tuple(b if d == "b" else d for d in shape)
  concrete = tuple(5 if d == "b" else d for d in shape)
  w = jax.random.normal(jax.random.key(3), (shape[-1], shape[-1]))  # the output's layout too
  block = jact.compressed(lambda w, x: jnp.tanh(x @ w), bits=2, compress_argnums=(1,), min_size=1)
  grads = lambda w, x, key: jax.grad(lambda w: jnp.sum(block(w, x, key=key) ** 2))(w)
  plain = jax.grad(lambda w, x, key: jnp.sum(jnp.tanh(x @ w) ** 2))
  spec = jax.ShapeDtypeStruct(dims, jnp.float32)
  with pytest.warns(SymbolicShapeWarning, match=r"symbolic shape .*batch"):
    exported = export.export(jax.jit(grads))(w, spec, KEY)
  x = jax.random.normal(jax.random.key(4), concrete)
  assert _relative(exported.call(w, x, KEY), plain(w, x, KEY)) < RTOL  # every residual exact


def _dense_gelu_with(compressor):
  def loss(w, x, key):
    k1, k2 = jax.random.split(key)
    h = jact.ops.dense(x, w, key=k1, compressor=compressor)
    return jnp.sum(jact.ops.gelu(h, key=k2, compressor=compressor) ** 2)

  return jax.grad(loss)


@pytest.mark.parametrize(
  "compressor",
  [
    jact.compressors.Division(4),
    jact.compressors.BLPA(4),
    jact.compressors.Fixpoint(4),
  ],
  ids=type,
)
def test_per_sample_compressors_export_a_symbolic_batch_as_the_direct_call(compressor):
  grads = _dense_gelu_with(compressor)
  (b,) = export.symbolic_shape("b")
  exported = _exported(grads, W, X, b)
  assert _relative(exported.call(W, X, KEY), jax.jit(grads)(W, X, KEY)) < RTOL


def test_a_compressor_whose_layout_spans_samples_keeps_a_symbolic_batch_exact():
  zero_value = jact.compressors.ZeroValue()  # top-k over the whole tensor

  def loss(w, x, key, exact=False):
    h = x @ w
    return jnp.sum(
      (jax.nn.gelu(h) if exact else jact.ops.gelu(h, key=key, compressor=zero_value)) ** 2
    )

  grads = jax.grad(loss)
  (b,) = export.symbolic_shape("b")
  with pytest.warns(SymbolicShapeWarning, match=r"ZeroValue.*spans samples"):
    exported = _exported(grads, W, X, b, strict=False)
  plain = jax.grad(lambda w, x, key: loss(w, x, key, exact=True))
  assert _relative(exported.call(W, X, KEY), plain(W, X, KEY)) < RTOL
  assert _relative(jax.jit(grads)(W, X, KEY), plain(W, X, KEY)) > 1e-3  # the direct call compresses
