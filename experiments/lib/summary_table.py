"""The README's key table (every paper's method: task, metric, saved bytes and their ratio),
built from the results JSON for `experiments.bench.summary` and `experiments.claims`.

>>> print(key_table({}, {}).splitlines()[2])
| CIFAR-10, pre-act ResNet-20 | fp | not run yet |  |  |  |  |  |
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.lib import notebook_support as support
from experiments.lib import paths

__all__ = ["ACTNN_VARIANTS", "GACT_TASKS", "key_table", "layer_input_bytes"]

RESULTS = paths.RESULTS
ACTNN_VARIANTS = [
  "fp",
  "actnn_l2",
  "pergroup2",
  "actnn_l3",
  "blpa4",
  "blpa2",
  "division",
  "acgc",
  "acgc_scale",
]
GACT_TASKS = {
  "sst2": "SST-2, transformer classifier",
  "shakespeare": "tiny Shakespeare, char LM",
  "cora_gcn": "Cora, GCN",
  "cora_gat": "Cora, GAT",
}
ACTNN_TASK = "CIFAR-10, pre-act ResNet-20"
HARDWARE = "2-core x86 CPU (XLA:CPU)"


def _ratio(saved, fp_saved) -> str:
  return "" if saved is None or not fp_saved else f"{fp_saved / saved:.1f}x"


def _actnn_rows(runs: dict, layer_bytes: int | None = None) -> list:
  fp_saved = (runs.get("fp") or {}).get("memory", {}).get("saved_bytes")
  rows = []
  for name in ACTNN_VARIANTS:
    r = runs.get(name)
    if r is None:
      rows.append([ACTNN_TASK, name, "not run yet", "", "", "", "", ""])
      continue
    memory = r.get("memory", {})
    if r["complete"]:
      metric = f"test accuracy **{r['final_test_accuracy']:.3f}**"
    elif r["history"]:
      last = r["history"][-1]
      metric = (
        f"test accuracy {last['test_accuracy']:.3f} "
        f"after epoch {last['epoch']}/{r['epochs']} (running)"
      )
    else:
      metric = "running"
    bits = r.get("final_average_bits")
    rows.append(
      [
        ACTNN_TASK,
        name,
        metric,
        support.mib(memory.get("saved_bytes")),
        _ratio(memory.get("saved_bytes"), fp_saved),
        _ratio(memory.get("saved_bytes"), layer_bytes),
        support.mib(memory.get("temp_bytes")),
        "" if bits is None else f"{bits:.2f}",
      ]
    )
  return rows


def metric_text(variant: dict) -> str:
  """The held-out figure shown: test accuracy where the task has a test split, else the
  metric the task selects by (the LM's held-out loss)."""
  return "test_accuracy" if "test_accuracy" in variant["final"] else variant["best_by"]


def _gact_rows(tasks: dict) -> list:
  rows = []
  for task, title in GACT_TASKS.items():
    result = tasks.get(task)
    if result is None:
      rows.append([title, "all", "not run yet", "", "", "", "", ""])
      continue
    variants = result["variants"]
    fp_saved = variants.get("fp", {}).get("saved_bytes")
    for name, v in variants.items():
      metric = metric_text(v)
      final = v["final"].get(metric)
      label = metric.replace("_", " ")
      shown = (
        f"{label} **{final:.3f}**" if final is not None else f"best {label} {v['best'][metric]:.3f}"
      )
      bits = v["average_bits"]
      rows.append(
        [
          title,
          name,
          shown,
          support.mib(v["saved_bytes"]),
          _ratio(v["saved_bytes"], fp_saved),
          "",
          support.mib(v["temp_bytes"]),
          "" if bits is None else f"{bits:.2f}",
        ]
      )
  return rows


def key_table(actnn_runs: dict, gact_tasks: dict, layer_bytes: int | None = None) -> str:
  """One row per task and method: final held-out metric, bytes saved for backward
  (plain JAX's over them, and -- the papers' baseline, ResNet-20 -- one float32 copy
  per layer input, `layer_bytes`, over them), the train step's compiled temp, average
  bits of adaptive plans."""
  return support.markdown_table(
    [
      "task",
      "method",
      "final held-out metric",
      "saved for backward",
      "fp / saved",
      "f32 layer inputs / saved",
      "compiled temp",
      "avg bits",
    ],
    _actnn_rows(actnn_runs, layer_bytes) + _gact_rows(gact_tasks),
  )


def layer_input_bytes(results: Path = RESULTS) -> int | None:
  """The papers' ResNet-20 baseline (`experiments.papers.memory_accounting`), if measured."""
  path = Path(results) / "memory_accounting.json"
  return json.loads(path.read_text())["float32_layer_input_bytes"] if path.exists() else None
