"""Executes the quickstart notebook with small settings; any cell error fails."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_runs(tmp_path, monkeypatch):
  monkeypatch.setenv("JACT_QUICKSTART_SMALL", "1")
  monkeypatch.setenv("JACT_FIGURE_DIR", str(tmp_path / "figures"))
  monkeypatch.setenv("JACT_DATA", str(tmp_path))  # the comparison uses the bundled digits
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = NotebookClient(nb, kernel_name="python3", timeout=300,
                          resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()  # raises CellExecutionError on the first failing cell

  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "small settings" in outputs
  assert "same outputs: True" in outputs
  assert "jact2" in outputs  # the comparison table was printed
  figure = tmp_path / "figures" / "quickstart_memory.png"
  assert figure.is_file() and figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
