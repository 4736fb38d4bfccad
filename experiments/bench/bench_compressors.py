"""Residual bytes and gradient error vs exact, per compressor, on a CIFAR ResNet.

The model is `experiments.lib.preact` (pre-activation ResNet, BN -> ReLU -> conv
units), first trained exactly for `--train-steps` steps on real CIFAR-10 so
the activations are those of a network in training. Then, on one fixed batch,
each method's gradient with respect to all parameters is compared with the
exact gradient over `--keys` rounding keys:

* rel. error: mean over keys of ||g_hat - g|| / ||g||;
* bias: ||mean over keys of g_hat - g|| / ||g|| (for an unbiased method it
  shrinks like 1/sqrt(keys); deterministic methods keep their error);
* unit bytes: what the backward pass keeps for the BN -> ReLU -> conv units
  (`jact.residual_report`, residuals named unit*), and the compression ratio
  against the exact jact units (float32 BN and conv inputs, 1-bit ReLU mask);
* residual bytes: everything the backward pass keeps (parameters excluded:
  also the input images and the exact head), and the ratio to plain JAX
  training's residuals.

Methods: ActNN per-group 2/4 bits, BLPA 4/8 bits (fused units), DIVISION
(B=8, Q=2), AC-GC fixpoint at the widths its bound gives for each e^2 in `--errors`
(AutoQuant), and the same with zero-value compression of the (sparse) conv
inputs (AutoQuantZ, capacity `--capacity`; conv inputs the bound leaves
uncompressed get lossless ZVC).

    python -m experiments.bench.bench_compressors --json experiments/results/bench_compressors.json
    python -m experiments.bench.bench_compressors --methods ActNN --batch 8 --keys 1 --widths 4 8 \
        --blocks 1 --train-steps 1 --train-batch 8 --json /tmp/c.json    # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jact
from experiments.lib import data, metadata, preact
from jact import compressors


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(tree)])


def load_batches(batch: int, train_steps: int, train_batch: int):
  n = max(batch, 1000)
  x, y, _, _ = data.load_image_dataset("cifar10", train_size=n + train_batch * 8)
  x = x - x.mean(axis=(0, 1, 2))
  return (jnp.asarray(x[:batch]), jnp.asarray(y[:batch])), (x[n:], y[n:])


def pretrain(params, train, steps: int, batch: int, lr: float = 0.05):
  """Exact training (plain JAX, SGD with momentum) for `steps` steps."""
  if steps <= 0:
    return params, []
  opt = optax.sgd(lr, momentum=0.9)
  state = opt.init(params)

  @jax.jit
  def step(params, state, xb, yb):
    value, grads = jax.value_and_grad(preact.loss)(params, (xb, yb), form="plain")
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  x, y = train
  losses = []
  for i in range(steps):
    j = (i * batch) % (len(x) - batch)
    params, state, value = step(
      params, state, jnp.asarray(x[j : j + batch]), jnp.asarray(y[j : j + batch])
    )
    losses.append(float(value))
  return params, losses


def acgc_plan(params, batch, error: float, updates: int, compressor):
  """AC-GC bound -> plan of `compressor` widths (statistics from `updates` keys)."""
  loss = lambda p, b, k: preact.loss(p, b, k, form="layers", compressor=compressors.Fixpoint(8))
  bounds = jact.acgc.error_bounded(loss, error=error, compressor=compressor)
  state = bounds.init(params, batch, jax.random.key(0))
  for i in range(updates):
    state = bounds.update(state, params, batch, jax.random.key(100 + i))
  return bounds.plan(state)


def zvc_on_conv_inputs(plan: jact.BitPlan, capacity: float) -> jact.BitPlan:
  """The plan with every conv input (a ReLU output, sparse) zero-value compressed:
  its fixed-point codes (AutoQuantZ), or, where the bound leaves it
  uncompressed, its exact values (lossless ZVC)."""
  entries = {}
  for name, c in plan.items():
    if name.endswith(".conv.lhs") and (c is None or isinstance(c, compressors.Fixpoint)):
      c = compressors.ZeroValue(c, capacity=capacity)
    entries[name] = c
  return jact.BitPlan(entries, default=plan.default)


def measure(name, params, batch, keys: int, form: str, bits=None, compressor=None, plan=None):
  def loss(p, key):
    with jact.use_plan(plan):
      return preact.loss(p, batch, key, form=form, bits=bits, compressor=compressor)

  exact = _flat(jax.grad(preact.loss)(params, batch, form="plain"))
  grad = jax.jit(jax.grad(loss))
  start = time.perf_counter()
  draws = np.stack([_flat(grad(params, jax.random.key(1000 + i))) for i in range(keys)])
  seconds = time.perf_counter() - start
  norm = np.linalg.norm(exact)
  rel = [float(np.linalg.norm(d - exact) / norm) for d in draws]
  report = jact.residual_report(loss, params, jax.random.key(0))
  units = sum(g.bytes for n, g in report.by_name().items() if n and n.startswith("unit"))
  return dict(
    method=name,
    residual_bytes=int(report.total_bytes),
    unit_bytes=int(units),
    rel_error=float(np.mean(rel)),
    rel_error_max=float(np.max(rel)),
    bias=float(np.linalg.norm(draws.mean(0) - exact) / norm),
    seconds_per_gradient=seconds / keys,
  )


def run(args):
  batch, train = load_batches(args.batch, args.train_steps, args.train_batch)
  params = preact.init(jax.random.key(0), widths=tuple(args.widths), blocks=args.blocks)
  params, losses = pretrain(params, train, args.train_steps, args.train_batch)
  densities = {}
  preact.apply(params, batch[0], form="plain", densities=densities)
  densities = {k: float(v) for k, v in densities.items()}
  plain_bytes = jact.residual_report(
    lambda p: preact.loss(p, batch, form="plain"), params
  ).total_bytes

  methods = [
    ("exact (jact ops, bits=None)", dict(form="layers", bits=None)),
    ("ActNN 2-bit", dict(form="layers", compressor=compressors.PerGroup(2))),
    ("ActNN 4-bit", dict(form="layers", compressor=compressors.PerGroup(4))),
    ("BLPA 4-bit", dict(form="blpa", bits=4)),
    ("BLPA 8-bit", dict(form="blpa", bits=8)),
    ("DIVISION B=8 Q=2", dict(form="layers", compressor=compressors.Division(block=8, bits=2))),
  ]
  wanted = lambda name: (
    not args.methods or any(name.lower().startswith(m.lower()) for m in args.methods)
  )
  acgc_plans = {}
  for error in args.errors if wanted("AC-GC") else ():
    plan = acgc_plan(params, batch, error, args.acgc_updates, compressors.Fixpoint())
    acgc_plans[error] = json.loads(plan.to_json())
    methods += [
      (
        f"AC-GC fixpoint e2={error:g}",
        dict(form="layers", compressor=compressors.Fixpoint(8), plan=plan),
      ),
      (
        f"AC-GC fixpoint + ZVC e2={error:g}",
        dict(
          form="layers",
          compressor=compressors.Fixpoint(8),
          plan=zvc_on_conv_inputs(plan, args.capacity),
        ),
      ),
    ]
  methods = [m for m in methods if wanted(m[0])]
  rows = []
  print(
    f"{'method':<36} {'unit bytes':>11} {'ratio':>6} {'all bytes':>11} {'vs plain':>8} "
    f"{'rel.err':>8} {'bias':>8}"
  )
  for name, kw in methods:
    row = measure(name, params, batch, args.keys, **kw)
    row["ratio_to_plain"] = plain_bytes / row["residual_bytes"]
    row["unit_ratio"] = rows[0]["unit_bytes"] / row["unit_bytes"] if rows else 1.0
    rows.append(row)
    print(
      f"{name:<36} {row['unit_bytes']:>11} {row['unit_ratio']:>6.1f} "
      f"{row['residual_bytes']:>11} {row['ratio_to_plain']:>8.1f} "
      f"{row['rel_error']:>8.4f} {row['bias']:>8.4f}",
      flush=True,
    )
  return dict(
    rows=rows,
    plain_bytes=int(plain_bytes),
    relu_density=densities,
    acgc_plans=acgc_plans,
    pretrain_loss=[losses[0], losses[-1]] if losses else None,
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--keys", type=int, default=8)
  parser.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
  parser.add_argument("--blocks", type=int, default=2)
  parser.add_argument("--train-steps", type=int, default=200)
  parser.add_argument("--train-batch", type=int, default=64)
  parser.add_argument("--errors", type=float, nargs="+", default=[0.5, 4.0], help="AC-GC e^2")
  parser.add_argument("--acgc-updates", type=int, default=3)
  parser.add_argument("--capacity", type=float, default=0.6, help="ZVC capacity")
  parser.add_argument(
    "--methods",
    nargs="+",
    default=None,
    help="only the methods whose names start with one of these (case-insensitive: "
    "exact, ActNN, BLPA, DIVISION, AC-GC); unit ratios are then to the first",
  )
  parser.add_argument("--json")
  args = parser.parse_args(argv)
  result = run(args)
  print(
    f"plain JAX residuals: {result['plain_bytes']} B; ReLU densities "
    f"{min(result['relu_density'].values()):.2f}..{max(result['relu_density'].values()):.2f}"
  )
  for error, plan in result["acgc_plans"].items():
    widths = [v["bits"] if isinstance(v, dict) else 32 for v in plan["bits"].values()]
    print(f"AC-GC e2={error:g}: widths {sorted(widths)}")
  if args.json:
    meta = metadata.run_metadata("experiments.bench.bench_compressors", argv, args=vars(args))
    with open(args.json, "w") as f:
      json.dump(dict(meta=meta, **result), f, indent=1)


if __name__ == "__main__":
  main()
