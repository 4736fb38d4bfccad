"""The XLA:CPU workarounds (`jact._core.xla_cpu`) exist only in programs for the CPU.

Lowered for cuda from this CPU-only machine, a compressed gradient holds none
of the ordering ties (their operations carry the name `jact_cpu_ordering` in
the program's locations) and keeps the requested group size; on the CPU the
ties are there and change no number.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact import _compat
from jact.compressors import PerGroup
from jact._core import rng, xla_cpu

MARK = "jact_cpu_ordering"


def _ops_loss(w, x, key):
  h = jact.ops.relu(jact.ops.dense(x, w, key=key, bits=4))
  return jnp.sum(jact.ops.gelu(h, key=key, bits=4) ** 2)


def _compressed_loss(w, x, key):
  block = jact.compressed(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w), bits=4)
  return jnp.sum(block(w, x, key=key) ** 2)


class _ConvBN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=False)(x)
    return jnp.mean(nn.relu(x))


def _convert_case():
  model = jact.convert(_ConvBN(), bits=4)
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  variables = _ConvBN().init(jax.random.key(1), x)

  def loss(params, x, key):
    out, _ = model.apply(
      {**variables, "params": params}, x, rngs={"jact": key}, mutable=["batch_stats"]
    )
    return out

  return loss, variables["params"], x


def _cases():
  w = jax.random.normal(jax.random.key(2), (32, 32)) / 6
  x = jax.random.normal(jax.random.key(3), (16, 32))
  loss, params, image = _convert_case()
  return {
    "ops": (_ops_loss, w, x),
    "compressed": (_compressed_loss, w, x),
    "convert": (loss, params, image),
  }


@pytest.mark.parametrize("case", ["ops", "compressed", "convert"])
def test_cuda_program_holds_no_cpu_ordering(case):
  loss, params, x = _cases()[case]
  key = jax.random.key(4)
  grad = lambda p, x: jax.grad(loss)(p, x, key)
  cpu = jax.jit(grad).trace(params, x).lower().as_text(debug_info=True)
  cuda = _compat.lower_for_cuda(grad, params, x).as_text(debug_info=True)
  assert MARK in cpu, "the CPU program lost its ordering ties"
  assert MARK not in cuda, "a program for cuda holds XLA:CPU ordering ties"
  assert cuda.count("stablehlo.optimization_barrier") == cpu.count("stablehlo.optimization_barrier")


def _no_ties(rule, values, anchors):
  del rule, anchors
  return list(values)


@pytest.mark.parametrize("case", ["ops", "compressed", "convert"])
def test_ties_change_no_number(case, monkeypatch):
  """The CPU program with its ties and the same program without them (what a
  GPU program computes) give bit-identical gradients."""
  loss, params, x = _cases()[case]
  key = jax.random.key(5)
  shipped = jax.jit(jax.grad(loss))(params, x, key)
  monkeypatch.setattr(xla_cpu, "on_cpu", _no_ties)
  jax.clear_caches()
  untied = jax.jit(jax.grad(lambda p, x, k: loss(p, x, k)))(params, x, key)
  jax.clear_caches()
  for a, b in zip(jax.tree.leaves(shipped), jax.tree.leaves(untied)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ties_under_vmap_keep_per_example_gradients():
  w = jax.random.normal(jax.random.key(6), (16, 16)) / 4
  xs = jax.random.normal(jax.random.key(7), (3, 8, 16))
  key = jax.random.key(8)
  # jitted (one compile each, not op-by-op): the ties are in the traced program either way
  vmapped = jax.jit(jax.vmap(lambda x: jax.grad(_ops_loss)(w, x, key)))
  assert MARK in vmapped.trace(xs).lower().as_text(debug_info=True)  # the ties are under vmap
  per_example = vmapped(xs)
  one = jax.jit(lambda x: jax.grad(_ops_loss)(w, x, key))
  looped = jnp.stack([one(x) for x in xs])
  np.testing.assert_allclose(per_example, looped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("platform, expected", [("cpu", 112), ("cuda", 256), ("tpu", 256)])
def test_group_size_is_the_programs_platforms(platform, expected):
  x = jax.random.normal(jax.random.key(9), (4, 784))

  def round_trip(x):  # traced under the platform (a fresh function: no cached trace), one compile
    stored = PerGroup(bits=4, group_size=256).compress(x, rng.seed_from_key(jax.random.key(10)))
    return stored, PerGroup(bits=4, group_size=256).decompress(stored)

  with xla_cpu.traced_for(platform):
    stored, back = jax.jit(round_trip)(x)
  packed = jax.tree.leaves(stored, is_leaf=lambda v: hasattr(v, "group_size"))[0]
  assert packed.group_size == expected
  assert packed.minimum.shape == (4, math.ceil(784 / expected))
  step = np.asarray(packed.scale, np.float32).max()
  assert back.shape == x.shape and float(jnp.max(jnp.abs(back - x))) <= step * 1.001


def test_padded_groups_round_unbiased_for_cuda():
  """The padded layout a cuda program uses (784 values in 4 groups of 256):
  over 400 draws the total rounding error has mean zero (|z| < 4.5; z of the
  per-draw sum, as tests/core/test_odd_shapes.py)."""
  x = jax.random.normal(jax.random.key(11), (2, 784))
  compressor = PerGroup(bits=2, group_size=256)

  @jax.jit
  def total_error(key):
    return jnp.sum(compressor.decompress(compressor.compress(x, rng.seed_from_key(key))) - x)

  with xla_cpu.traced_for("cuda"):
    errors = np.array([total_error(k) for k in jax.random.split(jax.random.key(12), 400)])
  assert errors.std() > 0
  z = errors.mean() / (errors.std() / math.sqrt(len(errors)))
  assert abs(z) < 4.5, z
