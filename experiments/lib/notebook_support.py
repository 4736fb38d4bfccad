"""Tables and plots of committed experiment results, for the notebooks and the README.

Every function reads result JSON written by an experiment CLI and tolerates
missing or partial results (a variant still running, a run not made yet): it
says what is missing instead of failing, so a notebook renders at any stage.

>>> print(actnn_table({}, ["fp"]))  # doctest: +NORMALIZE_WHITESPACE
| variant | epochs | test accuracy by epoch | final | saved for backward | compiled temp | avg bits |
|---|---|---|---|---|---|---|
| fp | not run yet | | | | | |
"""  # noqa: E501 (tables and commands in this docstring)

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
  "ACTNN_MAIN",
  "OTHER_METHODS",
  "load_json",
  "load_variants",
  "mib",
  "markdown_table",
  "actnn_table",
  "accuracy_curves",
  "variance_table",
  "show_figure",
  "bench_memory_table",
  "plan_cost_table",
  "bench_plans_table",
  "memory_batch_table",
  "both_caps_table",
  "acgc_sweep_table",
  "acgc_stored_table",
  "gact_table",
  "loss_curves",
]

ACTNN_MAIN = ["fp", "actnn_l2", "pergroup2", "actnn_l3"]
OTHER_METHODS = ["fp", "blpa4", "blpa2", "division", "acgc", "acgc_scale"]


def load_json(path) -> dict | None:
  """The JSON at `path`, or None when it does not exist."""
  path = Path(path)
  return json.loads(path.read_text()) if path.is_file() else None


