"""The figures `experiments.claims` fills templates with, computed from `experiments/results/`.

One function per experiment adds its names (`actnn.*`, `gact.*`, `table.*`, ...) to a dict.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

__all__ = ["PAPER", "compute"]


def _load(path: Path):
  return json.loads(path.read_text()) if path.exists() else None


def _f(value, digits: int) -> str:
  return f"{value:.{digits}f}"


def _ratio(value, digits: int = 1) -> str:
  return f"{value:.{digits}f}x"


def _span(values) -> str:
  """ "lo-hi" (or the one value) of integers."""
  lo, hi = min(values), max(values)
  return str(lo) if lo == hi else f"{lo}-{hi}"


def _plan_widths(plan: dict) -> list:
  """A plan's widths (None: kept exact), whether entries are widths or compressors."""
  return [b if b is None or isinstance(b, int) else b.get("bits") for b in plan["bits"].values()]


def _actnn(results: Path, out: dict) -> None:
  runs = {p.stem: _load(p) for p in sorted((results / "actnn_cifar").glob("*.json"))}
  accounting = _load(results / "memory_accounting.json")
  fp_saved = (runs.get("fp") or {}).get("memory", {}).get("saved_bytes")
  last_loss = {}
  for name, r in runs.items():
    if not r.get("complete"):
      continue
    key = f"actnn.{name}"
    out[f"{key}.accuracy"] = _f(r["final_test_accuracy"], 3)
    out[f"{key}.accuracy4"] = _f(r["final_test_accuracy"], 4)
    saved, temp = r["memory"]["saved_bytes"], r["memory"]["temp_bytes"]
    out[f"{key}.saved_mib"] = _f(saved / 2**20, 1)
    out[f"{key}.temp_mib"] = _f(temp / 2**20, 1)
    if fp_saved:
      out[f"{key}.fewer"] = _ratio(fp_saved / saved)
    if accounting:
      out[f"{key}.fewer_than_layers"] = _ratio(accounting["float32_layer_input_bytes"] / saved)
    if r.get("final_average_bits") is not None:
      out[f"{key}.bits"] = _f(r["final_average_bits"], 2)
    if r["history"]:
      out[f"{key}.epoch1"] = _f(r["history"][0]["test_accuracy"], 3)
    if r.get("plans"):
      widths = _plan_widths(r["plans"][-1]["plan"])
      out[f"{key}.plan_exact"] = str(sum(w is None for w in widths))
      out[f"{key}.plan_residuals"] = str(len(widths))
      every = {w for p in r["plans"] for w in _plan_widths(p["plan"])} - {None}
      out[f"{key}.plan_widths"] = ", ".join(str(w) for w in sorted(every))
    if r.get("losses"):
      # paired: every variant sees the same batches, so the last epoch's mean training loss
      # compares variants on identical data
      last = [
        x["loss"] for x in r["losses"] if x["step"] > r["total_steps"] * (1 - 1 / r["epochs"])
      ]
      last_loss[name] = float(np.mean(last))
      out[f"{key}.last_epoch_loss"] = _f(last_loss[name], 3)
  for name, loss in last_loss.items():
    if "fp" in last_loss:
      out[f"actnn.{name}.loss_over_fp"] = _f(loss / last_loss["fp"], 2)
  if accounting:
    out["actnn.layer_inputs_mib"] = _f(accounting["float32_layer_input_bytes"] / 2**20, 1)
    if fp_saved:
      out["actnn.plain_over_layers"] = _ratio(fp_saved / accounting["float32_layer_input_bytes"])
  _seeds(runs, out)


def _seed_of(name: str) -> tuple[str, int]:
  """(variant, seed) of a run's name: `fp` is seed 0, `fp_seed2` seed 2."""
  variant, _, seed = name.partition("_seed")
  return variant, int(seed or 0)


