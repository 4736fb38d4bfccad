"""Gradient variance vs bits on the CIFAR ResNet-20 (ActNN Fig. 5 style), over training.

ActNN's theory: a compressed gradient is unbiased and its variance is the
minibatch sampling variance plus a compression term that shrinks as
(2^b - 1)^-2; at 2 bits the compression term should already be small next to
the sampling term, and adaptive (per-layer / per-sample) widths should beat
uniform ones at the same average. This measures both terms on the
`experiments.papers.actnn_cifar` ResNet-20 at the parameters of its full-precision
run after each epoch (`--runs`; epoch 0 is the shared initialization):

* sampling variance: the summed per-coordinate variance of exact gradients of
  `--sampling-batches` independent training minibatches of `--batch` images;
* compression variance: for one fixed minibatch, the summed variance of the
  compressed gradient over `--keys` rounding seeds, for uniform 1/2/4/8-bit
  plans and for the plans chosen by `jact.Controller` with the ActNN analytic
  estimator (per-sample, L3) and the GACT numeric estimator at 2 bits average.

Writes `<results>/grad_variance.json` after every checkpoint (`complete`
false until the last) and `grad_variance.png`; a rerun with the same settings
keeps the checkpoints already measured and measures only the others (`--fresh`
measures all again). Cost: about 100 gradients of 128 images per checkpoint
(16 exact, 8 for each of six plans, the numeric estimator's 1 + L with L = 36
residuals) plus a compile per plan; one checkpoint took over 50 CPU-minutes on a
2-core machine shared with three other runs.

    python -m experiments.papers.grad_variance             # after experiments.papers.actnn_cifar --variants fp
    python -m experiments.papers.grad_variance --small     # a minute: small net, initialization only
"""  # noqa: E501 (tables and commands in this docstring)

from __future__ import annotations

import argparse
import functools
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jact
from experiments.lib import data as data_lib
from experiments.lib import metadata, paths, preact, resumable

__all__ = [
  "flat_gradient",
  "sampling_variance",
  "compression_variance",
  "adaptive_plan",
  "estimator_rows",
  "measure_checkpoint",
  "plot",
  "main",
]

UNIFORM_BITS = (1, 2, 4, 8)
ESTIMATORS = {
  "actnn_l3": dict(estimator="analytic", per_sample=True, allowed=jact.allocate.ACTNN_WIDTHS),
  "gact_numeric": dict(estimator="numeric"),
}


def flat_gradient(grad, params, batch, key, plan=None) -> np.ndarray:
  """The gradient as one float64 vector."""
  g = grad(params, batch, key, plan=plan)
  return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(g)])


def _summed_variance(vectors) -> float:
  return float(np.stack(vectors).var(axis=0, ddof=1).sum())


def sampling_variance(grad, params, batches) -> float:
  """Summed variance of exact minibatch gradients over independent `batches`."""
  return _summed_variance([flat_gradient(grad, params, b, jax.random.key(0)) for b in batches])


def compression_variance(grad, params, batch, plan, keys: int) -> float:
  """Summed variance of the compressed gradient of one batch over `keys` rounding seeds."""
  return _summed_variance(
    [flat_gradient(grad, params, batch, jax.random.key(1000 + i), plan) for i in range(keys)]
  )


def adaptive_plan(loss_fn, params, batch, avg_bits: float, **controller):
  """The plan a `jact.Controller` chooses at these parameters (one estimation)."""
  c = jact.Controller(loss_fn, avg_bits=avg_bits, **controller)
  state = c.init(params, batch, jax.random.key(2))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jact.CompressionVarianceWarning)
    return c.update(state, params, batch, jax.random.key(3)).plan


@functools.cache
def _gradients():
  """(jact loss, compressed gradient with a static plan, exact gradient), compiled once
  for every checkpoint."""
  loss_fn = functools.partial(preact.loss, form="layers", bits=2)
  grad = jax.jit(jact.planned(jax.grad(loss_fn)), static_argnames="plan")
  exact = jax.jit(
    lambda p, b, k, plan=None: jax.grad(functools.partial(preact.loss, form="plain"))(p, b, k)
  )
  return loss_fn, grad, exact


