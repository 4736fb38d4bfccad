"""Figures hand-written docs pages quote inline (`<!-- fig:NAME -->`), from experiments/results/.

One function per results file adds its names to a dict; `experiments.claims` merges them with
`experiments.lib.claims_figures`'.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

__all__ = ["compute"]


def _load(path: Path):
  return json.loads(path.read_text()) if path.exists() else None


def _sig3(value: float) -> str:
  """Three significant digits, at most two decimals, never an exponent: 0.92, 7.08, 27.7, 190."""
  digits = min(2, max(0, 2 - math.floor(math.log10(abs(value))))) if value else 0
  return f"{value:.{digits}f}"


def _span(values, digits: int = 1, unit: str = "x") -> str:
  lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
  return f"{lo}{unit}" if lo == hi else f"{lo}-{hi}{unit}"


_FRONTIER_MODELS = {
  ("lm_6x512", "xla"): "LM 6x512 (as written)",
  ("lm_6x512", "cudnn"): "LM 6x512 (cuDNN)",
  ("resnet50_224", "xla"): "ResNet-50 224, batch 128",
  ("vit_b16", "xla"): "ViT-B/16, batch 64 (as written)",
  ("vit_b16", "cudnn"): "ViT-B/16 (cuDNN)",
  ("llama1b_2048", "cudnn"): "Llama 1.1B, 2048 (cuDNN)",
  ("llama1b_8192", "cudnn"): "Llama 1.1B, 8192 (cuDNN)",
}
_JAX_POLICIES = {
  "remat_nothing": "remat",
  "remat_dots": "dots",
  "remat_dots_no_batch": "dots, no batch",
  "remat_names": "names",
  "offload_inputs": "offload",
}


def _frontier(results: Path, out: dict) -> None:
  """frontier.json: peaks (GiB) and predicted step times (ms) per model and configuration."""
  payload = _load(results / "frontier.json")
  if payload is None:
    return
  by = {}
  for r in payload["rows"]:
    if "peak_bytes" in r:
      by.setdefault((r["model"], r["attention"]), {})[r["config"]] = r
  cell = lambda r: f"{_sig3(r['peak_bytes'] / 2**30)}, {_sig3(r['predicted_ms'])}" if r else "-"
  rows, slower, lower = [], [], []
  for key, label in _FRONTIER_MODELS.items():
    c = by.get(key)
    if not c:
      continue
    best = min(_JAX_POLICIES, key=lambda n: c[n]["peak_bytes"])
    best_cell = "remat" if best == "remat_nothing" else f"{_JAX_POLICIES[best]} {cell(c[best])}"
    rows.append(
      [label, cell(c["plain"]), cell(c["remat_nothing"]), best_cell]
      + [cell(c.get(n)) for n in ("jact2", "convert2", "jact_ckpt2")]
    )
    remat = c["remat_nothing"]
    slower += [
      r["predicted_ms"] / remat["predicted_ms"]
      for n, r in c.items()
      if n.startswith(("jact", "convert"))
    ]
    if key[0] in ("lm_6x512", "vit_b16"):
      lower.append(c["jact_ckpt2"]["peak_bytes"] / remat["peak_bytes"])
  out["table.frontier"] = "\n".join(
    [
      "| model (attention) | plain | remat | best JAX | jact 2 bits | `jact.convert` 2 bits "
      "| `jact.checkpoint` 2 bits |",
      "|---|---|---|---|---|---|---|",
      *["| " + " | ".join(r) + " |" for r in rows],
    ]
  )
  out["frontier.jact_over_remat_time"] = _span(slower)
  out["frontier.ckpt_over_remat_peak"] = _span(lower, 2)
  resnet = by[("resnet50_224", "xla")]
  out["frontier.resnet50.ckpt2_peak"] = f"{resnet['jact_ckpt2']['peak_bytes'] / 2**30:.2f} GiB"
  out["frontier.resnet50.remat_peak"] = f"{resnet['remat_nothing']['peak_bytes'] / 2**30:.2f} GiB"
  llama = [r for r in payload["rows"] if r["model"] == "llama1b_8192" and r["attention"] == "xla"]
  plain = next(r for r in llama if r["config"] == "plain")
  out["frontier.llama8192.plain_xla_peak"] = f"{plain['peak_bytes'] / 2**30:.0f} GiB"
  compile_ratio = [
    r["compile_s"] / c["plain"]["compile_s"]
    for c in by.values()
    for n, r in c.items()
    if n.startswith(("jact", "convert"))
  ]
  out["frontier.compile_over_plain"] = _span(compile_ratio, 0)
  lm = by[("lm_6x512", "xla")]
  out["frontier.lm.jact2_compile"] = f"{lm['jact2']['compile_s']:.1f} s"
  out["frontier.lm.plain_compile"] = f"{lm['plain']['compile_s']:.1f} s"


def _time_model(results: Path, out: dict) -> None:
  """time_model.json: the step-time model against the H200's measured steps."""
  tm = _load(results / "time_model.json")
  if tm is None:
    return
  errors = [abs(r["ratio"] - 1) for r in tm["rows"]]
  out["time_model.max_error"] = f"{100 * max(errors):.1f}%"
  out["time_model.rows"] = str(len(tm["rows"]))
  out["time_model.rms"] = f"{100 * tm['rms_log_error']:.1f}%"
  out["time_model.held_out_rms"] = f"{100 * tm['held_out_rms_log_error']:.1f}%"
  out["time_model.temp_ratio"] = _span([r["temp_ratio"] for r in tm["rows"]], 2)


