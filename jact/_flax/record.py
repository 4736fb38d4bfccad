"""The record `jact.conversion_report` reads: a `Row` per layer call traced while
one is being taken (the twins note their own calls, the converter the rest)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from jact._flax.context import RECORDER, bound


@dataclasses.dataclass
class Row:
  """One converted (or not) layer call seen while tracing (see `ConversionReport`).

  path: the layer's module path; layer: its class; how: 'twin' (a jact twin),
  'engine' (this call's residuals through the generic engine), 'model' (the
  converted model's outermost call through the engine: the activation and
  pooling functions between its layers, and a layer that runs plain inside it,
  with the reason), or 'plain' (uncompressed); reason: why a layer runs
  plain; plain_bytes / saved_bytes: what the call keeps for the backward pass
  as a plain layer / as converted (None: not measured).
  """

  path: str
  layer: str
  how: str
  reason: str = ""
  plain_bytes: int | None = None
  saved_bytes: int | None = None
  calls: int = 1


@contextlib.contextmanager
def recording() -> Iterator[list]:
  """Collects a `Row` for every converted layer call traced inside."""
  with bound(RECORDER, []) as rows:
    yield rows


def is_recording() -> bool:
  return RECORDER.get() is not None


def record(
  path: str, layer: str, how: str, reason: str = "", plain_bytes=None, saved_bytes=None
) -> None:
  rows = RECORDER.get()
  if rows is None:
    return
  for row in rows:  # the same layer called again (shared, or a step of an unrolled loop)
    if (row.path, row.layer, row.how, row.reason) == (path, layer, how, reason):
      row.calls += 1
      if plain_bytes is not None:
        row.plain_bytes = (row.plain_bytes or 0) + plain_bytes
      if saved_bytes is not None:
        row.saved_bytes = (row.saved_bytes or 0) + saved_bytes
      return
  rows.append(Row(path, layer, how, reason, plain_bytes, saved_bytes))
