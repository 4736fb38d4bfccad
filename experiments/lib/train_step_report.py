"""Rows and tables of `experiments.bench.bench_train_step`: ratios to plain, progress lines."""

from __future__ import annotations

from experiments.lib import memory

__all__ = ["add_ratios", "progress_line", "table"]


def add_ratios(rows: list[dict]) -> None:
  """images/s ratio (jact / plain) and temp ratio (plain / jact) at the same batch."""
  plain = {r["batch"]: r for r in rows if r["bits"] is None and not r.get("oom")}
  for r in rows:
    base = plain.get(r["batch"])
    if base is not None and not r.get("oom"):
      r["throughput_ratio"] = r["images_per_s"] / base["images_per_s"]
      r["temp_reduction"] = base["temp_bytes"] / r["temp_bytes"]


def progress_line(row: dict) -> str:
  if row.get("oom"):
    return f"{row['config']:8s} batch {row['batch']}: out of memory"
  return (
    f"{row['config']:8s} batch {row['batch']}: {row['step_ms']:.1f} ms/step, "
    f"{row['images_per_s']:.1f} img/s, temp {row['temp_bytes'] / memory.MIB:.1f} MiB, "
    f"loss {row['loss'] if row['loss'] is None else round(row['loss'], 3)}, "
    f"compiled in {row['compile_s']:.0f} s"
  )


def table(rows: list[dict], searches: list[dict]) -> str:
  lines = (
    [
      f"{'config':8s} {'kernel':>13s} {'batch':>6s} {'step ms':>9s} {'spread':>15s} "
      f"{'img/s':>9s} {'ratio':>6s} {'temp MiB':>9s}"
    ]
    if rows
    else []
  )
  for r in rows:
    if r.get("oom"):
      lines.append(
        f"{r['config']:8s} {str(r['kernel'] or '-'):>13s} {r['batch']:6d}  out of memory"
      )
      continue
    ratio = f"{r['throughput_ratio']:.2f}" if "throughput_ratio" in r else "-"
    spread = f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}"
    lines.append(
      f"{r['config']:8s} {str(r['kernel'] or '-'):>13s} {r['batch']:6d} "
      f"{r['step_ms']:9.1f} {spread:>15s} {r['images_per_s']:9.1f} {ratio:>6s} "
      f"{r['temp_bytes'] / memory.MIB:9.1f}"
    )
  if searches:
    lines += [""] * bool(rows) + [
      f"{'config':8s} {'predicted':>10s} {'verified':>9s} {'img/s':>9s} "
      f"{'limit MiB':>10s} {'compiles':>9s}"
    ]
    for s in searches:
      rate = f"{s['images_per_s_rough']:.1f}" if "images_per_s_rough" in s else "-"
      lines.append(
        f"{s['config']:8s} {s['predicted_batch']:10d} {s['verified_batch']:9d} "
        f"{rate:>9s} {s['limit_bytes'] / memory.MIB:10.0f} {s['compiles']:9d}"
      )
  return "\n".join(lines)
