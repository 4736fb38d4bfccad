"""The one record of how a result was measured: command, date, versions, device and commit.

Every experiment stores `run_metadata(module, argv, **extra)` as its JSON's "meta"; `extra`
holds the settings only that experiment has.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys

import jax

from experiments.lib import paths

__all__ = ["git_state", "run_metadata", "versions"]

LIBRARIES = ("jax", "jaxlib", "flax", "optax")


def versions() -> dict:
  """Installed versions of the libraries a measurement depends on (None where absent)."""
  found = {}
  for name in LIBRARIES:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      found[name] = None
  return found


def git_state() -> dict:
  """The checkout's short commit and whether `jact/` differs from it (None outside git)."""

  def git(*args):
    return subprocess.run(
      ["git", *args], capture_output=True, text=True, check=True, cwd=paths.ROOT
    ).stdout.strip()

  try:
    return {
      "git_commit": git("rev-parse", "--short", "HEAD"),
      "jact_tree_modified": bool(git("status", "--porcelain", "--", "jact")),
    }
  except (OSError, subprocess.CalledProcessError):
    return {"git_commit": None, "jact_tree_modified": None}


def run_metadata(module: str, argv=None, **extra) -> dict:
  """Command, date (UTC), versions, device and commit of a run of `python -m module`."""
  args = list(sys.argv[1:] if argv is None else argv)
  device = jax.devices()[0]
  return {
    "command": " ".join(["python -m", module, *map(str, args)]),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    **versions(),
    "backend": jax.default_backend(),
    "device": device.device_kind,
    "device_count": jax.device_count(),
    "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    "cpu_count": os.cpu_count(),
    "python": platform.python_version(),
    **git_state(),
    **extra,
  }
