"""Real 8x8 handwritten digits for the library tests (scikit-learn ships them: no data kit).

The same images, split and scaling as `experiments.lib.data.load_image_dataset("digits")`
(whose data-kit CSV holds scikit-learn's digits, byte for byte).

>>> x_train, y_train, x_test, y_test = load_digits()
>>> x_train.shape, x_test.shape, x_train.dtype.name, y_train.dtype.name
((1438, 8, 8, 1), (359, 8, 8, 1), 'float32', 'int32')
>>> xb, yb = next(batches(x_train, y_train, 32, seed=0))
>>> xb.shape, yb.shape
((32, 8, 8, 1), (32,))
"""

from typing import Iterator

import numpy as np

__all__ = ["load_digits", "batches"]


def load_digits(test_fraction: float = 0.2, seed: int = 0):
  """(x_train, y_train, x_test, y_test): images float32 [N, 8, 8, 1] in [0, 1], labels int32."""
  from sklearn.datasets import load_digits as sklearn_digits

  d = sklearn_digits()
  x, y = d.images.astype(np.uint8)[..., None], d.target.astype(np.uint8)
  perm = np.random.default_rng(seed).permutation(len(x))
  n_test = int(round(len(x) * test_fraction))
  tr, te = perm[n_test:], perm[:n_test]
  as_float = lambda a: a.astype(np.float32) / np.float32(16.0)
  return as_float(x[tr]), y[tr].astype(np.int32), as_float(x[te]), y[te].astype(np.int32)


def batches(
  x: np.ndarray, y: np.ndarray, batch_size: int, *, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Yields (x_batch, y_batch) of `batch_size` examples forever, reshuffled every epoch
  with a seeded generator (the last partial batch of an epoch is dropped)."""
  if len(y) != len(x):
    raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
  if not 1 <= batch_size <= len(x):
    raise ValueError(f"batch_size must be in [1, {len(x)}] (the dataset size), got {batch_size}")
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(len(x))
    for start in range(0, len(x) - len(x) % batch_size, batch_size):
      idx = order[start : start + batch_size]
      yield x[idx], y[idx]
