#!/usr/bin/env bash
# The library's tests from an installed wheel, without the checkout (no experiments/, no
# jact/ sources): builds a wheel, installs it in a fresh venv that borrows this machine's
# packages (jax, flax, pytest: --system-site-packages, no network needed for them), copies
# tests/ alone to a temporary folder and runs a quick selection of it there.
#
# Usage: scripts/test_from_wheel.sh [pytest arguments...]
#   default arguments: the quick subset (-m "not slow") of tests/ but the checkout's own
#   checks (docs, lint, layout: they read the repository's files), stopping at the first
#   failure.
# Prints the installed jact's path (it must be the venv's, not the editable checkout).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
trap 'exit 143' TERM INT  # so that EXIT's clean-up runs when stopped

"$python" -m pip wheel "$repo" --no-deps -q -w "$work/dist"
wheel=$(ls "$work"/dist/jact-*.whl)
"$python" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for data in ("jact/py.typed", "jact/_gpu_targets/", "jact/_gpu_targets/h200.pbtxt"):
  if not any(n.startswith(data) for n in names):
    sys.exit(f"the wheel lacks {data}: check [tool.setuptools.package-data] in pyproject.toml")
PY

"$python" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install -q --no-deps --ignore-installed "$wheel"

cp -r "$repo/tests" "$work/tests"
find "$work/tests" -name __pycache__ -prune -exec rm -rf {} +
# The suite's pytest settings (pyproject.toml stays behind with the checkout).
cat > "$work/pytest.ini" <<'INI'
[pytest]
addopts = -ra --strict-markers -p no:cacheprovider
markers =
  slow: over ~2 s of one CPU core per test function
INI

cd "$work"
"$work/venv/bin/python" - <<'PY'
import pathlib, sys
import jact
where = pathlib.Path(jact.__file__).resolve()
print(f"jact {jact.__version__} from {where}")
if not str(where).startswith(sys.prefix):
  sys.exit(f"jact comes from {where}, not the venv's wheel ({sys.prefix})")
for name in ("experiments",):
  try:
    __import__(name)
  except ImportError:
    continue
  sys.exit(f"{name} is importable here: the run would not show the tests do without it")
PY

if [ $# -eq 0 ]; then
  set -- tests -m "not slow" -x -q -n 0 \
    --ignore=tests/test_docs.py --ignore=tests/test_lint.py --ignore=tests/test_layout.py
fi
"$work/venv/bin/python" -m pytest "$@"