def _mib(n: float, digits: int = 1) -> str:
  return f"{n / 2**20:.{digits}f} MiB"


def _pct(value: float) -> str:
  """A fraction as a percent with two significant digits: 0.0021 -> 0.21%, 0.229 -> 23%."""
  digits = max(0, 1 - math.floor(math.log10(abs(100 * value)))) if value else 0
  return f"{100 * value:.{digits}f}%"


def _variance(value: float) -> str:
  """A gradient variance as bench_fit's table shows it: 1.87, 6.8e-5."""
  if value >= 0.1:
    return f"{value:.2f}"
  mantissa, exponent = f"{value:.1e}".split("e")
  return f"{mantissa}e{int(exponent)}"


_FIT_SUBJECTS = {
  "stack8": "8-block transformer LM, segments ({batch} x 256)",
  "zoo_lm": "zoo linen LM, `jact.convert` ({batch} x 256)",
  "resnet50_224": "ResNet-50 224x224, `jact.convert` ({batch})",
}
_BATCH_CONFIGS = {"plain": "plain", "fit": "fit's configuration", "any": "any configuration"}


def _fit_cell(r: dict, first_miss: bool, named: bool) -> str:
  """One budget's cell: fit's peak and variance against the best fitting uniform width's (`named`:
  the table's first such cell spells out what the pair is)."""
  if not r["fits"]:
    return (
      f"nothing fits: smallest {_mib(r['smallest_peak_bytes'])}" if first_miss else "nothing fits"
    )
  fit, uniform = _variance(r["variance"]), _variance(r["uniform_variance"])
  bits = r["uniform_bits"]
  if fit == uniform:
    return f"{_mib(r['peak_bytes'])}; {fit} = uniform {bits}"
  if named:
    return f"{_mib(r['peak_bytes'])}; variance {fit} vs {uniform} (uniform {bits})"
  return f"{_mib(r['peak_bytes'])}; {fit} vs {uniform} ({bits})"


