"""Data loaders: shapes, dtypes, ranges, the fallback and the error messages."""

import gzip

import numpy as np
import pytest

from experiments.tests.conftest import skip_without_data_kit
from experiments.lib import data


@pytest.fixture
def empty_data(tmp_path, monkeypatch):
  monkeypatch.setenv("JACT_DATA", str(tmp_path))
  return tmp_path


def _check_images(x, y, n, hw, c):
  assert x.shape == (n, *hw, c) and x.dtype == np.float32
  assert y.shape == (n,) and y.dtype == np.int32
  assert 0.0 <= x.min() and x.max() <= 1.0 and x.max() > 0.5  # scaled, not all dark
  assert set(np.unique(y)) == set(range(10))


@pytest.mark.slow
def test_cifar10_subset(tmp_path, monkeypatch):
  monkeypatch.setenv("JACT_CACHE", str(tmp_path / "cache"))
  xtr, ytr, xte, yte = data.load_image_dataset("cifar10")
  _check_images(xtr, ytr, 10000, (32, 32), 3)
  _check_images(xte, yte, 2000, (32, 32), 3)
  # README: items are class-interleaved, item i has class i % 10.
  np.testing.assert_array_equal(ytr[:50], np.arange(50) % 10)
  # The decoded arrays were cached, and the cache gives the same images.
  cached = list((tmp_path / "cache").glob("cifar10_10k_2k_*.npz"))
  assert len(cached) == 1
  again = data.load_cifar10("10k_2k")
  np.testing.assert_array_equal(again[0][:100], np.round(xtr[:100] * 255).astype(np.uint8))
  assert again[0].dtype == np.uint8


def test_auto_uses_cifar_when_present():
  data._data_file(data._CIFAR_FILES["10k_2k"])  # the kit's CIFAR-10 is present
  assert data.resolve_dataset("auto") == "cifar10"


def test_mnist():
  xtr, ytr, xte, yte = data.load_mnist()
  assert xtr.shape == (60000, 28, 28) and xte.shape == (10000, 28, 28)
  assert xtr.dtype == np.uint8 and ytr.dtype == np.uint8
  assert ytr.max() == 9 and yte.min() == 0
  x, y, _, _ = data.load_image_dataset("mnist", train_size=100, test_size=10)
  _check_images(x, y, 100, (28, 28), 1)


def test_digits_csv_matches_sklearn_copy():
  x, y = data.load_digits_csv()
  xs, ys = data.load_sklearn_digits()
  assert x.shape == (1797, 8, 8) and x.max() == 16
  np.testing.assert_array_equal(x, xs)
  np.testing.assert_array_equal(y, ys)
  xtr, ytr, xte, yte = data.load_image_dataset("digits")
  _check_images(xtr, ytr, 1438, (8, 8), 1)
  _check_images(xte, yte, 359, (8, 8), 1)


def test_fallback_when_data_folder_is_empty(empty_data):
  assert data.data_dir() == empty_data
  assert data.resolve_dataset("auto") == "sklearn_digits"
  xtr, ytr, xte, yte = data.load_image_dataset("auto")
  _check_images(xtr, ytr, 1438, (8, 8), 1)
  _check_images(xte, yte, 359, (8, 8), 1)
  # Train and test partition the whole dataset (each image exactly once).
  x, y = data.load_sklearn_digits()
  rows = lambda xs, ys: sorted(bytes(r) + bytes([l]) for r, l in zip(xs.reshape(len(xs), -1), ys))
  split = np.round(np.concatenate([xtr, xte]) * 16).astype(np.uint8)
  assert rows(split, np.concatenate([ytr, yte]).astype(np.uint8)) == rows(x, y)


def test_digits_fall_back_to_the_same_images_in_sklearn(empty_data):
  kit_or_bundled = data.load_image_dataset("digits")
  bundled = data.load_image_dataset("sklearn_digits")
  for a, b in zip(kit_or_bundled, bundled, strict=True):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(FileNotFoundError, match=r"digits\.csv\.gz"):
    data.load_digits_csv()  # the kit's own loader still needs the kit