def paired_difference(a: dict[int, float], b: dict[int, float]) -> dict | None:
  """Paired comparison of two variants' final accuracies over the seeds both ran.

  A seed fixes the initial parameters and the batches of every variant, so the runs pair by seed;
  the statement is a two-sided paired t-test (scipy's `ttest_rel`) on a - b, in points.

  >>> d = paired_difference({0: 0.70, 1: 0.71, 2: 0.69}, {0: 0.68, 1: 0.69, 2: 0.671})
  >>> d["n"], round(d["mean_points"], 2), d["p"] < 0.05
  (3, 1.97, True)
  """
  from scipy import stats

  seeds = sorted(set(a) & set(b))
  if len(seeds) < 2:
    return None
  diff = 100 * (np.array([a[s] for s in seeds]) - np.array([b[s] for s in seeds]))
  if np.all(diff == diff[0]):
    p = 0.0 if diff[0] else 1.0
  else:
    p = float(stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue)
  return {
    "n": len(seeds),
    "mean_points": float(diff.mean()),
    "std_points": float(diff.std(ddof=1)),
    "p": p,
  }


def _significance(by_seed: dict[str, dict[int, float]], out: dict) -> None:
  """`sig.<variant>.<baseline>.*`: each variant against fp and uniform 2 bits, paired by seed."""
  for baseline in ("fp", "pergroup2"):
    for variant, accuracies in by_seed.items():
      if variant == baseline or baseline not in by_seed:
        continue
      d = paired_difference(accuracies, by_seed[baseline])
      if d is None:
        continue
      key = f"sig.{variant}.{baseline}"
      out[f"{key}.n"] = str(d["n"])
      out[f"{key}.points"] = f"{d['mean_points']:+.1f}"
      out[f"{key}.std_points"] = _f(d["std_points"], 1)
      out[f"{key}.p"] = _f(d["p"], 2)
      out[f"{key}.verdict"] = (
        ("above" if d["mean_points"] > 0 else "below") + f" (paired t-test p = {d['p']:.2f} < 0.05)"
        if d["p"] < 0.05
        else f"not distinguishable (paired t-test p = {d['p']:.2f})"
      )


def _seeds(runs: dict, out: dict) -> None:
  """Mean, sample standard deviation and range of the final accuracy over seeds, and the
  paired comparisons (`_significance`)."""
  by_variant: dict[str, list[float]] = {}
  by_seed: dict[str, dict[int, float]] = {}
  for name, r in sorted(runs.items(), key=lambda item: _seed_of(item[0])):
    if not r.get("complete"):
      continue
    variant, seed = _seed_of(name)
    by_variant.setdefault(variant, []).append(r["final_test_accuracy"])
    by_seed.setdefault(variant, {})[seed] = r["final_test_accuracy"]
  _significance(by_seed, out)
  for variant, values in by_variant.items():
    if len(values) < 2:
      continue
    v = np.asarray(values)
    key = f"seeds.{variant}"
    out[f"{key}.n"] = str(len(v))
    out[f"{key}.mean"] = _f(v.mean(), 3)
    out[f"{key}.std"] = _f(v.std(ddof=1), 3)
    out[f"{key}.min"] = _f(v.min(), 3)
    out[f"{key}.max"] = _f(v.max(), 3)
    out[f"{key}.values"] = ", ".join(_f(x, 3) for x in values)
  if len(by_variant.get("fp", ())) >= 2:
    fp_mean = float(np.mean(by_variant["fp"]))
    out["seeds.fp.std_points"] = _f(100 * np.std(by_variant["fp"], ddof=1), 1)
    for name, r in runs.items():
      if r.get("complete") and "_seed" not in name:
        out[f"actnn.{name}.below_fp_points"] = _f(100 * (fp_mean - r["final_test_accuracy"]), 1)
  if (
    "fp" in by_variant
    and "pergroup2" in by_variant
    and min(len(by_variant["fp"]), len(by_variant["pergroup2"])) >= 2
  ):
    gap = 100 * (np.mean(by_variant["fp"]) - np.mean(by_variant["pergroup2"]))
    out["seeds.gap_points"] = _f(gap, 1)
    spread = 100 * max(np.std(by_variant["fp"], ddof=1), np.std(by_variant["pergroup2"], ddof=1))
    out["seeds.largest_std_points"] = _f(spread, 1)


