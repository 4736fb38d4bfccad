"""The code passes the lint rules configured in pyproject.toml ([tool.ruff]).

The rules catch mistakes rather than style: undefined names and `__all__`
entries, unused imports and variables, bare excepts, mutable defaults. Ruff
runs in a subprocess so its whole report lands in the failure message.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_reports_nothing():
  run = subprocess.run(
      [sys.executable, "-m", "ruff", "check", "--no-cache", "jact", "tests", "experiments"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  if run.returncode != 0:
    pytest.fail(
        f"`ruff check jact tests experiments` failed (exit {run.returncode}): fix what it reports "
        "below (`ruff check --fix FILE` fixes some); without ruff, `pip install -e '.[test]'`.\n"
        + run.stdout + run.stderr, pytrace=False)
