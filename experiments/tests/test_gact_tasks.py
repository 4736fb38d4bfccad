"""`experiments.papers.gact_tasks --small` end to end on the real data kit: the LM (jact.convert,
fp, GACT CB1 and adaptive 2 bits) and the GAT (jact.compressed, fp and adaptive 2 bits). The other
variants
(L1, fixed bits) and tasks (the SST-2 transformer, the GCN, also run in notebook 03) take the
same code paths; every task and variant: `python -m experiments.papers.gact_tasks --small` (a few
minutes: each adaptive variant compiles the numeric estimator, so CI runs one per task).

Properties checked: one JSON per task with the run's metadata; every variant
present with finite losses; the same first loss in every variant of a task
(same initial parameters and first batch, and jact's forward pass is exact);
every compressed variant saves under half the bytes fp saves for the backward
pass; adaptive plans keep within their average-bit budget.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from experiments.papers import gact_tasks

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # compiles a jact train step and an estimator per variant

BUDGET = {"gact_l1": 4.0, "gact_cb1": 4.0, "adaptive2": 2.0}
TESTED = ["shakespeare", "cora_gat"]
TESTED_VARIANTS = ["fp", "gact_cb1", "adaptive2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """The run as a user starts it, in its own process with XLA:CPU's quick-compile flags (LLVM
  code generation only; the run is mostly compilation: 54 -> 43 CPU-s measured); the results
  are its JSON files, one per task found."""
  from experiments.lib.fresh_process import FAST_COMPILE_FLAGS

  out = tmp_path_factory.mktemp("gact")
  env = dict(
    os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
  )
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.papers.gact_tasks",
      "--small",
      "--quiet",
      "--tasks",
      *TESTED,
      "--variants",
      *TESTED_VARIANTS,
      "--results",
      str(out),
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  results = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
  return results, out


def test_one_json_per_task_with_metadata(run):
  results, out = run
  assert sorted(results) == sorted(TESTED)
  for task in TESTED:
    written = json.loads((out / f"{task}.json").read_text())
    assert written["task"] == task and written["meta"]["small"] is True
    assert written["meta"]["command"].startswith("python -m experiments.papers.gact_tasks")
    assert "--small" in written["meta"]["command"]
    expected = [v for v in gact_tasks.VARIANTS[task] if v in TESTED_VARIANTS]
    assert list(written["variants"]) == expected and len(expected) >= 2


def test_losses_finite_and_same_start(run):
  results, _ = run
  for task, result in results.items():
    records = result["variants"].values()
    for r in records:
      assert r["finite"] and r["steps"] == gact_tasks.SMALL[task]["steps"], (task, r["variant"])
      assert all(math.isfinite(point["loss"]) for point in r["losses"])
      assert r["best"] is not None and r["final"] is not None
    first = [r["first_loss"] for r in records]
    assert max(first) - min(first) <= 1e-5 * abs(first[0]), (task, first)


def test_compressed_variants_save_fewer_bytes(run):
  results, _ = run
  for task, result in results.items():
    variants = result["variants"]
    fp = variants["fp"]["saved_bytes"]
    for name, r in variants.items():
      assert r["temp_bytes"] > 0 and r["median_step_s"] > 0
      if name != "fp":
        assert r["saved_bytes"] < fp / 2, (task, name, r["saved_bytes"], fp)


def test_adaptive_plans_within_budget(run):
  results, _ = run
  for task, result in results.items():
    for name, r in result["variants"].items():
      if name not in BUDGET:
        assert r["average_bits"] is None and not r["plans"]
        continue
      assert r["plans"] and r["plans"][0]["step"] == 0, (task, name)
      assert 1.0 <= r["average_bits"] <= BUDGET[name] + 1e-9, (task, name, r["average_bits"])
      assert all(p["average_bits"] <= BUDGET[name] + 1e-9 for p in r["plans"])
