"""Executes every notebook (the experiment notebooks re-run their small versions); any cell
error fails. Also checks that the committed notebooks carry their outputs.

The kernels run with XLA:CPU's quick-compile flags (`memory_batch.FAST_COMPILE_FLAGS`, which
`memory_batch --small` uses for its own steps): they change LLVM's code generation only, not the
programs jact builds, and most of a small live run is compilation (bit_plans --small: 26 -> 17
CPU-s).
"""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
EXPERIMENT_NOTEBOOKS = sorted(p.name for p in NOTEBOOKS.glob("0[2-9]_*.ipynb"))


@pytest.fixture
def quick_compiles(monkeypatch):
  """Kernels started in the test inherit the quick-compile XLA flags."""
  from experiments.lib.fresh_process import FAST_COMPILE_FLAGS

  monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip())


def _execute(path: Path) -> nbformat.NotebookNode:
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(
    nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(path.parent)}}
  )
  try:
    client.execute()  # raises CellExecutionError on the first failing cell
  except CellExecutionError as err:
    if err.ename == "DataKitMissing":
      pytest.skip(f"{path.name} needs the data kit: set JACT_DATA=/path/to/data ({err.evalue})")
    raise
  return nb


def _outputs(nb) -> list:
  return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


@pytest.mark.slow
def test_quickstart_runs(tmp_path, monkeypatch, quick_compiles):
  monkeypatch.setenv("JACT_QUICKSTART_SMALL", "1")
  monkeypatch.setenv("JACT_FIGURE_DIR", str(tmp_path / "figures"))
  monkeypatch.setenv("JACT_DATA", str(tmp_path))  # the comparison uses the bundled digits
  nb = _execute(NOTEBOOKS / "01_quickstart.ipynb")
  outputs = "".join(o.get("text", "") for o in _outputs(nb))
  assert "small settings" in outputs
  assert "same outputs: True" in outputs
  assert "jact2" in outputs  # the comparison table was printed
  figure = tmp_path / "figures" / "quickstart_memory.png"
  assert figure.is_file() and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_there_are_experiment_notebooks():
  assert {n[:2] for n in EXPERIMENT_NOTEBOOKS} >= {"02", "03", "04", "05", "06"}


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENT_NOTEBOOKS)
def test_experiment_notebook_runs(name, quick_compiles):
  nb = _execute(NOTEBOOKS / name)
  assert not any(o.get("output_type") == "error" for o in _outputs(nb))
  assert any("image/png" in o.get("data", {}) for o in _outputs(nb)), "no figure was drawn"


@pytest.mark.parametrize("name", ["01_quickstart.ipynb", *EXPERIMENT_NOTEBOOKS])
def test_committed_with_outputs(name):
  """A reader who never runs the notebook sees its results: every code cell has outputs,
  at least one is a figure, and none is an error."""
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  silent = [
    c.source.splitlines()[0]
    for c in code
    if not c.get("outputs") and not c.source.lstrip().startswith(("import", "from", "#"))
  ]
  assert not silent, f"{name}: cells committed without outputs: {silent}"
  assert any("image/png" in o.get("data", {}) for o in _outputs(nb)), f"{name}: no figure"
  assert not any(o.get("output_type") == "error" for o in _outputs(nb)), f"{name}: error output"
