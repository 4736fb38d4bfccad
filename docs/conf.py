"""Sphinx configuration: MyST pages, notebooks from their saved outputs, autodoc API reference.

Build: `python -m sphinx -W -b html docs docs/_build` (warnings are errors).
"""

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's jact, also when it is not installed

project = "jact"
author = "the jact authors"
copyright = "the jact authors, Apache-2.0"

extensions = [
  "myst_nb",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.napoleon",
]

# The notebooks are rendered from the outputs saved in notebooks/*.ipynb; nothing runs at build.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Google-style docstrings (`Args:`, `Returns:`).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autosummary_generate = True
templates_path = ["_templates"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}

html_theme = "sphinx_book_theme"
html_title = "jact"
html_theme_options = {"show_toc_level": 2}

exclude_patterns = ["_build", "jupyter_execute", "Thumbs.db", ".DS_Store"]
suppress_warnings = [
  # notebooks open with a title and jump to "##" after code cells: intended
  "myst.header",
]

# Sphinx reads documents only from this folder. The notebooks live in notebooks/ (their one
# copy in git, executed by the tests); mirror them into docs/notebooks/ (git-ignored) at every
# build, rewriting a file only when it changed so incremental builds stay incremental.
_NOTEBOOKS = ROOT / "notebooks"
_MIRROR = Path(__file__).resolve().parent / "notebooks"


def _mirror_notebooks() -> None:
  _MIRROR.mkdir(exist_ok=True)
  wanted = {p.name: p for p in sorted(_NOTEBOOKS.glob("*.ipynb"))}
  for stale in _MIRROR.glob("*.ipynb"):
    if stale.name not in wanted:
      stale.unlink()
  for name, source in wanted.items():
    target = _MIRROR / name
    if not target.exists() or target.read_bytes() != source.read_bytes():
      shutil.copyfile(source, target)


_mirror_notebooks()

# The API pages list each namespace's `__all__` (docs/api_pages.py): written before autosummary
# reads them.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import api_pages  # noqa: E402

api_pages.write_pages()


def _drop_stale_stubs() -> None:
  """Removes autosummary stubs of names no longer public (a renamed or removed name's stub
  would otherwise fail the build: autodoc cannot import it)."""
  wanted = {n for namespace in api_pages.TITLES for n in api_pages.public_names(namespace)}
  for stub in (Path(__file__).resolve().parent / "_autosummary").glob("*.rst"):
    if stub.stem not in wanted:
      stub.unlink()


_drop_stale_stubs()
