"""One stored-residual protocol: every stored form is a `jact.compressors.Stored`.

A user compressor whose stored form is its own `Stored` pytree is restored
with `stored.decompress(dtype)` and scheduled exactly as a built-in stored form
holding the same arrays: the forward output waits for it and its
reconstruction waits for the cotangent (`jact._engine.scheduling`).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jact
from jact import compressors
from jact._core.packing import pack_codes
from jact._core.persample import PackedPerSample
from jact._engine.scheduling import barrier, is_stored


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Halves(compressors.Stored):
  """A user's stored form: the value in bfloat16."""

  data: jax.Array
  dtype: Any = dataclasses.field(metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    return int(self.data.size * 2)

  def decompress(self, dtype=None) -> jax.Array:
    return self.data.astype(dtype or self.dtype)


@dataclasses.dataclass(frozen=True)
class ToHalf(compressors.Compressor):
  """A user compressor (not registered: no `method`) storing its own `Halves`."""

  @property
  def unbiased(self) -> bool:
    return False

  @property
  def bits(self) -> int:
    return 16

  def with_bits(self, bits: int):
    return self

  def compress(self, x, seed=None):
    return Halves(x.astype(jnp.bfloat16), x.dtype)

  def decompress(self, stored, dtype=None):
    return stored.decompress(dtype)

  def stored_bytes(self, shape, dtype=None) -> int:
    return 2 * int(jnp.size(jnp.zeros(shape)))


@dataclasses.dataclass(frozen=True)
class ToHalfCompressed(ToHalf):
  """The same arrays in the built-in generic stored form, `Compressed`."""

  def compress(self, x, seed=None):
    return compressors.Compressed({"data": x.astype(jnp.bfloat16)}, self, x.shape, x.dtype)

  def decompress(self, stored, dtype=None):
    return stored.arrays["data"].astype(dtype or stored.dtype)


def _x():
  return jax.random.normal(jax.random.key(0), (8, 256))


def test_every_built_in_stored_form_is_stored():
  x = _x()
  forms = [
    compressors.PerGroup(4).compress(x, jnp.uint32(1)),
    compressors.Division(block=4).compress(x, jnp.uint32(1)),
    compressors.Fixpoint(8).compress(x),
    compressors.BLPA(4).compress(x),
    compressors.ZeroValue().compress(x),
    pack_codes(x > 0, 1),
  ]
  for form in forms:
    assert isinstance(form, compressors.Stored), type(form)
    assert is_stored(form)
  assert issubclass(PackedPerSample, compressors.Stored)


def test_a_user_stored_form_decompresses_and_is_recognized():
  x = _x()
  stored = ToHalf().compress(x)
  assert is_stored(stored)
  assert stored.decompress().dtype == jnp.float32
  assert stored.decompress(jnp.bfloat16).dtype == jnp.bfloat16
  assert bool((stored.decompress() == x.astype(jnp.bfloat16).astype(jnp.float32)).all())


def test_a_user_stored_form_waits_for_the_cotangent():
  x = _x()
  g = jnp.ones((8, 256))
  for form in (ToHalf().compress(x), ToHalfCompressed().compress(x)):
    text = str(jax.make_jaxpr(lambda s, g: barrier(s, g))(form, g))
    assert "jact_cpu_ordering" in text, type(form)


def _program(compressor):
  loss = lambda x: jnp.sum(jact.ops.gelu(x, compressor=compressor, name="act") ** 2)
  return str(jax.make_jaxpr(jax.grad(loss))(_x())), jax.grad(loss)(_x())


@pytest.mark.parametrize("word", ["jact_cpu_ordering", "optimization_barrier"])
def test_a_user_compressor_is_ordered_as_a_built_in_form(word):
  """The gradient program of an op storing `Halves` holds the ordering the
  same arrays get in a `Compressed` (forward epilogue and backward barrier),
  and the same gradient."""
  user, g_user = _program(ToHalf())
  built_in, g_built_in = _program(ToHalfCompressed())
  assert user.count(word) == built_in.count(word) > 0
  assert bool((g_user == g_built_in).all())


def test_stored_without_decompress_is_refused_when_built():
  @jax.tree_util.register_dataclass
  @dataclasses.dataclass(frozen=True)
  class Incomplete(compressors.Stored):
    data: jax.Array

  with pytest.raises(TypeError, match="abstract.*decompress"):
    Incomplete(jnp.ones(2))


def test_a_user_stored_form_is_restored_inside_jact_compressed():
  """`jact.compressed` restores any `Stored` it kept (`restore_saved`): a user
  compressor's gradient equals the same arrays' in a `Compressed`."""
  w = jax.random.normal(jax.random.key(1), (256, 256)) / 16

  def grad(compressor):
    block = jact.compressed(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w), compressor=compressor)
    return jax.grad(lambda w: jnp.sum(block(w, _x()) ** 2))(w)

  g_user, g_built_in = grad(ToHalf()), grad(ToHalfCompressed())
  assert bool((g_user == g_built_in).all())
  exact = jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(_x() @ w) @ w) ** 2))(w)
  assert not bool((g_user == exact).all())  # the residuals were stored in bfloat16
