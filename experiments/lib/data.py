"""Loaders for the real datasets of the offline data kit, and a batch iterator.

The data folder is `$JACT_DATA` when set (used as given, even if empty), else
the first existing of `<project root>/../shared/data` and `<cwd>/../shared/data`.
A missing file raises `FileNotFoundError` naming the file and the fix; when no
data folder exists at all it is a `DataKitMissing` (the test suite skips the
tests that need the kit on such a checkout). The 8x8 digits need no data folder:
scikit-learn ships them.
Decoded CIFAR-10 images are cached as uint8 arrays in `$JACT_CACHE`
(default `~/.cache/jact`).

>>> x_tr, y_tr, x_te, y_te = load_image_dataset("sklearn_digits")
>>> x_tr.shape[1:], x_tr.dtype.name, float(x_tr.max()) <= 1.0
((8, 8, 1), 'float32', True)
>>> xb, yb = next(batches(x_tr, y_tr, 32, seed=0))
>>> xb.shape, yb.shape
((32, 8, 8, 1), (32,))
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "DATASETS",
  "DataKitMissing",
  "data_dir",
  "cache_dir",
  "load_cifar10",
  "load_mnist",
  "load_digits_csv",
  "load_sklearn_digits",
  "resolve_dataset",
  "load_image_dataset",
  "batches",
  "load_pool",
]

DATA_ENV = "JACT_DATA"
CACHE_ENV = "JACT_CACHE"
DATASETS = ("auto", "cifar10", "cifar10_full", "mnist", "digits", "sklearn_digits")
_CIFAR_FILES = {
  "10k_2k": "cifar10/cifar10_jpeg_q75_10k_2k.npz",
  "full": "cifar10/cifar10_jpeg_q75_full.npz",
}
_MNIST_FILES = {
  "x_train": "mnist/train-images-idx3-ubyte.gz",
  "y_train": "mnist/train-labels-idx1-ubyte.gz",
  "x_test": "mnist/t10k-images-idx3-ubyte.gz",
  "y_test": "mnist/t10k-labels-idx1-ubyte.gz",
}
_DIGITS_FILE = "sklearn_digits/digits.csv.gz"


class DataKitMissing(FileNotFoundError):
  """No data folder was found at all (neither `$JACT_DATA` nor `../shared/data`).

  Distinct from a file missing from a folder that exists, so that a checkout
  without the data kit can skip what needs it while a misconfigured kit fails.
  `relative` is the file that was asked for.
  """

  def __init__(self, relative: str):
    looked = ", ".join(str(p) for p in _candidates())
    super().__init__(
      f"data file {relative!r} not found: no data folder (looked in {looked}). "
      f"Set {DATA_ENV}=/path/to/shared/data."
    )
    self.relative = relative


def _candidates() -> list[Path]:
  project_root = Path(__file__).resolve().parents[2]
  return [project_root.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]


def data_dir() -> Path | None:
  """The data folder: `$JACT_DATA` if set, else `../shared/data` (project root, then cwd).

  Returns None when no folder is found.
  """
  env = os.environ.get(DATA_ENV)
  if env:
    return Path(env).expanduser()
  for path in _candidates():
    if path.is_dir():
      return path
  return None


def cache_dir() -> Path:
  """Where decoded arrays are cached: `$JACT_CACHE` or `~/.cache/jact`."""
  return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jact").expanduser()


def _data_file(relative: str, root: str | os.PathLike | None = None) -> Path:
  base = Path(root) if root is not None else data_dir()
  if base is None:
    raise DataKitMissing(relative)
  path = base / relative
  if not path.is_file():
    raise FileNotFoundError(
      f"data file {relative!r} not found: {path} does not exist. Point {DATA_ENV} at the "
      f"folder that holds {relative!r} (currently {base})."
    )
  return path


def _file_digest(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()[:16]


def _decode_jpegs(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
  from PIL import Image  # optional dependency, only needed to decode CIFAR-10

  data = blob.tobytes()
  images = [
    np.asarray(Image.open(io.BytesIO(data[offsets[i] : offsets[i + 1]])).convert("RGB"))
    for i in range(len(offsets) - 1)
  ]
  return np.stack(images).astype(np.uint8)


def _save_atomic(path: Path, **arrays) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp.npz")
  try:
    with os.fdopen(fd, "wb") as f:
      np.savez(f, **arrays)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def load_cifar10(subset: str = "10k_2k", *, root=None, use_cache: bool = True):
  """CIFAR-10 (JPEG q75 re-encoding) as uint8 arrays.

  Args:
    subset: "10k_2k" (first 10000 train / 2000 test images) or "full" (50000 / 10000).
    root: data folder (default: `data_dir()`).
    use_cache: read/write the decoded arrays in `cache_dir()`.

  Returns:
    (x_train, y_train, x_test, y_test): images uint8 [N, 32, 32, 3], labels uint8 [N].
  """
  if subset not in _CIFAR_FILES:
    raise ValueError(f"subset must be one of {sorted(_CIFAR_FILES)}, got {subset!r}")
  path = _data_file(_CIFAR_FILES[subset], root)
  cached = cache_dir() / f"cifar10_{subset}_{_file_digest(path)}.npz" if use_cache else None
  if cached is not None and cached.is_file():
    with np.load(cached) as z:
      return z["x_train"], z["y_train"], z["x_test"], z["y_test"]
  with np.load(path) as z:
    out = dict(
      x_train=_decode_jpegs(z["train_jpeg"], z["train_offsets"]),
      y_train=z["y_train"].astype(np.uint8),
      x_test=_decode_jpegs(z["test_jpeg"], z["test_offsets"]),
      y_test=z["y_test"].astype(np.uint8),
    )
  if cached is not None:
    try:
      _save_atomic(cached, **out)
    except OSError:
      pass  # an unwritable cache only costs a second decode
  return out["x_train"], out["y_train"], out["x_test"], out["y_test"]


def _read_idx(path: Path, magic: int) -> np.ndarray:
  with gzip.open(path, "rb") as f:
    raw = f.read()
  found = int.from_bytes(raw[:4], "big")
  if found != magic:
    raise ValueError(f"{path} is not an IDX file with magic {magic} (found {found})")
  ndim = raw[3]
  dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
  return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_mnist(*, root=None):
  """MNIST from the official IDX files.

  Returns:
    (x_train, y_train, x_test, y_test): images uint8 [N, 28, 28], labels uint8 [N]
    (60000 train, 10000 test).
  """
  paths = {k: _data_file(v, root) for k, v in _MNIST_FILES.items()}
  return (
    _read_idx(paths["x_train"], 2051),
    _read_idx(paths["y_train"], 2049),
    _read_idx(paths["x_test"], 2051),
    _read_idx(paths["y_test"], 2049),
  )


def load_digits_csv(*, root=None):
  """UCI optical digits from the data kit's CSV (64 pixels 0..16 + label per row).

  Returns:
    (x, y): images uint8 [1797, 8, 8] with values 0..16, labels uint8 [1797].
  """
  path = _data_file(_DIGITS_FILE, root)
  table = np.loadtxt(path, delimiter=",", dtype=np.int64)
  return table[:, :64].reshape(-1, 8, 8).astype(np.uint8), table[:, 64].astype(np.uint8)


def load_sklearn_digits():
  """The same digits as shipped inside scikit-learn (no data folder needed).

  Returns:
    (x, y): images uint8 [1797, 8, 8] with values 0..16, labels uint8 [1797].
  """
  from sklearn.datasets import load_digits

  d = load_digits()
  return d.images.astype(np.uint8), d.target.astype(np.uint8)


def resolve_dataset(name: str = "auto", *, root=None) -> str:
  """The concrete dataset "auto" stands for: "cifar10" when its file is in the data
  folder, else "sklearn_digits". Other names are validated and returned."""
  if name not in DATASETS:
    raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")
  if name != "auto":
    return name
  if _has_file(_CIFAR_FILES["10k_2k"], root):
    return "cifar10"
  return "sklearn_digits"


def _has_file(relative: str, root=None) -> bool:
  base = Path(root) if root is not None else data_dir()
  return base is not None and (base / relative).is_file()


def _split_digits(x, y, test_fraction=0.2, seed=0):
  perm = np.random.default_rng(seed).permutation(len(x))
  n_test = int(round(len(x) * test_fraction))
  tr, te = perm[n_test:], perm[:n_test]
  return x[tr], y[tr], x[te], y[te]


def load_image_dataset(
  name: str = "auto", *, root=None, train_size: int | None = None, test_size: int | None = None
):
  """An image classification dataset as float32 NHWC in [0, 1] with int32 labels.

  Args:
    name: one of `DATASETS`. "auto" is CIFAR-10 (10k/2k subset) when the data
      folder holds it, else scikit-learn's bundled digits. "digits" reads the data
      kit's CSV when the data folder holds it, else scikit-learn's copy of the same
      images; both digits variants use a fixed 1438/359 train/test split.
    root: data folder (default: `data_dir()`).
    train_size, test_size: keep only the first examples (CIFAR-10 prefixes of
      10k items are class balanced).

  Returns:
    (x_train, y_train, x_test, y_test), images float32 [N, H, W, C], labels int32 [N].
  """
  name = resolve_dataset(name, root=root)
  if name in ("cifar10", "cifar10_full"):
    xtr, ytr, xte, yte = load_cifar10("10k_2k" if name == "cifar10" else "full", root=root)
    scale = 255.0
  elif name == "mnist":
    xtr, ytr, xte, yte = load_mnist(root=root)
    xtr, xte, scale = xtr[..., None], xte[..., None], 255.0
  else:
    from_kit = name == "digits" and _has_file(_DIGITS_FILE, root)
    x, y = load_digits_csv(root=root) if from_kit else load_sklearn_digits()
    xtr, ytr, xte, yte = _split_digits(x[..., None], y)
    scale = 16.0
  xtr, ytr = xtr[:train_size], ytr[:train_size]
  xte, yte = xte[:test_size], yte[:test_size]
  as_float = lambda a: a.astype(np.float32) / np.float32(scale)
  return as_float(xtr), ytr.astype(np.int32), as_float(xte), yte.astype(np.int32)


def batches(
  x: np.ndarray,
  y: np.ndarray,
  batch_size: int,
  *,
  seed: int = 0,
  shuffle: bool = True,
  drop_last: bool = True,
  epochs: int | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Yields (x_batch, y_batch); reshuffles every epoch with a seeded generator.

  Runs forever when `epochs` is None. With `drop_last`, every batch has
  `batch_size` examples (so a jitted step compiles once).
  """
  n = len(x)
  if len(y) != n:
    raise ValueError(f"x and y differ in length: {n} vs {len(y)}")
  if batch_size < 1 or (drop_last and batch_size > n):
    raise ValueError(f"batch_size must be in [1, {n}] (the dataset size), got {batch_size}")
  rng = np.random.default_rng(seed)
  epoch = 0
  while epochs is None or epoch < epochs:
    order = rng.permutation(n) if shuffle else np.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
      idx = order[start : start + batch_size]
      yield x[idx], y[idx]
    epoch += 1


def load_pool(dataset: str, image: int, dtype, size: int = 256):
  """(dataset name, images [size, image, image, 3] standardized, labels int32) on the device."""
  name = resolve_dataset(dataset)
  x, y, _, _ = load_image_dataset(name, train_size=size, test_size=1)
  if x.shape[-1] == 1:
    x = np.repeat(x, 3, axis=-1)
  x = (x - x.mean((0, 1, 2))) / (x.std((0, 1, 2)) + 1e-6)
  x = jax.image.resize(jnp.asarray(x), (len(x), image, image, 3), "bilinear")
  return name, x.astype(dtype), jnp.asarray(y, jnp.int32)
