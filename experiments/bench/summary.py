"""The README's key results: accuracy and memory per method per task, as a table and two plots.

Reads the committed full-run results of `experiments.papers.actnn_cifar` and
`experiments.papers.gact_tasks` (whatever exists: a variant still running shows its
last epoch, one not run yet says so) and writes

* the markdown table (printed, and `summary.md`),
* `summary_accuracy.png`: the ResNet-20's test accuracy after each epoch per variant,
* `summary_tradeoff.png`: every task's final held-out metric (test accuracy where
  there is a test split, else the LM's held-out loss) against the bytes its
  variants save for the backward pass, relative to fp,

under `experiments/results/`, each plot titled with its scale and hardware.

    python -m experiments.bench.summary
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.lib import notebook_support as support
from experiments.lib import paths, summary_table

__all__ = ["accuracy_plot", "tradeoff_plot", "main"]

RESULTS = paths.RESULTS


def accuracy_plot(actnn_runs: dict, path: Path):
  """ResNet-20 test accuracy by epoch, per variant, titled with scale and hardware."""
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  ax = support.accuracy_curves(actnn_runs, summary_table.ACTNN_VARIANTS, title="")
  fp = actnn_runs.get("fp") or {}
  scale = (
    f"{fp.get('train_size', 50000)} images, batch {fp.get('batch_size', 128)}, "
    f"{fp.get('epochs', 3)} epochs"
  )
  ax.set_title(
    f"{summary_table.ACTNN_TASK}: test accuracy by variant\n{scale}, {summary_table.HARDWARE}",
    fontsize=9,
  )
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.figure.tight_layout()
  ax.figure.savefig(path, dpi=110)
  plt.close(ax.figure)
  return path


def _limits(values, fp_value, min_span):
  """y limits holding every value and spanning at least `min_span` (so that a
  difference of a few thousandths does not fill the panel)."""
  lo, hi = min(values + [fp_value]), max(values + [fp_value])
  pad = max(0.0, min_span - (hi - lo)) / 2
  return lo - pad - 0.05 * min_span, hi + pad + 0.05 * min_span


def tradeoff_plot(actnn_runs: dict, gact_tasks: dict, path: Path):
  """Held-out metric against bytes saved for backward (relative to fp), one panel per task;
  accuracy panels span at least 10 points, loss panels 10% of fp's loss."""
  import matplotlib.pyplot as plt
  from matplotlib.ticker import LogLocator, NullFormatter

  panels = []
  fp = actnn_runs.get("fp") or {}
  points = [
    (name, r["memory"]["saved_bytes"], r["final_test_accuracy"])
    for name, r in actnn_runs.items()
    if r.get("complete") and "memory" in r
  ]
  if "memory" in fp and points:
    panels.append(
      (
        f"{summary_table.ACTNN_TASK}\n{fp['epochs']} epochs of {fp['train_size']}",
        "test accuracy",
        fp["memory"]["saved_bytes"],
        fp["final_test_accuracy"],
        points,
      )
    )
  for task, title in summary_table.GACT_TASKS.items():
    result = gact_tasks.get(task)
    if result is None or "fp" not in result["variants"]:
      continue
    variants = result["variants"]
    metric = summary_table.metric_text(variants["fp"])
    points = [
      (name, v["saved_bytes"], v["final"][metric])
      for name, v in variants.items()
      if metric in v["final"]
    ]
    unit = "epochs" if task.startswith("cora") else "steps"
    panels.append(
      (
        f"{title}\n{variants['fp']['steps']} {unit}",
        metric.replace("_", " "),
        variants["fp"]["saved_bytes"],
        variants["fp"]["final"][metric],
        points,
      )
    )
  columns = min(max(len(panels), 1), 3)
  rows = max(1, -(-len(panels) // columns))
  fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.2 * rows), squeeze=False)
  flat = list(axes.flat)
  for ax in flat[len(panels) :]:
    ax.set_axis_off()
  if not panels:
    flat[0].text(0.5, 0.5, "no full-run results yet", ha="center", transform=flat[0].transAxes)
  for ax, (title, ylabel, fp_bytes, fp_value, points) in zip(flat, panels):
    for name, saved, value in points:
      ax.scatter(saved / fp_bytes, value)
      ax.annotate(
        name, (saved / fp_bytes, value), fontsize=7, xytext=(3, 2), textcoords="offset points"
      )
    ax.axhline(fp_value, color="0.6", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(
      *_limits([v for _, _, v in points], fp_value, 0.1 if "accuracy" in ylabel else 0.1 * fp_value)
    )
    ax.set(xlabel="saved for backward / fp", ylabel=ylabel)
    ax.set_title(title, fontsize=8)
  fig.suptitle(
    "Held-out metric vs memory kept for the backward pass (dotted: fp); "
    f"full runs on a {summary_table.HARDWARE}",
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv=None) -> str:
  p = argparse.ArgumentParser(
    prog="python -m experiments.bench.summary", description=__doc__.split("\n")[0]
  )
  p.add_argument("--results", type=Path, default=RESULTS)
  a = p.parse_args(argv)
  import matplotlib

  matplotlib.use("Agg")  # files only (the plot functions themselves leave a notebook's backend)
  actnn_runs = support.load_variants(a.results / "actnn_cifar")
  gact_tasks = support.load_variants(a.results / "gact")
  table = summary_table.key_table(
    actnn_runs, gact_tasks, summary_table.layer_input_bytes(a.results)
  )
  (a.results / "summary.md").write_text(table + "\n")
  accuracy_plot(actnn_runs, a.results / "summary_accuracy.png")
  tradeoff_plot(actnn_runs, gact_tasks, a.results / "summary_tradeoff.png")
  print(table)
  return table


if __name__ == "__main__":
  main()
