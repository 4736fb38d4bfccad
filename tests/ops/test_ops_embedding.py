"""Tests of the embedding lookup (jact/ops/_embedding.py).

Lossless: forward equals `flax.linen.Embed` / `jnp.take` and the table
gradient equals jax's own gradient bit for bit; the only residual is the ids.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact.ops._embedding import embed

from jact._compat.testing import saved_residuals

VOCAB, FEATURES = 50, 16


def _table(seed=0, dtype=jnp.float32, shape=(VOCAB, FEATURES)):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


def _ids(seed=1, shape=(4, 12), low=0, high=VOCAB, dtype=jnp.int32):
  return jnp.asarray(np.random.default_rng(seed).integers(low, high, size=shape), dtype)


def _value_and_grad(fn, ids, table, ct):
  def run(table):
    y, vjp = jax.vjp(lambda t: fn(ids, t), table)
    return y, vjp(ct)[0]

  return jax.jit(run)(table)


def test_forward_matches_flax_embed():
  table, ids = _table(), _ids()
  module = nn.Embed(VOCAB, FEATURES)
  y_ref = module.apply({"params": {"embedding": table}}, ids)
  np.testing.assert_array_equal(embed(ids, table), y_ref)


@pytest.mark.slow
@pytest.mark.parametrize("ids_dtype", [jnp.int32, jnp.uint8, jnp.int16])
def test_gradient_equals_jax_scatter_add(ids_dtype):
  # Repeated ids (a vocabulary smaller than the number of lookups) must accumulate.
  table, ids = _table(2, shape=(10, FEATURES)), _ids(3, (6, 20), high=10, dtype=ids_dtype)
  ct = _table(4, shape=(6, 20, FEATURES))
  y, g = _value_and_grad(embed, ids, table, ct)
  y_ref, g_ref = _value_and_grad(lambda i, t: jnp.take(t, i, axis=0), ids, table, ct)
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(g, g_ref)
  counts = np.bincount(np.asarray(ids).ravel(), minlength=10)
  assert counts.max() > 1  # the case really has repeats
  # Rows never looked up get exactly zero gradient.
  assert bool((g[counts == 0] == 0).all())


def test_negative_and_out_of_range_ids_like_jnp_take():
  table = _table(5, shape=(8, 4))
  ids = jnp.array([[0, 7, -1, -8], [8, -9, 100, 3]])
  ct = _table(6, shape=(2, 4, 4))
  y, g = _value_and_grad(embed, ids, table, ct)
  y_ref, g_ref = _value_and_grad(lambda i, t: jnp.take(t, i, axis=0), ids, table, ct)
  np.testing.assert_array_equal(y, y_ref)  # out-of-range rows are NaN in both
  assert bool(jnp.isnan(y[1, 0]).all()) and bool(jnp.isnan(y[1, 2]).all())
  np.testing.assert_array_equal(g, g_ref)  # and contribute no gradient


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_table(dtype):
  table, ids = _table(7, dtype), _ids(8)
  ct = jnp.ones((4, 12, FEATURES), dtype)
  y, g = _value_and_grad(embed, ids, table, ct)
  y_ref, g_ref = _value_and_grad(lambda i, t: jnp.take(t, i, axis=0), ids, table, ct)
  assert y.dtype == dtype and g.dtype == dtype
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(g, g_ref)


def test_multi_axis_table_rows():
  table, ids = _table(9, shape=(6, 3, 2)), _ids(10, (5,), high=6)
  ct = _table(11, shape=(5, 3, 2))
  y, g = _value_and_grad(embed, ids, table, ct)
  y_ref, g_ref = _value_and_grad(lambda i, t: jnp.take(t, i, axis=0), ids, table, ct)
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(g, g_ref)


def test_saves_only_the_ids():
  table, ids = _table(12), _ids(13)
  for fn, args in [
    (lambda t: embed(ids, t), (table,)),  # ids closed over
    (lambda i, t: embed(i, t), (ids, table)),
  ]:  # ids an argument
    saved = saved_residuals(fn, *args)
    assert len(saved) == 1, saved
    aval, desc = saved[0]
    assert aval.shape == ids.shape and aval.dtype == ids.dtype
    assert "named 'embed.ids'" in desc
  # Under a policy keeping only the ids' name, the ids are all that is kept
  # (besides the table argument itself): nothing is recomputed from the table.
  f = lambda t: jnp.sum(jnp.sin(embed(ids, 2.0 * t, name="tok")))
  policy = jax.checkpoint_policies.save_only_these_names("tok.ids")
  kept = [
    (a, d)
    for a, d in saved_residuals(jax.checkpoint(f, policy=policy), table)
    if not d.startswith(("from the argument", "from a literal", "from a constant"))
  ]
  assert len(kept) == 1 and kept[0][0].dtype == ids.dtype and "named 'tok.ids'" in kept[0][1]


def test_errors():
  table = _table(14)
  with pytest.raises(TypeError, match=r"integer ids.*astype\(jnp.int32\)"):
    embed(jnp.array([1.0, 2.0]), table)
  with pytest.raises(TypeError, match="floating-point table"):
    embed(jnp.array([1, 2]), jnp.ones((4, 2), jnp.int32))
  with pytest.raises(ValueError, match="non-empty string"):
    embed(jnp.array([1, 2]), table, name="")