def _bench_fit(results: Path, out: dict) -> None:
  """bench_fit.json: fit's configurations per budget, and largest_batch against bisection."""
  payload = _load(results / "bench_fit.json")
  if payload is None:
    return
  subjects = payload["subjects"]
  fractions = [r["fraction"] for r in next(iter(subjects.values()))["rows"]]
  lines = [
    "| model (batch) | plain peak | " + " | ".join(fractions) + " |",
    "|---" * (2 + len(fractions)) + "|",
  ]
  fitted, searches, batch_compilations = [], [], []
  for name, s in subjects.items():
    cells, missed = [], False
    for r in s["rows"]:
      cells.append(_fit_cell(r, not missed, named=not fitted))
      missed = missed or not r["fits"]
      if r["fits"]:
        fitted.append(r)
        searches.append(r["search_seconds"])
    label = _FIT_SUBJECTS.get(name, name).format(batch=s["batch"])
    lines.append(f"| {label} | {_mib(s['plain_peak_bytes'])} | " + " | ".join(cells) + " |")
    rows = {r["config"]: r for r in s["largest_batch"]}
    for r in rows.values():
      if "compilations" in r:
        batch_compilations.append(r["compilations"])
    out[f"fit.{name}.largest_batch"] = ", ".join(
      f"{_BATCH_CONFIGS[c]} {r['batch']} (true {r['true_max']})"
      for c, r in rows.items()
      if "true_max" in r
    )
    out[f"fit.{name}.batch_budget"] = _mib(next(iter(rows.values()))["budget_bytes"])
    smallest = [r["smallest_peak_bytes"] for r in s["rows"] if not r["fits"]]
    if smallest:
      out[f"fit.{name}.smallest"] = _mib(min(smallest), 0)
  out["table.fit"] = "\n".join(lines)
  gains = [r["uniform_variance"] / r["variance"] for r in fitted]
  better = [g for g in gains if g > 1]  # the others chose the uniform width itself
  out["fit.rows_fit"] = str(len(fitted))
  out["fit.rows_not_fit"] = str(sum(not r["fits"] for s in subjects.values() for r in s["rows"]))
  out["fit.rows_equal"] = str(len(gains) - len(better))
  out["fit.variance_gain"] = f"{min(better):.1f}x-{max(better):.0f}x"
  out["fit.compilations"] = f"{min(r['compilations'] for r in fitted)}-" + str(
    max(r["compilations"] for r in fitted)
  )
  out["fit.search_seconds"] = f"{min(searches):.0f}-{max(searches):.0f} s"
  out["fit.batch_compilations"] = f"{min(batch_compilations)}-{max(batch_compilations)}"
  zoo = [r["seconds"] for r in subjects["zoo_lm"]["largest_batch"] if r["config"] != "plain"]
  out["fit.zoo_lm.batch_seconds"] = f"{min(zoo):.0f}-{max(zoo):.0f} s"
  plain = next(r for r in subjects["resnet50_224"]["largest_batch"] if r["config"] == "plain")
  needs = re.search(r"batch 1 needs (\d+) bytes", plain["why"])
  out["fit.resnet50_224.plain_batch1_peak"] = _mib(int(needs.group(1)))


