"""The long-run plumbing of the experiments: resumable checkpoints, the data order every
variant shares, and the result tables that must render at any stage of a run."""

import json

import jax.numpy as jnp
import numpy as np

from experiments.papers import actnn_cifar
from experiments.lib import notebook_support, resumable


def test_checkpoint_round_trip_and_replace(tmp_path):
  resumable.save(tmp_path, {"w": jnp.arange(3.0)}, {"step": 1})
  resumable.save(tmp_path, {"w": jnp.arange(3.0) * 2}, {"step": 2})
  state, progress, folder = resumable.restore(tmp_path, {"w": jnp.zeros(3)})
  assert progress == {"step": 2} and folder.name == "checkpoint"
  np.testing.assert_array_equal(state["w"], [0.0, 2.0, 4.0])
  assert not (tmp_path / "checkpoint.old").exists() and not (tmp_path / "checkpoint.new").exists()


def test_restore_falls_back_to_the_old_checkpoint(tmp_path):
  """A run killed between the two renames leaves only checkpoint.old: it is used."""
  resumable.save(tmp_path, {"w": jnp.ones(2)}, {"step": 5})
  (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")
  _, progress, _ = resumable.restore(tmp_path, {"w": jnp.zeros(2)})
  assert progress["step"] == 5
  assert resumable.restore(tmp_path / "empty", {"w": jnp.zeros(2)}) is None


def test_write_json_is_atomic(tmp_path):
  resumable.write_json(tmp_path / "a" / "r.json", {"x": 1})
  assert json.loads((tmp_path / "a" / "r.json").read_text()) == {"x": 1}
  assert list((tmp_path / "a").iterdir()) == [tmp_path / "a" / "r.json"]


def test_every_variant_sees_the_same_batches():
  x = np.arange(40 * 2 * 2 * 1, dtype=np.float32).reshape(40, 2, 2, 1)
  y = np.arange(40)
  a = actnn_cifar._batch(x, y, 7, 8, seed=0)
  b = actnn_cifar._batch(x, y, 7, 8, seed=0)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  epoch0 = np.concatenate([actnn_cifar._batch(x, y, s, 8, seed=0)[1] for s in range(5)])
  epoch1 = np.concatenate([actnn_cifar._batch(x, y, s, 8, seed=0)[1] for s in range(5, 10)])
  assert sorted(epoch0) == sorted(epoch1) == list(range(40))  # each epoch: every image once
  assert not np.array_equal(epoch0, epoch1)  # reshuffled


def test_augment_crops_and_flips_the_image_itself():
  rng = np.random.default_rng(0)
  x = rng.random((64, 6, 6, 3)).astype(np.float32)
  out = actnn_cifar.augment(x, np.random.default_rng(1), pad=0)  # no crop: only flips
  flipped = [np.array_equal(o, i[:, ::-1]) for o, i in zip(out, x)]
  kept = [np.array_equal(o, i) for o, i in zip(out, x)]
  assert all(f or k for f, k in zip(flipped, kept)) and 16 < sum(flipped) < 48


def test_unknown_variant_names_the_choices():
  try:
    actnn_cifar.variant_settings("fp16")
  except ValueError as err:
    assert "actnn_l3" in str(err)
  else:
    raise AssertionError("no error")


def test_tables_render_partial_results():
  runs = {"fp": dict(history=[dict(epoch=1, test_accuracy=0.5)], epochs=3, complete=False)}
  table = notebook_support.actnn_table(runs, ["fp", "blpa2"])
  assert "1/3 (running)" in table and "0.500" in table and "| blpa2 | not run yet" in table
  assert "not run yet" in notebook_support.variance_table("/nonexistent/grad_variance.json")
