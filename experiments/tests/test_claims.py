"""Every figure the README's Results, the generated docs pages and the notebooks' prose quote comes
from the committed JSON.

`experiments.claims` computes each named figure from `experiments/results/`;
these tests render the templates again and compare with what is committed, so
a result rerun without regenerating the prose (or prose edited by hand) fails.
"""

import importlib.util
from pathlib import Path

import nbformat
import pytest

from experiments import claims

ROOT = Path(__file__).resolve().parents[2]


def _notebook_templates():
  spec = importlib.util.spec_from_file_location("notebook_build", ROOT / "notebooks" / "build.py")
  build = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(build)
  return build.NOTEBOOKS


NOTEBOOKS = _notebook_templates()


def test_templates_quote_figures_instead_of_typing_them():
  typed = {"README": claims.typed_figures(claims.TEMPLATE.read_text())}
  for page, template in claims.PAGES.items():
    typed[page.name] = claims.typed_figures(template.read_text())
  for name, cells in NOTEBOOKS.items():
    typed[name] = [
      f for kind, text in cells if kind == "markdown" for f in claims.typed_figures(text)
    ]
  assert not any(typed.values()), {k: v for k, v in typed.items() if v}


def test_typed_figures_finds_decimals_ratios_and_percents():
  assert claims.typed_figures("0.698, 20.6x, 3x, 5 %, 12%") == [
    "0.698",
    "20.6x",
    "3x",
    "5 %",
    "12%",
  ]
  assert claims.typed_figures("ResNet-20, 8x8 blocks, 3 epochs, e^2, {{a.b}}") == []


def test_readme_results_are_rendered_from_the_committed_data():
  readme = claims.README.read_text()
  start, end = claims.readme_section(readme)
  expected = "\n" + claims.render(claims.TEMPLATE.read_text()) + "\n"
  assert readme[start:end] == expected, (
    "README's Results differ from the data: run python -m experiments.claims"
  )


@pytest.mark.parametrize("page", sorted(claims.PAGES), ids=lambda p: p.name)
def test_generated_docs_pages_are_rendered_from_the_committed_data(page):
  expected = claims.render(claims.PAGES[page].read_text())
  assert page.read_text() == expected, (
    f"{page.relative_to(ROOT)} differs from the data: run python -m experiments.claims"
  )


def test_stale_names_a_page_edited_by_hand(tmp_path, monkeypatch):
  page, template = tmp_path / "page.md", tmp_path / "page_template.md"
  template.write_text("fp reaches {{actnn.fp.accuracy}}")
  page.write_text("fp reaches 0.999")  # typed by hand, not rendered
  monkeypatch.setattr(claims, "ROOT", tmp_path.parent)
  monkeypatch.setattr(claims, "README", ROOT / "README.md")
  monkeypatch.setattr(claims, "PAGES", {page: template})
  assert claims.stale() == [f"{tmp_path.name}/page.md"]
  page.write_text(claims.render(template.read_text()))
  assert claims.stale() == []


def test_readme_results_point_to_the_generated_results_page():
  readme = claims.README.read_text()
  start, end = claims.readme_section(readme)
  assert "docs/results.md" in readme[start:end]
  assert ROOT / "docs" / "results.md" in claims.PAGES


@pytest.mark.parametrize("name", sorted(NOTEBOOKS))
def test_notebook_prose_is_rendered_from_the_committed_data(name):
  notebook = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
  committed = [c.source for c in notebook.cells if c.cell_type == "markdown"]
  expected = [claims.render(text) for kind, text in NOTEBOOKS[name] if kind == "markdown"]
  assert committed == expected, (
    f"{name}'s prose differs from the data: run python notebooks/build.py --only {name[:2]}"
  )


def test_render_names_a_missing_figure():
  with pytest.raises(KeyError, match="no figure for"):
    claims.render("{{no.such.figure}}", {})


def test_figures_follow_the_json(tmp_path):
  """A figure is computed, not stored: change the JSON and the figure changes."""
  (tmp_path / "actnn_cifar").mkdir()
  run = dict(
    complete=True,
    final_test_accuracy=0.5,
    epochs=1,
    total_steps=10,
    memory=dict(saved_bytes=2**20, temp_bytes=2**21),
    history=[],
    losses=[],
    plans=[],
  )
  import json

  (tmp_path / "actnn_cifar" / "fp.json").write_text(json.dumps(run))
  (tmp_path / "actnn_cifar" / "pergroup2.json").write_text(
    json.dumps(
      dict(run, final_test_accuracy=0.25, memory=dict(saved_bytes=2**18, temp_bytes=2**20))
    )
  )
  f = claims.figures(tmp_path)
  assert f["actnn.fp.accuracy"] == "0.500" and f["actnn.pergroup2.accuracy"] == "0.250"
  assert f["actnn.pergroup2.fewer"] == "4.0x" and f["actnn.pergroup2.saved_mib"] == "0.2"


def test_every_generated_file_is_up_to_date():
  """README's Results, the generated pages and the generated blocks in hand-written docs pages."""
  assert claims.stale() == [], "run python -m experiments.claims"


