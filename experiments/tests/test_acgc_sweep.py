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
  levels = {"a.conv.lhs": 4e4, "a.bn.xhat": 1.0, "b.conv.lhs": 1e2}
  sizes = {"a.conv.lhs": 100, "a.bn.xhat": 100, "b.conv.lhs": 50}
  rows = acgc_sweep.sweep(
    levels, sizes, {"a.conv.lhs": 0.5, "b.conv.lhs": 0.5}, errors=(0.5, 8.0, 512.0)
  )
  for key in ("compression_jact", "compression_any_width"):
    assert [r[key] for r in rows] == sorted(r[key] for r in rows), key
  # at e^2 = 0.5 conv a needs sqrt(8e4) = 283 levels: 10 bits, kept exact by jact (widths <= 8)
  assert rows[0]["any_bits"]["a.conv.lhs"] == 10 and rows[0]["jact_bits"]["a.conv.lhs"] == 32
  assert rows[0]["kept_exact_jact"] == 1
  # zero-value accounting: a 1-bit mask plus the non-zeros at the needed width
  assert rows[0]["compression_autoquantz"] > rows[0]["compression_any_width"]


def test_layer_inputs_count_one_copy_per_layer():
  values = memory_accounting.layer_inputs(batch=4, widths=(8, 16), blocks=1, image=(16, 16, 3))
  # units: 8ch 16x16 (bn, conv) x2, then 16ch: unit2's inputs at 16x16 x8ch, unit3 at 8x8 x16ch
  per_unit = [16 * 16 * 8, 16 * 16 * 8, 16 * 16 * 8, 8 * 8 * 16]
  by_hand = 2 * 4 * sum(per_unit) + 4 * 16 * 16 * 3 + 2 * 4 * 8 * 8 * 16 + 4 * 16
  assert sum(values.values()) == by_hand, values
