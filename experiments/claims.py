"""Every figure the README's Results, the docs' generated pages and the notebooks' prose quote.

Prose is written as a template: a figure is `{{name}}`, never a typed number.
`figures()` computes every name from `experiments/results/` (formatted as the
prose shows it; the computations are `experiments.lib.claims_figures`),
`render(text)` fills a template, and `python -m experiments.claims` rewrites the
README's Results section (between its `results:begin` / `results:end` markers)
from `experiments/results_template.md` and each page in `PAGES` (e.g.
`docs/results.md`) from its template.
`experiments/tests/test_claims.py` renders them and the notebooks' prose again and fails
when a quoted figure differs from the data or a template types a figure.

Names: `actnn.<variant>.<field>` (accuracy, saved_mib, temp_mib, fewer: plain JAX's
saved bytes over the variant's, fewer_than_layers: one float32 copy per layer input
over the variant's, bits), `seeds.<variant>.<field>` (mean, std, min, max, n,
values), `gact.<task>.<variant>.<field>` (metric, fewer, bits),
`gv.<epoch>.<field>`, `mb.<model>.<method>.<field>`, `bp.<model>.<field>`,
`acgc.<checkpoint>.<field>`, whole tables `table.<experiment>` (bench_compressors,
bench_memory, bench_models, whole_model_error, train_sharded) for the generated blocks of
hand-written docs pages.

Hand-written pages (README.md, docs/**/*.md, the GPU results README) quote a figure in a
generated block (`<!-- claims:NAME -->` ... `<!-- claims:end -->`, a whole table) or inline,
`<!-- fig:NAME -->1.5 GiB<!-- /fig -->`; `measured_figures(text)` lists the measured figures
typed anywhere else, and `experiments/tests/test_claims.py` fails on any.

>>> render("fp reaches {{x}}", {"x": "0.698"})
'fp reaches 0.698'
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from experiments.gpu import figures as gpu_figures
from experiments.lib import claims_figures, docs_figures
from experiments.lib.claims_figures import PAPER

__all__ = [
  "RESULTS",
  "TEMPLATE",
  "README",
  "PAGES",
  "PAPER",
  "figures",
  "render",
  "placeholders",
  "typed_figures",
  "measured_figures",
  "hand_written",
  "readme_section",
  "render_blocks",
  "stale",
  "main",
]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
TEMPLATE = ROOT / "experiments" / "results_template.md"
README = ROOT / "README.md"
# Generated docs pages: the page -> its template (the whole page is generated).
PAGES = {
  ROOT / "docs" / "results.md": ROOT / "experiments" / "results_page_template.md",
}
# A generated block inside a hand-written docs page: `<!-- claims:NAME -->`, the rendered
# `{{NAME}}`, `<!-- claims:end -->` (the prose around it is typed by hand).
_BLOCK = re.compile(
  r"^([ \t]*)(<!-- claims:([A-Za-z0-9_.\-]+) -->\n)(.*?)^([ \t]*<!-- claims:end -->)", re.S | re.M
)
DOCS = ROOT / "docs"
GPU_README = RESULTS / "gpu" / "README.md"
# An inline generated figure in a hand-written page: `<!-- fig:NAME -->VALUE<!-- /fig -->`.
_INLINE = re.compile(r"(<!-- fig:([A-Za-z0-9_.\-]+) -->)(.*?)(<!-- /fig -->)", re.S)
# Parts of a hand-written page that hold no typed figure: generated regions (blocks, inline
# figures, the README's Results and frontier lines), code, link targets.
_NOT_PROSE = [
  re.compile(r"<!-- claims:[\w.\-]+ -->.*?<!-- claims:end -->", re.S),
  re.compile(r"<!-- results:begin -->.*?<!-- results:end -->", re.S),
  re.compile(r"<!-- frontier:begin -->.*?<!-- frontier:end -->", re.S),
  _INLINE,
  re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1", re.S | re.M),  # fenced code
  re.compile(r"`[^`\n]*`"),  # inline code: API arguments, commands
  re.compile(r"\]\([^)\s]*\)"),  # link targets
]
# Versions are not measurements: a dotted number after a package's name, or any x.y.z.
_VERSION = re.compile(
  r"(?i)\b(?:c?python|jax(?:lib)?|flax|triton|jax-triton|numpy|optax|orbax-checkpoint|cuda|apache)"
  r"[\s-]*"
  r"(?:[<>=]=?\s*)?\d+(?:\.\d+)+(?:\.x)?(?:\s*[-–]\s*\d+(?:\.\d+)+(?:\.x)?)?"
  r"|\b\d+\.\d+\.\d+\b"
)
_NUMBER = r"\d+(?:\.\d+)?"
_UNIT = r"(?:\s?(?:[KMGT]i?B(?:/s)?|kB|B/s|[nµm]?s|CPU-s|min(?:utes?)?|hours?|%)|x|×)"
# A measured figure: a number (or range, or slashed list of numbers) with a unit of bytes, time,
# ratio or percent; a decimal fraction or a number in e-notation; a test count.
_MEASURED = re.compile(
  rf"(?<![\w.\-/])(?:{_NUMBER}(?:\s?[-–/]\s?{_NUMBER})*{_UNIT}(?![\w/])"
  r"|\d+(?:\.\d+)?e[-+]?\d+(?![\w.])"
  r"|\d+\.\d+(?![\w.])"
  r"|\d+ (?:tests|passed)\b)"
)
# Section numbers of a paper are not measurements.
_SECTION = re.compile(r"(?:Sec\.|§|Table|Eq\.|Fig\.|Section|Appendix)\s*\d+(?:\.\d+)*")
# Typed on purpose, not measured (page -> phrases; "" for every page): constants, datasheet
# figures, sizes a script is run at.
NOT_MEASURED = {
  "": ["3.39e38", "3.4e38", "1e-30"],  # the largest bfloat16 and float32, a floor of a step
  "frontier.md": ["80 GB at 3.35 TB/s", "141 GB at 4.8 TB/s"],
  "platforms.md": ["50 MB L2", "141 GB at 4.8 TB/s"],
  "kernels.md": ["1 MB to 1 GB"],
  "fit.md": ['"my step needs 70 GiB'],  # a user's words, not a step anyone measured
  # what a test is designed to detect, its tolerance, the rates it runs at and the bound it asserts
  "guarantees.md": [
    "a bias of 1 % of a rounding step",
    "relative < 1e-5 tested",
    "rates 0, 0.1 and 0.5",
    "within 20 % of its saving",
  ],
  "distributed.md": [
    "within 1% of Flax's (the test's bound)",
    "within 5% at 8 bits (the test's bound)",
  ],
}
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
_PLACEHOLDER = re.compile(r"\{\{([A-Za-z0-9_.\-:]+)\}\}")
# A typed figure: a decimal, a ratio ("3.4x", "20x") or a percentage.
_TYPED = re.compile(r"(?<![\w.])(\d+\.\d+|\d+(?:\.\d+)?x|\d+(?:\.\d+)?\s?%)(?![\w])")


def figures(results: Path = RESULTS) -> dict[str, str]:
  """name -> the figure as the prose shows it, computed from the results under `results`."""
  path = str(Path(results).resolve())
  out = dict(claims_figures.compute(path))
  out.update(docs_figures.compute(path))
  out.update(gpu_figures.compute(path))
  return out


def hand_written() -> list[Path]:
  """The hand-written pages: README.md, docs/**/*.md (but the generated pages), the GPU READMEs."""
  docs = [p for p in sorted(DOCS.rglob("*.md")) if p not in PAGES and "_build" not in p.parts]
  return [README, *docs, GPU_README, ROOT / "experiments" / "gpu" / "README.md"]


def measured_figures(text: str, page: str = "") -> list[str]:
  """Measured figures typed into a hand-written page instead of generated.

  Counted: a number, range or slashed list with a unit of bytes, time, ratio or percent, a
  decimal fraction, a number in e-notation, a test count. Not counted: generated blocks and
  inline figures, code, link targets, versions, a paper's section numbers, and the phrases
  `NOT_MEASURED` lists for every page ("") and for `page` (a file name).

  >>> measured_figures("2 bits: 1.2x less, 45-70 ms, 0.17 / 2.7 / 14 %, 12 MiB, 0.698, 9 tests")
  ['1.2x', '45-70 ms', '0.17 / 2.7 / 14 %', '12 MiB', '0.698', '9 tests']
  >>> measured_figures("variance 6.8e-5 vs 7.2e-4")
  ['6.8e-5', '7.2e-4']
  >>> measured_figures("jax 0.10.2, Python 3.11-3.13, 8x8 blocks, `40 * 2**30`, Apache-2.0")
  []
  >>> measured_figures("a peak of <!-- fig:x.y -->1.5 GiB<!-- /fig --> at 8 bits")
  []
  """
  for pattern in _NOT_PROSE:
    text = pattern.sub(" ", text)
  for phrase in NOT_MEASURED[""] + NOT_MEASURED.get(page, []):
    text = text.replace(phrase, " ")
  return _MEASURED.findall(_SECTION.sub(" ", _VERSION.sub(" ", text)))


def placeholders(text: str) -> list[str]:
  """The figure names a template quotes."""
  return _PLACEHOLDER.findall(text)


def render(text: str, values: dict[str, str] | None = None) -> str:
  """`text` with every `{{name}}` replaced by its figure (KeyError names a missing one)."""
  values = figures() if values is None else values
  missing = [n for n in placeholders(text) if n not in values]
  if missing:
    raise KeyError(
      f"no figure for {missing}: add it to experiments/lib/claims_figures.py or run the "
      "experiment that writes it"
    )
  return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def typed_figures(text: str) -> list[str]:
  """Figures typed into a template instead of quoted (`{{name}}`): decimals, ratios, percents.

  >>> typed_figures("fp {{a.b}} vs 0.698, 20.6x less, 3 epochs, 8x8 blocks")
  ['0.698', '20.6x']
  """
  return _TYPED.findall(_PLACEHOLDER.sub("", text))


def readme_section(readme: str) -> tuple[int, int]:
  """(start, end) offsets of the generated part of the README's Results."""
  start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
  return start, end


