"""The API reference pages, one per public namespace, written from each namespace's `__all__`.

`docs/conf.py` runs `write_pages()` at every build, before autosummary reads the pages, so a
name added to (or removed from) an `__all__` reaches the reference without editing a page;
`tests/test_docs.py` checks the committed pages are what this writes
(`python docs/api_pages.py` rewrites them).
"""

from __future__ import annotations

import importlib
from pathlib import Path

API = Path(__file__).resolve().parent / "api"

# Namespace -> the page's title; the order of docs/api.md.
TITLES = {
  "jact": "the top-level namespace",
  "jact.ops": "compressed ops",
  "jact.compressors": "compressors",
  "jact.kernels": "kernels and their registry",
  "jact.nn": "linen twins",
  "jact.nnx": "nnx twins",
  "jact.sensitivity": "sensitivity estimators",
  "jact.acgc": "AC-GC error bounds",
  "jact.levels": "ActNN and GACT presets",
  "jact.allocate": "bit allocation",
  "jact.rng": "rounding noise",
}


def public_names(namespace: str) -> list[str]:
  """`namespace.__all__`, fully qualified; the top level leaves out its sub-namespaces."""
  module = importlib.import_module(namespace)
  names = [f"{namespace}.{n}" for n in module.__all__]
  return [n for n in names if namespace != "jact" or n not in TITLES]


def page(namespace: str) -> str:
  """The page's Markdown: the module's docstring, then a summary of its public names."""
  entries = "\n".join(f"   {n}" for n in public_names(namespace))
  return (
    f"# `{namespace}`: {TITLES[namespace]}\n\n"
    f"```{{eval-rst}}\n.. automodule:: {namespace}\n\n.. py:currentmodule:: None\n```\n\n"
    f"```{{eval-rst}}\n.. autosummary::\n   :toctree: ../_autosummary\n\n{entries}\n```\n"
  )


def write_pages() -> list[Path]:
  """Writes every page that changed (an unchanged page keeps its time: incremental builds)."""
  written = []
  for namespace in TITLES:
    path = API / f"{namespace}.md"
    text = page(namespace)
    if not path.exists() or path.read_text() != text:
      path.write_text(text)
      written.append(path)
  return written


if __name__ == "__main__":
  for path in write_pages():
    print(f"wrote {path}")
