"""`jact.convert`'s linen and nnx tables are built from what the twins of
`jact.nn` / `jact.nnx` declare (`conversion`), not from lists of their own."""

import types

import flax.linen as nn
import pytest
from flax import nnx

from jact import nn as jnn
from jact import nnx as jnnx
from jact._convert import linen as convert_linen
from jact._convert import nnx as convert_nnx
from jact._flax.conversion import Conversion, rounds, table


def _declaring(namespace) -> list[type]:
  return [
    twin
    for twin in (getattr(namespace, n) for n in namespace.__all__)
    if isinstance(twin, type) and "conversion" in vars(twin)
  ]


@pytest.mark.parametrize(
  "namespace, built",
  [(jnn, convert_linen._LINEN_TWINS), (jnnx, convert_nnx._NNX_TWINS)],
  ids=["linen", "nnx"],
)
def test_convert_routes_every_declared_layer_to_its_twin(namespace, built):
  declared = {layer: twin for twin in _declaring(namespace) for layer in twin.conversion.replaces}
  assert built == declared
  assert len(built) >= 8
  for layer, twin in built.items():
    # a twin derives from the Flax layer it replaces (or from that layer's base): same parameters
    flax_base = next(c for c in twin.__mro__ if c.__module__.startswith("flax."))
    assert issubclass(layer, flax_base) and flax_base is not nnx.Module, (layer, twin)


def test_rounding_twins_are_read_from_their_settings():
  assert rounds(jnn.Dense) and rounds(jnn.BatchNorm) and rounds(jnnx.Linear)
  assert not rounds(jnn.Embed) and not rounds(jnn.Dropout)
  assert not rounds(jnnx.Embed) and not rounds(jnnx.Dropout)
  assert set(convert_nnx._ROUNDING_TWINS) == {t for t in _declaring(jnnx) if rounds(t)}


def _namespace(**classes) -> types.ModuleType:
  module = types.ModuleType("toy")
  module.__dict__.update(classes)
  module.__all__ = list(classes)
  return module


def test_a_new_twin_is_routed_where_it_is_declared():
  class Twin(nn.Dense):
    conversion = Conversion((nn.Dense,))

  class Child(Twin):  # inherits the declaration: does not replace nn.Dense a second time
    pass

  assert table(_namespace(Twin=Twin, Child=Child, helper=len)) == {nn.Dense: Twin}


def test_conflicting_or_malformed_declarations_are_errors():
  class A(nnx.Linear):
    conversion = Conversion((nnx.Linear,))

  class B(nnx.Linear):
    conversion = Conversion((nnx.Linear,))

  with pytest.raises(TypeError, match="Linear is replaced by both toy.A and toy.B"):
    table(_namespace(A=A, B=B))

  class C(nnx.Linear):
    conversion = (nnx.Linear,)

  with pytest.raises(TypeError, match="must be a jact._flax.conversion.Conversion"):
    table(_namespace(C=C))
