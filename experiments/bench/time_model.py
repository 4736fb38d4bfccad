"""Predicted step times of XLA:GPU programs (`jact._step_time`) against H200 measurements.

Builds, with abstract arguments only, the train steps whose step times were measured on an
NVIDIA H200 (experiments/results/gpu/2026-11-27-h200-b/r/campaign: ResNet-50 224x224 batch 128,
`bench_train_step`, plain and jact 2/4/8 bits; the transformer LM 6 x 512, length 512, batch 32,
`gpu_lm`, plain, jact 8/4/2 bits and `jact_checkpoint`), compiles each deviceless for the H200
(`jact.compile_for`), predicts its step time from the scheduled HLO, fits the few global
constants of `Calibration` on log time, and prints measured vs predicted per program. The
measurements are jax 0.11.2's programs; the predictions are of this jax's programs.

    python -m experiments.bench.time_model [--json experiments/results/time_model.json]
    python -m experiments.bench.time_model --small --json /tmp/time_model.json   # ~1 min on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import jact
from experiments.bench import bench_train_step
from experiments.lib import blockwise, metadata, paths, resumable, zoo
from jact import _step_time

__all__ = ["MEASURED", "programs", "main"]

CAMPAIGN = paths.RESULTS / "gpu" / "2026-11-27-h200-b" / "r" / "campaign"
LM_METHODS = ("plain", "jact8", "jact4", "jact2", "jact_checkpoint")
RESNET_CONFIGS = (None, 2, 4, 8)


def _campaign_rows():
  resnet = json.loads((CAMPAIGN / "resnet50.json").read_text())["result"]["rows"]
  lm = json.loads((CAMPAIGN / "lm.json").read_text())["result"]["rows"]
  yield from ((f"resnet50/{row['config']}", row) for row in resnet)
  yield from ((f"lm/{row['method']}", row) for row in lm)


def measured_ms() -> dict[str, float]:
  """Step milliseconds of the campaign's programs, named `resnet50/<config>` and `lm/<method>`."""
  return {name: row["step_ms"] for name, row in _campaign_rows()}


def measured_temp_bytes() -> dict[str, int]:
  """XLA's temp bytes of the same programs as compiled on the H200 (with its kernels)."""
  return {name: row["temp_bytes"] for name, row in _campaign_rows()}


MEASURED = measured_ms()


def _resnet_steps(image: int, width: int, stage_sizes, batch: int):
  """(name, step, abstract args) of bench_train_step's ResNet-50 steps, without data or memory."""
  bench = bench_train_step.Bench.__new__(bench_train_step.Bench)  # no data pool, no real state
  bench.image, bench.classes, bench.stem = image, 1000, "imagenet"
  bench.arch = {"width": width, **({"stage_sizes": stage_sizes} if stage_sizes else {})}
  bench.dtype = jnp.dtype(jnp.float32)
  bench.tx = bench_train_step.optax.sgd(bench_train_step.LEARNING_RATE, momentum=0.9)

  def init_state():
    model = bench.model(None)
    x = jnp.zeros((1, image, image, 3), jnp.float32)
    variables = model.init({"params": jax.random.key(0, impl="rbg")}, x, train=False)
    return {
      "variables": variables,
      "opt": bench.tx.init(variables["params"]),
      "step": jnp.zeros((), jnp.int32),
    }

  state = jax.eval_shape(init_state)
  x = jax.ShapeDtypeStruct((batch, image, image, 3), jnp.float32)
  y = jax.ShapeDtypeStruct((batch,), jnp.int32)
  key = jax.random.key(1)
  for bits in RESNET_CONFIGS:
    name = f"resnet50/{bench_train_step.config_name(bits)}"
    yield name, bench.step_fn(bits), (state, x, y, key)


def _lm_steps(layers: int, width: int, length: int, batch: int):
  """(name, step, abstract args) of gpu_lm's transformer LM steps."""
  cfg = zoo.LMConfig(
    emb_dim=width,
    num_heads=max(1, width // 64),
    num_layers=layers,
    mlp_dim=4 * width,
    max_len=length,
  )
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  model = zoo.TransformerLM(cfg)
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
  )
  opt_state = jax.eval_shape(blockwise.optimizer().init, params)
  key = jax.random.key(0)
  for method in LM_METHODS:
    step = blockwise.train_step(blockwise.lm_loss(method, cfg), blockwise.optimizer())
    yield f"lm/{method}", step, (params, opt_state, (tokens, tokens), key)


SMALL = ("resnet50/plain", "resnet50/jact2", "lm/plain", "lm/jact2")


def programs(small: bool = False):
  """(name, step, abstract args) of every measured program (`small`: four of them shrunk)."""
  if small:
    steps = [
      *_resnet_steps(image=32, width=8, stage_sizes=(1, 1, 1, 1), batch=4),
      *_lm_steps(layers=1, width=64, length=32, batch=2),
    ]
    yield from (s for s in steps if s[0] in SMALL)
  else:
    yield from _resnet_steps(image=224, width=64, stage_sizes=None, batch=128)
    yield from _lm_steps(layers=6, width=512, length=512, batch=32)


def predict_all(small: bool, hlo_dir=None):
  """(names, predicted step times at the default calibration, compile seconds, compiled temp
  bytes); with
  `hlo_dir`, each program's scheduled HLO is written there too."""
  names, steps, compile_s, temps = [], [], [], []
  for name, step, args in programs(small):
    t0 = time.perf_counter()
    compiled = jact.compile_for(step, *args, target="h200")
    compile_s.append(time.perf_counter() - t0)
    names.append(name)
    temps.append(int(compiled.memory_analysis().temp_size_in_bytes))
    text = compiled.as_text()
    if hlo_dir:
      Path(hlo_dir).mkdir(parents=True, exist_ok=True)
      (Path(hlo_dir) / (name.replace("/", "_") + ".hlo")).write_text(text)
    steps.append(_step_time.predict_step_time(text, target="h200"))
    print(f"{name}: compiled in {compile_s[-1]:.1f} s; {steps[-1]}", flush=True)
  return names, steps, compile_s, temps