def _gact(results: Path, out: dict) -> None:
  for path in sorted((results / "gact").glob("*.json")):
    task = _load(path)
    variants = task["variants"]
    fp_saved = variants.get("fp", {}).get("saved_bytes")
    for name, v in variants.items():
      key = f"gact.{path.stem}.{name}"
      metric = "test_accuracy" if "test_accuracy" in v["final"] else v["best_by"]
      out[f"{key}.metric"] = _f(v["final"][metric], 3)
      if fp_saved:
        out[f"{key}.fewer"] = _ratio(fp_saved / v["saved_bytes"], 0)
      if v.get("average_bits") is not None:
        out[f"{key}.bits"] = _f(v["average_bits"], 2)
      out[f"{key}.temp_mib"] = _f(v["temp_bytes"] / 2**20, 1)


def _gact_metric(v: dict) -> tuple[str, float]:
  """(name, value) of a GACT variant's final held-out metric (test accuracy where measured)."""
  metric = "test_accuracy" if "test_accuracy" in v["final"] else v["best_by"]
  return metric, float(v["final"][metric])


def _gact_seeds(results: Path, out: dict) -> None:
  """`gseeds.<task>.<variant>.*` over the seeds of the GACT runs (seed 0: `gact/<task>.json`, seed
  s: `gact_seeds/seed<s>/<task>.json`) and `gsig.<task>.adaptive2.fixed2.*`: adaptive against fixed
  2 bits, paired by seed (a seed fixes both variants' initialization and batches). For a loss
  the difference is fixed minus adaptive, for an accuracy adaptive minus fixed: positive means
  the adaptive plan is better."""
  by_task: dict[str, dict[str, dict[int, float]]] = {}
  metrics: dict[str, str] = {}
  paths = [(0, p) for p in sorted((results / "gact").glob("*.json"))]
  paths += [
    (int(p.parent.name.removeprefix("seed")), p)
    for p in sorted((results / "gact_seeds").glob("seed*/*.json"))
  ]
  for seed, path in paths:
    task = _load(path)
    if task["seed"] != seed:
      raise ValueError(f"{path} holds seed {task['seed']}, its folder says {seed}")
    for name, v in task["variants"].items():
      metrics[path.stem], value = _gact_metric(v)
      by_task.setdefault(path.stem, {}).setdefault(name, {})[seed] = value
  for task, variants in by_task.items():
    for name, values in variants.items():
      if len(values) < 2:
        continue
      v = np.array([values[s] for s in sorted(values)])
      key = f"gseeds.{task}.{name}"
      out[f"{key}.n"] = str(len(v))
      out[f"{key}.mean"] = _f(v.mean(), 3)
      out[f"{key}.std"] = _f(v.std(ddof=1), 3)
      out[f"{key}.values"] = ", ".join(_f(x, 3) for x in v)
    if "adaptive2" in variants and "fixed2" in variants:
      better, worse = variants["adaptive2"], variants["fixed2"]
      if "loss" in metrics[task]:
        better, worse = worse, better
      d = paired_difference(better, worse)
      if d is None:
        continue
      key = f"gsig.{task}.adaptive2.fixed2"
      out[f"{key}.n"] = str(d["n"])
      out[f"{key}.metric"] = metrics[task].replace("_", " ")
      out[f"{key}.difference"] = f"{d['mean_points'] / 100:+.3f}"
      out[f"{key}.p"] = _f(d["p"], 2)
      out[f"{key}.verdict"] = (
        ("better" if d["mean_points"] > 0 else "worse")
        + f" (paired t-test p = {d['p']:.2f} < 0.05)"
        if d["p"] < 0.05
        else f"not distinguishable (paired t-test p = {d['p']:.2f})"
      )


def _sci3(value: float) -> str:
  """Three significant figures, e-notation below 0.001: 0.0213, 3.22e-05."""
  return f"{value:.2e}" if 0 < abs(value) < 1e-3 else f"{value:.3g}"


