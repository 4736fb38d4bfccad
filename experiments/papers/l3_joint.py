"""ActNN L3 (joint layer x sample allocation, widths 1..8) against uniform 2 bits at equal bytes.

ActNN's claim (Sec. 4.2, Fig. 5): at the same average bits, allocating widths
over layers and samples lowers the gradient's compression variance below
uniform widths. On the `experiments.papers.actnn_cifar` ResNet-20 this
measures, for one `--seed` (the initialization of epoch 0, the fixed batch,
the sampling batches and the rounding keys), at the parameters of the fp
run's checkpoints (`--epochs`; 0 is the seed's initialization):

* `uniform2`: every residual at 2 bits;
* `actnn_l3`: the plan of `jact.levels.get("actnn:L3").controller` (ActNN's
  joint allocation at 1..8 bits, each layer's mean width split among the
  step's samples);
* `actnn_l3_1248`: the same controller restricted to 1, 2, 4, 8 bits (the
  L3 jact had before integer widths);
* `actnn_l25`: ActNN's L2.5 -- every layer at 2 bits on average, split
  among samples at 1..8 bits (no allocation between layers).

Each row holds the summed variance of the compressed gradient of the fixed
batch over `--keys` rounding seeds, its ratio to the minibatch sampling
variance and to `uniform2`'s, the plan's average bits and the bytes the
compressed residuals take (`jact.residual_report` of the planned loss), so
"equal bytes" is measured, not assumed. Writes
`<results>/l3_joint_seed<seed>.json` (`--small`: `l3_joint_small_seed<seed>.json`).

    python -m experiments.papers.l3_joint --seed 0          # after actnn_cifar --variants fp
    python -m experiments.papers.l3_joint --small --seed 1  # minutes: small net, initialization
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jact
from experiments.lib import data as data_lib
from experiments.lib import metadata, paths, preact, resumable
from experiments.papers import grad_variance

__all__ = ["plans", "stored_bytes", "measure", "main"]


def plans(loss_fn, params, batch, sizes, *, avg_bits: float, key) -> dict:
  """The compared plans by method name (the controllers estimate once at `params`)."""

  def controller_plan(**settings):
    c = jact.levels.get("actnn:L3").controller(loss_fn, avg_bits=avg_bits, **settings)
    state = c.init(params, batch, key)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", jact.CompressionVarianceWarning)
      return c.update(state, params, batch, jax.random.fold_in(key, 1)).plan

  actnn = jact.allocate.ACTNN_WIDTHS
  l25 = jact.compressors.PerSample(avg_bits, widths=actnn)
  return {
    "uniform2": jact.BitPlan.uniform(sizes, 2),
    "actnn_l3": controller_plan(),
    "actnn_l3_1248": controller_plan(allowed=(1, 2, 4, 8)),
    "actnn_l25": jact.BitPlan(
      {n: l25 for n in sizes}, budgets={n: avg_bits for n in sizes}, sizes=sizes
    ),
  }


def stored_bytes(loss_fn, params, batch, key, plan) -> int:
  """Bytes of the plan's residuals that the planned loss's backward pass keeps."""

  def planned(p):
    with jact.use_plan(plan):
      return loss_fn(p, batch, key)

  report = jact.residual_report(planned, params).by_name()
  return int(sum(report[n].bytes for n in dict(plan.sizes) if n in report))


def measure(params, batches, *, keys: int, avg_bits: float, seed: int) -> list[dict]:
  """Rows (method, average bits, bytes, variance, ratios) at one set of parameters."""
  loss_fn, grad, exact = grad_variance._gradients()  # pylint: disable=protected-access
  batch = batches[0]
  sites = jact.sensitivity.find_residuals(loss_fn, params, batch, jax.random.key(1))
  sizes = {n: s.size for n, s in sites.items()}
  sampled = grad_variance.sampling_variance(exact, params, batches)
  rows = [dict(method="sampling", avg_bits=None, bytes=None, variance=sampled)]
  chosen = plans(loss_fn, params, batch, sizes, avg_bits=avg_bits, key=jax.random.key(seed + 2))
  for name, plan in chosen.items():
    variance = _variance(grad, params, batch, plan, keys, seed)
    rows.append(
      dict(
        method=name,
        avg_bits=float(plan.average_bits()),
        bytes=stored_bytes(loss_fn, params, batch, jax.random.key(1), plan),
        variance=variance,
        plan=plan.to_dict(),
      )
    )
  uniform = next(r for r in rows if r["method"] == "uniform2")
  for r in rows:
    r["over_sampling"] = r["variance"] / sampled
    r["over_uniform2"] = r["variance"] / uniform["variance"]
    r["bytes_over_uniform2"] = None if r["bytes"] is None else r["bytes"] / uniform["bytes"]
  return rows


def _variance(grad, params, batch, plan, keys: int, seed: int) -> float:
  """Summed variance of the compressed gradient over `keys` rounding seeds of this seed."""
  vectors = [
    grad_variance.flat_gradient(grad, params, batch, jax.random.key(1000 * (seed + 1) + i), plan)
    for i in range(keys)
  ]
  return float(np.stack(vectors).var(axis=0, ddof=1).sum())


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(
    prog="python -m experiments.papers.l3_joint", description=__doc__.split("\n")[0]
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--epochs", type=int, nargs="+", default=[0], help="fp run checkpoints (0: init)")
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--keys", type=int, default=8)
  p.add_argument("--sampling-batches", type=int, default=16)
  p.add_argument("--avg-bits", type=float, default=2.0)
  p.add_argument("--runs", type=Path, default=paths.ACTNN_CIFAR_RUNS)
  p.add_argument("--results", type=Path, default=paths.RESULTS)
  p.add_argument("--small", action="store_true", help="widths 8/16/32, 1 block, batch 32")
  p.add_argument("--widths", type=int, nargs="+", default=None, help="the ResNet's stage widths")
  a = p.parse_args(argv)
  widths, blocks = ((8, 16, 32), 1) if a.small else ((16, 32, 64), 3)
  if a.widths:
    widths = tuple(a.widths)
  if a.small:
    a.epochs, a.batch, a.keys, a.sampling_batches = [0], 32, 4, 4
  x, y, _, _ = data_lib.load_image_dataset(
    "cifar10_full", train_size=a.batch * a.sampling_batches * (1 if a.small else 8), test_size=1
  )
  rng = np.random.default_rng(a.seed)
  batches = [
    tuple(map(jnp.asarray, (x[i], y[i])))
    for i in (rng.choice(len(x), a.batch, replace=False) for _ in range(a.sampling_batches))
  ]
  init = preact.init(jax.random.key(a.seed), widths=widths, blocks=blocks)
  result = dict(
    meta=metadata.run_metadata("experiments.papers.l3_joint", argv),
    seed=a.seed,
    batch=a.batch,
    keys=a.keys,
    sampling_batches=a.sampling_batches,
    avg_bits=a.avg_bits,
    widths=list(widths),
    blocks=blocks,
    checkpoints={},
    missing=[],
  )
  name = f"l3_joint{'_small' if a.small else ''}_seed{a.seed}"
  for epoch in a.epochs:
    like = preact.init(jax.random.key(0), widths=widths, blocks=blocks)
    params = init if epoch == 0 else grad_variance._snapshot(a.runs, epoch, like)  # pylint: disable=protected-access
    if params is None:
      result["missing"].append(epoch)
      print(f"epoch {epoch}: no snapshot under {a.runs / 'fp'}; run experiments.papers.actnn_cifar")
      continue
    rows = measure(params, batches, keys=a.keys, avg_bits=a.avg_bits, seed=a.seed)
    result["checkpoints"][str(epoch)] = rows
    for r in rows[1:]:
      print(
        f"seed {a.seed} epoch {epoch} {r['method']:<14} bits {r['avg_bits']:.3f} "
        f"bytes {r['bytes']} (x{r['bytes_over_uniform2']:.4f}) variance {r['variance']:.4g} "
        f"(x{r['over_uniform2']:.3f} uniform2, x{r['over_sampling']:.3g} sampling)",
        flush=True,
      )
    resumable.write_json(a.results / f"{name}.json", result)
  result["complete"] = not result["missing"]
  resumable.write_json(a.results / f"{name}.json", result)
  return result


if __name__ == "__main__":
  main()
