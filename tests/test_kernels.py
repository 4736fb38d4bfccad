"""The kernel registry: the XLA reference is always there, selection and overrides work."""

import jax
import jax.numpy as jnp
import pytest

from jact import kernels


def test_reference_is_registered_and_selected_on_cpu():
  assert kernels.select("quantize", platform="cpu").name == "xla"
  assert kernels.select("dequantize", platform="gpu").name == "xla"


def test_registered_kernel_wins_by_priority_on_its_platform_only():
  impl = kernels.Implementation("quantize", "test_fast", kernels.available("quantize")["xla"].fn,
                                platforms=("gpu",), priority=10)
  kernels.register(impl)
  try:
    assert kernels.select("quantize", platform="gpu").name == "test_fast"
    assert kernels.select("quantize", platform="cpu").name == "xla"
    with kernels.use(quantize="xla"):
      assert kernels.select("quantize", platform="gpu").name == "xla"
    assert kernels.select("quantize", implementation="xla", platform="gpu").name == "xla"
  finally:
    kernels._REGISTRY["quantize"].pop("test_fast")


def test_selected_reference_is_the_quantizer():
  x = jnp.linspace(-1, 1, 512).reshape(2, 256)
  fn = kernels.select("quantize").fn
  p = fn(x, jax.random.key(0), bits=4)
  assert jnp.abs(kernels.select("dequantize").fn(p) - x).max() <= 2 / 15


def test_unknown_names_raise_with_the_choices():
  with pytest.raises(ValueError, match="available: \\['xla'\\]"):
    kernels.select("quantize", implementation="cuda_magic")
  with pytest.raises(KeyError, match="known ops"):
    kernels.available("no_such_op")
  with pytest.raises(ValueError, match="available"):
    with kernels.use(quantize="nope"):
      pass
