"""The GPU campaign's extras on an offline GPU machine: install the bundled wheels it needs.

The GPU machines have jax, flax and triton but no network, and start bare at every call: the
jax-triton kernels (jact's primary Triton path) need the `jax_triton` package, which
`scripts/gpu_bundle.sh` puts in `gpu_data/wheels/` beside the working tree. A shell line run
before the campaign installed it in the first H200 session; the second session's calls did
not run it, and every jax-triton row failed with an ImportError. The campaign and
`kernel_diff` now install what is missing themselves, into the interpreter that runs them.

    python -m experiments.gpu.extras [WHEELS_DIR]     # what it would install, and installs it
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["EXTRAS", "wheels_dir", "ensure_extras"]

EXTRAS = {"jax_triton": "jax_triton-*.whl", "PIL": "pillow-*.whl"}
"""module -> the wheel (glob) that provides it in the bundle's `wheels/` folder."""


def wheels_dir() -> Path:
  """`$JACT_DATA/wheels` (the campaign runs with JACT_DATA=gpu_data), else ./gpu_data/wheels."""
  return Path(os.environ.get("JACT_DATA", "gpu_data")) / "wheels"


def ensure_extras(wheels: Path | None = None, modules=tuple(EXTRAS)) -> dict[str, str]:
  """Installs, with this interpreter's pip and no index, the bundled wheel of each of
  `modules` that does not import; returns module -> "present", "installed", "no wheel in
  DIR" or "failed: <pip's last line>". Never raises: a missing extra costs its rows only,
  and each row says why."""
  wheels = wheels_dir() if wheels is None else Path(wheels)
  status = {}
  for module in modules:
    if importlib.util.find_spec(module) is not None:
      status[module] = "present"
      continue
    found = sorted(wheels.glob(EXTRAS[module]))
    if not found:
      status[module] = f"no wheel in {wheels}"
      continue
    run = subprocess.run(
      [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--quiet",
        str(found[-1]),
      ],
      capture_output=True,
      text=True,
      check=False,
    )
    importlib.invalidate_caches()
    if run.returncode == 0 and importlib.util.find_spec(module) is not None:
      status[module] = "installed"
    else:
      last = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
      status[module] = f"failed: {last[0]}"
  return status


if __name__ == "__main__":
  print(ensure_extras(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
