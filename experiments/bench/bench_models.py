"""What jact does to unmodified Flax example models (issue 16).

For each model of `experiments/lib/zoo.py`, written as Flax examples write them,
compares the plain model with `jact.convert(model, bits=b)` and with
`jact.compressed` around the whole model (see `experiments/lib/zoo_harness.py`):

* fwd_diff: max |logits - plain logits| of a training forward pass;
* saved: bytes saved for the backward pass (`jact.residual_report`), and of
  those the bytes without a `checkpoint_name` (`unnamed`: what no jact op
  named; inside `jax.shard_map` -- the ResNet's step -- every residual is
  reported as an unnamed output of shard_map, so there it is all of them);
* temp: compiled temp bytes of the jitted gradient (compile only);
* compile: seconds to lower and compile the jitted gradient;
* step: seconds per gradient evaluation (median of a few after warm-up);
* grad_err: ||g - g_exact|| / ||g_exact|| for one rounding draw.

Ratios are plain / variant for bytes and variant / plain for times, all
from the same run. A variant that fails is recorded with its error.

    python -m experiments.bench.bench_models [--quick] [--models NAME ...] [--json PATH]

writes `experiments/results/bench_models.json` (default) with the rows, the
issue's targets and whether they are met, and the run's metadata.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import jact
from experiments.lib import memory, metadata, paths, timing
from experiments.lib.zoo import CASES
from experiments.lib.zoo_harness import flat, variant_fns

RESULTS = paths.RESULTS
TARGET_MODELS = ("resnet18", "bilstm_sst2", "transformer_lm")
ERROR_MODELS = ("resnet18", "transformer_lm")


def _unnamed_bytes(report) -> int:
  return sum(r.bytes for r in report.residuals if not r.is_argument and r.name is None)


def measure(case, variant, bits, batch, key, steps, reference=None) -> dict:
  """One row; `reference` is the plain row's (logits, gradient) or None."""
  row = {"model": case.name, "framework": case.framework, "variant": variant, "bits": bits}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      fns = variant_fns(case, variant, bits)
      args = (fns.params, fns.state, batch, key)
      logits = jax.jit(fns.forward)(*args)[0]
      report = jact.residual_report(
        lambda p, s, b: fns.loss(p, s, b, key)[0], fns.params, fns.state, batch
      )
      row["saved_bytes"] = report.total_bytes
      row["unnamed_bytes"] = _unnamed_bytes(report)
      start = time.perf_counter()
      compiled = jax.jit(jax.grad(fns.loss, has_aux=True)).lower(*args).compile()
      row["compile_s"] = time.perf_counter() - start
      row["temp_bytes"] = memory.compiled_memory_of(compiled).temp_bytes
      grad = flat(compiled(*args)[0])
      row["step_s"] = timing.median_seconds(compiled, *args, calls=steps)
      row["finite"] = bool(jnp.all(jnp.isfinite(grad)))
      if reference is not None:
        ref_logits, ref_grad = reference
        row["fwd_diff"] = float(jnp.max(jnp.abs(logits - ref_logits)))
        row["grad_err"] = float(jnp.linalg.norm(grad - ref_grad) / jnp.linalg.norm(ref_grad))
      row["_reference"] = (logits, grad)
    except Exception as e:  # pylint: disable=broad-except  # recorded, the table goes on
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  messages = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})
  if messages:
    row["warnings"] = messages
  return row


def with_ratios(row, plain):
  if "error" in row or "error" in plain:
    return row
  row["saved_ratio"] = plain["saved_bytes"] / max(row["saved_bytes"], 1)
  row["temp_ratio"] = plain["temp_bytes"] / max(row["temp_bytes"], 1)
  row["compile_ratio"] = row["compile_s"] / plain["compile_s"]
  row["step_ratio"] = row["step_s"] / plain["step_s"]
  return row


def bench_case(case, bits_list, steps, log) -> list[dict]:
  batch, key = case.batch(0), jax.random.key(1)
  plain = measure(case, "plain", None, batch, key, steps)
  log(plain)
  reference = plain.pop("_reference", None)
  rows = [plain]
  for variant in ("convert", "compressed"):
    for bits in bits_list:
      row = measure(case, variant, bits, batch, key, steps, reference)
      row.pop("_reference", None)
      rows.append(with_ratios(row, plain))
      log(row)
  return rows


