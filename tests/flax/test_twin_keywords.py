"""The Flax twins take `bits=` or `compressor=` only: `group_size=` / `stochastic=`
give the ops' TypeError naming the `PerGroup` to pass, and that suggestion
builds a twin that runs."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jact
from jact.compressors import PerGroup
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
REMOVED = [
  dict(group_size=64),
  dict(stochastic=False),
  dict(bits=2, group_size=64, stochastic=False),
]


def _suggested(message: str) -> PerGroup:
  """The compressor the message says to pass, evaluated."""
  found = re.search(r"compressor=(jact\.compressors\.PerGroup\([^)]*\))", message)
  assert found, message
  return eval(found.group(1), {"jact": jact})  # noqa: S307 (our own message)


def _check(make, api: str, given: dict):
  with pytest.raises(TypeError, match=re.escape(api) + " no longer takes") as e:
    make(**given)
  message = str(e.value)
  for k, v in given.items():
    if k != "bits":
      assert f"{k}={v!r}" in message
  want = PerGroup(
    given.get("bits", 4),
    group_size=given.get("group_size", 256),
    stochastic=given.get("stochastic", True),
  )
  assert _suggested(message) == want
  return make(compressor=want), want  # the fix builds the twin


@pytest.mark.parametrize("given", REMOVED, ids=lambda g: ",".join(g))
@pytest.mark.parametrize("name", LINEN)
def test_linen_twin_removed_keywords_name_pergroup(name, given):
  twin, want = _check(LINEN[name], f"jact.nn.{name}", given)
  assert twin.compressor == want
  assert not hasattr(twin, "group_size") and not hasattr(twin, "stochastic")


@pytest.mark.parametrize("given", REMOVED, ids=lambda g: ",".join(g))
@pytest.mark.parametrize("name", NNX)
def test_nnx_twin_removed_keywords_name_pergroup(name, given):
  twin, want = _check(NNX[name], f"jact.nnx.{name}", given)
  assert twin.compressor == want
  assert not hasattr(twin, "group_size") and not hasattr(twin, "stochastic")


def test_linen_positional_bits_in_the_message():
  with pytest.raises(TypeError, match=r"PerGroup\(2, group_size=64, stochastic=True\)"):
    jnn.GELU(False, 2, group_size=64)  # approximate, bits


def test_compressed_module_removed_keywords_name_pergroup():
  layer = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
  _check(
    lambda **kw: CompressedModule(layer, rngs=nnx.Rngs(jact=0), **kw),
    "jact.compressed",
    dict(stochastic=False),
  )


def test_suggested_compressor_trains_like_the_spelled_out_twin():
  """A linen Dense with the suggested PerGroup keeps what `bits=` keeps for
  the default settings and rounds to nearest without a key for stochastic=False."""
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
  "compressor, want",
  [
    (PerGroup(2), dict(bits=2, compressor=None)),  # the default PerGroup: bits= alone
    (
      PerGroup(4, group_size=64, stochastic=False),
      dict(bits=4, compressor=PerGroup(4, group_size=64, stochastic=False)),
    ),
  ],
)
def test_convert_gives_nnx_twins_bits_or_compressor(compressor, want):
  model = jact.convert(
    nnx.Linear(3, 4, rngs=nnx.Rngs(0)), compressor=compressor, rngs=nnx.Rngs(jact=1)
  )
  assert isinstance(model, jnnx.Linear)
  assert dict(bits=model.bits, compressor=model.compressor) == want


def test_compress_convolutions_names_per_group_for_removed_keywords():
  with pytest.raises(
    TypeError, match=r"jact\.levels\.compress_convolutions.*PerGroup\(2, group_size=64"
  ):
    jact.levels.compress_convolutions(lambda x: x, bits=2, group_size=64)