def _compile_time(results: Path, out: dict) -> None:
  """compile_time.json and compile_anatomy.json: what jact's residuals cost XLA:CPU's compiler."""
  ct = _load(results / "compile_time.json")
  if ct is not None:
    by = {(r["model"], r["variant"]): r for r in ct["rows"]}
    zoo = [
      r["compile_cpu_ratio"]
      for (model, variant), r in by.items()
      if model in ("transformer_lm", "bilstm_sst2", "resnet18") and variant != "plain"
    ]
    stack = [
      r["compile_cpu_ratio"]
      for (model, variant), r in by.items()
      if model == "transformer_stack_x8" and variant != "plain"
    ]
    out["compile_time.zoo_cpu_ratio"] = _span(zoo, 0)
    out["compile_time.stack_cpu_ratio"] = _span(stack, 0)
    for model, variant in (("resnet50_224", "convert"), ("transformer_stack_x8", "per_block")):
      out[f"compile_time.{model}.{variant}"] = f"{by[(model, variant)]['compile_s']:.1f} s"
      out[f"compile_time.{model}.plain"] = f"{by[(model, 'plain')]['compile_s']:.1f} s"
  ca = _load(results / "compile_anatomy.json")
  if ca is None:
    return
  by = {r["program"]: r for r in ca["rows"]}
  cpu = lambda name: by[name]["compile_cpu_s"]  # noqa: E731
  temp = lambda name: by[name]["temp_bytes"]  # noqa: E731
  calls = ca["meta"]["quantize_calls"]
  out["anatomy.plain"] = f"{cpu('plain'):.1f} CPU-s"
  out["anatomy.jact"] = f"{cpu('jact'):.1f}"
  out["anatomy.exact"] = f"{cpu('jact, exact residuals'):.1f} s"
  out["anatomy.quantize_calls"] = str(calls)
  out["anatomy.per_residual"] = (
    f"{1000 * (cpu('jact') - cpu('jact, exact residuals')) / calls:.0f} ms"
  )
  out["anatomy.quantizers"] = f"{cpu('quantizers alone, constant seeds'):.1f} s"
  out["anatomy.minimal"] = f"{cpu('minimal quantizers, seeds as parameters'):.1f} s"
  out["anatomy.ordering"] = f"{cpu('jact') - cpu('jact, no CPU ordering'):.1f} s"
  out["anatomy.ordering_temp"] = f"{temp('jact, no CPU ordering') / temp('jact'):.1f}x"
  out["anatomy.opaque"] = f"{cpu('jact, opaque quantizers'):.1f} s"
  out["anatomy.opaque_over_plain"] = f"{cpu('jact, opaque quantizers') / cpu('plain'):.1f}x"
  out["anatomy.opaque_no_ordering"] = f"{cpu('jact, opaque quantizers, no CPU ordering'):.1f} s"
  out["anatomy.opaque_ordering_temp"] = (
    f"{temp('jact, opaque quantizers, no CPU ordering') / temp('jact, opaque quantizers'):.1f}x"
  )


def _memory_scaling(results: Path, out: dict) -> None:
  """memory_scaling.json: compiled temp added per block against the residual bytes."""
  ms = _load(results / "memory_scaling.json")
  if ms is None:
    return
  by = {(r["block"], r["bits"]): r for r in ms["rows"]}
  out["memory_scaling.relu_cnn2.temp_per_block"] = _mib(by[("relu_cnn", 2)]["temp_per_block"], 2)
  out["memory_scaling.relu_cnn2.residual_per_block"] = _mib(
    by[("relu_cnn", 2)]["residual_per_block"], 2
  )
  out["memory_scaling.relu_cnn.plain_per_block"] = _mib(by[("relu_cnn", None)]["temp_per_block"], 0)


def _grad_error(results: Path, out: dict) -> None:
  """grad_error.json: single-draw relative gradient error on a real batch, per model and width."""
  ge = _load(results / "grad_error.json")
  if ge is None:
    return
  by = {(r["model"], r["variant"], r["bits"]): r for r in ge["rows"]}
  for bits in (8, 4):
    lm = {_pct(by[("transformer_lm", v, bits)]["single"]) for v in ("compressed", "convert")}
    out[f"grad_error.lm.{bits}"] = "-".join(sorted(lm))
    for variant in ("compressed", "convert"):
      out[f"grad_error.resnet18.{variant}.{bits}"] = _pct(by[("resnet18", variant, bits)]["single"])
  out["grad_error.target_4"] = f"{100 * by[('resnet18', 'convert', 4)]['target']:.0f}%"


def _train_zoo(results: Path, out: dict) -> None:
  """train_zoo.json (4 bits) and train_zoo_2bit.json: final losses against two plain seeds."""
  four, two = _load(results / "train_zoo.json"), _load(results / "train_zoo_2bit.json")
  if four is None or two is None:
    return
  r = next(s for s in four["summary"] if s["model"] == "resnet18")
  out["train_zoo.resnet18.convert4"] = f"{r['convert']:.3f}"
  out["train_zoo.resnet18.plain"] = f"{r['plain_seed0']:.3f}/{r['plain_seed1']:.3f}"
  r2 = next(s for s in two["summary"] if s["model"] == "resnet18")
  out["train_zoo.resnet18.gap2"] = f"{r2['gap']:.2f}"
  out["train_zoo.resnet18.noise"] = f"{r2['noise']:.3f}"