def test_a_generated_block_is_filled_from_the_data(tmp_path):
  import json

  rows = [
    dict(
      model="resnet18_cifar",
      bits=b,
      input_shape=[8, 32, 32, 3],
      residual_reduction=r,
      temp_reduction=r / 2,
    )
    for b, r in ((None, 1.0), (2, 12.34))
  ]
  (tmp_path / "bench_memory.json").write_text(json.dumps(dict(rows=rows)))
  table = claims.figures(tmp_path)["table.bench_memory"]
  assert "| ResNet-18, CIFAR (8) | 12.3x | 6.2x |" in table.splitlines()
  page = "x\n<!-- claims:table.bench_memory -->\n| typed | by hand |\n<!-- claims:end -->\n"
  assert claims.render_blocks(page, {"table.bench_memory": table}) == (
    f"x\n<!-- claims:table.bench_memory -->\n{table}\n<!-- claims:end -->\n"
  )


# Pages whose typed figures are not generated yet (issue 49, item 5, left owed): each must still
# fail (strict), so a page that is fixed leaves this set.
OWED: set[str] = set()


def _owed(page: Path):
  name = str(page.relative_to(ROOT))
  mark = pytest.mark.xfail(strict=True, reason="typed figures owed: generate them or drop them")
  return pytest.param(page, id=name, marks=[mark] if name in OWED else [])


@pytest.mark.parametrize("page", [_owed(p) for p in claims.hand_written()])
def test_hand_written_pages_type_no_measured_figure(page):
  """A measured figure on a hand-written page is generated (`<!-- fig:NAME -->`, a claims block)."""
  typed = claims.measured_figures(page.read_text(), page.name)
  assert not typed, (
    f"{page.relative_to(ROOT)} types measured figures {typed}: quote each from the data "
    "(`<!-- fig:NAME -->...<!-- /fig -->`, NAME computed in experiments/lib/docs_figures.py or "
    "experiments/gpu/figures.py, then python -m experiments.claims) or write it in words"
  )


def test_measured_figures_finds_bytes_times_ratios_percents_decimals_and_test_counts():
  text = "1.5 GiB, 21.8 ms, 3x, 4-6x, 2.3 %, 0.17 / 2.7 / 14 %, 0.698, 2740 tests, 1808 passed"
  assert claims.measured_figures(text) == [
    "1.5 GiB",
    "21.8 ms",
    "3x",
    "4-6x",
    "2.3 %",
    "0.17 / 2.7 / 14 %",
    "0.698",
    "2740 tests",
    "1808 passed",
  ]
  not_measured = (
    "2 bits, 8x8 blocks, 224x224, 6 x 512, jax 0.10.2, flax 0.12.6-0.12.12, Python 3.11-3.13, "
    "Apache-2.0, `budget_bytes=40 * 2**30`, [a](b-1.5x.md), <!-- fig:a.b -->1.5 GiB<!-- /fig -->"
  )
  assert claims.measured_figures(not_measured) == []
  assert claims.measured_figures("```python\nx = 0.5  # 3 ms\n```\n") == []


def test_an_inline_figure_typed_over_is_stale_and_a_bare_one_is_found(tmp_path, monkeypatch):
  page = tmp_path / "docs" / "page.md"
  page.parent.mkdir()
  monkeypatch.setattr(claims, "ROOT", tmp_path)
  monkeypatch.setattr(claims, "DOCS", page.parent)
  monkeypatch.setattr(claims, "README", ROOT / "README.md")
  monkeypatch.setattr(claims, "PAGES", {})
  monkeypatch.setattr(claims, "GPU_README", claims.GPU_README)
  value = claims.figures()["actnn.fp.accuracy"]
  page.write_text(f"fp reaches <!-- fig:actnn.fp.accuracy -->{value}<!-- /fig -->.\n")
  assert "docs/page.md" not in claims.stale()
  page.write_text("fp reaches <!-- fig:actnn.fp.accuracy -->0.999<!-- /fig -->.\n")
  assert "docs/page.md" in claims.stale()
  assert claims.measured_figures("fp reaches 0.999 in 12 s") == ["0.999", "12 s"]


def test_hand_written_pages_figures_follow_the_json(tmp_path):
  """docs/fit.md's table and figures are computed from bench_fit.json: change a run, they change."""
  import json

  payload = json.loads((claims.RESULTS / "bench_fit.json").read_text())
  assert "table.fit" not in claims.figures(tmp_path)  # no JSON, no figure (never a stored one)
  row = payload["subjects"]["stack8"]["rows"][0]
  row["variance"], row["search_seconds"] = row["uniform_variance"] / 40, 999.4
  (tmp_path / "changed").mkdir()  # figures are cached per results folder
  (tmp_path / "changed" / "bench_fit.json").write_text(json.dumps(payload))
  after = claims.figures(tmp_path / "changed")
  assert "variance 1.8e-5 vs 7.2e-4 (uniform 8)" in after["table.fit"]
  assert after["fit.variance_gain"] == "1.2x-40x"
  assert after["fit.search_seconds"] == "71-999 s"