def load_variants(directory) -> dict:
  """{file stem: result} for every JSON file in `directory` (empty when it is missing)."""
  directory = Path(directory)
  if not directory.is_dir():
    return {}
  return {p.stem: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def mib(n) -> str:
  return "" if n is None else f"{n / 2**20:.1f} MiB"


def markdown_table(header, rows) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def actnn_table(runs: dict, names) -> str:
  """One row per variant: accuracy after each epoch, final accuracy, memory, average bits."""
  rows = []
  for name in names:
    r = runs.get(name)
    if r is None:
      rows.append([name, "not run yet", "", "", "", "", ""])
      continue
    accs = ", ".join(f"{h['test_accuracy']:.3f}" for h in r["history"])
    done = f"{len(r['history'])}/{r['epochs']}" + ("" if r["complete"] else " (running)")
    memory = r.get("memory", {})
    final = r.get("final_test_accuracy")
    rows.append(
      [
        name,
        done,
        accs,
        "" if final is None else f"**{final:.3f}**",
        mib(memory.get("saved_bytes")),
        mib(memory.get("temp_bytes")),
        "" if r.get("final_average_bits") is None else f"{r['final_average_bits']:.2f}",
      ]
    )
  return markdown_table(
    [
      "variant",
      "epochs",
      "test accuracy by epoch",
      "final",
      "saved for backward",
      "compiled temp",
      "avg bits",
    ],
    rows,
  )


def accuracy_curves(runs: dict, names, title: str):
  """Test accuracy after each epoch, one line per variant that has any."""
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for name in names:
    r = runs.get(name)
    if r and r["history"]:
      ax.plot(
        [h["epoch"] for h in r["history"]],
        [h["test_accuracy"] for h in r["history"]],
        "o-",
        label=name,
      )
  ax.set(xlabel="epoch", ylabel="test accuracy", title=title)
  if ax.lines:
    ax.legend(fontsize=8)
  else:
    ax.text(0.5, 0.5, "no full-run results yet", ha="center", transform=ax.transAxes)
  fig.tight_layout()
  return ax


def variance_table(path) -> str:
  """Gradient variance rows of `experiments.papers.grad_variance` per checkpoint."""
  result = load_json(path)
  if result is None:
    return f"*{Path(path).name}: not run yet*"
  rows = []
  for epoch, entries in result["checkpoints"].items():
    for e in entries:
      bits = "" if e["avg_bits"] is None else f"{e['avg_bits']:.2f}"
      rows.append([epoch, e["method"], bits, f"{e['variance']:.3g}", f"{e['over_sampling']:.3g}"])
  return markdown_table(["epoch", "method", "bits", "variance", "/ sampling variance"], rows)


def show_figure(path):
  """Displays the PNG at `path`, or says that it is not there yet."""
  from IPython.display import Image, Markdown, display

  path = Path(path)
  display(Image(filename=str(path)) if path.is_file() else Markdown(f"*{path.name}: not run yet*"))


def bench_memory_table(path) -> str:
  """`experiments.bench.bench_memory`: bytes saved for backward and compiled temp per model and
  bits."""
  result = load_json(path)
  if result is None:
    return f"*{Path(path).name}: not run yet*"
  rows = [
    [
      r["model"],
      r["bits"] or "plain",
      mib(r["residual_bytes"]),
      mib(r["temp_bytes"]),
      f"{r['temp_reduction']:.1f}x",
    ]
    for r in result["rows"]
  ]
  return markdown_table(
    ["model", "bits", "saved for backward", "compiled temp", "temp reduction"], rows
  )


def plan_cost_table(path) -> str:
  """Estimator cost in train steps, per model, from `experiments.papers.bit_plans`."""
  result = load_json(path)
  if result is None:
    return f"*{Path(path).name}: not run yet*"
  rows = []
  for model in ("resnet", "transformer"):
    if model in result:
      c = result[model]["cost"]
      rows.append(
        [
          model,
          f"{c['step_s']:.3f} s",
          f"{c['analytic_in_steps']:.2f}",
          f"{c['numeric_in_steps']:.2f}",
        ]
      )
  return markdown_table(
    ["model", "gradient step", "analytic update (steps)", "numeric update (steps)"], rows
  )


def bench_plans_table(path) -> str:
  """`experiments.bench.bench_plans`: compression variance of each plan over the sampling
  variance."""
  result = load_json(path)
  if result is None:
    return f"*{Path(path).name}: not run yet*"
  rows = [
    [
      r["model"],
      r["method"],
      f"{r['avg_bits']:.2f}",
      f"{r['variance']:.3g}",
      f"{r['variance_over_sampling']:.3g}",
    ]
    for r in result["rows"]
  ]
  return markdown_table(["model", "plan", "avg bits", "variance", "/ sampling"], rows)


def memory_batch_table(path) -> str:
  """`experiments.bench.memory_batch`: largest batch under the cap and step time, per model and
  method."""
  result = load_json(path)
  if result is None:
    return f"*{Path(path).name}: not run yet*"
  cap = result["settings"]["cap_mib"]
  rows = []
  for model, r in result["models"].items():
    times = r.get("timing", {}).get("methods", {})
    for method, row in r["methods"].items():
      if row["status"] != "measured":
        rows.append([model, method, row.get("reason", row["status"])[:60], "", "", "", ""])
        continue
      at = row.get("at_largest", {})
      ratio = times.get(method, {}).get("ratio_vs_plain")
      fmt = lambda v: "" if v is None else f"{v:.1f}"
      rows.append(
        [
          model,
          method,
          row["largest_batch"],
          fmt(row.get("batch_vs_plain")),
          fmt(at.get("step_mib")),
          fmt(at.get("compiled_step_mib")),
          "" if ratio is None else f"{ratio:.2f}",
        ]
      )
  return f"cap: {cap:g} MiB of `{result['settings']['measure']}`\n\n" + markdown_table(
    [
      "model",
      "method",
      "largest batch",
      "x plain",
      "step MiB there",
      "XLA temp+out MiB",
      "step time x plain",
    ],
    rows,
  )


def both_caps_table(step_path, program_path) -> str:
  """`experiments.bench.memory_batch` run twice, capping the step's RSS and the step plus its
  compiled program (`--cap-on with_program_mib`): the largest batch under each cap."""
  step, program = load_json(step_path), load_json(program_path)
  if step is None or program is None:
    return f"*{Path(program_path).name}: not run yet*"
  rows = []
  for model, r in program["models"].items():
    for method, row in r["methods"].items():
      if row["status"] != "measured":
        continue
      other = step["models"].get(model, {}).get("methods", {}).get(method, {})
      probes = [p for p in row.get("probes", []) if p.get("program_mib") is not None]
      at = row.get("at_largest") or (probes[0] if probes else {})
      largest = (
        row["largest_batch"]
        or f"none (batch {probes[0]['batch']}: {probes[0]['with_program_mib']:.0f} MiB)"
        if probes
        else row["largest_batch"]
      )
      rows.append(
        [
          model,
          method,
          other.get("largest_batch", ""),
          largest,
          f"{at['program_mib']:.0f}" if at else "",
        ]
      )
  cap = program["settings"]["cap_mib"]
  return f"cap: {cap:g} MiB\n\n" + markdown_table(
    [
      "model",
      "method",
      "largest batch, step RSS",
      "largest batch, step + program",
      "program MiB there",
    ],
    rows,
  )


def acgc_sweep_table(path) -> str:
  """`experiments.papers.acgc_sweep`: per e^2 and parameters, jact's widths and three
  compressions."""
  result = load_json(path)
  if result is None:
    return f"*{Path(path).name}: not run yet*"
  rows = []
  for name, c in result["checkpoints"].items():
    for r in c["rows"]:
      rows.append(
        [
          name,
          f"{r['error']:g}",
          f"{r['jact_average_bits']:.2f}",
          r["kept_exact_jact"],
          f"{r['compression_jact']:.2f}x",
          f"{r['any_average_bits']:.2f}",
          f"{r['compression_any_width']:.2f}x",
          f"{r['compression_autoquantz']:.2f}x",
        ]
      )
  return markdown_table(
    [
      "parameters",
      "e^2",
      "jact bits (Fixpoint 2..16, else exact)",
      "kept exact",
      "jact compression",
      "bits, any width <= 16",
      "compression",
      "AutoQuantZ accounting",
    ],
    rows,
  )


def acgc_stored_table(path) -> str:
  """`experiments.papers.acgc_sweep`: bytes measured at the paper's e^2 under each plan
  (AC-GC, the same at widths 2/4/8, AutoQuantZ) against float32."""
  result = load_json(path)
  if result is None:
    return f"*{Path(path).name}: not run yet*"
  labels = dict(
    acgc="AC-GC (Fixpoint 2..16)", acgc_248="AC-GC at 2/4/8 bits", autoquantz="AutoQuantZ"
  )
  rows = []
  for name, c in result["checkpoints"].items():
    for plan, label in labels.items():
      m = c.get("stored", {}).get(plan)
      if m:
        exact = sum(b is None for b in m["bits"].values())
        rows.append(
          [
            name,
            label,
            exact,
            f"{m['bounded_bytes'] / 2**20:.1f}",
            f"{m['compression_bounded']:.2f}x",
            f"{m['compression_step']:.2f}x",
          ]
        )
  return markdown_table(
    [
      "parameters",
      "plan",
      "kept exact",
      "MiB stored (36 residuals)",
      "vs float32",
      "whole step vs plain float32",
    ],
    rows,
  )


def gact_table(tasks: dict) -> str:
  """`experiments.papers.gact_tasks`: per task and variant, the held-out metric, memory and bits."""
  if not tasks:
    return "*gact tasks: not run yet*"
  rows = []
  for task, result in tasks.items():
    for name, v in result["variants"].items():
      metric, final = v["best_by"], v["final"]
      rows.append(
        [
          task,
          name,
          f"{metric} {v['best'][metric]:.4f}",
          f"{final[metric]:.4f}" if metric in final else "",
          f"{final['test_accuracy']:.4f}" if "test_accuracy" in final else "",
          mib(v["saved_bytes"]),
          mib(v["temp_bytes"]),
          "" if v["average_bits"] is None else f"{v['average_bits']:.2f}",
          f"{v['steps']}",
          "yes" if v["finite"] else "**no**",
        ]
      )
  return markdown_table(
    [
      "task",
      "variant",
      "best held-out",
      "final held-out",
      "final test accuracy",
      "saved for backward",
      "compiled temp",
      "avg bits",
      "steps",
      "finite",
    ],
    rows,
  )


def loss_curves(tasks: dict, title: str):
  """Training loss per task (one panel each), one line per variant."""
  import matplotlib.pyplot as plt

  if not tasks:
    fig, ax = plt.subplots(figsize=(5, 2))
    ax.text(0.5, 0.5, "no full-run results yet", ha="center", transform=ax.transAxes)
    ax.set_axis_off()
    return ax
  fig, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks), 3), squeeze=False)
  for ax, (task, result) in zip(axes[0], tasks.items()):
    for name, v in result["variants"].items():
      ax.plot([p["step"] for p in v["losses"]], [p["loss"] for p in v["losses"]], label=name)
    ax.set(title=task, xlabel="step")
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel("training loss")
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  return axes


