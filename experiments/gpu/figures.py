"""The figures `experiments/results/gpu/README.md` quotes (`gpu.*`), from the campaigns' JSON."""

from __future__ import annotations

import functools
import json
from pathlib import Path

__all__ = ["compute"]


def _load(path: Path):
  return json.loads(path.read_text()) if path.exists() else None


@functools.cache
def compute(results: str) -> dict:
  """name -> figure, from the GPU folders under the results folder `results`."""
  out: dict[str, str] = {}
  gpu = Path(results) / "gpu"
  for part in ():
    part(gpu, out)
  return out
