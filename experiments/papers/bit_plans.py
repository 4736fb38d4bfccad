"""Bit plans at work: the widths ActNN's and GACT's estimators choose, over training.

* ResNet: the `experiments.papers.actnn_cifar` ResNet-20 at the full-precision run's
  parameters after each epoch (`--runs`; epoch 0 = the shared
  initialization). At each, one batch of `--batch` CIFAR-10 images, the
  estimator state warmed by `--updates` updates, then the plan of
  `jact.Controller` with the ActNN analytic (per-layer) and the GACT numeric
  estimator at `--avg-bits`.
* Transformer: a 2-block character transformer (`experiments.bench.bench_plans`'s,
  written with jact ops) trained with Adam on tiny Shakespeare for `--lm-steps`
  steps under the numeric controller (re-planning every `--adapt-interval`
  steps); at each re-plan the analytic estimator's plan at the same parameters
  is recorded too.

Both record every residual's width (a heat map: residual x time) and the
estimators' cost in train-step equivalents (a compiled `Controller.update`'s
time, estimation and re-planning included, over a jitted gradient step's). Writes
`<results>/bit_plans.json`
and `bit_plans_<model>.png`.

    python -m experiments.papers.bit_plans
    python -m experiments.papers.bit_plans --small      # under a minute: tiny nets, few steps
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jact
from experiments.lib import data as data_lib
from experiments.lib import metadata, paths, plan_models, preact, resumable, timing

__all__ = [
  "estimator_plan",
  "cost_in_steps",
  "resnet_plans",
  "transformer_plans",
  "check_plans",
  "heat_map",
  "main",
]

ESTIMATORS = ("analytic", "numeric")


def estimator_plan(controller, params, batch, *, updates: int, seed: int = 0):
  """(plan, seconds of the last update) after `updates` estimator updates at fixed parameters.

  `controller` is a `jact.Controller` with `adapt_interval=1`; reuse one per
  estimator so that its update compiles once.
  """
  state = controller.init(params, batch, jax.random.key(seed))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jact.CompressionVarianceWarning)
    for i in range(updates):
      start = time.perf_counter()
      state = controller.update(state, params, batch, jax.random.key(seed + 1 + i))
      seconds = time.perf_counter() - start
  return state.plan, seconds


def cost_in_steps(loss_fn, params, batch, update_seconds: dict) -> dict:
  """Estimator updates (`update_seconds`: kind -> seconds, compiled) in jitted gradient steps."""
  grad = jax.jit(jax.grad(loss_fn))
  step = timing.median_seconds(lambda: grad(params, batch, jax.random.key(0)))
  out = dict(step_s=step)
  for kind, seconds in update_seconds.items():
    out[f"{kind}_s"], out[f"{kind}_in_steps"] = seconds, seconds / step
  return out


def _controllers(loss_fn, avg_bits: float) -> dict:
  return {
    kind: jact.Controller(loss_fn, estimator=kind, avg_bits=avg_bits, adapt_interval=1)
    for kind in ESTIMATORS
  }


def _widths(plan, names) -> list:
  return [plan.bits_for(n, None) for n in names]


def check_plans(model: dict, label: str) -> None:
  """Raises if `model`'s recorded plans are unusable: residual names that are not
  strings, or not one residual given a width by any plan (every one "uncompressed"
  means the names did not match the plans', not a choice of the estimators)."""
  bad = [n for n in model["names"] if not isinstance(n, str)]
  if bad:
    raise ValueError(f"bit_plans {label}: residual names must be strings, got {bad[:3]}")
  widths = [b for kind in ESTIMATORS for plan in model[kind] for b in plan]
  if widths and all(b is None for b in widths):
    raise ValueError(
      f"bit_plans {label}: every plan leaves every residual uncompressed; "
      "the names do not match the plans' residuals"
    )


def resnet_plans(
  *,
  runs: Path,
  epochs,
  batch_size: int,
  avg_bits: float,
  updates: int,
  widths=(16, 32, 64),
  blocks: int = 3,
) -> dict:
  """Plans of both estimators at each epoch snapshot of the fp run."""
  x, y, _, _ = data_lib.load_image_dataset("cifar10_full", train_size=batch_size, test_size=1)
  batch = (jnp.asarray(x), jnp.asarray(y))
  loss_fn = functools.partial(preact.loss, form="layers", bits=2)
  init = preact.init(jax.random.key(0), widths=widths, blocks=blocks)
  names = list(jact.sensitivity.find_residuals(loss_fn, init, batch, jax.random.key(0)))
  out = dict(names=names, times=[], missing=[], **{k: [] for k in ESTIMATORS})
  controllers, seconds = _controllers(loss_fn, avg_bits), {}
  for epoch in epochs:
    params = init
    if epoch:
      restored = resumable.restore(runs / "fp" / "snapshots" / f"epoch{epoch}", dict(params=init))
      if restored is None:
        out["missing"].append(epoch)
        continue
      params = restored[0]["params"]
    out["times"].append(f"epoch {epoch}")
    for kind in ESTIMATORS:
      plan, seconds[kind] = estimator_plan(
        controllers[kind], params, batch, updates=max(updates, 2)
      )  # the last one: compiled
      out[kind].append(_widths(plan, names))
  out["cost"] = cost_in_steps(loss_fn, init, batch, seconds)
  return out


def _text_batches(batch_size: int, length: int, seed: int = 0):
  text = data_lib._data_file("tinyshakespeare/input.txt").read_text()  # pylint: disable=protected-access
  vocab = sorted(set(text))
  ids = np.frombuffer(text.encode("latin-1", "replace"), np.uint8)
  lookup = np.zeros(256, np.int32)
  lookup[[ord(c) for c in vocab]] = np.arange(len(vocab))
  ids = lookup[ids]
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(ids) - length - 1, batch_size)
    seq = np.stack([ids[s : s + length + 1] for s in starts])
    yield len(vocab), (jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:]))


