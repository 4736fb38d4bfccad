"""jact under plain `jax.jit` with `in_shardings` (no `jact.sharded_batch`), on 8
simulated host devices.

The device count is fixed when jax starts, so the checks run in one separate
process with `--xla_force_host_platform_device_count=8` and report JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import YNN_FLAG

_SCRIPT = r"""
import json
import jax, jax.numpy as jnp
import flax.linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P
import jact

mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
replicated, batch_sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def rel(a, b):
  return max(float(jnp.linalg.norm(u - v) / jnp.linalg.norm(v))
             for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# A converted nn.RNN(GRUCell) at 2 bits: the batch sharded 8 ways against one device.
class Rnn(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.RNN(nn.GRUCell(32))(x)


rnn = Rnn()
xs = jax.random.normal(jax.random.key(0), (64, 6, 16))
params = rnn.init(jax.random.key(1), xs)
converted = jact.convert(rnn, bits=2)


def rnn_loss(p, x, key):
  return jnp.sum(converted.apply(p, x, rngs={"jact": key}) ** 2)


one = jax.jit(jax.grad(rnn_loss))
eight = jax.jit(jax.grad(rnn_loss), in_shardings=(replicated, batch_sharded, None))
plain = jax.grad(lambda p, x: jnp.sum(rnn.apply(p, x) ** 2))(params, xs)
g1, g8 = one(params, xs, jax.random.key(5)), eight(params, xs, jax.random.key(5))
other = one(params, xs, jax.random.key(6))
noise = lambda g: jax.tree.map(lambda a, b: a - b, g, plain)
rnn_result = {"sharded_vs_one_device": rel(g8, g1),
              "noise_sharded_vs_one_device": rel(noise(g8), noise(g1)),
              "noise_other_key": rel(noise(other), noise(g1))}

print(json.dumps({"devices": jax.device_count(), "rnn": rnn_result}))
"""


@pytest.fixture(scope="module")
def eight_devices():
  env = dict(os.environ)
  # XLA's default flags, as a user has them: the test process turns XLA:CPU's
  # YNN fusion off (tests/conftest.py), and with it on a matmul over a shard of
  # the rows rounds differently in the last place than over all of them
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(YNN_FLAG)]
  env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
  env["JAX_PLATFORMS"] = "cpu"
  root = pathlib.Path(__file__).resolve().parents[2]
  env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
  proc = subprocess.run(
    [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["devices"] == 8, result
  return result


@pytest.mark.slow
def test_converted_rnn_rounds_a_sharded_batch_as_one_device(eight_devices):
  """A converted nn.RNN(GRUCell) under jit with the batch sharded 8 ways draws
  the rounding noise of one device with the same key: gradients and their
  noise (gradient minus plain Flax's) agree to float reassociation (1e-5),
  while another key's noise differs by order 1. Before, each step's key was
  a hash of its arguments' bits, which a shard's matmul rounds differently in
  the last place: noise 1.7x apart, as far as another key's."""
  r = eight_devices["rnn"]
  assert r["sharded_vs_one_device"] < 1e-5, r
  assert r["noise_sharded_vs_one_device"] < 1e-4, r
  assert r["noise_other_key"] > 0.5, r


def test_rounding_noise_of_a_symbolic_batch_is_the_concrete_batchs():
  """`jact.rng.element_bits` traced for `jax.export` with a symbolic leading
  axis gives the bits of the concrete shape (the wide index, whose high word
  is 0 there); before, it needed every size as a number."""
  import jax
  import jax.numpy as jnp
  from jax import export

  from jact import rng

  seed = rng.seed_from_key(jax.random.key(0))
  bits = lambda x: rng.element_bits(seed, x.shape)
  (b,) = export.symbolic_shape("b")
  exported = export.export(jax.jit(bits))(jax.ShapeDtypeStruct((b, 5, 7), jnp.float32))
  for n in (1, 3, 16):
    x = jnp.zeros((n, 5, 7))
    assert (exported.call(x) == bits(x)).all()