def _mb(n):
  return f"{n / 2**20:7.2f}" if n is not None else "      -"


def format_row(r) -> str:
  head = f"{r['model']:<15} {r['variant']:<10} {str(r['bits'] or '-'):>4}"
  if "error" in r:
    return f"{head}  FAILED {r['error'][:110]}"
  ratio = lambda k: f"{r[k]:5.2f}x" if k in r else "     -"
  err = f"{r['grad_err']:.2e}" if "grad_err" in r else "       -"
  fwd = f"{r['fwd_diff']:.1e}" if "fwd_diff" in r else "      -"
  return (
    f"{head} {fwd} {_mb(r['saved_bytes'])} ({ratio('saved_ratio')}) "
    f"unnamed {_mb(r['unnamed_bytes'])}"
    f" {_mb(r['temp_bytes'])} ({ratio('temp_ratio')}) "
    f"{r['compile_s']:6.1f}s ({ratio('compile_ratio')})"
    f" {r['step_s'] * 1e3:7.1f}ms ({ratio('step_ratio')}) {err}{'' if r['finite'] else ' NaN'}"
  )


HEADER = (
  "model           variant    bits fwd_diff saved MiB (ratio)  unnamed MiB temp MiB (ratio)"
  "  compile (ratio)  step (ratio)  grad_err"
)


def _row(rows, model, variant, bits):
  for r in rows:
    if r["model"] == model and r["variant"] == variant and r["bits"] == bits:
      return r
  return None


def targets(rows) -> list[dict]:
  """The issue's targets, each with the figures it was judged on."""
  out = []

  def add(what, model, variant, bits, key, test):
    r = _row(rows, model, variant, bits)
    if r is None or (key == "finite" and "error" in r):  # a failed row is listed by its error
      return
    value = r.get(key)
    out.append(
      {
        "target": what,
        "model": model,
        "variant": variant,
        "bits": bits,
        key: value,
        "met": bool(value is not None and test(value)),
        **({"error": r["error"]} if "error" in r else {}),
      }
    )

  for model in TARGET_MODELS:
    for variant in ("convert", "compressed"):
      add("compiled temp cut >= 3x at 2 bits", model, variant, 2, "temp_ratio", lambda v: v >= 3)
  for model in ERROR_MODELS:
    for variant in ("convert", "compressed"):
      add("gradient error < 0.5% at 8 bits", model, variant, 8, "grad_err", lambda v: v < 5e-3)
      add("gradient error < 5% at 4 bits", model, variant, 4, "grad_err", lambda v: v < 5e-2)
  for r in rows:
    if r["variant"] != "plain":
      add(
        "compile time within 2x of plain",
        r["model"],
        r["variant"],
        r["bits"],
        "compile_ratio",
        lambda v: v <= 2,
      )
      add(
        "no NaN at any bit width where plain is finite",
        r["model"],
        r["variant"],
        r["bits"],
        "finite",
        lambda v: v,
      )
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="bits 8 and 2 only, one timed step")
  parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
  parser.add_argument("--json", default=str(RESULTS / "bench_models.json"))
  args = parser.parse_args(argv)
  run_meta = metadata.run_metadata(
    "experiments.bench.bench_models", argv
  )  # the library as the run starts
  bits_list = (8, 2) if args.quick else (8, 4, 2)
  steps = 1 if args.quick else 3
  print(HEADER, flush=True)
  rows = []
  for name in args.models:
    rows += bench_case(CASES[name], bits_list, steps, lambda r: print(format_row(r), flush=True))
  checks = targets(rows)
  print("\ntargets:")
  for t in checks:
    value = {
      k: v for k, v in t.items() if k not in ("target", "model", "variant", "bits", "met", "error")
    }
    print(
      f"  {'MET ' if t['met'] else 'MISS'} {t['target']:<48} {t['model']:<15} {t['variant']:<10} "
      f"bits={t['bits']} {value}{' ' + t['error'][:80] if 'error' in t else ''}"
    )
  path = Path(args.json)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"meta": run_meta, "rows": rows, "targets": checks}, indent=1) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