def transformer_plans(
  *,
  steps: int,
  adapt_interval: int,
  batch_size: int,
  length: int,
  avg_bits: float,
  d: int = 64,
  blocks: int = 2,
) -> dict:
  """Numeric-controller training of the character transformer; plans at every re-plan."""
  stream = _text_batches(batch_size, length)
  vocab, batch = next(stream)
  loss_fn = functools.partial(plan_models.transformer_loss)
  params = plan_models.transformer_params(
    jax.random.key(0), vocab, d=d, blocks=blocks, length=length
  )
  tx = optax.adam(3e-3)
  opt_state = tx.init(params)

  def train_step(params, opt_state, batch, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step_fn = jax.jit(jact.planned(train_step), static_argnames="plan")
  controller = jact.Controller(
    loss_fn, estimator="numeric", avg_bits=avg_bits, adapt_interval=adapt_interval
  )
  cstate = controller.init(params, batch, jax.random.key(1))
  analytic = jact.Controller(loss_fn, estimator="analytic", avg_bits=avg_bits, adapt_interval=1)
  astate = analytic.init(params, batch, jax.random.key(1))
  seconds = {k: [] for k in ESTIMATORS}
  names = [name for name, _ in cstate.plan.sizes]  # sizes: (name, values) pairs
  out = dict(names=names, times=[], losses=[], **{k: [] for k in ESTIMATORS})
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jact.CompressionVarianceWarning)
    for step in range(steps):
      _, batch = next(stream)
      key = jax.random.fold_in(jax.random.key(2), step)
      due = controller.due(cstate.step)
      start = time.perf_counter()
      cstate = controller.update(cstate, params, batch, key)
      if due:
        seconds["numeric"].append(time.perf_counter() - start)
        start = time.perf_counter()
        astate = analytic.update(astate, params, batch, key)
        seconds["analytic"].append(time.perf_counter() - start)
        out["times"].append(f"step {step}")
        out["numeric"].append(_widths(cstate.plan, names))
        out["analytic"].append(_widths(astate.plan, names))
      params, opt_state, loss = step_fn(params, opt_state, batch, key, plan=cstate.plan)
      out["losses"].append(float(loss))
  # the first update of each compiled it: the cost is the median of the later ones
  out["cost"] = cost_in_steps(
    loss_fn, params, batch, {k: float(np.median(v[1:] or v)) for k, v in seconds.items()}
  )
  return out


