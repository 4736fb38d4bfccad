"""BatchNorm with `axis_name` (cross-device statistics), as data-parallel Flax code writes it.

Each test runs `vmap(grad(loss), axis_name=...)` over a leading device axis, which is what
`pmap(grad(loss), axis_name=...)` computes on one device per shard: the twins and converted
models must give Flax's forward and running statistics, and gradients close to Flax's (exact
at bits=None), instead of falling back to the uncompressed layer.
"""

import json
import os
import pathlib
import subprocess
import sys
import warnings
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from devices import EIGHT_CPU_DEVICES

import jact
from jact._convert import ConversionWarning, convert

DEVICES, PER_DEVICE = 4, 2
AXIS = "batch"
X = jnp.asarray(
  np.random.default_rng(0).standard_normal((DEVICES, PER_DEVICE, 6, 6, 3)), jnp.float32
)
COT = jnp.asarray(
  np.random.default_rng(1).standard_normal((DEVICES, PER_DEVICE, 6, 6, 8)), jnp.float32
)
JACT_KEY = jax.random.key(7, impl="rbg")


def _rel_err(got, want) -> float:
  return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


class ConvBN(nn.Module):
  """Plain Flax: Conv -> BatchNorm(axis_name) -> relu, nothing jact in it (`norm`: the
  BatchNorm class, or a function building jact's twin in the twin test)."""

  norm: Callable[..., nn.Module] = nn.BatchNorm

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3))(x)
    x = self.norm(use_running_average=False, momentum=0.9, axis_name=AXIS)(x)
    return nn.relu(x)


def _linen_step(model, variables, rngs):
  """Per-device (params gradient, output, new batch_stats) under the named axis."""

  def local(params, x, cot):
    y, state = model.apply({**variables, "params": params}, x, mutable=["batch_stats"], rngs=rngs)
    return jnp.sum(y * cot), (y, state["batch_stats"])

  grad = jax.grad(local, has_aux=True)
  step = jax.vmap(grad, in_axes=(None, 0, 0), axis_name=AXIS)
  return jax.jit(step)(variables["params"], X, COT)


def _linen_variables():
  return jax.jit(
    jax.vmap(lambda x: ConvBN().init(jax.random.key(0), x), axis_name=AXIS, out_axes=None)
  )(X)


def _check_against_plain(got, want, *, exact: bool):
  (g, (y, stats)), (wg, (wy, wstats)) = got, want
  np.testing.assert_allclose(y, wy, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(wstats)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(wg)):
    a, b = a.sum(0), b.sum(0)  # per-device parameter gradients, summed as a psum would
    if exact:  # atol: the conv bias before batch norm has an exact gradient of ~1e-6 noise
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 + 1e-4 * float(jnp.abs(b).max()))
    elif float(jnp.linalg.norm(b)) > 1e-3:  # conv bias before batch norm: exact gradient ~0
      assert _rel_err(a, b) < 0.05, _rel_err(a, b)


def test_linen_twin_with_axis_name_matches_flax():
  variables = _linen_variables()
  want = _linen_step(ConvBN(), variables, {})
  for bits in (None, 8):
    twin = ConvBN(norm=lambda **kw: jact.nn.BatchNorm(bits=bits, **kw))
    got = _linen_step(twin, variables, {"jact": JACT_KEY})
    _check_against_plain(got, want, exact=bits is None)


@pytest.mark.slow
def test_linen_convert_keeps_batch_norm_with_axis_name_compressed():
  variables = _linen_variables()
  want = _linen_step(ConvBN(), variables, {})
  with warnings.catch_warnings():
    warnings.simplefilter("error", ConversionWarning)  # nothing may fall back
    converted = convert(ConvBN(), bits=8)
    got = _linen_step(converted, variables, {"jact": JACT_KEY})
  _check_against_plain(got, want, exact=False)

  def saved(model, rngs):
    def loss(params):
      def local(x):
        y, _ = model.apply({**variables, "params": params}, x, mutable=["batch_stats"], rngs=rngs)
        return jnp.sum(y)

      return jnp.sum(jax.vmap(local, axis_name=AXIS)(X))

    return jact.residual_report(loss, variables["params"])

  report = saved(convert(ConvBN(), bits=2), {"jact": JACT_KEY}).by_name()
  # the normalized input is stored at 2 bits: an eighth of its float32 bytes, plus the
  # per-group min/step
  conv_out_bytes = COT.size * 4
  assert report["BatchNorm_0.xhat"].bytes * 7 < conv_out_bytes, report


