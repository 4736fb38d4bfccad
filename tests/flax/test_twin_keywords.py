"""The Flax twins take `bits=` or `compressor=` and resolve them once, when built,
to the one value their ops get (a `Compressor`, or None); the retired
`group_size=` / `stochastic=` are no keywords of theirs."""

import jax
import jax.numpy as jnp
import pytest
from flax import linen, nnx

import jact
from jact.compressors import Division, PerGroup
from jact import nn as jnn
from jact import nnx as jnnx
from jact._flax.compressed import CompressedModule

LINEN = {
  "Dense": lambda **kw: jnn.Dense(4, **kw),
  "Conv": lambda **kw: jnn.Conv(4, (3,), **kw),
  "BatchNorm": lambda **kw: jnn.BatchNorm(**kw),
  "LayerNorm": lambda **kw: jnn.LayerNorm(**kw),
  "RMSNorm": lambda **kw: jnn.RMSNorm(**kw),
  "MultiHeadDotProductAttention": lambda **kw: jnn.MultiHeadDotProductAttention(2, **kw),
  "SelfAttention": lambda **kw: jnn.SelfAttention(2, **kw),
  "GELU": lambda **kw: jnn.GELU(**kw),
  "Softmax": lambda **kw: jnn.Softmax(**kw),
}
RNGS = dict(params=0, jact=1)
NNX = {
  "Linear": lambda **kw: jnnx.Linear(3, 4, rngs=nnx.Rngs(**RNGS), **kw),
  "Conv": lambda **kw: jnnx.Conv(3, 4, (3,), rngs=nnx.Rngs(**RNGS), **kw),
  "BatchNorm": lambda **kw: jnnx.BatchNorm(3, rngs=nnx.Rngs(**RNGS), **kw),
  "LayerNorm": lambda **kw: jnnx.LayerNorm(3, rngs=nnx.Rngs(**RNGS), **kw),
  "MultiHeadAttention": lambda **kw: jnnx.MultiHeadAttention(1, 4, rngs=nnx.Rngs(**RNGS), **kw),
  "GELU": lambda **kw: jnnx.GELU(rngs=nnx.Rngs(**RNGS), **kw),
  "Softmax": lambda **kw: jnnx.Softmax(rngs=nnx.Rngs(**RNGS), **kw),
}
SETTINGS = [
  (dict(), PerGroup(4)),
  (dict(bits=2), PerGroup(2)),
  (dict(bits=None), None),
  (dict(compressor=PerGroup(8, group_size=64, stochastic=False)), PerGroup(8, 64, False)),
  (dict(compressor=Division()), Division()),
]


def _stored(twin):
  return twin._stored() if isinstance(twin, linen.Module) else twin.jact_stored


@pytest.mark.parametrize(
  "given, want", SETTINGS, ids=["default", "bits", "exact", "per_group", "division"]
)
@pytest.mark.parametrize("make", [*LINEN.values(), *NNX.values()], ids=[*LINEN, *NNX])
def test_twins_resolve_bits_and_compressor_once(make, given, want):
  twin = make(**given)
  assert _stored(twin) == want
  assert (twin.bits, twin.compressor) == (given.get("bits", 4), given.get("compressor"))


@pytest.mark.parametrize("removed", [dict(group_size=64), dict(stochastic=False)], ids=str)
@pytest.mark.parametrize("make", [*LINEN.values(), *NNX.values()], ids=[*LINEN, *NNX])
def test_retired_keywords_are_no_keywords_of_the_twins(make, removed):
  with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(removed))}'"):
    make(**removed)


def test_bad_settings_fail_when_the_twin_is_built():
  with pytest.raises(ValueError, match="bits"):
    jnn.Dense(4, bits=9)
  with pytest.raises(TypeError, match="compressor="):
    jnn.Dense(4, bits=PerGroup(2))
  with pytest.raises(ValueError, match="conflict"):
    jnnx.Linear(3, 4, bits=2, compressor=PerGroup(2), rngs=nnx.Rngs(0))


def test_compressed_module_resolves_bits():
  layer = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
  a = CompressedModule(layer, rngs=nnx.Rngs(jact=0), bits=2)
  b = CompressedModule(layer, rngs=nnx.Rngs(jact=0), compressor=PerGroup(2))
  assert a.residual_config == b.residual_config
  with pytest.raises(TypeError, match="group_size"):
    CompressedModule(layer, rngs=nnx.Rngs(jact=0), group_size=64)


def test_a_per_group_compressor_trains_like_bits():
  """A linen Dense with `PerGroup(4)` keeps what `bits=4` keeps (same gradients
  for the same key) and rounds to nearest without a key for stochastic=False."""
  x = jax.random.normal(jax.random.key(0), (4, 8))
  variables = jnn.Dense(4).init(jax.random.key(1), x)
  nearest = jnn.Dense(4, compressor=PerGroup(4, stochastic=False))

  def loss(layer, v, **kw):
    return jnp.sum(layer.apply(v, x, **kw) ** 2)

  g_near = jax.jit(jax.grad(lambda v: loss(nearest, v)))(variables)  # no 'jact' stream needed
  rngs = {"rngs": {"jact": jax.random.key(2)}}
  g_default, g_bits = jax.jit(
    lambda v: [
      jax.grad(lambda v: loss(layer, v, **rngs))(v)
      for layer in (jnn.Dense(4, compressor=PerGroup(4)), jnn.Dense(4, bits=4))
    ]
  )(variables)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), g_default, g_bits))
  assert jax.tree.all(jax.tree.map(lambda a: bool(jnp.all(jnp.isfinite(a))), g_near))


@pytest.mark.parametrize(
  "given, want",
  [
    (dict(bits=2), PerGroup(2)),
    (dict(compressor=PerGroup(2)), PerGroup(2)),
    (dict(bits=None), None),
    (dict(compressor=PerGroup(4, 64, False)), PerGroup(4, 64, False)),
  ],
)
def test_convert_gives_the_twins_the_resolved_compressor(given, want):
  model = jact.convert(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(jact=1), **given)
  assert isinstance(model, jnnx.Linear)
  assert model.jact_stored == want
  with pytest.raises(TypeError, match="unexpected keyword argument 'group_size'"):
    jact.convert(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), group_size=64)
