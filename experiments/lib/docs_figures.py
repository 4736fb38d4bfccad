"""Figures hand-written docs pages quote inline (`<!-- fig:NAME -->`), from experiments/results/.

One function per results file adds its names to a dict; `experiments.claims` merges them with
`experiments.lib.claims_figures`'.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

__all__ = ["compute"]


def _load(path: Path):
  return json.loads(path.read_text()) if path.exists() else None


@functools.cache
def compute(results: str) -> dict:
  """name -> figure, from the results folder `results` (a resolved path string)."""
  out: dict[str, str] = {}
  path = Path(results)
  for part in ():
    part(path, out)
  return out