def _rendered() -> dict[Path, str]:
  """Every generated file -> its full text as rendered from the committed data."""
  readme = README.read_text()
  start, end = readme_section(readme)
  values = figures()
  out = {README: readme[:start] + "\n" + render(TEMPLATE.read_text(), values) + "\n" + readme[end:]}
  for page, template in PAGES.items():
    out[page] = render(template.read_text(), values)
  for page in hand_written():
    text = out.get(page, page.read_text() if page.exists() else "")
    if _BLOCK.search(text) or _INLINE.search(text):
      out[page] = render_blocks(text, values)
  return out


def render_blocks(text: str, values: dict[str, str] | None = None) -> str:
  """`text` with each generated block (`<!-- claims:NAME -->` ... `<!-- claims:end -->`) and
  each inline figure (`<!-- fig:NAME -->` ... `<!-- /fig -->`) filled.

  >>> render_blocks("a\\n<!-- claims:x -->\\nold\\n<!-- claims:end -->\\nb", {"x": "new"})
  'a\\n<!-- claims:x -->\\nnew\\n<!-- claims:end -->\\nb'
  >>> render_blocks("peak <!-- fig:x -->old<!-- /fig -->", {"x": "1.5 GiB"})
  'peak <!-- fig:x -->1.5 GiB<!-- /fig -->'
  """
  values = figures() if values is None else values

  def fill(m):  # the block keeps its indentation (a table inside a list item)
    indent = m.group(1)
    body = render("{{" + m.group(3) + "}}", values)
    return (
      indent + m.group(2) + "".join(indent + line + "\n" for line in body.split("\n")) + m.group(5)
    )

  text = _BLOCK.sub(fill, text)
  return _INLINE.sub(
    lambda m: m.group(1) + render("{{" + m.group(2) + "}}", values) + m.group(4), text
  )


def stale() -> list[str]:
  """The generated files whose text differs from what the data renders (repo-relative)."""
  return [
    str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    for path, text in _rendered().items()
    if not path.exists() or path.read_text() != text
  ]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(
    prog="python -m experiments.claims", description=__doc__.split("\n")[0]
  )
  p.add_argument(
    "--check",
    action="store_true",
    help="only say whether the README and the generated pages are up to date",
  )
  a = p.parse_args(argv)
  if a.check:
    old = stale()
    raise SystemExit(f"stale: {', '.join(old)}: run python -m experiments.claims" if old else 0)
  for path, text in _rendered().items():
    path.write_text(text)


if __name__ == "__main__":
  main()
