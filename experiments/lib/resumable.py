"""Resumable long runs: an atomic orbax checkpoint of (arrays, progress) per run.

A CPU run of an hour or more must survive being stopped: `save` writes the
train state (any pytree of arrays, with orbax) and the progress (JSON) into a
fresh folder and swaps it in with two renames, so a run killed at any moment
leaves either the old or the new checkpoint; `restore` returns None when a run
has none yet.

>>> import tempfile, jax.numpy as jnp
>>> d = tempfile.mkdtemp()
>>> save(d, {"w": jnp.ones(3)}, {"step": 7})
>>> state, progress, _ = restore(d, {"w": jnp.zeros(3)})
>>> progress["step"], float(state["w"].sum())
(7, 3.0)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["save", "restore", "write_json", "earlier_result"]

_CURRENT, _NEW, _OLD = "checkpoint", "checkpoint.new", "checkpoint.old"


def _checkpointer():
  import orbax.checkpoint as ocp

  return ocp.StandardCheckpointer()


def save(directory, state, progress: dict, write_extra=None) -> None:
  """Writes `state` (pytree of arrays) and `progress` (JSON) as the run's checkpoint.

  `write_extra(folder)`, if given, writes more into the checkpoint's folder
  before it is swapped in (e.g. `jact.Controller.save`).
  """
  root = Path(directory).resolve()
  root.mkdir(parents=True, exist_ok=True)
  new, current, old = root / _NEW, root / _CURRENT, root / _OLD
  shutil.rmtree(new, ignore_errors=True)
  new.mkdir()
  with _checkpointer() as ckpt:
    ckpt.save(new / "state", state)
    ckpt.wait_until_finished()
  if write_extra is not None:
    write_extra(new)
  (new / "progress.json").write_text(json.dumps(progress))
  shutil.rmtree(old, ignore_errors=True)
  if current.exists():
    current.rename(old)
  new.rename(current)
  shutil.rmtree(old, ignore_errors=True)


def restore(directory, like):
  """(state shaped like `like`, progress, folder) of the run's checkpoint, or None."""
  root = Path(directory).resolve()
  for name in (_CURRENT, _OLD):  # a run killed between the two renames left only .old
    path = root / name
    if (path / "progress.json").exists():
      with _checkpointer() as ckpt:
        state = ckpt.restore(path / "state", like)
      return state, json.loads((path / "progress.json").read_text()), path
  return None


def write_json(path, payload: dict) -> None:
  """Writes `payload` to `path` atomically (a reader never sees half a file)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text(json.dumps(payload, indent=1))
  tmp.replace(path)


def earlier_result(path, same_settings, fresh: bool = False, log=print) -> dict | None:
  """The results JSON a previous run wrote at `path`, for a rerun to keep what
  it measured: None when `fresh`, when there is none, or when
  `same_settings(earlier)` is false (it was measured otherwise)."""
  path = Path(path)
  if fresh or not path.is_file():
    return None
  earlier = json.loads(path.read_text())
  if not same_settings(earlier):
    log(f"{path} was measured with other settings: measuring again")
    return None
  return earlier