def _nnx_model(convert_bits=None):
  model = nnx.Sequential(
    nnx.Conv(3, 8, (3, 3), rngs=nnx.Rngs(0)),
    nnx.BatchNorm(8, momentum=0.9, axis_name=AXIS, rngs=nnx.Rngs(0)),
  )
  if convert_bits is not None:
    with warnings.catch_warnings():
      warnings.simplefilter("error", ConversionWarning)
      model = convert(model, bits=convert_bits, rngs=nnx.Rngs(jact=0))
  return model


def _nnx_step(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def local(params, rest, x, cot):
    m = nnx.merge(graphdef, params, rest, copy=True)
    y = m(x)
    return jnp.sum(y * cot), (y, nnx.state(m, nnx.BatchStat))

  grad = jax.grad(local, has_aux=True)
  return jax.jit(jax.vmap(grad, in_axes=(None, None, 0, 0), axis_name=AXIS))(params, rest, X, COT)


@pytest.mark.slow
def test_nnx_convert_keeps_batch_norm_with_axis_name_compressed():
  want = _nnx_step(_nnx_model())
  got = _nnx_step(_nnx_model(convert_bits=8))
  assert isinstance(_nnx_model(convert_bits=8).layers[1], jact.nnx.BatchNorm)
  (g, (y, stats)), (wg, (wy, wstats)) = got, want
  np.testing.assert_allclose(y, wy, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(wstats)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  gk, wk = g["layers"][0]["kernel"][...].sum(0), wg["layers"][0]["kernel"][...].sum(0)
  assert _rel_err(gk, wk) < 0.05, _rel_err(gk, wk)


# ------------------------------------------------------------------------ collectives on 8 devices

_COLLECTIVES_SCRIPT = r"""
import collections, json, re, sys
import jax, jax.numpy as jnp
sys.path[:0] = sys.argv[1:]
from test_cross_device_norm import AXIS, ConvBN, convert

x = jnp.ones((jax.local_device_count(), 2, 6, 6, 3))
variables = jax.jit(lambda x: ConvBN().init(jax.random.key(0), x))(x[0])


def collectives(model, rngs):
  def step(params, x):
    def local(params, x):
      y, state = model.apply({**variables, "params": params}, x, mutable=["batch_stats"],
                             rngs=rngs)
      return jnp.sum(y ** 2), state
    grads, state = jax.grad(local, has_aux=True)(params, x)
    return jax.lax.pmean(grads, AXIS), state
  hlo = jax.pmap(step, axis_name=AXIS, in_axes=(None, 0)).lower(
      variables["params"], x).compile().as_text()
  ops = re.findall(r" (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                   r"(?:-start)?\(", hlo)
  return dict(collections.Counter(ops))


print(json.dumps({"devices": jax.local_device_count(),
                  "plain": collectives(ConvBN(), {}),
                  "jact": collectives(convert(ConvBN(), bits=2), {"jact": jax.random.key(1)})}))
"""


@pytest.mark.slow
def test_converted_batch_norm_adds_no_collectives_on_8_devices(tmp_path):
  """pmap over 8 host devices (own process: the device count is fixed at jax's start): the
  compiled train step of the converted model has exactly the plain model's collectives."""
  script = tmp_path / "collectives.py"
  script.write_text(_COLLECTIVES_SCRIPT)
  env = dict(
    os.environ,
    XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + EIGHT_CPU_DEVICES).strip(),
    JAX_PLATFORMS="cpu",
  )
  here = pathlib.Path(__file__).parent  # this module, imported by the script, and its helpers
  done = subprocess.run(
    [sys.executable, str(script), str(here), str(here.parent)],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result["devices"] == 8
  assert result["plain"].get("all-reduce", 0) >= 2, result  # statistics + gradient mean
  assert result["jact"] == result["plain"], result
