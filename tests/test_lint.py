"""The code passes the lint rules and the formatter configured in pyproject.toml ([tool.ruff]).

The rules catch mistakes (undefined names and `__all__` entries, unused imports and variables,
bare excepts, mutable defaults) plus line length and blank lines; `ruff format` owns the layout.
Ruff runs in a subprocess so its whole report lands in the failure message.
"""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATHS = ["jact", "tests", "experiments", "notebooks/build.py", "docs/conf.py"]


def test_ruff_check_reports_nothing():
  run = subprocess.run(
    [sys.executable, "-m", "ruff", "check", "--no-cache", *PATHS],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  if run.returncode != 0:
    pytest.fail(
      f"`ruff check {' '.join(PATHS)}` failed (exit {run.returncode}): fix what it reports "
      "below (`ruff check --fix FILE` fixes some); without ruff, `pip install -e '.[test]'`.\n"
      + run.stdout
      + run.stderr,
      pytrace=False,
    )


def test_ruff_format_changes_nothing():
  run = subprocess.run(
    [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *PATHS],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  if run.returncode != 0:
    pytest.fail(
      f"`ruff format --check {' '.join(PATHS)}` would reformat files (exit {run.returncode}): "
      f"run `ruff format FILE` on them.\n" + run.stdout + run.stderr,
      pytrace=False,
    )
