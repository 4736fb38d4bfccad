"""`jact.fit` under a mesh: the budget is per device (8 simulated host devices, own process)."""

import json
import os
import subprocess
import sys

import pytest

from devices import EIGHT_CPU_DEVICES

_SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jact
from jact._fit.steps import configure, step_peak

def mlp(w, x):
  return x + jnp.tanh(x @ w[0]) @ w[1]

segs = [jact.segment(mlp, name=f"s{i}", compress_argnums=(1,)) for i in range(8)]

def loss(ws, x):
  for s, w in zip(segs, ws):
    x = s(w, x)
  return jnp.sum(x ** 2)

mesh = Mesh(jax.devices(), ("data",))
ws = [(jnp.eye(64, 256) * 0.5, jnp.eye(256, 64) * 0.5) for _ in range(8)]
ws = jax.device_put(ws, NamedSharding(mesh, P()))
x = jax.device_put(jax.random.normal(jax.random.key(0), (8 * 1024, 64)),
                   NamedSharding(mesh, P("data")))
per_device = step_peak(configure(loss, None, None), (ws, x), (0,))
whole = step_peak(configure(loss, None, None), (jax.device_get(ws), jax.device_get(x)), (0,))
result = jact.fit(loss, ws, x, budget_bytes=per_device // 2)

def kinds(fn):
  step = jax.jit(lambda ws, x, key: jax.grad(fn)(ws, x, key=key))
  hlo = step.lower(ws, x, jax.random.key(0)).compile().as_text()
  return sorted(set(re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all)\(", hlo)))

print(json.dumps({
  "devices": jax.device_count(), "per_device": per_device, "whole": whole,
  "budget": per_device // 2, "peak": result.peak_bytes,
  "plain_kinds": kinds(configure(loss, None, None)), "fit_kinds": kinds(result.loss_fn),
}))
"""


@pytest.mark.slow
def test_fit_under_a_mesh_meets_a_per_device_budget(tmp_path):
  script = tmp_path / "script.py"
  script.write_text(_SCRIPT)
  flags = os.environ.get("XLA_FLAGS", "") + " " + EIGHT_CPU_DEVICES
  env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
  done = subprocess.run(
    [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900
  )
  assert done.returncode == 0, done.stderr[-3000:]
  r = json.loads(done.stdout.strip().splitlines()[-1])
  assert r["devices"] == 8
  assert r["per_device"] < r["whole"] / 4  # the figures are one device's
  assert r["peak"] <= r["budget"]
  assert r["fit_kinds"] == r["plain_kinds"]  # the configured step adds no collective kind