def estimator_rows(params, batch, *, keys: int, avg_bits: float, methods=ESTIMATORS) -> list:
  """Rows of the adaptive plans (`methods`: names of ESTIMATORS) at these parameters."""
  loss_fn, grad, _ = _gradients()
  rows = []
  for name in methods:
    plan = adaptive_plan(loss_fn, params, batch, avg_bits, **ESTIMATORS[name])
    rows.append(
      dict(
        method=name,
        avg_bits=float(plan.average_bits()),
        variance=compression_variance(grad, params, batch, plan, keys),
        plan=plan.to_dict(),
      )
    )
  return rows


def measure_checkpoint(params, batches, *, keys: int, avg_bits: float = 2.0) -> list[dict]:
  """Rows (method, average bits, variance) at one set of parameters.

  `batches[0]` is the fixed batch of the compression terms; all of them give
  the sampling variance.
  """
  loss_fn, grad, exact = _gradients()
  batch = batches[0]
  sites = jact.sensitivity.find_residuals(loss_fn, params, batch, jax.random.key(1))
  sizes = {n: s.size for n, s in sites.items()}
  rows = [
    dict(method="sampling", avg_bits=None, variance=sampling_variance(exact, params, batches))
  ]
  for bits in UNIFORM_BITS:
    rows.append(
      dict(
        method="uniform",
        avg_bits=float(bits),
        variance=compression_variance(grad, params, batch, jact.BitPlan.uniform(sizes, bits), keys),
      )
    )
  rows += estimator_rows(params, batch, keys=keys, avg_bits=avg_bits)
  sampled = rows[0]["variance"]
  for r in rows:
    r["over_sampling"] = r["variance"] / sampled
  return rows


def _snapshot(runs: Path, epoch: int, like):
  restored = resumable.restore(runs / "fp" / "snapshots" / f"epoch{epoch}", dict(params=like))
  return None if restored is None else restored[0]["params"]


