"""The tables and figures `experiments/results/gpu/README.md` quotes (`gpu.*`), from the campaigns'
committed JSON (and, for a run its timeout cut before the JSON, the lines its log printed).

Names: `table.gpu.<session>.<measure>` (generated blocks), `gpu.<session>.<figure>` (inline).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

__all__ = ["compute"]

SESSION_B = "2026-11-27-h200-b"
SESSION_ORDERING = "2026-11-27-h200-ordering"


def _load(path: Path):
  return json.loads(path.read_text()) if path.exists() else None


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _mib(b: float) -> str:
  return f"{b / 2**20:.1f} MiB"


def _mb(b: float) -> str:
  return f"{b / 1e6:.1f} MB"


def _pct(ratio: float) -> str:
  return f"{100 * (ratio - 1):.0f} %"


def _resnet50(gpu: Path, out: dict) -> None:
  run = _load(gpu / SESSION_B / "r" / "campaign" / "resnet50.json")
  if run is None:
    return
  rows = run["result"]["rows"]
  plain = next(r for r in rows if r["config"] == "plain")
  cells = []
  for r in sorted(rows, key=lambda r: (r["bits"] is not None, r["bits"] or 0)):
    label = "plain" if r["bits"] is None else f"jact {r['bits']} bits ({r['kernel']})"
    step, temp = f"{r['step_ms']:.1f} ms", _mib(r["temp_bytes"])
    if r is not plain:
      step += f" ({r['step_ms'] / plain['step_ms']:.2f}x)"
      temp += f" ({plain['temp_bytes'] / r['temp_bytes']:.1f}x less)"
    cells.append([label, step, temp, f"{r['compile_s']:.0f} s"])
  out[f"table.gpu.{SESSION_B}.resnet50"] = _table(
    ["ResNet-50 224², batch 128 (`bench_train_step`)", "step", "compiled temp", "compile"], cells
  )


def _lm(gpu: Path, out: dict) -> None:
  run = _load(gpu / SESSION_B / "r" / "campaign" / "lm.json")
  if run is None:
    return
  labels = {"plain": "plain", "jact_checkpoint": "`jact.checkpoint`"}
  cells = [
    [
      labels.get(r["method"], re.sub(r"jact(\d+)", r"jact \1 bits", r["method"])),
      f"{r['step_ms']:.1f} ms",
      _mb(r["temp_bytes"]),
      f"{r['compile_s']:.0f} s",
    ]
    for r in run["result"]["rows"]
  ]
  out[f"table.gpu.{SESSION_B}.lm"] = _table(
    ["transformer LM 6 x 512, length 512, batch 32 (`gpu_lm`)", "step", "compiled temp", "compile"],
    cells,
  )


def _ordering_rows(rows: list[dict], title: str) -> str:
  cells = [
    [f"{r['workload']} [{r['mode']}]", _mb(r["temp_bytes"]), f"{r['ms']:.2f} ms"] for r in rows
  ]
  return _table([title, "compiled temp", "step"], cells)


def _ordering(gpu: Path, out: dict) -> None:
  run = _load(gpu / SESSION_B / "o" / "ordering.json")
  if run is not None:
    rows = run["ordering"]
    out[f"table.gpu.{SESSION_B}.ordering"] = _ordering_rows(rows, "ResNet-18 CIFAR (`ordering`)")
    ties = next(r for r in rows if r["mode"] == "ties")
    out[f"gpu.{SESSION_B}.ordering.ties_temp"] = _pct(ties["temp_vs_shipped"])
    out[f"gpu.{SESSION_B}.ordering.ties_time"] = _pct(ties["time_vs_shipped"])
  log = gpu / SESSION_ORDERING / "ordering.log"
  if log.exists():  # cut by its timeout before the JSON: the rows its log printed
    found = re.findall(
      r"^\s+(.+?) \[(\w+)\]: temp_bytes (\d+), ms ([\d.]+)$", log.read_text(), re.M
    )
    rows = [dict(workload=w, mode=m, temp_bytes=int(t), ms=float(ms)) for w, m, t, ms in found]
    out[f"table.gpu.{SESSION_ORDERING}.transformer"] = _ordering_rows(
      rows, "8 pre-LN transformer blocks, batch (16, 256, 256)"
    )
    shipped, ties = (next(r for r in rows[1:] if r["mode"] == m) for m in ("shipped", "ties"))
    for key, r in (("plain", rows[0]), ("shipped", shipped), ("ties", ties)):
      out[f"gpu.{SESSION_ORDERING}.{key}.temp"] = _mb(r["temp_bytes"])
      out[f"gpu.{SESSION_ORDERING}.{key}.step"] = f"{r['ms']:.2f} ms"
    out[f"gpu.{SESSION_ORDERING}.ties_time"] = _pct(ties["ms"] / shipped["ms"])


def _measures(gpu: Path, out: dict) -> None:
  run = _load(gpu / SESSION_B / "m" / "measures.json")
  if run is None:
    return
  out[f"table.gpu.{SESSION_B}.compressors"] = _table(
    ["compressor", "stored / input", "compress", "decompress"],
    [
      [
        r["compressor"],
        f"1/{r['ratio']:.1f}",
        f"{r['compress_gbps'] / 1000:.2f} TB/s",
        f"{r['decompress_gbps'] / 1000:.2f} TB/s",
      ]
      for r in run["compressors"]
    ],
  )
  out[f"table.gpu.{SESSION_B}.attention"] = _table(
    ["attention (`gpu_measures attention`)", "length", "step", "temp"],
    [
      [r["variant"], str(r["length"]), f"{r['ms']:.2f} ms", _mb(r["temp_bytes"])]
      for r in run["attention"]
    ],
  )
  out[f"table.gpu.{SESSION_B}.offload"] = _table(
    ["pre-LN transformer stack (`gpu_measures offload`)", "step", "device temp"],
    [[r["variant"], f"{r['ms']:.1f} ms", _mb(r["temp_bytes"])] for r in run["offload"]],
  )
  grid = run["relu_grid"]
  out[f"gpu.{SESSION_B}.relu_grid.exact"] = (
    "bit-exact on every row shape"
    if all(r["bit_exact_vs_xla"] for r in grid if r.get("bit_exact_vs_xla") is not None)
    else "not bit-exact on every row shape"
  )


@functools.cache
def compute(results: str) -> dict:
  """name -> figure, from the GPU folders under the results folder `results`."""
  out: dict[str, str] = {}
  gpu = Path(results) / "gpu"
  for part in (_resnet50, _lm, _ordering, _measures):
    part(gpu, out)
  return out