def _whole_model(results: Path, out: dict) -> None:
  """bench_whole_model.json: one jact.compressed around a stack against one per block."""
  wm = _load(results / "bench_whole_model.json")
  if wm is None:
    return
  by = {(r["stack"], r["mode"]): r for r in wm["rows"]}
  for stack, name in (("relu_cnn", "cnn"), ("transformer", "transformer")):
    whole, per = by[(f"{stack} x8", "whole")], by[(f"{stack} x8", "per_block")]
    out[f"whole_model.{name}.whole"] = _mib(whole["temp_bytes"], 2)
    out[f"whole_model.{name}.per_block"] = _mib(per["temp_bytes"], 2)
    out[f"whole_model.{name}.over_per_block"] = f"{whole['temp_bytes'] / per['temp_bytes']:.2f}x"
    out[f"whole_model.{name}.vs_plain"] = f"{whole['temp_reduction_vs_plain']:.1f}x"
    scan = by[(f"{stack} scan8", "whole")]
    out[f"whole_model.{name}.scan_vs_plain"] = f"{scan['temp_reduction_vs_plain']:.1f}x"


def _whole_model_error(results: Path, out: dict) -> None:
  """whole_model_error.json: the offset LayerNorm's error and what row storage costs in temp."""
  we = _load(results / "whole_model_error.json")
  if we is None:
    return
  errors = we["offset_layer_norm"]["errors"]
  out["whole_model_error.offset_ln"] = f"{100 * min(errors):.1f}–{100 * max(errors):.1f} %"
  out["whole_model_error.target_8bit"] = f"{100 * we['targets']['error_8bit']:.0f} %"
  rows_cost = [
    r["compressed_2"]["temp_bytes"] / r["rows_off_2"]["temp_bytes"] - 1 for r in we["rows"]
  ]
  out["whole_model_error.rows_temp_cost"] = f"+{100 * max(rows_cost):.0f} %"


def _train_sharded(results: Path, out: dict) -> None:
  """train_sharded.json: the plain model's collectives a step."""
  ts = _load(results / "train_sharded.json")
  if ts is None:
    return
  plain = next(r for r in ts["runs"] if r["variant"] == "plain")
  received = sum(c["bytes"] for c in plain["collectives"].values())
  out["train_sharded.plain.all_reduces"] = str(plain["collectives"]["all-reduce"]["count"])
  out["train_sharded.plain.collective_mib"] = _mib(received, 0)


_GPU_FUSION_MODELS = {
  "lm_6x512": "LM 6x512",
  "resnet50_224": "ResNet-50 224",
  "vit_b16": "ViT-B/16",
  "llama1b_2048": "Llama 1.1B, 2048",
  "llama1b_8192": "Llama 1.1B, 8192",
}


def _gpu_fusion_program(row: dict) -> str:
  if row["mode"] is None:
    return "plain"
  chosen = {i for impls in row["implementations"].values() for i in impls}
  kernels = "/".join(sorted(chosen - {"xla"})) + " kernels"
  how = "XLA quantizer" if row["mode"] == "xla" else kernels
  how += " (some calls XLA)" if row["mode"] == "kernel" and "xla" in chosen else ""
  return f"{row['config'][4:]} bits, {how}"


