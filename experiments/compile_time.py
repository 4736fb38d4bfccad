"""How long the jitted gradient of a zoo model takes to trace, lower and compile.

For each model of `experiments/zoo.py`, compares the plain model with
`jact.convert(model, bits=b)` and with `jact.compressed` around the whole
model (`experiments/zoo_harness.variant_fns`), timing separately

* trace: `jax.jit(jax.grad(loss)).trace(...)` (Python: the model and jact);
* lower: `.lower()` (to StableHLO);
* compile: `.compile()` (XLA's passes and code generation), as wall seconds
  and as this process's CPU seconds (less sensitive to other processes on a
  shared machine; XLA:CPU compiles on several threads, so it can exceed wall);

and recording sizes that explain them: jaxpr equations (nested ones
included), lines of the lowered StableHLO and fusions in the optimized HLO
(XLA:CPU emits one kernel per fusion that is not a duplicate of another).
Each figure is the minimum over `--repeat` runs. Ratios are variant / plain.

    python -m experiments.compile_time [--models NAME ...] [--bits 2] [--repeat 1] [--json PATH]

writes `experiments/results/compile_time.json` (default) with the rows and
the run's metadata (commit, versions, date, machine, load average).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import flax
import jax

from experiments.zoo import CASES
from experiments.zoo_harness import variant_fns

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_MODELS = ("mnist_cnn", "transformer_lm", "bilstm_sst2", "resnet18")


def meta(argv) -> dict:
  root = Path(__file__).parents[1]
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True, cwd=root).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "jact"], capture_output=True,
                                text=True, check=True, cwd=root).stdout.strip())
  except (OSError, subprocess.CalledProcessError):
    commit, dirty = None, None
  return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": "python -m experiments.compile_time " + " ".join(argv),
          "jax": jax.__version__, "flax": flax.__version__, "backend": jax.default_backend(),
          "machine": f"{platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()}",
          "python": platform.python_version(), "git_commit": commit,
          "jact_tree_modified": dirty, "load_average_start": os.getloadavg()}


def count_eqns(jaxpr) -> int:
  """Equations of a jaxpr, those of nested jaxprs (jit, custom_vjp, scan...) included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(inner, "eqns"):
          n += count_eqns(inner)
  return n


def measure_once(case, variant: str, bits: int | None, batch, key) -> dict:
  fns = variant_fns(case, variant, bits)
  args = (fns.params, fns.state, batch, key)
  grad = jax.jit(jax.grad(fns.loss, has_aux=True))
  start = time.perf_counter()
  traced = grad.trace(*args)
  traced_at = time.perf_counter()
  lowered = traced.lower()
  lowered_at, cpu_start = time.perf_counter(), time.process_time()
  compiled = lowered.compile()
  done, cpu_done = time.perf_counter(), time.process_time()
  return {"trace_s": traced_at - start, "lower_s": lowered_at - traced_at,
          "compile_s": done - lowered_at, "compile_cpu_s": cpu_done - cpu_start,
          "jaxpr_eqns": count_eqns(traced.jaxpr.jaxpr),
          "stablehlo_lines": lowered.as_text().count("\n"),
          "fusions": compiled.as_text().count(" fusion("),
          "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes)}


def measure(case, variant: str, bits: int | None, repeat: int) -> dict:
  row = {"model": case.name, "framework": case.framework, "variant": variant, "bits": bits}
  batch, key = case.batch(0), jax.random.key(1)
  try:
    runs = [measure_once(case, variant, bits, batch, key) for _ in range(repeat)]
  except Exception as e:  # pylint: disable=broad-except  # recorded, the table goes on
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return row
  for k in runs[0]:
    row[k] = min(r[k] for r in runs)
  return row


def with_ratios(row, plain) -> dict:
  if "error" not in row and "error" not in plain:
    for k in ("trace_s", "lower_s", "compile_s", "compile_cpu_s", "fusions", "stablehlo_lines"):
      row[k.removesuffix("_s") + "_ratio"] = row[k] / max(plain[k], 1e-9)
  return row


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(CASES))
  parser.add_argument("--variants", nargs="+", default=["convert", "compressed"],
                      choices=["convert", "compressed"])
  parser.add_argument("--bits", type=int, default=2)
  parser.add_argument("--repeat", type=int, default=1)
  parser.add_argument("--json", type=Path, default=RESULTS / "compile_time.json")
  args = parser.parse_args(argv)
  info, rows = meta(argv), []
  for name in args.models:
    case = CASES[name]
    plain = measure(case, "plain", None, args.repeat)
    rows.append(plain)
    for variant in args.variants:
      rows.append(with_ratios(measure(case, variant, args.bits, args.repeat), plain))
    for r in rows[-1 - len(args.variants):]:
      figures = ("error: " + r["error"]) if "error" in r else (
          f"trace {r['trace_s']:6.2f}s lower {r['lower_s']:5.2f}s compile {r['compile_s']:6.2f}s"
          f" (cpu {r['compile_cpu_s']:6.2f}s, x{r.get('compile_cpu_ratio', 1):.1f})"
          f" fusions {r['fusions']:5d} eqns {r['jaxpr_eqns']:6d}")
      print(f"{r['model']:15s} {r['variant']:10s} {figures}", flush=True)
  info["load_average_end"] = os.getloadavg()
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
