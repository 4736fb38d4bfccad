"""Gradient variance vs average bits for uniform, ActNN-analytic, GACT-numeric and
AC-GC plans, and the estimators' cost in training steps.

Models (real data): a small residual CNN on CIFAR-10 and a 2-block character
transformer on tiny Shakespeare, both written with jact ops at the top level
(as the analytic estimators need). For each plan the compression variance is
measured by Monte Carlo: the total variance of the gradient over `--keys`
rounding keys for one fixed batch. AC-GC plans come from its error bound
(e^2 in `--errors`), so their average bits are whatever the bound gives.

    python -m experiments.bench.bench_plans --json experiments/results/bench_plans.json
"""

from __future__ import annotations

import argparse
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import jact
from experiments.lib import data, metadata, plan_models, timing


def cifar_setup(batch_size):
  x, y, _, _ = data.load_image_dataset("cifar10", train_size=batch_size)
  return (
    plan_models.cnn_params(jax.random.key(0)),
    (jnp.asarray(x), jnp.asarray(y)),
    plan_models.cnn_loss,
  )


def shakespeare_setup(batch_size, length=64):
  text = data._data_file("tinyshakespeare/input.txt").read_text()  # pylint: disable=protected-access
  vocab = sorted(set(text))
  ids = np.array([vocab.index(c) for c in text[: batch_size * (length + 1) * 4]], np.int32)
  rng = np.random.default_rng(0)
  starts = rng.integers(0, len(ids) - length - 1, batch_size)
  seq = np.stack([ids[s : s + length + 1] for s in starts])
  batch = (jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:]))
  return (
    plan_models.transformer_params(jax.random.key(0), len(vocab), length=length),
    batch,
    plan_models.transformer_loss,
  )


# ----------------------------------------------------------------------------- measurement


def mc_variance(grad, params, batch, plan, keys):
  flat = lambda t: np.concatenate([np.ravel(a) for a in jax.tree.leaves(t)])
  gs = np.stack(
    [flat(grad(params, batch, jax.random.key(10_000 + i), plan=plan)) for i in range(keys)]
  )
  return float(gs.var(axis=0, ddof=1).sum())


def run_model(name, setup, bits_list, errors, keys):
  params, batch, loss = setup
  grad = jax.jit(jact.planned(jax.grad(loss)), static_argnames="plan")
  sites = jact.sensitivity.find_residuals(loss, params, batch, jax.random.key(1))
  sizes = {n: s.size for n, s in sites.items()}
  rows = []
  step_time = timing.time_call(
    lambda k: grad(params, batch, k, plan=None), [(jax.random.key(0),)], reps=3, blocks=1
  )[0]
  estimators = {}
  for kind in ("numeric", "analytic"):
    est = getattr(jact.sensitivity, kind)(loss)
    state = est.init(params, batch, jax.random.key(1))
    cost = timing.time_call(
      lambda k: est.update(state, params, batch, k).sensitivity,
      [(jax.random.key(2),)],
      reps=3,
      blocks=1,
    )[0]
    state = est.update(state, params, batch, jax.random.key(3))
    estimators[kind] = (state, cost)
  sampling = float(jact.sensitivity.sampling_variance(loss, params, batch, jax.random.key(4)))
  for bits in bits_list:
    uniform = jact.BitPlan.uniform(sizes, bits)
    rows.append(
      dict(
        model=name,
        method="uniform",
        avg_bits=bits,
        variance=mc_variance(grad, params, batch, uniform, keys),
      )
    )
    for kind, (state, _) in estimators.items():
      c = np.asarray(state.sensitivity, np.float64)
      known = [i for i, v in enumerate(c) if np.isfinite(v)]
      names = [state.names[i] for i in known]
      d = [sizes[n] for n in names]
      chosen = jact.allocate.greedy_allocate(np.maximum(c[known], 0), d, int(bits * sum(d)))
      plan = uniform.replace(dict(zip(names, chosen)))
      rows.append(
        dict(
          model=name,
          method=f"{'gact' if kind == 'numeric' else 'actnn'}_{kind}",
          avg_bits=plan.average_bits(),
          estimated=len(known),
          of=len(sizes),
          variance=mc_variance(grad, params, batch, plan, keys),
        )
      )
  for e2 in errors:
    bounds = jact.acgc.error_bounded(loss, error=e2)
    state = bounds.init(params, batch, jax.random.key(1))
    for i in range(3):
      state = bounds.update(state, params, batch, jax.random.key(20 + i))
    plan = jact.BitPlan.uniform(sizes, 4).replace(dict(bounds.plan(state)))
    rows.append(
      dict(
        model=name,
        method=f"acgc_e2={e2}",
        avg_bits=plan.average_bits(),
        variance=mc_variance(grad, params, batch, plan, keys),
      )
    )
  for r in rows:
    r["variance_over_sampling"] = r["variance"] / sampling
  cost = dict(
    model=name,
    train_step_s=step_time,
    residuals=len(sizes),
    sampling_variance=sampling,
    **{f"{k}_update_s": c for k, (_, c) in estimators.items()},
    **{f"{k}_cost_in_steps": c / step_time for k, (_, c) in estimators.items()},
  )
  return rows, cost


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--keys", type=int, default=16)
  parser.add_argument("--bits", type=float, nargs="+", default=[2, 4])
  parser.add_argument("--errors", type=float, nargs="+", default=[0.1, 0.5])
  parser.add_argument("--models", nargs="+", default=["cifar_cnn", "shakespeare_transformer"])
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  setups = {"cifar_cnn": cifar_setup, "shakespeare_transformer": shakespeare_setup}
  rows, costs = [], []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for m in args.models:
      r, c = run_model(m, setups[m](args.batch), args.bits, args.errors, args.keys)
      rows += r
      costs.append(c)
  for r in rows:
    print(
      f"{r['model']:<24} {r['method']:<18} bits {r['avg_bits']:5.2f}  "
      f"variance {r['variance']:.4g}  (x{r['variance_over_sampling']:.3g} sampling)"
    )
  for c in costs:
    print(c)
  if args.json:
    meta = metadata.run_metadata("experiments.bench.bench_plans", argv)
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, rows=rows, costs=costs), f, indent=1)


if __name__ == "__main__":
  main()
