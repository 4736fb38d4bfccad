"""Cora and CiteSeer from the Planetoid files of the offline data kit, ready for a GCN.

Files are looked up like every dataset of `experiments.lib.data` (`$JACT_DATA`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from experiments.lib.data import _data_file

__all__ = ["Planetoid", "load_planetoid", "load_cora", "normalized_adjacency"]

_PLANETOID_PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")


@dataclasses.dataclass(frozen=True)
class Planetoid:
  """A Planetoid citation graph (Yang et al. 2016 split), ready for a GCN.

  Attributes:
    x: node features, float32 [N, F], each row divided by its sum (rows
      without any feature stay zero), as in Kipf & Welling's GCN.
    y: class of each node, int32 [N]; -1 for nodes without a label (only
      CiteSeer's isolated test nodes, which are padded in).
    train_mask, val_mask, test_mask: bool [N], the standard split: the
      first 20 labelled nodes per class (`x`), the next 500 nodes, and the
      1000 nodes listed in `test.index`.
    edges: int32 [2, E], the undirected graph as directed edges in both
      directions (each pair once per direction, no self loops), sorted.
    adj_index: int32 [2, E + N], (row, column) of the nonzeros of A + I.
    adj_weight: float32 [E + N], the entries of D^-1/2 (A + I) D^-1/2 at
      `adj_index` (D the degrees of A + I), so that
      `(A_hat @ h)[r] = sum over k with adj_index[0, k] == r of
      adj_weight[k] * h[adj_index[1, k]]`.
  """

  name: str
  x: np.ndarray
  y: np.ndarray
  train_mask: np.ndarray
  val_mask: np.ndarray
  test_mask: np.ndarray
  edges: np.ndarray
  adj_index: np.ndarray
  adj_weight: np.ndarray

  @property
  def num_nodes(self) -> int:
    return int(self.x.shape[0])

  @property
  def num_features(self) -> int:
    return int(self.x.shape[1])

  @property
  def num_classes(self) -> int:
    return int(self.y.max()) + 1

  def adjacency_dense(self) -> np.ndarray:
    """D^-1/2 (A + I) D^-1/2 as a dense float32 [N, N] array (for checks)."""
    a = np.zeros((self.num_nodes, self.num_nodes), np.float32)
    np.add.at(a, (self.adj_index[0], self.adj_index[1]), self.adj_weight)
    return a


def normalized_adjacency(edges: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
  """The GCN propagation matrix D^-1/2 (A + I) D^-1/2 in coordinate form.

  Args:
    edges: int [2, E] directed edges of a symmetric graph without self loops.
    num_nodes: N.

  Returns:
    (index int32 [2, E + N], weight float32 [E + N]): the edges followed by
    the N self loops, weight[k] = 1 / sqrt(deg(row) * deg(col)), deg
    counting the self loop.

  >>> idx, w = normalized_adjacency(np.array([[0, 1], [1, 0]]), 3)
  >>> idx.tolist(), np.round(w, 3).tolist()
  ([[0, 1, 0, 1, 2], [1, 0, 0, 1, 2]], [0.5, 0.5, 0.5, 0.5, 1.0])
  """
  loops = np.arange(num_nodes)
  index = np.concatenate([np.asarray(edges, np.int64), np.stack([loops, loops])], axis=1)
  degree = np.bincount(index[0], minlength=num_nodes).astype(np.float64)
  inv_sqrt = 1.0 / np.sqrt(degree)
  weight = inv_sqrt[index[0]] * inv_sqrt[index[1]]
  return index.astype(np.int32), weight.astype(np.float32)


def _load_pickle(path: Path):
  import pickle
  import warnings

  try:
    import scipy.sparse  # noqa: F401  (the feature matrices are pickled scipy matrices)
  except ImportError as e:  # pragma: no cover
    raise ImportError(f"reading {path.name} needs scipy (pip install 'jact[test]')") from e
  with open(path, "rb") as f, warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # old scipy.sparse.csr module path
    return pickle.load(f, encoding="latin1")  # Python-2 pickles


def load_planetoid(name: str = "cora", *, root=None) -> Planetoid:
  """Cora or CiteSeer from the Planetoid files (`planetoid/ind.<name>.*`).

  Follows the usual GCN preprocessing (Kipf & Welling's `load_data`): the
  test nodes are put back at the positions listed in `test.index` (CiteSeer's
  isolated test nodes padded with zero features and no label), features are
  row-normalized, the graph is made symmetric with duplicates and self loops
  dropped, and the normalized adjacency with self loops is precomputed.

  Args:
    name: "cora" or "citeseer".
    root: data folder (default: `data_dir()`).

  Returns:
    A `Planetoid` (numpy arrays). Cora: 2708 nodes, 1433 features, 7
    classes, 5278 undirected edges; 140 / 500 / 1000 train / val / test.
  """
  if name not in ("cora", "citeseer"):
    raise ValueError(f"unknown Planetoid dataset {name!r}; choose 'cora' or 'citeseer'")
  paths = {part: _data_file(f"planetoid/ind.{name}.{part}", root) for part in _PLANETOID_PARTS}
  import scipy.sparse as sp

  x, y, tx, ty, allx, ally, graph = (_load_pickle(paths[p]) for p in _PLANETOID_PARTS[:-1])
  test_index = np.loadtxt(paths["test.index"], dtype=np.int64).reshape(-1)
  test_sorted = np.sort(test_index)
  first_test = int(test_sorted[0])
  if name == "citeseer":  # isolated test nodes are missing from tx/ty: pad them in
    span = int(test_sorted[-1]) - first_test + 1
    tx_full = sp.lil_matrix((span, tx.shape[1]), dtype=np.float32)
    tx_full[test_sorted - first_test, :] = tx
    ty_full = np.zeros((span, ty.shape[1]), ty.dtype)
    ty_full[test_sorted - first_test, :] = ty
    tx, ty = tx_full, ty_full
  features = np.asarray(sp.vstack([allx, tx]).todense(), np.float32)
  onehot = np.vstack([ally, ty])
  # Rows first_test.. of (allx, tx) are the test nodes in sorted order; node
  # test_index[i] is row test_sorted[i].
  features[test_index] = features[test_sorted]
  onehot[test_index] = onehot[test_sorted]
  num_nodes = features.shape[0]
  if len(graph) > num_nodes or max(graph) >= num_nodes:
    raise ValueError(f"ind.{name}.graph has nodes beyond the {num_nodes} feature rows")

  labels = np.where(onehot.any(1), onehot.argmax(1), -1).astype(np.int32)
  row_sum = features.sum(1, keepdims=True)
  features = np.divide(features, row_sum, out=np.zeros_like(features), where=row_sum > 0)

  pairs = np.array([(i, j) for i, nbrs in graph.items() for j in nbrs if i != j], np.int64)
  pairs = np.concatenate([pairs, pairs[:, ::-1]])
  pairs = np.unique(pairs, axis=0)  # symmetric, each directed edge once, sorted by (row, col)
  edges = pairs.T.astype(np.int32)
  adj_index, adj_weight = normalized_adjacency(edges, num_nodes)

  def mask(idx):
    m = np.zeros(num_nodes, bool)
    m[idx] = True
    return m

  n_train = y.shape[0]
  return Planetoid(
    name=name,
    x=features,
    y=labels,
    train_mask=mask(np.arange(n_train)),
    val_mask=mask(np.arange(n_train, n_train + 500)),
    test_mask=mask(test_sorted),
    edges=edges,
    adj_index=adj_index,
    adj_weight=adj_weight,
  )


def load_cora(*, root=None) -> Planetoid:
  """`load_planetoid("cora")`: 2708 nodes, 1433 features, 7 classes, 140/500/1000 split."""
  return load_planetoid("cora", root=root)