def test_no_data_folder_at_all_is_data_kit_missing(tmp_path, monkeypatch):
  monkeypatch.delenv("JACT_DATA", raising=False)
  monkeypatch.setattr(data, "_candidates", lambda: [tmp_path / "a", tmp_path / "b"])
  assert data.data_dir() is None
  with pytest.raises(data.DataKitMissing, match=r"no data folder .*JACT_DATA") as err:
    data.load_mnist()
  assert err.value.relative == data._MNIST_FILES["x_train"]
  assert str(tmp_path / "a") in str(err.value)  # the places looked in are named
  # The test suite turns it (and only it) into a skip naming the fix.
  with pytest.raises(pytest.skip.Exception, match=r"'mnist/train-images.*JACT_DATA="):
    with skip_without_data_kit():
      data.load_mnist()
  assert data.resolve_dataset("auto") == "sklearn_digits"


def test_a_file_missing_from_a_data_folder_fails(empty_data):
  with pytest.raises(FileNotFoundError) as err:
    with skip_without_data_kit():
      data.load_mnist()
  assert not isinstance(err.value, data.DataKitMissing)


@pytest.mark.parametrize(
  "loader, missing",
  [
    (lambda: data.load_cifar10("10k_2k", use_cache=False), "cifar10_jpeg_q75_10k_2k.npz"),
    (lambda: data.load_cifar10("full", use_cache=False), "cifar10_jpeg_q75_full.npz"),
    (data.load_mnist, "train-images-idx3-ubyte.gz"),
    (data.load_digits_csv, "digits.csv.gz"),
  ],
)
def test_missing_file_error_names_the_file(empty_data, loader, missing):
  with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")) as err:
    loader()
  assert "JACT_DATA" in str(err.value)


def test_missing_later_file_is_named(empty_data):
  (empty_data / "mnist").mkdir()
  # Every file is looked up before any is read, so a placeholder stands in for
  # the images file.
  (empty_data / data._MNIST_FILES["x_train"]).write_bytes(b"")
  with pytest.raises(FileNotFoundError, match=r"train-labels-idx1-ubyte\.gz"):
    data.load_mnist()


def test_bad_idx_file_is_rejected(empty_data):
  (empty_data / "mnist").mkdir()
  for name in data._MNIST_FILES.values():
    with gzip.open(empty_data / name, "wb") as f:
      f.write(b"\x00\x00\x08\x01" + b"\x00" * 8)  # a label header where images belong
  with pytest.raises(ValueError, match="magic 2051"):
    data.load_mnist()


def test_unknown_dataset():
  with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
    data.load_image_dataset("imagenet")


def test_batches_shapes_and_epoch_coverage():
  x = np.arange(10, dtype=np.float32)[:, None]
  y = np.arange(10)
  it = data.batches(x, y, 3, seed=1)
  first_epoch = [next(it) for _ in range(3)]
  assert all(xb.shape == (3, 1) and yb.shape == (3,) for xb, yb in first_epoch)
  seen = np.concatenate([yb for _, yb in first_epoch])
  assert len(set(seen)) == 9  # one epoch, no repeats, last partial batch dropped
  for xb, yb in first_epoch:
    np.testing.assert_array_equal(xb[:, 0], yb)  # pairs stay aligned
  second_epoch = np.concatenate([next(it)[1] for _ in range(3)])
  assert not np.array_equal(seen, second_epoch)  # reshuffled


def test_batches_seeded_and_finite():
  x = np.arange(20)
  a = [yb for _, yb in data.batches(x, x, 4, seed=3, epochs=2)]
  b = [yb for _, yb in data.batches(x, x, 4, seed=3, epochs=2)]
  c = [yb for _, yb in data.batches(x, x, 4, seed=4, epochs=2)]
  assert len(a) == 10
  assert all(np.array_equal(p, q) for p, q in zip(a, b))
  assert not all(np.array_equal(p, q) for p, q in zip(a, c))
  ordered = list(data.batches(x, x, 8, shuffle=False, drop_last=False, epochs=1))
  np.testing.assert_array_equal(np.concatenate([yb for _, yb in ordered]), x)
  assert [len(yb) for _, yb in ordered] == [8, 8, 4]


def test_batches_errors():
  x = np.zeros(5)
  with pytest.raises(ValueError, match="batch_size"):
    next(data.batches(x, x, 6))
  with pytest.raises(ValueError, match="differ in length"):
    next(data.batches(x, np.zeros(4), 2))
