"""Reading `experiments/results/frontier.json`: tables, each model's frontier plot, and the
one-line summary README carries (generated here, checked against README by a test)."""

from __future__ import annotations

import json
import pathlib

__all__ = ["load", "kind", "table", "plot", "summary_line", "floors"]

JAX_CONFIGS = (
  "plain",
  "remat_nothing",
  "remat_dots",
  "remat_dots_no_batch",
  "remat_names",
  "offload_inputs",
)
GIB = 2**30


def load(path) -> dict:
  return json.loads(pathlib.Path(path).read_text())


def kind(config: str) -> str:
  """ "jax" (plain and JAX's policies), "jact" (compressed, jact.checkpoint) or "fit"."""
  if config.startswith("fit_"):
    return "fit"
  return "jax" if config in JAX_CONFIGS else "jact"


def _measured(payload: dict, model: str, attention: str) -> list[dict]:
  return [
    r
    for r in payload["rows"]
    if r["model"] == model and r["attention"] == attention and "peak_bytes" in r
  ]


def table(payload: dict, model: str, attention: str) -> str:
  """A markdown table of one model's rows: peak, predicted step, compile seconds."""
  rows = _measured(payload, model, attention)
  plain = next((r for r in rows if r["config"] == "plain"), None)
  unit, scale = (
    ("GiB", GIB)
    if max((r["peak_bytes"] for r in rows), default=0) >= GIB
    else (
      "MiB",
      2**20,
    )
  )
  lines = [
    f"**{model}**, attention {attention} (XLA:GPU for an H200, compiled on a CPU; step times "
    "predicted, not measured)",
    "",
    f"| configuration | peak {unit} | x plain | predicted ms | x plain | compile s | chose |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    ratio = lambda k: f"{r[k] / plain[k]:.2f}" if plain else ""
    lines.append(
      f"| {r['config']} | {r['peak_bytes'] / scale:.2f} | {ratio('peak_bytes')} | "
      f"{r['predicted_ms']:.1f} | {ratio('predicted_ms')} | {r['compile_s']:.1f} | "
      f"{r.get('chose', '')} |"
    )
  refused = [r for r in payload["rows"] if r["model"] == model and "peak_bytes" not in r]
  for r in refused:
    if r["attention"] == attention:
      lines.append(f"| {r['config']} | - | | | | | {r.get('why') or r.get('error', '')[:80]} |")
  return "\n".join(lines)


def plot(payload: dict, model: str, attention: str, ax) -> None:
  """Peak memory against predicted step time, JAX's configurations and jact's."""
  styles = {"jax": ("o", "tab:blue"), "jact": ("s", "tab:orange"), "fit": ("*", "tab:green")}
  for r in _measured(payload, model, attention):
    marker, color = styles[kind(r["config"])]
    ax.scatter(r["predicted_ms"], r["peak_bytes"] / GIB, marker=marker, color=color, s=40)
    ax.annotate(r["config"], (r["predicted_ms"], r["peak_bytes"] / GIB), fontsize=7)
  for name, (marker, color) in styles.items():
    ax.scatter([], [], marker=marker, color=color, label=name)
  ax.set_xlabel("predicted step (ms, H200 roofline)")
  ax.set_ylabel("compiled peak (GiB)")
  ax.set_title(f"{model} ({attention} attention)", fontsize=9)
  ax.legend(fontsize=7)


def floors(payload: dict, model: str, attention: str) -> dict:
  """The lowest peak JAX's configurations reach and jact's (with their predicted times)."""
  rows = _measured(payload, model, attention)
  best = {}
  for side in ("jax", "jact"):
    mine = [r for r in rows if kind(r["config"]) == side]
    if mine:
      low = min(mine, key=lambda r: r["peak_bytes"])
      best[side] = (low["config"], low["peak_bytes"], low["predicted_ms"])
  return best


def summary_line(payload: dict) -> str:
  """README's one line: per model, JAX's and jact's lowest XLA:GPU peak."""
  parts = []
  models = dict.fromkeys(r["model"] for r in payload["rows"])
  for model in models:
    best = floors(payload, model, "xla")
    if "jax" in best and "jact" in best:
      (jc, jp, jt), (ac, ap, at) = best["jax"], best["jact"]
      parts.append(
        f"{model} {jp / GIB:.2f} GiB ({jc}, {jt:.0f} ms) vs {ap / GIB:.2f} GiB ({ac}, {at:.0f} ms)"
      )
  return (
    "Frontier (XLA:GPU for an H200, compiled on a CPU, attention as written; the lowest peak "
    "of JAX's policies vs jact's, step times predicted): " + "; ".join(parts) + "."
  )
