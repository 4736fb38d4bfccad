"""Edge cases of the converter and the optimization levels (issue 14, slice F).

Byte counts are derived from the storage format, not read back from the code:
a per-group quantized tensor of `rows` samples keeps, per group of 256 values,
256 * bits / 8 bytes of codes plus a bfloat16 minimum and a bfloat16 step.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jact
from jact import nnx as jnnx
from jact._convert import convert

GROUP = 256


def _packed_bytes(rows: int, per_row: int, bits: int) -> int:
  """Bytes of `rows` samples of `per_row` values (a multiple of 256) at `bits`."""
  assert per_row % GROUP == 0
  groups = rows * per_row // GROUP
  return groups * (GROUP * bits // 8 + 2 * 2)


def _normal(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# ----------------------------------------------------------------------------- convert twice


def _nnx_bytes(model, x) -> dict:
  graph, state = nnx.split(model)
  loss = lambda state, x: nnx.merge(graph, state)(x).sum()
  return {
    name: group.bytes
    for name, group in jact.residual_report(loss, state, x).by_name().items()
    if name is not None
  }


@pytest.mark.slow
def test_convert_nnx_again_applies_new_settings():
  x = _normal((8, 256), 0)
  net = nnx.Sequential(
    nnx.Linear(256, 256, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(256, 4, rngs=nnx.Rngs(1))
  )
  # functions=False: the layers alone, whose residuals keep the twins' names (the
  # model's call through the engine is covered by the test after this one)
  net = convert(net, bits=4, rngs=nnx.Rngs(jact=2), functions=False)
  assert _nnx_bytes(net, x) == {
    n: _packed_bytes(8, 256, 4) for n in ("layers/0.lhs", "layers/2.lhs")
  }
  # no rngs: each twin re-forks its own stream
  assert convert(net, bits=2, functions=False) is net
  assert [net.layers[i].bits for i in (0, 2)] == [2, 2]
  assert _nnx_bytes(net, x) == {
    n: _packed_bytes(8, 256, 2) for n in ("layers/0.lhs", "layers/2.lhs")
  }
  convert(
    net, compressor=jact.compressors.PerGroup(8, stochastic=False), functions=False
  )  # round-to-nearest: no stream
  assert net.layers[0].jact_rngs is None
  assert _nnx_bytes(net, x)["layers/0.lhs"] == _packed_bytes(8, 256, 8)
  # back to stochastic rounding: the twins have no stream left, and without rngs
  # they get none (keys from jact.nnx.use_key); rngs gives them streams again
  convert(net, bits=2, functions=False)
  assert net.layers[0].jact_rngs is None
  convert(net, bits=2, rngs=nnx.Rngs(jact=3), functions=False)
  assert net.layers[0].jact_rngs is not None
  assert _nnx_bytes(net, x)["layers/0.lhs"] == _packed_bytes(8, 256, 2)


def _nnx_total(model, x) -> int:
  graph, state = nnx.split(model)
  return jact.residual_report(
    lambda state, x: nnx.merge(graph, state)(x).sum(), state, x
  ).total_bytes


@pytest.mark.slow
def test_convert_nnx_model_call_around_twins_keeps_their_pieces_and_parameters():
  """The model's call through the engine (functions=True) adds what the functions
  between the layers save (relu's mask, 1 bit a value) and nothing else: the
  twins' pieces are kept as they are, at the twins' (new) widths, and the
  kernels the twins keep are the model's parameters, not compressed again."""
  x = _normal((8, 256), 0)
  net = nnx.Sequential(
    nnx.Linear(256, 256, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(256, 4, rngs=nnx.Rngs(1))
  )
  relu_mask = 8 * 256 // 8
  net = convert(net, bits=4, rngs=nnx.Rngs(jact=2))
  assert _nnx_total(net, x) == 2 * _packed_bytes(8, 256, 4) + relu_mask
  assert convert(net, bits=2) is net
  assert _nnx_total(net, x) == 2 * _packed_bytes(8, 256, 2) + relu_mask
  # the twins' pieces keep their names; the model's own residual is relu's mask
  saved = _nnx_bytes(net, x)
  model_own = {n: b for n, b in saved.items() if n.startswith("Sequential.")}
  assert list(model_own.values()) == [relu_mask]
  assert {n: b for n, b in saved.items() if n not in model_own} == {
    n: _packed_bytes(8, 256, 2) for n in ("layers/0.lhs", "layers/2.lhs")
  }


def test_convert_nnx_twin_itself_takes_new_bits():
  layer = jnnx.Linear(256, 4, bits=4, rngs=nnx.Rngs(params=0, jact=1))
  assert convert(layer, bits=1) is layer
  # a layer has no functions between layers: its class is the twin's, no model call
  assert type(layer) is jnnx.Linear
  assert _nnx_bytes(layer, _normal((8, 256), 0)) == {"Linear.lhs": _packed_bytes(8, 256, 1)}


@pytest.mark.slow
def test_convert_nnx_model_call_draws_from_its_layers_streams():
  """Converted without rngs, a model whose twins have streams of their own gets
  one too (forked from its first layer's), so it is differentiated without
  jact.nnx.use_key; a model whose layers have none gets none (state unchanged)."""
  x = _normal((8, 256), 0)
  twins = nnx.Sequential(
    jnnx.Linear(256, 256, rngs=nnx.Rngs(params=0, jact=1)),
    nnx.relu,
    jnnx.Linear(256, 4, rngs=nnx.Rngs(params=1, jact=2)),
  )
  convert(twins, bits=2)
  assert twins.jact_model_rngs is not None
  assert _nnx_total(twins, x) == 2 * _packed_bytes(8, 256, 2) + 8 * 256 // 8
  plain = nnx.Sequential(nnx.Linear(256, 4, rngs=nnx.Rngs(0)), nnx.relu)
  state = nnx.state(plain)
  convert(plain, bits=2)
  assert plain.jact_model_rngs is None
  assert jax.tree.structure(nnx.state(plain)) == jax.tree.structure(state)


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.Dense(256)(x))


def test_convert_linen_again_applies_new_settings():
  x = _normal((8, 256), 0)
  variables = _MLP().init(jax.random.key(0), x)
  rngs = {"jact": jax.random.key(1)}

  def report(model):
    return jact.residual_report(lambda v, x: model.apply(v, x, rngs=rngs).sum(), variables, x)

  def saved(model):
    return {
      name: group.bytes for name, group in report(model).by_name().items() if name is not None
    }

  once = convert(_MLP(), bits=4)
  assert saved(once) == {n: _packed_bytes(8, 256, 4) for n in ("Dense_0.lhs", "Dense_1.lhs")}
  twice = convert(once, bits=2)
  # a copy; the argument is unchanged
  assert twice.jact_compressor.bits == 2 and once.jact_compressor.bits == 4
  assert saved(twice) == {n: _packed_bytes(8, 256, 2) for n in ("Dense_0.lhs", "Dense_1.lhs")}
  # bits=None: what the plain model saves (the hidden activation in float32)
  assert report(convert(once, bits=None)).total_bytes == report(_MLP()).total_bytes == 8 * 256 * 4


# ----------------------------------------------------------------------------- levels L1/L2


def _conv(x, k):
  return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _block(k1, k2, w, x):
  """conv -> conv -> dense on a 4x8x8x4 input: conv1 and the dense layer read
  activations of 4 x 512 values (two groups per sample)."""
  h = _conv(_conv(x, k1), k2)
  return h.reshape(h.shape[0], -1) @ w


def _block_args():
  return (
    _normal((3, 3, 4, 8), 1) / 6,
    _normal((3, 3, 8, 8), 2) / 8,
    _normal((512, 16), 3) / 22,
    _normal((4, 8, 8, 4), 4),
  )


def _level_report(level, **kwargs):
  f = jact.levels.get(level).wrap(_block, **kwargs)
  return jact.residual_report(lambda *a: f(*a, key=jax.random.key(0)).sum(), *_block_args())


def test_level_l1_compresses_convolution_inputs_only():
  report = _level_report("actnn:L1")
  compressed = _packed_bytes(4, 512, 4)
  dense_input = 4 * 512 * 4  # float32, as plain JAX keeps it
  assert {n: g.bytes for n, g in report.by_name().items()} == {
    "block.conv1.lhs": compressed,
    None: dense_input,
  }
  assert report.total_bytes == compressed + dense_input
  # the block's input is an argument (kept by reference) unless listed, as in jact.compressed
  listed = _level_report("actnn:L1", compress_argnums=(3,)).by_name()
  assert listed["block.conv0.lhs"].bytes == _packed_bytes(4, 256, 4)


def test_level_l2_compresses_convolution_and_dense_inputs():
  report = _level_report("actnn:L2")
  assert None not in report.by_name()  # nothing kept in full precision
  assert report.total_bytes == 2 * _packed_bytes(4, 512, 4)


def test_level_l1_forward_exact_dense_gradient_exact():
  """The dense layer's weight gradient reads only its (uncompressed) input:
  under L1 it equals the plain gradient; the conv kernel gradient reads the
  4-bit conv input and differs."""
  args = _block_args()
  wrapped = jact.levels.get("actnn:L1").wrap(_block)
  np.testing.assert_array_equal(wrapped(*args, key=jax.random.key(0)), _block(*args))
  loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
  g = jax.jit(jax.grad(loss(lambda *a: wrapped(*a, key=jax.random.key(0))), argnums=(1, 2)))(*args)
  ref = jax.jit(jax.grad(loss(_block), argnums=(1, 2)))(*args)
  np.testing.assert_allclose(g[1], ref[1], rtol=1e-6, atol=1e-6)
  assert not np.allclose(g[0], ref[0], rtol=1e-4, atol=0)
  with pytest.raises(ValueError, match="PRNG key"):
    wrapped(*args)