METHOD_COLORS = {
  "plain": "black",
  "remat": "tab:gray",
  "jact4": "tab:blue",
  "jact2": "tab:green",
  "jact_checkpoint": "tab:orange",
  "offload": "tab:purple",
}


def memory_batch_plot(model: str, result: dict, config, path) -> str:
  """`experiments.bench.memory_batch`: the capped memory (solid) and XLA's estimate of the step's
  buffers (dashed)
  vs batch per method, the cap, and each method's largest batch (star), as a PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for method, row in result["methods"].items():
    probes = [p for p in row.get("probes", []) if p.get(config.measure) is not None]
    if not probes:
      continue
    color = METHOD_COLORS.get(method)
    batches = [p["batch"] for p in probes]
    ax.plot(
      batches,
      [p[config.measure] for p in probes],
      "o-",
      color=color,
      label=f"{method} (largest {row['largest_batch']})",
    )
    ax.plot(batches, [p["compiled_step_mib"] for p in probes], "--", color=color, alpha=0.5)
    for p in probes:
      if p["batch"] == row["largest_batch"]:
        ax.plot(p["batch"], p[config.measure], "*", color=color, markersize=14)
  ax.axhline(config.cap_mib, color="red", linestyle=":", label=f"cap {config.cap_mib:g} MiB")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log", base=2)
  for axis in (ax.xaxis, ax.yaxis):
    axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.set_xlabel("batch")
  ax.set_ylabel("MiB")
  what = {"step_mib": "peak RSS the step adds", "with_program_mib": "peak RSS over pre-compile"}
  ax.set_title(
    f"{result['description']}\n{what[config.measure]} (solid), XLA temp + outputs (dashed)",
    fontsize=7.5,
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return str(path)