def _fp8(results: Path, out: dict) -> None:
  """`fp8.<model>.<method>.*` (`experiments.papers.fp8_compare`): each method's gradient error over
  the sampling variance (mean over seeds), bytes a value, and FP8's error over int8's."""
  for model, name in (("resnet20", "fp8_compare.json"), ("char_lm", "fp8_compare_char_lm.json")):
    run = _load(results / name)
    if not run or not run.get("complete"):
      continue
    summary = run["summary"]
    for method, row in summary.items():
      key = f"fp8.{model}.{method}"
      out[f"{key}.seeds"] = str(row["seeds"])
      out[f"{key}.bytes"] = _f(row["bytes_per_value"], 3)
      out[f"{key}.error"] = _sci3(row["error_over_sampling"]["mean"])
      out[f"{key}.mean_error"] = _sci3(row["mean_error_over_sampling"]["mean"])
    for method in ("fp8_e4m3", "fp8_e4m3_sr", "fp8_e5m2"):
      if method in summary and "int8" in summary:
        ratio = (
          summary[method]["error_over_sampling"]["mean"]
          / summary["int8"]["error_over_sampling"]["mean"]
        )
        out[f"fp8.{model}.{method}.over_int8"] = _ratio(ratio, 0)


def _l3_joint(results: Path, out: dict) -> None:
  """`l3.<method>.*` (`experiments.papers.l3_joint`, initialization): compression variance over
  uniform 2 bits per seed, bytes over uniform's, and a t-test over seeds of that ratio's log."""
  from scipy import stats

  rows: dict[str, dict[int, dict]] = {}
  for path in sorted(results.glob("l3_joint_seed*.json")):
    run = _load(path)
    if not run.get("complete"):
      continue
    for row in run["checkpoints"]["0"]:
      rows.setdefault(row["method"], {})[run["seed"]] = row
  uniform = rows.get("uniform2", {})
  for method, by_seed in rows.items():
    if method in ("sampling", "uniform2"):
      continue
    seeds = sorted(set(by_seed) & set(uniform))
    if not seeds:
      continue
    ratios = [by_seed[s]["variance"] / uniform[s]["variance"] for s in seeds]
    key = f"l3.{method}"
    out[f"{key}.n"] = str(len(seeds))
    out[f"{key}.over_uniform2"] = ", ".join(_f(r, 2) for r in ratios)
    out[f"{key}.over_uniform2_mean"] = _f(float(np.mean(ratios)), 2)
    out[f"{key}.bytes_over_uniform2"] = ", ".join(
      _f(by_seed[s]["bytes"] / uniform[s]["bytes"], 4) for s in seeds
    )
    if len(seeds) >= 2:
      # the seeds' variances differ in scale (0.11 vs 0.15), their ratios to uniform's do not:
      # test whether the log ratio is 0
      p = stats.ttest_1samp(np.log(ratios), 0.0).pvalue
      out[f"{key}.p"] = _sci3(float(p)) if np.isfinite(p) else "undefined (equal ratios)"


def _grad_variance(results: Path, out: dict) -> None:
  for name, prefix in (("grad_variance", "gv"), ("grad_variance_before_bn_rule", "gv_before")):
    gv = _load(results / f"{name}.json")
    if gv is not None:
      _variance_rows(gv, prefix, out)


def _variance_rows(gv: dict, prefix: str, out: dict) -> None:
  for epoch, rows in gv["checkpoints"].items():
    by = {(r["method"], r["avg_bits"]): r for r in rows}
    key = f"{prefix}.{epoch}"
    uniform = {int(b): by[("uniform", b)]["variance"] for (m, b) in by if m == "uniform"}
    for b in uniform:
      out[f"{key}.uniform{b}.over_sampling"] = _f(by[("uniform", float(b))]["over_sampling"], 2)
    for lo, hi in ((1, 2), (2, 4), (4, 8)):
      if lo in uniform and hi in uniform and uniform[hi] > 0:
        out[f"{key}.fall_{lo}_{hi}"] = _ratio(uniform[lo] / uniform[hi], 1 if lo == 1 else 0)
    for r in rows:
      if r.get("plan"):
        widths = _plan_widths(r["plan"])
        out[f"{key}.{r['method']}.at_budget"] = (
          f"{sum(w == round(r['avg_bits']) for w in widths)} of {len(widths)}"
        )
      if r["method"] in ("actnn_l3", "gact_numeric") and 2 in uniform:
        out[f"{key}.{r['method']}.over_uniform2"] = _ratio(r["variance"] / uniform[2], 2)
        out[f"{key}.{r['method']}.variance"] = _f(r["variance"], 3)
    if 2 in uniform:
      out[f"{key}.uniform2.variance"] = _f(uniform[2], 3)


