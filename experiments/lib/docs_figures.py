"""Figures hand-written docs pages quote inline (`<!-- fig:NAME -->`), from experiments/results/.

One function per results file adds its names to a dict; `experiments.claims` merges them with
`experiments.lib.claims_figures`'.
"""

from __future__ import annotations

import functools
import json
import math
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


@functools.cache
def compute(results: str) -> dict:
  """name -> figure, from the results folder `results` (a resolved path string)."""
  out: dict[str, str] = {}
  path = Path(results)
  for part in (_frontier, _time_model):
    part(path, out)
  return out