def plot(result: dict, path) -> None:
  """Variance vs bits: one line per checkpoint, sampling variance dashed, adaptive plans as
  marks."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for color, (epoch, rows) in zip(colors, result["checkpoints"].items()):
    uniform = [r for r in rows if r["method"] == "uniform"]
    ax.plot(
      [r["avg_bits"] for r in uniform],
      [r["variance"] for r in uniform],
      "o-",
      color=color,
      label=f"uniform, epoch {epoch}",
    )
    ax.axhline(rows[0]["variance"], color=color, ls="--", lw=1)
    for r, marker in zip([r for r in rows if r["method"] in ESTIMATORS], "s^"):
      ax.plot(
        r["avg_bits"],
        r["variance"],
        marker,
        color=color,
        ms=8,
        mfc="none",
        label=f"{r['method']}, epoch {epoch}",
      )
  ax.set(
    xscale="log",
    yscale="log",
    xlabel="bits (average)",
    ylabel="gradient variance",
    title="compression variance vs sampling variance (dashed)",
  )
  ax.set_xticks(UNIFORM_BITS, [str(b) for b in UNIFORM_BITS])
  ax.set_xticks([], minor=True)
  ax.legend(fontsize=6, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(
    prog="python -m experiments.papers.grad_variance", description=__doc__.split("\n")[0]
  )
  p.add_argument(
    "--epochs",
    type=int,
    nargs="+",
    default=[0, 1, 3],
    help="checkpoints of the fp run (0: initialization)",
  )
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--keys", type=int, default=8)
  p.add_argument("--sampling-batches", type=int, default=16)
  p.add_argument("--avg-bits", type=float, default=2.0)
  p.add_argument("--runs", type=Path, default=paths.ACTNN_CIFAR_RUNS)
  p.add_argument("--results", type=Path, default=paths.RESULTS)
  p.add_argument(
    "--small",
    action="store_true",
    help="small ResNet (widths 8/16/32, 1 block), batch 32, initialization only",
  )
  p.add_argument(
    "--widths",
    type=int,
    nargs="+",
    default=None,
    help="the ResNet's stage widths (default 16 32 64; --small: 8 16 32)",
  )
  p.add_argument(
    "--remeasure",
    nargs="+",
    default=(),
    choices=list(ESTIMATORS),
    help="in the checkpoints kept from an earlier run, measure these adaptive "
    "plans again (after an estimator changed; same batch and keys)",
  )
  p.add_argument(
    "--fresh",
    action="store_true",
    help="measure every checkpoint again (default: keep those already written)",
  )
  a = p.parse_args(argv)
  widths, blocks = ((8, 16, 32), 1) if a.small else ((16, 32, 64), 3)
  if a.widths:
    widths = tuple(a.widths)
  if a.small:
    a.epochs, a.batch, a.keys, a.sampling_batches = [0], 32, 4, 4
  x, y, _, _ = data_lib.load_image_dataset(
    "cifar10_full", train_size=a.batch * a.sampling_batches * (1 if a.small else 8), test_size=1
  )
  rng = np.random.default_rng(0)
  batches = [
    tuple(map(jnp.asarray, (x[i], y[i])))
    for i in (rng.choice(len(x), a.batch, replace=False) for _ in range(a.sampling_batches))
  ]
  init = preact.init(jax.random.key(0), widths=widths, blocks=blocks)  # actnn_cifar's seed 0
  settings = dict(
    batch=a.batch,
    keys=a.keys,
    sampling_batches=a.sampling_batches,
    avg_bits=a.avg_bits,
    widths=list(widths),
    blocks=blocks,
  )
  name = "grad_variance_small" if a.small else "grad_variance"
  path = a.results / f"{name}.json"
  earlier = resumable.earlier_result(
    path, lambda e: all(e.get(k) == v for k, v in settings.items()), a.fresh
  )
  kept = (
    {}
    if earlier is None
    else {e: rows for e, rows in earlier["checkpoints"].items() if int(e) in a.epochs}
  )
  result = dict(
    meta=metadata.run_metadata("experiments.papers.grad_variance", argv),
    **settings,
    checkpoints=kept,
    missing=[],
    complete=False,
  )
  if kept:
    result["meta"]["kept_from"] = earlier["meta"]
    print(f"keeping epochs {sorted(map(int, kept))} from {path} ({earlier['meta']['date']})")
  if kept and a.remeasure:
    result["meta"]["remeasured"] = list(a.remeasure)
  for epoch in a.epochs:
    if str(epoch) in kept and not a.remeasure:
      continue
    params = init if epoch == 0 else _snapshot(a.runs, epoch, init)
    if str(epoch) in kept and params is None:
      raise SystemExit(f"epoch {epoch}: no snapshot under {a.runs / 'fp'} to remeasure at")
    if str(epoch) in kept:
      fresh_rows = {
        r["method"]: r
        for r in estimator_rows(
          params, batches[0], keys=a.keys, avg_bits=a.avg_bits, methods=a.remeasure
        )
      }
      sampled = next(r["variance"] for r in kept[str(epoch)] if r["method"] == "sampling")
      for r in fresh_rows.values():
        r["over_sampling"] = r["variance"] / sampled
        print(
          f"epoch {epoch} {r['method']:<13} remeasured: variance {r['variance']:.4g} "
          f"(x{r['over_sampling']:.3g} sampling)",
          flush=True,
        )
      kept[str(epoch)] = [fresh_rows.get(r["method"], r) for r in kept[str(epoch)]]
      resumable.write_json(path, result)
      continue
    if params is None:
      result["missing"].append(epoch)
      print(
        f"epoch {epoch}: no snapshot under {a.runs / 'fp'}; "
        "run experiments.papers.actnn_cifar first"
      )
      continue
    rows = measure_checkpoint(params, batches, keys=a.keys, avg_bits=a.avg_bits)
    result["checkpoints"][str(epoch)] = rows
    for r in rows:
      bits = "" if r["avg_bits"] is None else f"{r['avg_bits']:.2f}"
      print(
        f"epoch {epoch} {r['method']:<13} bits {bits:>5} variance {r['variance']:.4g} "
        f"(x{r['over_sampling']:.3g} sampling)",
        flush=True,
      )
    resumable.write_json(path, result)  # a partial result survives an interrupted run
  result["checkpoints"] = {
    str(e): result["checkpoints"][str(e)] for e in a.epochs if str(e) in result["checkpoints"]
  }
  result["complete"] = not result["missing"]
  resumable.write_json(path, result)
  if result["checkpoints"]:
    plot(result, a.results / f"{name}.png")
  return result


if __name__ == "__main__":
  main()