def _memory_batch(results: Path, out: dict) -> None:
  for path, prefix in (
    (results / "memory_batch.json", "mb"),
    (results / "memory_batch_program" / "memory_batch.json", "mbp"),
  ):
    mb = _load(path)
    if mb is not None:
      _batch_rows(mb, prefix, out)


def _batch_rows(mb: dict, prefix: str, out: dict) -> None:
  out[f"{prefix}.cap_mib"] = str(mb["settings"]["cap_mib"])
  for model, m in mb["models"].items():
    plain = m["methods"]["plain"].get("largest_batch")
    for method, r in m["methods"].items():
      if r.get("largest_batch") is None:
        continue
      key = f"{prefix}.{model}.{method}"
      out[f"{key}.batch"] = str(r["largest_batch"])
      if plain:
        out[f"{key}.times"] = _ratio(r["largest_batch"] / plain)
      probes = [p for p in r.get("probes", []) if p.get("program_mib") is not None]
      at = r.get("at_largest") or (probes[0] if probes else None)
      if at:
        out[f"{key}.program_mib"] = _f(at["program_mib"], 0)
    for method, t in m.get("timing", {}).get("methods", {}).items():
      out[f"{prefix}.{model}.{method}.step_ratio"] = _ratio(t["ratio_vs_plain"], 2)


def _bench_plans(results: Path, out: dict) -> None:
  bp = _load(results / "bench_plans.json")
  if bp is None:
    return
  budget = None  # rows run uniform, then the adaptive plans at that uniform width
  for r in bp["rows"]:
    method = r["method"]
    if method == "uniform":
      budget = int(round(r["avg_bits"]))
    name = method.replace("acgc_e2=", "acgc") if "acgc" in method else f"{method}{budget}"
    out[f"bp.{r['model']}.{name}.variance"] = f"{r['variance']:.3g}"
  for c in bp["costs"]:
    out[f"bp.{c['model']}.numeric_cost"] = _f(c["numeric_cost_in_steps"], 1)
    out[f"bp.{c['model']}.analytic_cost"] = _f(c["analytic_cost_in_steps"], 1)


def _acgc(results: Path, out: dict) -> None:
  sweep = _load(results / "acgc_sweep.json")
  if sweep is None:
    return
  out["acgc.paper_error"] = f"{sweep['paper_error']:g}"
  for name, c in sweep["checkpoints"].items():
    for r in c["rows"]:
      key = f"acgc.{name}.e{r['error']:g}"
      out[f"{key}.jact"] = _ratio(r["compression_jact"])
      out[f"{key}.any"] = _ratio(r["compression_any_width"])
      out[f"{key}.zvc"] = _ratio(r["compression_autoquantz"])
      out[f"{key}.bits"] = _f(r["jact_average_bits"], 1)
      out[f"{key}.any_bits"] = _f(r["any_average_bits"], 1)
      out[f"{key}.exact"] = str(r["kept_exact_jact"])
    layers = c["layers"]
    conv = [v["bits_at_paper_error"] for n, v in layers.items() if n.endswith("conv.lhs")]
    norm = [v["bits_at_paper_error"] for n, v in layers.items() if n.endswith("xhat")]
    scale = [v["bits_with_scale_bound"] for n, v in layers.items() if n.endswith("xhat")]
    out[f"acgc.{name}.conv_bits"] = _span(conv)
    out[f"acgc.{name}.norm_bits"] = _span(norm)
    out[f"acgc.{name}.norm_bits_scale_bound"] = _span(scale)
    density = [v["density"] for n, v in layers.items() if n.endswith("conv.lhs")]
    out[f"acgc.{name}.conv_density"] = f"{min(density):.2f}-{max(density):.2f}"
    for plan, m in {k: v for k, v in c.get("stored", {}).items() if isinstance(v, dict)}.items():
      # measured bytes at the paper's e^2 (acgc, acgc_248, autoquantz): bounded residuals
      # against float32, and the whole step against the plain float32 network
      out[f"acgc.{name}.stored.{plan}"] = _ratio(m["compression_bounded"])
      out[f"acgc.{name}.stored.{plan}.step"] = _ratio(m["compression_step"])
      out[f"acgc.{name}.stored.{plan}.exact"] = str(sum(b is None for b in m["bits"].values()))


