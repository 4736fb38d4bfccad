"""nnx models built as a stack by `nnx.vmap` and run by `nnx.scan`, converted
with their own streams (`jact.convert(..., rngs=)`), the way Flax's nnx docs
write a scan over layers: identical forward, gradients close to plain."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jact
from stats import tree_rel_err

LAYERS = 3


class Block(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.fc = nnx.Linear(16, 16, rngs=rngs)

  def __call__(self, x):
    return x + nnx.gelu(self.fc(self.norm(x)))


@nnx.split_rngs(splits=LAYERS)
@nnx.vmap(in_axes=(0,), out_axes=0)
def stacked_blocks(rngs):
  return Block(rngs)


@nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
def forward(block, x):
  return block(x)


class Blocks(nnx.Module):
  """A model holding nothing but the stack, scanned inside its own call."""

  def __init__(self, rngs):
    self.blocks = stacked_blocks(rngs)

  def __call__(self, x):
    return forward(self.blocks, x)


X = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)


def _loss(model, x):
  return jnp.sum(forward(model, x) ** 2)


def _grads(model, loss):
  return nnx.to_pure_dict(nnx.state(nnx.jit(nnx.grad(loss))(model, X), nnx.Param))


def test_vmap_built_stack_converted_with_rngs_runs_under_scan():
  plain = stacked_blocks(nnx.Rngs(0))
  model = jact.convert(stacked_blocks(nnx.Rngs(0)), bits=2, rngs=nnx.Rngs(jact=1))
  # the model's own stream (its call's functions) is stacked like its layers
  assert model.jact_model_rngs.key[...].shape == (LAYERS,)
  run = nnx.jit(forward)
  np.testing.assert_array_equal(run(model, X), run(plain, X))
  model8 = jact.convert(stacked_blocks(nnx.Rngs(0)), bits=8, rngs=nnx.Rngs(jact=1))
  # 8-bit rounding of every residual: measured 0.4% relative L2 error
  assert tree_rel_err(_grads(model8, _loss), _grads(plain, _loss)) < 0.03


def test_a_model_holding_only_a_stack_calls_its_own_function_once():
  plain = Blocks(nnx.Rngs(0))
  model = jact.convert(Blocks(nnx.Rngs(0)), bits=8, rngs=nnx.Rngs(jact=1))
  loss = lambda m, x: jnp.sum(m(x) ** 2)
  np.testing.assert_array_equal(nnx.jit(lambda m: m(X))(model), plain(X))
  assert tree_rel_err(_grads(model, loss), _grads(plain, loss)) < 0.03
