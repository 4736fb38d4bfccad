"""`experiments.papers.acgc_sweep` and `experiments.papers.memory_accounting` on a small
pre-activation ResNet.

The sweep derives every e^2 from one estimation at e^2 = 1 (the bounds are
linear in e^2): checked against estimations at other e^2. The papers' memory
baseline is checked against a count by hand.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from experiments.papers import acgc_sweep, memory_accounting
from experiments.lib import preact


def _setup():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 16, 16, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, 8), jnp.int32)
  params = preact.init(jax.random.key(0), widths=(8, 16), blocks=1)
  loss = functools.partial(preact.loss, form="layers", compressor=jact.compressors.Fixpoint(8))
  return params, [(x, y)], loss


def test_needed_levels_scale_as_one_over_e2():
  params, batches, loss = _setup()
  at_one = acgc_sweep.needed_levels(loss, params, batches, jax.random.key(1))
  for e2 in (8.0,):
    bounds = jact.acgc.error_bounded(
      loss, error=e2, window=1, compressor=jact.compressors.Fixpoint(8)
    )
    state = bounds.update(
      bounds.init(params, batches[0], jax.random.key(1)),
      params,
      batches[0],
      jax.random.fold_in(jax.random.key(1), 0),
    )
    direct = dict(zip(state.names, np.asarray(state.levels_sq[0], np.float64)))
    for name, levels in at_one.items():
      np.testing.assert_allclose(direct[name], levels / e2, rtol=1e-5, err_msg=name)


def test_sweep_compresses_more_as_e2_grows():
  levels = {"a.conv.lhs": 4e4, "a.bn.xhat": 1.0, "b.conv.lhs": 1e2, "c.conv.lhs": 1e9}
  sizes = {"a.conv.lhs": 100, "a.bn.xhat": 100, "b.conv.lhs": 50, "c.conv.lhs": 10}
  rows = acgc_sweep.sweep(
    levels, sizes, {"a.conv.lhs": 0.5, "b.conv.lhs": 0.5}, errors=(0.5, 8.0, 512.0)
  )
  for key in ("compression_jact", "compression_any_width"):
    assert [r[key] for r in rows] == sorted(r[key] for r in rows), key
  # at e^2 = 0.5 conv a needs sqrt(8e4) = 283 levels: 10 bits, which Fixpoint stores; conv c
  # needs sqrt(2e9) = 44721 > 2^15 - 1: wider than 16 bits, kept exact
  assert rows[0]["any_bits"]["a.conv.lhs"] == rows[0]["jact_bits"]["a.conv.lhs"] == 10
  assert rows[0]["jact_bits"]["c.conv.lhs"] == 32 and rows[0]["kept_exact_jact"] == 1
  assert rows[1]["jact_bits"]["c.conv.lhs"] == 15 and rows[1]["kept_exact_jact"] == 0
  # zero-value accounting: a 1-bit mask plus the non-zeros at the needed width
  assert rows[0]["compression_autoquantz"] > rows[0]["compression_any_width"]


def test_stored_bytes_are_the_plans_measured_residuals():
  """At the paper's e^2 the measured bytes of each bounded residual are its
  compressor's layout (Fixpoint at the exact width, exact float32 when wider than
  16 bits); restricted to 2/4/8 bits more is stored, with ZVC less."""
  params, batches, loss = _setup()
  sites = jact.sensitivity.find_residuals(loss, params, batches[0], jax.random.key(0))
  names = sorted(sites)
  sizes = {n: sites[n].size for n in names}
  # needs of 2, 3, 9, 11, 16 bits and beyond 16 (levels at e^2 = 1; the plan is at 0.5)
  needs = [1.0, 9.0, 255.0**2, 1023.0**2, 32767.0**2, 1e10]
  levels = {n: needs[i % len(needs)] / 2 for i, n in enumerate(names)}
  capacities = {n: 0.5 for n in names if n.endswith("conv.lhs")}
  plans = acgc_sweep.paper_plans(loss, levels, capacities)
  plain = functools.partial(preact.loss, form="plain")
  out = acgc_sweep.stored(loss, plain, params, batches[0], plans, sizes)
  widths = {1.0: 2, 9.0: 3, 255.0**2: 9, 1023.0**2: 11, 32767.0**2: 16}
  for i, n in enumerate(names):
    need = needs[i % len(needs)]
    c = plans["acgc"][n]
    if need == 1e10:
      assert c is None and out["acgc"]["bytes"][n] == 4 * sizes[n]
      continue
    assert c.bits == widths[need], (n, need, c)
    assert out["acgc"]["bytes"][n] == c.stored_bytes(sites[n].shape)
  assert out["acgc_248"]["bounded_bytes"] > out["acgc"]["bounded_bytes"]
  assert out["autoquantz"]["bounded_bytes"] < out["acgc"]["bounded_bytes"]
  assert out["acgc"]["compression_bounded"] == pytest.approx(
    out["float32_bounded_bytes"] / out["acgc"]["bounded_bytes"]
  )


def test_layer_inputs_count_one_copy_per_layer():
  values = memory_accounting.layer_inputs(batch=4, widths=(8, 16), blocks=1, image=(16, 16, 3))
  # units: 8ch 16x16 (bn, conv) x2, then 16ch: unit2's inputs at 16x16 x8ch, unit3 at 8x8 x16ch
  per_unit = [16 * 16 * 8, 16 * 16 * 8, 16 * 16 * 8, 8 * 8 * 16]
  by_hand = 2 * 4 * sum(per_unit) + 4 * 16 * 16 * 3 + 2 * 4 * 8 * 8 * 16 + 4 * 16
  assert sum(values.values()) == by_hand, values
