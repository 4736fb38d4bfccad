"""`jact.sharded_batch`: its checks, and that it never changes a value.

What it is for (FSDP and tensor parallelism keep activations sharded over the
batch) is measured on 8 devices in tests/test_distributed.py; here, on one
device, the block must leave gradients bit-identical and reject bad input.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact

MESH = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
W = jax.random.normal(jax.random.key(0), (64, 64)) / 8
X = jax.random.normal(jax.random.key(1), (16, 64))


def _loss(w, x):
  key = jax.random.key(2)
  h = jact.ops.relu(jact.ops.dense(x, w, key=key, bits=2))
  whole = jact.compressed(lambda w, h: jnp.tanh(h @ w), bits=4)
  return jnp.sum(whole(w, h, key=key) ** 2)


def test_gradients_are_bit_identical_inside_the_block():
  want = jax.jit(jax.grad(_loss))(W, X)
  with jact.sharded_batch("data", MESH):
    got = jax.jit(jax.grad(_loss))(W, X)
  np.testing.assert_array_equal(got, want)


def test_the_context_mesh_stands_in_for_the_mesh_argument():
  want = jax.jit(jax.grad(_loss))(W, X)
  with jax.set_mesh(MESH), jact.sharded_batch(("data",)):
    got = jax.jit(jax.grad(_loss))(W, X)
  np.testing.assert_array_equal(got, want)


def test_the_constraint_is_in_the_program_only_inside_the_block():
  def text():
    return jax.jit(jax.grad(_loss)).lower(W, X).as_text()

  outside = text()
  with jact.sharded_batch("data", MESH):
    inside = text()
  assert inside.count("sharding_constraint") > outside.count("sharding_constraint"), inside


@pytest.mark.parametrize("axes", [(), 3, ("data", 1)])
def test_axes_must_be_mesh_axis_names(axes):
  with pytest.raises(ValueError, match="mesh axis names"):
    with jact.sharded_batch(axes, MESH):
      pass


def test_an_axis_the_mesh_lacks_is_named():
  with pytest.raises(ValueError, match="no axis 'batch'"):
    with jact.sharded_batch("batch", MESH):
      pass


def test_without_a_mesh_the_error_names_the_fix():
  with pytest.raises(ValueError, match=r"jax.set_mesh"):
    with jact.sharded_batch("data"):
      jax.grad(_loss)(W, X)