_MEMORY_MODELS = {
  "resnet18_cifar": "ResNet-18, CIFAR",
  "resnet50_cifar": "ResNet-50, CIFAR",
  "resnet18_224": "ResNet-18, 224²",
  "resnet50_224": "ResNet-50, 224²",
  "transformer": "transformer, 8 blocks",
}

_ZOO_MODELS = {
  "resnet18": "ResNet-18 (CIFAR, batch 32)",
  "bilstm_sst2": "SST-2 BiLSTM",
  "transformer_lm": "LM1B-style decoder",
  "gemma_nnx": "Gemma-like nnx transformer",
  "seq2seq": "LSTM seq2seq",
  "scan_mlp_nnx": "nnx scan over `nnx.vmap`-built blocks",
  "mnist_cnn": "nnx MNIST CNN",
}

_WHOLE_MODELS = {
  "vit": "ViT (class token, pre-LN)",
  "mixer": "MLP-Mixer",
  "convnext_nnx": "nnx ConvNeXt",
  "gn_resnet": "GroupNorm + StdConv ResNet",
  "offset_norms": "offset input into LN/RMSNorm/GN",
  "norm_chain": "rsqrt / division / L2-norm chain",
}


def _input_label(row) -> str:
  """The input size of a memory row: the transformer's full shape, a CNN's batch."""
  shape = row["input_shape"]
  return "x".join(map(str, shape)) if row["model"] == "transformer" else str(shape[0])


