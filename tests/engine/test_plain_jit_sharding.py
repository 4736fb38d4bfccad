"""jact under plain `jax.jit` with `in_shardings` or inside `jax.set_mesh` (no
`jact.sharded_batch`), on 8 simulated host devices: a converted RNN's rounding
noise, and a dense+ReLU stack's collectives and per-device temp against the
plain stack's (weights replicated or FSDP-sharded).

The device count is fixed when jax starts, so each script runs in a separate
process with `--xla_force_host_platform_device_count=8` and reports JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import YNN_FLAG

from devices import EIGHT_CPU_DEVICES

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


_STACK_SCRIPT = r"""
import collections, json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import jact

WIDTH, BATCH = 512, 8192  # 2 bits, activations dominate the per-device memory


def plain(ws, x, key):
  for w in ws:
    x = jax.nn.relu(x @ w)
  return jnp.mean(x ** 2)


def ops(ws, x, key):
  for i, w in enumerate(ws):
    x = jact.ops.relu(jact.ops.dense(x, w, key=jax.random.fold_in(key, i), bits=2))
  return jnp.mean(x ** 2)


whole = jact.compressed(lambda ws, x: plain(ws, x, None), bits=2)
VARIANTS = {"plain": plain, "ops": ops, "compressed": lambda ws, x, key: whole(ws, x, key=key)}


def measure(compiled, rows):
  hlo = compiled.as_text()
  found = re.findall(r" (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                     r"(?:-start)?\(", hlo)
  # all-gathers of arrays with the global batch's rows (codes, statistics, activations)
  batch_gathers = re.findall(r"= [a-z0-9]+\[%d[,\]][^=]* all-gather(?:-start)?\(" % rows, hlo)
  return {"collectives": dict(collections.Counter(found)), "batch_gathers": len(batch_gathers),
          "temp": int(compiled.memory_analysis().temp_size_in_bytes)}


key = jax.random.key(7)
x = jax.random.normal(jax.random.key(99), (BATCH, WIDTH))
runs = {}
for axis_type in ("Auto", "Explicit"):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  batch = NamedSharding(mesh, P("data"))
  setups = {"replicated": (8, P()), "fsdp_input_dim": (4, P("data", None)),
            "fsdp_output_dim": (4, P(None, "data"))}
  if axis_type == "Explicit":
    setups = {"replicated": setups["replicated"]}
  for setup, (layers, spec) in setups.items():
    ws = [jax.random.normal(jax.random.key(i), (WIDTH, WIDTH)) / WIDTH**0.5 for i in range(layers)]
    weights = NamedSharding(mesh, spec)
    for name, fn in VARIANTS.items():
      if axis_type == "Auto":  # plain jit: the shardings are jit's arguments, no mesh is set
        grad = jax.jit(jax.grad(fn), in_shardings=([weights] * layers, batch, None),
                       out_shardings=[weights] * layers)
        runs[f"jit/{setup}/{name}"] = measure(grad.lower(ws, x, key).compile(), BATCH)
      # an ambient mesh: sharded arguments traced inside jax.set_mesh
      args = ([jax.device_put(w, weights) for w in ws], jax.device_put(x, batch), key)
      if axis_type == "Auto" and setup == "fsdp_output_dim":
        continue
      with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(fn)).lower(*args).compile()
      runs[f"set_mesh_{axis_type}/{setup}/{name}"] = measure(compiled, BATCH)

print(json.dumps({"devices": jax.device_count(), "runs": runs}))
"""


def _run_on_eight_devices(script: str) -> dict:
  """Runs `script` in a process with 8 host devices; returns its last line's JSON."""
  env = dict(os.environ)
  # XLA's default flags, as a user has them: the test process turns XLA:CPU's
  # YNN fusion off (tests/conftest.py), and with it on a matmul over a shard of
  # the rows rounds differently in the last place than over all of them
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(YNN_FLAG)]
  env["XLA_FLAGS"] = " ".join(flags + [EIGHT_CPU_DEVICES])
  env["JAX_PLATFORMS"] = "cpu"
  root = pathlib.Path(__file__).resolve().parents[2]
  env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
  proc = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["devices"] == 8, result
  return result


@pytest.fixture(scope="module")
def eight_devices():
  return _run_on_eight_devices(_SCRIPT)


@pytest.fixture(scope="module")
def stack_runs():
  return _run_on_eight_devices(_STACK_SCRIPT)["runs"]


_REPLICATED = ["jit/replicated", "set_mesh_Auto/replicated", "set_mesh_Explicit/replicated"]
_FSDP = ["jit/fsdp_input_dim", "jit/fsdp_output_dim", "set_mesh_Auto/fsdp_input_dim"]


@pytest.mark.slow
@pytest.mark.parametrize("setup", _REPLICATED)
@pytest.mark.parametrize("variant", ["ops", "compressed"])
def test_replicated_weights_compile_to_plain_collectives_at_half_its_temp(
  stack_runs, setup, variant
):
  """Data parallelism without `jact.sharded_batch` (plain `jax.jit` with
  `in_shardings`, or inside `jax.set_mesh` with Auto or Explicit axes; 8
  dense+ReLU layers of 512, batch 8192 over 8 devices, 2 bits): exactly the
  plain program's collectives (one all-reduce of the gradients) and at most
  half its per-device temp. Before, each kept kernel was tied to the
  cotangent's first row, a one-element all-reduce per layer (jact.ops: 8
  against plain's 1), unless the step was traced inside `jact.sharded_batch`."""
  plain, r = stack_runs[f"{setup}/plain"], stack_runs[f"{setup}/{variant}"]
  assert plain["collectives"] == {"all-reduce": 1}, plain
  assert r["collectives"] == plain["collectives"], (r, plain)
  assert r["temp"] <= plain["temp"] / 2, (r, plain)


@pytest.mark.slow
@pytest.mark.parametrize("setup", _FSDP)
@pytest.mark.parametrize("variant", ["ops", "compressed"])
def test_fsdp_weights_gather_no_batch_and_use_no_more_temp_than_plain(stack_runs, setup, variant):
  """Weights sharded on their input or output dimension (FSDP), batch sharded,
  without `jact.sharded_batch` (4 layers): per-device temp at most plain's, no
  all-gather of an array with the global batch's rows (plain has none), no
  all-to-all, and only all-gathers and all-reduces (beyond plain's, the
  weights gathered again in the backward: at most one per layer but the first).
  Before, the partitioner gave each reconstruction the weight gradient's
  layout and gathered the global batch's codes and cotangents: FSDP on the
  input dimension 21.5 (jact.ops) and 53.7 MiB (jact.compressed) against
  plain's 19.0."""
  plain, r = stack_runs[f"{setup}/plain"], stack_runs[f"{setup}/{variant}"]
  layers = plain["collectives"]["all-gather"]
  assert plain["batch_gathers"] == 0, plain
  assert r["batch_gathers"] == 0, (r, plain)
  assert set(r["collectives"]) == set(plain["collectives"]) == {"all-gather", "all-reduce"}, r
  assert r["collectives"]["all-reduce"] == plain["collectives"]["all-reduce"], (r, plain)
  assert r["collectives"]["all-gather"] <= 2 * layers - 1, (r, plain)
  assert r["temp"] <= plain["temp"], (r, plain)


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
