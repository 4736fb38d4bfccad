"""`experiments.bench.summary`: the README's key table and plots from result JSON.

Synthetic result files in the shape the experiment CLIs write (a complete fp
run, a variant still running, one GACT task); checked: a row per variant and
task, fp's bytes over each variant's, running and missing runs said as such,
both plots written.
"""

import json

from experiments.bench import summary
from experiments.lib import summary_table

MIB = 2**20


def _actnn(name, history, complete, saved=None, bits=None):
  result = dict(
    variant=name,
    epochs=3,
    batch_size=128,
    train_size=50000,
    complete=complete,
    history=[dict(epoch=e, step=390 * e, test_accuracy=a) for e, a in history],
  )
  if complete:
    result.update(
      final_test_accuracy=history[-1][1], memory=dict(saved_bytes=saved, temp_bytes=saved // 2)
    )
    if bits is not None:
      result["final_average_bits"] = bits
  return result


def _gact_variant(saved, accuracy, bits=None):
  return dict(
    best_by="accuracy",
    best=dict(accuracy=accuracy),
    final=dict(accuracy=accuracy),
    steps=200,
    saved_bytes=saved,
    temp_bytes=2 * saved,
    average_bits=bits,
  )


def test_table_and_plots(tmp_path):
  (tmp_path / "actnn_cifar").mkdir()
  (tmp_path / "gact").mkdir()
  runs = {
    "fp": _actnn("fp", [(1, 0.5), (2, 0.6), (3, 0.7)], True, saved=480 * MIB),
    "actnn_l3": _actnn(
      "actnn_l3", [(1, 0.55), (2, 0.65), (3, 0.69)], True, saved=30 * MIB, bits=2.0
    ),
    "blpa2": _actnn("blpa2", [(1, 0.4)], False),
  }
  for name, result in runs.items():
    (tmp_path / "actnn_cifar" / f"{name}.json").write_text(json.dumps(result))
  cora = dict(
    variants={"fp": _gact_variant(8 * MIB, 0.8), "adaptive2": _gact_variant(MIB, 0.79, bits=2.0)}
  )
  (tmp_path / "gact" / "cora_gat.json").write_text(json.dumps(cora))

  table = summary.main(["--results", str(tmp_path)]).splitlines()
  rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in table[2:]}
  assert len(rows) == len(summary_table.ACTNN_VARIANTS) + 3 + 2  # 3 GACT tasks not run, Cora GAT x2
  l3 = rows[(summary_table.ACTNN_TASK, "actnn_l3")]
  assert "**0.690**" in l3 and "30.0 MiB" in l3 and "16.0x" in l3 and "2.00" in l3
  assert "after epoch 1/3 (running)" in rows[(summary_table.ACTNN_TASK, "blpa2")]
  assert "not run yet" in rows[(summary_table.ACTNN_TASK, "division")]
  assert (
    "8.0x" in rows[("Cora, GAT", "adaptive2")] and "**0.790**" in rows[("Cora, GAT", "adaptive2")]
  )
  assert "not run yet" in rows[("SST-2, transformer classifier", "all")]
  assert (tmp_path / "summary.md").read_text().splitlines() == table
  for png in ("summary_accuracy.png", "summary_tradeoff.png"):
    assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
