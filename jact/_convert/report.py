"""`conversion_report`: what `jact.convert` did to each layer a model call ran.

Traces `fn` (typically the loss) once, abstractly, and lists every layer call
with how it was converted ('twin', 'engine', 'model' or 'plain', with the
reason) and the bytes it keeps plain and converted (linen and nnx models
alike); each layer left plain also gets a `ConversionWarning` with its share of
the bytes.

>>> import jax, jax.numpy as jnp, flax.linen as nn, jact
>>> class Net(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(2)(nn.relu(nn.DenseGeneral(64)(x)))
>>> x = jnp.ones((16, 256))
>>> variables = Net().init(jax.random.key(0), x)
>>> model = jact.convert(Net(), bits=2)
>>> loss = lambda v, x: model.apply(v, x, rngs={'jact': jax.random.key(1)}).sum()
>>> report = jact.conversion_report(loss, variables, x)
>>> [(r.path, r.how) for r in report.rows]
[('Net', 'model'), ('DenseGeneral_0', 'engine'), ('Dense_0', 'twin')]
>>> report.rows[1].saved_bytes < report.rows[1].plain_bytes
True
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax
from flax import nnx

from jact._convert.settings import ConversionWarning
from jact._convert.nnx import plain_layers
from jact._convert.generic import saved_bytes
from jact._convert.nnx_bytes import measuring, noting_plain
from jact._flax.record import Row, recording

__all__ = ["conversion_report", "ConversionReport"]


@dataclasses.dataclass
class ConversionReport:
  """The layer calls of one traced function (see the module docstring).

  rows: one `Row` per distinct (layer, conversion) met, in call order (a
  layer called several times is one row; `calls` counts them);
  total_bytes: what the whole function keeps for its backward pass.
  """

  rows: list[Row]
  total_bytes: int

  def plain(self) -> list[Row]:
    return [r for r in self.rows if r.how == "plain"]

  def __str__(self) -> str:
    def size(n):
      return "-" if n is None else f"{n:,}"

    table = [("layer", "type", "converted", "plain B", "saved B", "note")]
    table += [
      (r.path, r.layer, r.how, size(r.plain_bytes), size(r.saved_bytes), r.reason)
      for r in self.rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(5)]
    lines = [
      "  ".join(str(c).ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5] for row in table
    ]
    lines.append(f"saved for backward by the whole call: {self.total_bytes:,} B")
    return "\n".join(line.rstrip() for line in lines)


def _nnx_plain_layers(args, kwargs) -> list[tuple[str, str, str, bool, nnx.Module]]:
  """The layers of the nnx modules passed to `fn` that `convert` left plain
  (see `plain_layers`), each once."""
  modules = [
    leaf for leaf in jax.tree.leaves((args, kwargs), is_leaf=_is_nnx_module) if _is_nnx_module(leaf)
  ]
  found, seen = [], set()
  for module in modules:
    for name, layer, reason, in_model, obj in plain_layers(module):
      if (name, layer) not in seen:
        seen.add((name, layer))
        found.append((name, layer, reason, in_model, obj))
  return found


def _uncalled_rows(layers, rows) -> list[Row]:
  """Rows for the plain layers that `fn` did not call (no bytes: nothing ran)."""
  called = {(r.path, r.layer) for r in rows}
  return [
    Row(name, layer, "model" if in_model else "plain", reason)
    for name, layer, reason, in_model, _ in layers
    if (name, layer) not in called
  ]


def _is_nnx_module(x) -> bool:
  return isinstance(x, nnx.Module)


def conversion_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ConversionReport:
  """Traces `fn(*args, **kwargs)` (abstractly) and reports each layer call of the
  converted models inside it; warns (`ConversionWarning`) about each layer left
  plain, with its share of the saved bytes.

  `fn` returns an array or a pytree of arrays (e.g. a loss); its array
  arguments (variables, batch, keys) are not counted as saved.
  """
  if not callable(fn):
    raise TypeError(
      f"jact.conversion_report: fn must be a function that calls the converted "
      f"model (e.g. lambda v, x: model.apply(v, x).sum()), got "
      f"{type(fn).__name__} {fn!r:.40}"
    )
  layers = _nnx_plain_layers(args, kwargs)
  noted = [(name, reason, in_model, obj) for name, _, reason, in_model, obj in layers]
  with recording() as rows, measuring(), noting_plain(noted):
    total = saved_bytes(lambda *a: fn(*a, **kwargs), args, kept=set(range(len(args))))
  report = ConversionReport(list(rows) + _uncalled_rows(layers, rows), total)
  for row in report.plain():
    share = (
      ""
      if row.saved_bytes is None or not total
      else f"; it saves {row.saved_bytes:,} B, {100 * row.saved_bytes / total:.0f}% of "
      f"the {total:,} B saved for the backward pass"
    )
    warnings.warn(
      f"jact.convert: {row.path} (flax {row.layer}) runs uncompressed: {row.reason}{share}",
      ConversionWarning,
      stacklevel=2,
    )
  return report