def _sig3(value: float) -> str:
  """Three significant figures, no exponent, thousands separated: 0.813, 14.1, 93,400."""
  if value == 0:
    return "0"
  digits = 2 - int(np.floor(np.log10(abs(value))))
  rounded = round(value, digits)
  return f"{rounded:,.{max(digits, 0)}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _tables(results: Path, out: dict) -> None:
  """Whole tables of the docs pages' generated blocks (`<!-- claims:table.NAME -->`)."""
  bc = _load(results / "bench_compressors.json")
  if bc is not None:
    rows = [
      [
        r["method"].replace(" e2=", ", e²="),
        f"{r['unit_bytes'] / 1e6:.1f} MB",
        _ratio(r["unit_ratio"]),
        _f(r["rel_error"], 3),
        _f(r["bias"], 3),
      ]
      for r in bc["rows"]
      if not r["method"].startswith("exact")
    ]
    out["table.bench_compressors"] = _table(
      [
        "method",
        "unit residual bytes",
        "vs exact units",
        "gradient rel. error",
        "error of the 8-key mean",
      ],
      rows,
    )
  bm = _load(results / "bench_memory.json")
  if bm is not None:
    rows = [
      [
        f"{_MEMORY_MODELS.get(r['model'], r['model'])} ({_input_label(r)})",
        _ratio(r["residual_reduction"]),
        _ratio(r["temp_reduction"]),
      ]
      for r in bm["rows"]
      if r["bits"] == 2
    ]
    out["table.bench_memory"] = _table(
      ["model (batch)", "saved for backward", "compiled temp"], rows
    )
  bmo = _load(results / "bench_models.json")
  if bmo is not None:
    by = {(r["model"], r["variant"], r["bits"]): r for r in bmo["rows"]}
    rows = []
    for model, label in _ZOO_MODELS.items():
      plain = by.get((model, "plain", None))
      cells = [by.get((model, v, 2)) for v in ("convert", "compressed")]
      if plain and all(cells):
        rows.append(
          [label]
          + [
            f"{plain['saved_bytes'] / c['saved_bytes']:.0f}x / "
            f"{plain['temp_bytes'] / c['temp_bytes']:.1f}x"
            for c in cells
          ]
        )
    out["table.bench_models"] = _table(
      ["model", "convert: saved / compiled temp", "whole-model compressed: saved / compiled temp"],
      rows,
    )
  wm = _load(results / "whole_model_error.json")
  if wm is not None:
    by = {r["model"]: r for r in wm["rows"]}
    rows = []
    for model, label in _WHOLE_MODELS.items():
      r = by.get(model)
      if r is None:
        continue
      errors = [
        " / ".join(_sig3(100 * r[f"{kind}_{b}"]["mean_error"]) for b in (8, 4, 2))
        for kind in ("convert", "compressed", "rows_off")
      ]
      temp = [r["plain_temp_bytes"], r["convert_2"]["temp_bytes"], r["compressed_2"]["temp_bytes"]]
      rows.append(
        [
          label,
          *errors,
          f"{r['ratio_4']:.2f}, {r['ratio_2']:.2f}",
          " / ".join(f"{b / 1000:.0f}" for b in temp) + " kB",
        ]
      )
    out["table.whole_model_error"] = _table(
      [
        "model",
        "convert 8 / 4 / 2 bits (%)",
        "whole-model 8 / 4 / 2",
        "rows off 8 / 4 / 2",
        "whole ÷ convert at 4, 2 bits",
        "temp",
      ],
      rows,
    )
  ts = _load(results / "train_sharded.json")
  if ts is not None:
    rows = []
    for r in ts["runs"]:
      kinds = ", ".join(f"{k} {c['count']}" for k, c in r["collectives"].items())
      received = sum(c["bytes"] for c in r["collectives"].values()) / 2**20
      rows.append(
        [
          r["variant"],
          f"{r['per_device_bytes']['temp'] / 2**20:.1f} MiB",
          f"{kinds}: {received:.1f} MiB",
          _f(r["seconds_per_step"], 2),
          _f(r["final_loss"], 3),
          _f(r["held_out_loss"], 3),
        ]
      )
    out["table.train_sharded"] = _table(
      [
        "variant",
        "per-device temp",
        "collectives (count: bytes a device receives)",
        "s/step",
        "loss, last 20 steps",
        "held-out loss",
      ],
      rows,
    )


# Figures the papers report (quoted, with where): not computed here, but named so that a
# template never types a number.
PAPER = {
  "paper.acgc.autoquantz_average": ("7.5x", "AC-GC Table 2, AutoQuantZ, average over tasks"),
  "paper.acgc.autoquantz_cifar_resnet50": ("4.2x", "AC-GC Table 2, CIFAR-10 ResNet-50"),
}


def _theory(out: dict) -> None:
  """ActNN's variance factor S(b) = (2^b - 1)^-2: the predicted fall between widths."""
  for lo, hi in ((1, 2), (2, 4), (4, 8)):
    out[f"theory.fall_{lo}_{hi}"] = _ratio(((2**hi - 1) / (2**lo - 1)) ** 2, 0)


@functools.cache
def compute(results: str) -> dict:
  """name -> figure for every name, from the results folder `results` (a resolved path string)."""
  out: dict[str, str] = {name: value for name, (value, _) in PAPER.items()}
  _theory(out)
  path = Path(results)
  for part in (
    _actnn,
    _gact,
    _gact_seeds,
    _fp8,
    _l3_joint,
    _grad_variance,
    _memory_batch,
    _bench_plans,
    _acgc,
    _tables,
  ):
    part(path, out)
  from experiments.lib import notebook_support  # the key table, as summary prints it
  from experiments.lib import summary_table as summary

  out["key_table"] = summary.key_table(
    notebook_support.load_variants(path / "actnn_cifar"),
    notebook_support.load_variants(path / "gact"),
    summary.layer_input_bytes(path),
  )
  return out
