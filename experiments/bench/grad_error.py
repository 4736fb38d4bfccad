"""Gradient error of jact on unmodified zoo models (issue 16 item 2).

For each model, variant (`compressed`: `jact.compressed` around the whole
model; `convert`: `jact.convert`) and width, on the first training batch of
real data (CIFAR-10, SST-2, tiny Shakespeare: the loaders of
`experiments.bench.train_zoo`), the relative error
||g - g_exact|| / ||g_exact|| of the parameter gradient against the plain
model's, for one rounding draw (`single`, key 1) and for the mean of
`--draws` draws (`mean`: variance shrinks like 1/draws, a bias would not), and
whether every draw's gradient is finite. Targets (issue 16): single-draw
error below 0.5% at 8 bits and 5% at 4 bits; finite at 2 bits.

Each row also names the parameters the single-draw error comes from
(`largest_errors`: a parameter's share of ||g - g_exact||^2 and of
||g_exact||^2), which tells a few badly stored residuals from noise spread
over the whole model.

    python -m experiments.bench.grad_error [--models resnet18 transformer_lm] [--bits 8 4 2]
        [--variants compressed convert] [--draws 8] [--json PATH]

writes `experiments/results/grad_error.json` (default) with the rows and the
run's metadata (commit, versions, date, command). One compile per
(model, variant, width): the key is an argument of the jitted gradient.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments.lib import metadata, paths, zoo_data
from experiments.lib.zoo import CASES
from experiments.lib.zoo_harness import flat, variant_fns

RESULTS = paths.RESULTS
TARGETS = {8: 0.005, 4: 0.05}


def exact_gradient(case, batch):
  fns = variant_fns(case, "plain")
  grad = jax.jit(jax.grad(lambda p, k: fns.loss(p, fns.state, batch, k)[0]))
  return flat(grad(fns.params, jax.random.key(1)))


def largest_errors(params, error, exact, top: int = 4) -> list[dict]:
  """The `top` parameters with the largest share of ||error||^2, with their
  share of ||exact||^2 (both flat, in `params`' leaf order)."""
  total_error, total_exact = float(jnp.sum(error**2)), float(jnp.sum(exact**2))
  rows, start = [], 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    stop = start + leaf.size
    rows.append(
      {
        "param": jax.tree_util.keystr(path),
        "error_share": float(jnp.sum(error[start:stop] ** 2)) / total_error,
        "gradient_share": float(jnp.sum(exact[start:stop] ** 2)) / total_exact,
      }
    )
    start = stop
  rows.sort(key=lambda r: -r["error_share"])
  return [
    {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows[:top]
  ]


def measure(case, variant: str, bits: int, batch, exact, draws: int) -> dict:
  """One row: single-draw and `draws`-mean relative errors of `variant` at `bits`."""
  row = {"model": case.name, "variant": variant, "bits": bits}
  try:
    fns = variant_fns(case, variant, bits)
    grad = jax.jit(jax.grad(lambda p, k: fns.loss(p, fns.state, batch, k)[0]))
    start = time.perf_counter()
    grad = grad.lower(fns.params, jax.random.key(0)).compile()
    row["compile_s"] = round(time.perf_counter() - start, 1)
    grads = [flat(grad(fns.params, jax.random.key(k))) for k in range(1, draws + 1)]
    norm = jnp.linalg.norm(exact)
    row["single"] = float(jnp.linalg.norm(grads[0] - exact) / norm)
    row["largest_errors"] = largest_errors(fns.params, grads[0] - exact, exact)
    row["mean"] = float(jnp.linalg.norm(sum(grads) / draws - exact) / norm)
    row["draws"] = draws
    row["finite"] = bool(all(jnp.all(jnp.isfinite(g)) for g in grads))
    if bits in TARGETS:
      row["target"] = TARGETS[bits]
      row["met"] = row["single"] < TARGETS[bits]
  except Exception as e:  # pylint: disable=broad-except  # recorded, the table goes on
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  return row


def format_row(r: dict) -> str:
  head = f"{r['model']:15s} {r['variant']:10s} {r['bits']:>2} bits"
  if "error" in r:
    return f"{head}  FAILED {r['error'][:100]}"
  met = (
    ""
    if "met" not in r
    else ("  target met" if r["met"] else f"  target {r['target']:.1%} NOT met")
  )
  top = r["largest_errors"][0]
  return (
    f"{head}  single {r['single']:7.2%}  mean of {r['draws']} {r['mean']:7.2%}  "
    f"finite {r['finite']}  compile {r['compile_s']:.0f}s{met}\n"
    f"{'':26s}largest error: {top['param']} ({top['error_share']:.0%} of the error, "
    f"{top['gradient_share']:.0%} of the gradient)"
  )


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--models", nargs="+", default=["resnet18", "transformer_lm"], choices=sorted(zoo_data.DATA)
  )
  parser.add_argument(
    "--variants", nargs="+", default=["compressed", "convert"], choices=["compressed", "convert"]
  )
  parser.add_argument("--bits", nargs="+", type=int, default=[8, 4, 2])
  parser.add_argument("--draws", type=int, default=8)
  parser.add_argument("--json", default=str(RESULTS / "grad_error.json"))
  args = parser.parse_args(argv)
  info = metadata.run_metadata("experiments.bench.grad_error", argv)
  info["command"] = "python -m experiments.bench.grad_error " + " ".join(argv)
  rows = []
  for name in args.models:
    case = CASES[name]
    batch = next(zoo_data.DATA[name](0)[0])
    exact = exact_gradient(case, batch)
    for variant in args.variants:
      for bits in args.bits:
        rows.append(measure(case, variant, bits, batch, exact, args.draws))
        print(format_row(rows[-1]), flush=True)
  Path(args.json).parent.mkdir(parents=True, exist_ok=True)
  Path(args.json).write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
