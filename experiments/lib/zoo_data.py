"""Real-data batches for the zoo's models (`experiments.lib.zoo`): CIFAR-10 images for the
ResNet-18, SST-2 sentences for the BiLSTM and tiny Shakespeare windows for the LM (`DATA`)."""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np

from experiments.lib import data
from experiments.lib.zoo import LM_CONFIG

__all__ = ["DATA", "cifar_batches", "shakespeare_batches", "sst2_batches", "sst2_split"]


def cifar_batches(seed, batch_size=32):
  x, y, xte, yte = data.load_image_dataset("cifar10")
  mean, std = x.mean(axis=(0, 1, 2)), x.std(axis=(0, 1, 2))
  norm = lambda a: (a - mean) / std
  train = (
    {"inputs": (jnp.asarray(norm(xb)),), "labels": jnp.asarray(yb)}
    for xb, yb in data.batches(x, y, batch_size, seed=seed)
  )
  test = [
    {"inputs": (jnp.asarray(norm(xb)),), "labels": jnp.asarray(yb)}
    for xb, yb in data.batches(xte[:512], yte[:512], batch_size, shuffle=False, epochs=1)
  ]
  return train, test


def sst2_split(name):
  path = data._data_file(f"sst2/stsa.binary.{name}")  # pylint: disable=protected-access
  labels, sentences = [], []
  for line in path.read_text(encoding="utf-8").splitlines():
    label, _, text = line.partition(" ")
    labels.append(int(label))
    sentences.append(text.split())
  return sentences, np.asarray(labels, np.int32)


def sst2_batches(seed, batch_size=32, length=40, vocab_size=4000):
  """Word ids (0 padding, 1 unknown; the vocab_size - 2 most frequent training
  words), lengths clipped to `length`."""
  train, y = sst2_split("train")
  test, yte = sst2_split("dev")
  counts = collections.Counter(w for s in train for w in s)
  ids = {w: i + 2 for i, (w, _) in enumerate(counts.most_common(vocab_size - 2))}

  def encode(sentences):
    tokens = np.zeros((len(sentences), length), np.int32)
    lengths = np.zeros(len(sentences), np.int32)
    for i, s in enumerate(sentences):
      s = [ids.get(w, 1) for w in s][:length] or [1]
      tokens[i, : len(s)], lengths[i] = s, len(s)
    return np.concatenate([tokens, lengths[:, None]], axis=1)

  as_batch = lambda xb, yb: {
    "inputs": (jnp.asarray(xb[:, :-1]), jnp.asarray(xb[:, -1])),
    "labels": jnp.asarray(yb),
  }
  train_it = (as_batch(xb, yb) for xb, yb in data.batches(encode(train), y, batch_size, seed=seed))
  test_b = [
    as_batch(xb, yb)
    for xb, yb in data.batches(encode(test[:512]), yte[:512], batch_size, shuffle=False, epochs=1)
  ]
  return train_it, test_b


def shakespeare_batches(seed, batch_size=16, length=64):
  text = data._data_file("tinyshakespeare/input.txt").read_text()  # pylint: disable=protected-access
  vocab = sorted(set(text))
  if len(vocab) != LM_CONFIG.vocab_size:
    raise ValueError(f"tiny Shakespeare has {len(vocab)} symbols, the LM {LM_CONFIG.vocab_size}")
  lookup = np.zeros(max(map(ord, vocab)) + 1, np.int32)
  lookup[[ord(c) for c in vocab]] = np.arange(len(vocab))
  ids = lookup[np.frombuffer(text.encode("ascii"), np.uint8)]
  split = int(0.9 * len(ids))

  def window(starts, source):
    seq = np.stack([source[s : s + length + 1] for s in starts])
    return {"inputs": (jnp.asarray(seq[:, :-1]),), "labels": jnp.asarray(seq[:, 1:])}

  def train():
    rng = np.random.default_rng(seed)
    while True:
      yield window(rng.integers(0, split - length - 1, batch_size), ids)

  held = ids[split:]
  test = [
    window(np.arange(i, i + batch_size) * (length + 1), held)
    for i in range(0, 32 * batch_size, batch_size)
  ]
  return train(), test


DATA = {
  "resnet18": cifar_batches,
  "bilstm_sst2": sst2_batches,
  "transformer_lm": shakespeare_batches,
}
