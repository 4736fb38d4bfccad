"""`experiments.papers.l3_joint --small` on the real CIFAR-10 kit (one stage).

Checked: every plan has a finite positive variance; the adaptive plans spend
at most the 2-bit budget (average bits) and store the same bytes as uniform
2 bits within 0.1% (one width byte per sample is PerSample's only extra); the
L3 plan's widths come from 1..8 and its per-sample entries are PerSample at
ActNN's widths; the result file is written.
"""

import json
import math

import pytest

from experiments.papers import l3_joint

pytestmark = pytest.mark.slow  # compiles the ResNet's gradient per plan


def test_small_run(tmp_path):
  result = l3_joint.main(["--small", "--widths", "8", "--seed", "3", "--results", str(tmp_path)])
  rows = {r["method"]: r for r in result["checkpoints"]["0"]}
  assert set(rows) == {"sampling", "uniform2", "actnn_l3", "actnn_l3_1248", "actnn_l25"}
  assert all(math.isfinite(r["variance"]) and r["variance"] > 0 for r in rows.values())
  for name in ("actnn_l3", "actnn_l3_1248", "actnn_l25"):
    assert rows[name]["avg_bits"] <= 2.0 + 1e-9
    assert rows[name]["bytes_over_uniform2"] == pytest.approx(1.0, abs=1e-3)
  entries = rows["actnn_l3"]["plan"]["bits"].values()
  assert all(e["method"] == "per_sample" and e["widths"] == list(range(1, 9)) for e in entries)
  written = json.loads((tmp_path / "l3_joint_small_seed3.json").read_text())
  assert written["complete"] and written["seed"] == 3