def leave_one_out(steps, measured_s, calibration) -> list[float]:
  """Each program's predicted seconds under constants fitted to the other programs."""
  out = []
  for i in range(len(steps)):
    rest = [j for j in range(len(steps)) if j != i]
    cal = _step_time.fit_calibration(
      [steps[j] for j in rest], [measured_s[j] for j in rest], start=calibration
    )
    out.append(steps[i].with_calibration(cal).seconds)
  return out


def overhead_profile(steps, measured_s, overheads=(2e-6, 5e-6, 1e-5)) -> list[dict]:
  """The fit with the launch overhead held at each of `overheads`: how well the nine rows
  tell the constants apart."""
  out = []
  for overhead in overheads:
    start = _step_time.Calibration(launch_overhead_s=overhead)
    fields = ("matmul_efficiency", "conv_efficiency", "bandwidth_efficiency")
    cal = _step_time.fit_calibration(steps, measured_s, start=start, fields=fields)
    ratios = [s.with_calibration(cal).seconds / m for s, m in zip(steps, measured_s)]
    out.append({"calibration": dataclasses.asdict(cal), "rms_log_error": rms_log(ratios)})
  return out


def rms_log(ratios) -> float | None:
  ratios = [r for r in ratios if r]
  if not ratios:
    return None
  return round(float(sum(math.log(r) ** 2 for r in ratios) / len(ratios)) ** 0.5, 4)


def table(rows) -> str:
  lines = [
    f"{'program':<22} {'measured ms':>11} {'predicted ms':>12} {'ratio':>6} "
    f"{'held-out ms':>11} {'compile s':>9}"
  ]
  for r in rows:
    measured = "-" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}"
    ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
    held = "-" if r.get("held_out_ms") is None else f"{r['held_out_ms']:.1f}"
    lines.append(
      f"{r['program']:<22} {measured:>11} {r['predicted_ms']:>12.1f} {ratio:>6} "
      f"{held:>11} {r['compile_s']:>9.1f}"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m experiments.bench.time_model", description=__doc__.splitlines()[0]
  )
  p.add_argument("--small", action="store_true", help="four shrunk programs, no fit (CPU test)")
  p.add_argument("--json", default=str(paths.RESULTS / "time_model.json"))
  p.add_argument("--hlo-dir", default=None, help="write each program's scheduled HLO here")
  a = p.parse_args(argv)
  names, steps, compile_s, temps = predict_all(a.small, a.hlo_dir)
  device_temps = {} if a.small else measured_temp_bytes()
  measured_s = [None if a.small else MEASURED[n] / 1e3 for n in names]
  calibration = _step_time.DEFAULT_CALIBRATION
  held_out, profile = [None] * len(names), []
  if not a.small:
    calibration = _step_time.fit_calibration(steps, measured_s)
    held_out = leave_one_out(steps, measured_s, calibration)
    profile = overhead_profile(steps, measured_s)
  rows = []
  for name, step, m, c, h, temp in zip(names, steps, measured_s, compile_s, held_out, temps):
    step = step.with_calibration(calibration)
    on_device = device_temps.get(name)
    rows.append(
      {
        "program": name,
        "measured_ms": None if m is None else round(1e3 * m, 3),
        "predicted_ms": round(1e3 * step.seconds, 3),
        "ratio": None if m is None else round(step.seconds / m, 3),
        "held_out_ms": None if h is None else round(1e3 * h, 3),
        "compile_s": round(c, 1),
        "temp_bytes": temp,
        "h200_temp_bytes": on_device,
        "temp_ratio": None if not on_device else round(temp / on_device, 3),
        "tflop": round(step.flops / 1e12, 4),
        "gbytes": round(step.bytes_accessed / 1e9, 3),
        "kernels": step.kernels,
        "by_kind_ms": {k: round(1e3 * v, 3) for k, v in sorted(step.by_kind.items())},
        "notes": list(step.notes),
      }
    )
  ratios = [r["ratio"] for r in rows if r["ratio"]]
  out = {
    "meta": metadata.run_metadata(
      "experiments.bench.time_model",
      argv,
      target="h200",
      small=a.small,
      measured="NVIDIA H200, jax/jaxlib 0.11.2: experiments/results/gpu/2026-11-27-h200-b/r/"
      "campaign/{resnet50,lm}.json (step_ms)",
      temp="temp_bytes: this jax's deviceless XLA:GPU compile (jact's kernels staged in); "
      "h200_temp_bytes: the same step compiled on the H200 (jax 0.11.2)",
      note="predicted_ms: jact._step_time's roofline of this jax's XLA:GPU program (compiled "
      "deviceless for the H200), with the calibration fitted here on log time to all rows; "
      "held_out_ms: fitted to the other rows only. Predictions, not measurements; the "
      "measurements are of jax 0.11.2's programs, the predictions of "
      f"jax {jax.__version__}'s.",
    ),
    "calibration": dataclasses.asdict(calibration),
    "rms_log_error": rms_log(ratios),
    "held_out_rms_log_error": rms_log(
      [r["held_out_ms"] / r["measured_ms"] for r in rows if r["held_out_ms"] and r["measured_ms"]]
    ),
    "fixed_overhead_fits": profile,
    "rows": rows,
  }
  resumable.write_json(a.json, out)
  print(table(rows))
  print(f"calibration: {calibration}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