def heat_map(model: dict, title: str, path) -> None:
  """One panel per estimator: residuals (rows) x time (columns), colored by bits."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.colors import BoundaryNorm, ListedColormap

  names, times = model["names"], model["times"]
  cmap = ListedColormap(["#d73027", "#fc8d59", "#91bfdb", "#4575b4", "#dddddd"])
  norm = BoundaryNorm([0.5, 1.5, 3, 6, 12, 40], cmap.N)
  fig, axes = plt.subplots(
    1,
    len(ESTIMATORS),
    figsize=(3 + 1.2 * len(times) * len(ESTIMATORS), 1.5 + 0.18 * len(names)),
    squeeze=False,
  )
  for ax, kind in zip(axes[0], ESTIMATORS):
    grid = np.array([[32 if b is None else b for b in col] for col in model[kind]], float).T
    image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
    ax.set_xticks(range(len(times)), times, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(names)), names if ax is axes[0][0] else [], fontsize=6)
    ax.set_title(f"{kind} estimator", fontsize=9)
  cbar = fig.colorbar(image, ax=axes[0].tolist(), ticks=[1, 2, 4, 8, 32])
  cbar.set_label("bits (32: kept uncompressed)")
  fig.suptitle(title, fontsize=10)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  plt.close(fig)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(
    prog="python -m experiments.papers.bit_plans", description=__doc__.split("\n")[0]
  )
  p.add_argument(
    "--models", nargs="+", default=["resnet", "transformer"], choices=["resnet", "transformer"]
  )
  p.add_argument("--avg-bits", type=float, default=2.0)
  p.add_argument("--epochs", type=int, nargs="+", default=[0, 1, 2, 3])
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--updates", type=int, default=3)
  p.add_argument("--lm-steps", type=int, default=600)
  p.add_argument("--adapt-interval", type=int, default=100)
  p.add_argument("--runs", type=Path, default=paths.ACTNN_CIFAR_RUNS)
  p.add_argument("--results", type=Path, default=paths.RESULTS)
  p.add_argument("--small", action="store_true")
  a = p.parse_args(argv)
  result = dict(
    meta=metadata.run_metadata("experiments.papers.bit_plans", argv),
    avg_bits=a.avg_bits,
    small=a.small,
  )
  if "resnet" in a.models:
    sizes = (
      dict(widths=(8, 16, 32), blocks=1, batch_size=32, epochs=[0], updates=1)
      if a.small
      else dict(batch_size=a.batch, epochs=a.epochs, updates=a.updates)
    )
    result["resnet"] = resnet_plans(runs=a.runs, avg_bits=a.avg_bits, **sizes)
    check_plans(result["resnet"], "resnet")
  if "transformer" in a.models:
    sizes = (
      dict(steps=5, adapt_interval=4, batch_size=8, length=32, d=32, blocks=1)
      if a.small
      else dict(steps=a.lm_steps, adapt_interval=a.adapt_interval, batch_size=32, length=64)
    )
    result["transformer"] = transformer_plans(avg_bits=a.avg_bits, **sizes)
    check_plans(result["transformer"], "transformer")
  name = "bit_plans_small" if a.small else "bit_plans"
  for model in a.models:
    result[model]["meta"] = result["meta"]
  path = a.results / f"{name}.json"
  if path.exists():  # a run of some models keeps the others' earlier results (each with its meta)
    earlier = json.loads(path.read_text())
    for model in ("resnet", "transformer"):
      if model not in result and model in earlier:
        result[model] = {"meta": earlier["meta"], **earlier[model]}
  resumable.write_json(path, result)
  for model in ("resnet", "transformer"):
    if model in result and result[model]["times"]:
      heat_map(
        result[model],
        f"{model}: bits per residual at {a.avg_bits:g} bits average",
        a.results / f"{name}_{model}.png",
      )
      cost = result[model]["cost"]
      print(
        f"{model}: analytic update = {cost['analytic_in_steps']:.2f} steps, "
        f"numeric update = {cost['numeric_in_steps']:.2f} steps"
      )
  return result


if __name__ == "__main__":
  main()