def _gpu_fusion(results: Path, out: dict) -> None:
  """gpu_fusion.json: where the compression lands in XLA:GPU's program, and its compile time."""
  payload = _load(results / "gpu_fusion.json")
  if payload is None:
    return
  rows = [r for r in payload["rows"] if r["model"] in _GPU_FUSION_MODELS]
  by = {(r["model"], r["config"], r["mode"]): r for r in rows}
  table = [
    "| model | program | launches | GB accessed | CPU-s: trace+lower, XLA compile | vs plain "
    "| residuals: one pass / recomputed / read back | launches, reads of x per residual "
    "| Triton call sites / shape classes / kernels |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    s, t, n = r["summary"], r["triton"], r["summary"]["residuals"]
    cublas = " (cuBLAS gemms)" if r.get("compiler_options") else ""
    cells = [
      _GPU_FUSION_MODELS[r["model"]] + cublas,
      _gpu_fusion_program(r),
      str(r["launches"]),
      f"{r['bytes_accessed'] / 1e9:.1f}",
      f"{r['trace_lower_cpu_s']:.1f}, {r['compile_cpu_s']:.1f}",
      f"{r['vs_plain']['total_cpu']:.1f}x" if "vs_plain" in r else "-",
      f"{s['one pass']} / {s['recomputed']} / {s['read back']}" if n else "-",
      f"{s['compress_ops'] / n:.1f}, {s['x_reads'] / n:.1f}" if n else "-",
      f"{t['call_sites']} / {t['shape_classes']} / {t['distinct']}" if t["call_sites"] else "-",
    ]
    table.append("| " + " | ".join(cells) + " |")
  out["table.gpu_fusion"] = "\n".join(table)
  jact = [r for r in rows if r["mode"] is not None]
  ratio = lambda mode, key: [r["vs_plain"][key] for r in jact if r["mode"] == mode]  # noqa: E731
  out["gpu_fusion.total_xla_over_plain"] = _span(ratio("xla", "total_cpu"))
  out["gpu_fusion.total_kernel_over_plain"] = _span(ratio("kernel", "total_cpu"))
  out["gpu_fusion.compile_xla_over_plain"] = _span(ratio("xla", "compile_cpu"))
  out["gpu_fusion.compile_kernel_over_plain"] = _span(ratio("kernel", "compile_cpu"))
  xla = [r for r in jact if r["mode"] == "xla" and r["summary"]["residuals"]]
  per = lambda r, key: r["summary"][key] / r["summary"]["residuals"]  # noqa: E731
  out["gpu_fusion.xla_ops_per_residual"] = _span([per(r, "compress_ops") for r in xla], 1, "")
  out["gpu_fusion.xla_fewest_ops"] = str(
    min(g["compress_ops_min"] for r in xla for g in r["residuals"])
  )
  kernels = [r for r in jact if r["mode"] == "kernel" and r["triton"]["call_sites"]]
  out["gpu_fusion.kernel_sites"] = _span([r["triton"]["call_sites"] for r in kernels], 0, "")
  out["gpu_fusion.kernel_distinct"] = _span([r["triton"]["distinct"] for r in kernels], 0, "")
  out["gpu_fusion.kernel_classes"] = _span([r["triton"]["shape_classes"] for r in kernels], 0, "")
  pairs = [(a, by.get((a["model"], a["config"], "kernel"))) for a in xla if a["config"] == "jact2"]
  pairs = [(a, b) for a, b in pairs if b is not None]
  for key, name in (("bytes_accessed", "bytes"), ("launches", "launches")):
    ordered = sorted(pairs, key=lambda p: p[0][key] / p[1][key])  # noqa: B023
    out[f"gpu_fusion.{name}_xla_over_kernel"] = ", ".join(
      f"{a[key] / b[key]:.2f}x ({_GPU_FUSION_MODELS[a['model']]})" for a, b in ordered
    )
    out[f"gpu_fusion.{name}_kernel_over_plain"] = _span([b["vs_plain"][key] for _, b in pairs], 2)
  for model, short in (("lm_6x512", "lm"), ("resnet50_224", "resnet50")):
    a = by.get((model, "jact2", "xla"))
    if a is None:
      continue
    s = a["summary"]
    out[f"gpu_fusion.{short}.residuals"] = str(s["residuals"])
    for placement in ("one pass", "recomputed"):
      out[f"gpu_fusion.{short}.{placement.replace(' ', '_')}"] = str(s[placement])


@functools.cache
def compute(results: str) -> dict:
  """name -> figure, from the results folder `results` (a resolved path string)."""
  out: dict[str, str] = {}
  path = Path(results)
  for part in (
    _frontier,
    _gpu_fusion,
    _time_model,
    _bench_fit,
    _compile_time,
    _memory_scaling,
    _grad_error,
    _train_zoo,
    _whole_model,
    _whole_model_error,
    _train_sharded,
  ):
    part(path, out)
  return out
