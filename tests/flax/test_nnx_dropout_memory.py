"""A converted nnx model with dropout never compiles to more temp than plain's."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jact

pytestmark = pytest.mark.slow  # compiles whole train steps

KEY = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)


class DropoutMLP(nnx.Module):
  def __init__(self, rate: float, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(512, 512, rngs=rngs) for _ in range(4)])
    self.drops = nnx.List([nnx.Dropout(rate) for _ in range(4)])
    self.head = nnx.Linear(512, 10, rngs=rngs)

  def __call__(self, x, rngs):
    for layer, drop in zip(self.layers, self.drops):
      x = drop(jax.nn.relu(layer(x)), deterministic=False, rngs=rngs)
    return self.head(x)


def _temp(model, x) -> int:
  graphdef, state = nnx.split(model)
  state = jax.eval_shape(lambda: state)

  def step(state, x, key):
    def loss(state):
      m = nnx.merge(graphdef, state)
      return jnp.mean(m(x, nnx.Rngs(dropout=key)) ** 2)

    with jact.nnx.use_key(jax.random.fold_in(key, 1)):
      return jax.grad(loss)(state)

  return jact.compiled_memory(step, state, x, KEY).temp_bytes


def test_dropout_costs_a_converted_nnx_model_no_more_than_plain():
  # The twin keeps the mask packed to 1 bit, drawn once after its input (as
  # the linen twin): redrawn from the key in the backward, XLA:CPU kept every
  # layer's random bits alive at once.
  x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
  saving = {}
  for rate in (0.0, 0.1, 0.5):
    plain = _temp(DropoutMLP(rate, nnx.Rngs(0)), x)
    converted = _temp(jact.convert(DropoutMLP(rate, nnx.Rngs(0)), bits=2), x)
    assert converted <= plain, (rate, converted, plain)
    saving[rate] = plain / converted
  assert saving[0.1] >= 0.8 * saving[0.0], saving
  assert saving[0.5] >= 0.8 * saving[0.0], saving
