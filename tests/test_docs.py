"""The README stays short and its links resolve; the docs pages it points to exist.

The docs build itself (`python -m sphinx -W -b html docs docs/_build`) runs in CI;
these checks need no Sphinx.
"""

import re
import sys
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


# What the docs build writes inside docs/ (docs/.gitignore'd outputs), never a source page.
_BUILD_OUTPUTS = {"_build", "_autosummary", "jupyter_execute", "notebooks"}


def _source_pages(docs: Path = DOCS) -> list[Path]:
  """The Markdown pages of docs/ that are written by hand or by api_pages.py, not build outputs."""
  return sorted(
    p for p in docs.rglob("*.md") if not _BUILD_OUTPUTS & set(p.relative_to(docs).parts[:-1])
  )


PAGES = [README, *_source_pages()]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
  missing = [t for t in _relative_links(page) if not _target(page, t).exists()]
  assert not missing, f"{page.relative_to(ROOT)} links to missing {missing}"


def test_every_docs_page_is_in_the_index_or_a_toctree():
  listed = set()
  for page in _source_pages():
    folder = page.parent.relative_to(DOCS)
    for block in re.findall(r"```\{toctree\}\n(.*?)```", page.read_text(), re.S):
      listed |= {
        (folder / line.strip()).as_posix()
        for line in block.splitlines()
        if line.strip() and not line.startswith(":")
      }
  pages = {p.relative_to(DOCS).with_suffix("").as_posix() for p in _source_pages()} - {"index"}
  assert pages <= listed, sorted(pages - listed)


def test_a_built_copy_of_the_docs_is_not_read_as_a_source_page(tmp_path):
  # CI builds the docs into docs/_build before the quick subset runs; its _sources/ copies
  # are neither in a toctree nor beside their link targets.
  (tmp_path / "_build" / "_sources").mkdir(parents=True)
  (tmp_path / "_build" / "_sources" / "index.md").write_text("copy")
  (tmp_path / "index.md").write_text("source")
  assert _source_pages(tmp_path) == [tmp_path / "index.md"]


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


def test_each_namespace_has_an_api_page_generated_from_its_public_names():
  """docs/api/<namespace>.md is what docs/api_pages.py writes from the namespace's `__all__`
  (the docs build rewrites it; `python docs/api_pages.py` does too), and docs/api.md links it."""
  sys.path.insert(0, str(DOCS))
  try:
    import api_pages
  finally:
    sys.path.remove(str(DOCS))
  assert set(api_pages.TITLES) == {"jact", *(f"jact.{s}" for s in NAMESPACES)}
  for name in api_pages.TITLES:
    assert f"api/{name}" in (DOCS / "api.md").read_text(), f"docs/api.md does not list {name}"
    page = DOCS / "api" / f"{name}.md"
    assert page.read_text() == api_pages.page(name), (
      f"{page} is stale: run `python docs/api_pages.py`"
    )
  import jact

  assert "jact.ops.dense" in api_pages.public_names("jact.ops")
  assert "jact.ops" not in api_pages.public_names("jact") and jact.convert


# The layout page's tree names folders and modules by their path under the package above them.
_TREE_ENTRY = re.compile(r"^  (\S+?(?:/|\.py))(?=[\s,]|$)", re.M)
_BACKTICKED_PATH = re.compile(r"`((?:jact|tests|experiments|notebooks|scripts|docs)/[\w/.]*)`")


def _architecture_paths() -> list[str]:
  """Every path docs/architecture.md names: backticked paths and the entries of its tree."""
  text = (DOCS / "architecture.md").read_text()
  paths = set(_BACKTICKED_PATH.findall(text))
  tree = re.search(r"```\n(jact/.*?)```", text, re.S).group(1)
  top = None
  for line in tree.splitlines():
    if re.match(r"^\S+/", line):
      top = line.split()[0]
      paths.add(top)
    elif top == "jact/" and (entry := _TREE_ENTRY.match(line)):
      paths.add(top + entry.group(1))
  return sorted(paths)


def _exists(path: str) -> bool:
  """A path, a module written without `.py`, or a package's module (`jact/_engine/store`)."""
  target = ROOT / path.rstrip("/")
  return target.exists() or target.with_suffix(".py").exists()


def test_every_path_the_layout_page_names_exists():
  paths = _architecture_paths()
  assert "jact/_engine/" in paths and "jact/_report.py" in paths  # the tree was read
  missing = [p for p in paths if not _exists(p)]
  assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_a_missing_layout_path_is_found():
  assert _exists("jact/_engine/store") and _exists("jact/_engine/")
  assert not _exists("jact/_engine/no_such_module")


# A cited test: a file under tests/ (optionally `::name`), or a test's or test module's name.
_TEST_PATH = re.compile(r"(?<![\w/])((?:experiments/)?tests/[\w/*]+\.py)(?:::(\w+))?")
_TEST_NAME = re.compile(r"(?<![\w/.])(test_\w+)\b")
PLACEHOLDERS = {"tests/test_x.py"}  # a name a page uses for "your test file"
_TEST_ROOTS = [ROOT / "tests", ROOT / "experiments" / "tests"]


def _test_sources() -> dict[Path, str]:
  return {p: p.read_text() for r in _TEST_ROOTS if r.exists() for p in sorted(r.rglob("*.py"))}


def _cited_tests_missing(text: str, sources: dict[Path, str]) -> list[str]:
  missing = []
  known = {p.stem for p in sources}  # test modules and test functions
  for source in sources.values():
    known |= set(re.findall(r"^\s*def (test_\w+)", source, re.M))
  for path, name in _TEST_PATH.findall(text):
    if path in PLACEHOLDERS:
      continue
    files = sorted(ROOT.glob(path))
    if not files:
      missing.append(path)
    elif name and not any(re.search(rf"def {name}\b", f.read_text()) for f in files):
      missing.append(f"{path}::{name}")
  bare = _TEST_PATH.sub(" ", text)
  for name in _TEST_NAME.findall(bare):
    if name not in known and f"tests/{name}.py" not in PLACEHOLDERS:
      missing.append(name)
  return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_test_a_page_cites_exists(page):
  missing = _cited_tests_missing(page.read_text(), _test_sources())
  assert not missing, f"{page.relative_to(ROOT)} cites tests that do not exist: {missing}"


def test_a_cited_test_that_does_not_exist_is_found():
  sources = _test_sources()
  assert (
    _cited_tests_missing("`tests/test_docs.py::test_a_missing_link_target_is_found`", sources) == []
  )
  assert _cited_tests_missing("tests/test_edge_*.py, test_no_such_thing", sources) == [
    "tests/test_edge_*.py",
    "test_no_such_thing",
  ]
  assert _cited_tests_missing("tests/test_docs.py::test_gone", sources) == [
    "tests/test_docs.py::test_gone"
  ]


def test_the_getting_started_example_runs():
  """The page's example converts an ordinary Flax model and differentiates it."""
  code = re.findall(r"```python\n(.*?)```", (DOCS / "getting_started.md").read_text(), re.S)
  assert len(code) == 1
  scope = {}
  exec(compile(code[0], "docs/getting_started.md", "exec"), scope)
  grads, params = scope["grads"], scope["params"]
  assert {k: v.shape for k, v in grads["Dense_0"].items()} == {
    k: v.shape for k, v in params["Dense_0"].items()
  }
