"""The README stays short and its links resolve; the docs pages it points to exist.

The docs build itself (`python -m sphinx -W -b html docs docs/_build`) runs in CI;
these checks need no Sphinx.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _target(page: Path, link: str) -> Path:
  """The file a link names; docs/notebooks/ is the build's mirror of notebooks/ (docs/conf.py)."""
  if page.parent == DOCS and link.startswith("notebooks/"):
    return ROOT / link
  return page.parent / link


def _relative_links(page: Path) -> list[str]:
  return [t for t in _LINK.findall(page.read_text()) if "://" not in t]


def test_readme_is_at_most_200_lines():
  assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize(
  "command",
  [
    'pip install -e ".[experiments]" && python -m experiments.compare',
    'pip install -e ".[test]" && python -m pytest -q -n 2',
  ],
)
def test_readme_keeps_the_two_commands(command):
  assert f"```bash\n{command}\n```" in README.read_text()


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve(page):
  missing = [t for t in _relative_links(page) if not _target(page, t).exists()]
  assert not missing, f"{page.relative_to(ROOT)} links to missing {missing}"


def test_every_docs_page_is_in_the_index_or_a_toctree():
  listed = set()
  for page in DOCS.glob("*.md"):
    for block in re.findall(r"```\{toctree\}\n(.*?)```", page.read_text(), re.S):
      listed |= {
        line.strip() for line in block.splitlines() if line.strip() and not line.startswith(":")
      }
  pages = {p.stem for p in DOCS.glob("*.md")} - {"index"}
  assert pages <= listed, sorted(pages - listed)


def test_a_missing_link_target_is_found(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("[ok](page.md) [gone](nope.md#x) [web](https://example.org)")
  assert _relative_links(page) == ["page.md", "nope.md"]
  assert not (tmp_path / "nope.md").exists()


NAMESPACES = (
  "ops",
  "compressors",
  "kernels",
  "nn",
  "nnx",
  "sensitivity",
  "acgc",
  "levels",
  "allocate",
  "rng",
)


def test_the_api_page_lists_every_public_name():
  """docs/api.md names each `__all__` entry of `jact` and its public namespaces, and nothing
  else."""
  import jact

  listed = set(re.findall(r"^   (jact\.[\w.]+)$", (DOCS / "api.md").read_text(), re.M))
  public = {f"jact.{n}" for n in jact.__all__ if n not in NAMESPACES}
  for space in NAMESPACES:
    public |= {f"jact.{space}.{n}" for n in getattr(jact, space).__all__}
  assert listed == public, {"missing": sorted(public - listed), "extra": sorted(listed - public)}
