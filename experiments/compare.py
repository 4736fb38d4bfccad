"""The main comparison: plain training vs jact twins at several bit widths.

    python -m experiments.compare [--steps 300 --batch 64 --bits 8 4 2 --dataset auto]

Trains `SmallCNN` with the plain Flax layers and with the jact twins at each
bit width, from the same initial parameters and the same data order, and
prints one row per variant: final training loss (mean of the last 10 steps),
test accuracy, bytes saved for the backward pass of the loss (arguments
excluded), compiled temporary memory of the train step, median step time, and
the ratios of the last three to plain training. `--json PATH` writes the rows.

Test accuracy is computed by the plain model in inference mode: the twins'
forward pass is exact and their variables are the plain ones, so this is the
trained jact model's accuracy.

>>> rows = run_comparison(steps=2, batch_size=16, bits=(2,), dataset="sklearn_digits",
...                       widths=(4, 8, 8), progress=False)
>>> [r["variant"] for r in rows]
['plain', 'jact2']
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.lib import data as data_lib
from experiments.lib import memory, metadata, timing
from experiments.lib.models import SmallCNN, jact_layers, plain_layers
from jact.compressors import PerGroup

__all__ = ["run_comparison", "format_table", "residual_bytes", "main"]

_LAST = 10  # final_loss averages this many last steps


def residual_bytes(fn, *args) -> int:
  """Bytes saved for `fn`'s backward pass, not counting `fn`'s own arguments
  (`jact.residual_report`)."""
  from jact._report import residual_report

  return int(residual_report(fn, *args).total_bytes)


def _make_optimizer(name: str, learning_rate: float | None):
  if name == "momentum":
    return optax.sgd(0.01 if learning_rate is None else learning_rate, momentum=0.9)
  if name == "adam":
    return optax.adam(1e-3 if learning_rate is None else learning_rate)
  raise ValueError(f"optimizer must be 'momentum' or 'adam', got {name!r}")


def _loss_fn(model):
  def loss(params, batch_stats, x, y, step, key):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      x,
      train=True,
      rngs={"jact": jax.random.fold_in(key, step)},
      mutable=["batch_stats"],
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), updates

  return loss


def _train_step(model, tx):
  loss_fn = _loss_fn(model)

  def step_fn(state, x, y, step, key):
    params, batch_stats, opt_state = state
    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, batch_stats, x, y, step, key
    )
    deltas, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, deltas), updates["batch_stats"], opt_state), loss

  return step_fn


def _accuracy(predict, variables, x, y, batch_size=500) -> float:
  correct = 0
  for start in range(0, len(x), batch_size):
    pred = predict(variables, jnp.asarray(x[start : start + batch_size]))
    correct += int(np.sum(np.asarray(pred) == y[start : start + batch_size]))
  return correct / len(x)


def _progress(iterable, desc, enabled):
  if not enabled:
    return iterable
  from tqdm import tqdm

  return tqdm(iterable, desc=desc, leave=False, file=sys.stderr)


def run_comparison(
  *,
  steps: int = 300,
  batch_size: int = 64,
  bits: Sequence[int] = (8, 4, 2),
  dataset: str = "auto",
  widths: Sequence[int] = (32, 64, 128),
  optimizer: str = "momentum",
  learning_rate: float | None = None,
  group_size: int = 256,
  seed: int = 0,
  train_size: int | None = None,
  test_size: int | None = None,
  progress: bool = True,
) -> list[dict[str, Any]]:
  """Trains SmallCNN plain and with jact twins at each of `bits`; one row per variant.

  All variants start from the same parameters (the plain model's init with
  `seed`) and see the same batches in the same order. Rows hold: variant,
  bits (None for plain), dataset, steps, batch_size, final_loss, test_accuracy,
  residual_bytes, temp_bytes, step_time_s (median), compile_s, losses (one
  per step), and residual_ratio / temp_ratio / time_ratio relative to plain.
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  tx = _make_optimizer(optimizer, learning_rate)
  name = data_lib.resolve_dataset(dataset)
  xtr, ytr, xte, yte = data_lib.load_image_dataset(name, train_size=train_size, test_size=test_size)
  num_classes = int(max(ytr.max(), yte.max())) + 1
  widths = tuple(int(w) for w in widths)
  # Parameters are drawn with the 'rbg' PRNG: on XLA:CPU compiling threefry draws
  # for the initializers took ~10 s per kernel shape (measured), rbg ~1 s.
  init_key = jax.random.key(seed, impl="rbg")
  rng_key = jax.random.fold_in(jax.random.key(seed), 1)  # the 'jact' stream, folded per step

  plain = SmallCNN(num_classes, widths, plain_layers())
  x0 = jnp.asarray(xtr[:batch_size])
  variables = jax.jit(lambda k, x: plain.init(k, x, train=False))(init_key, x0)
  params, batch_stats = variables["params"], variables["batch_stats"]
  predict = jax.jit(lambda v, xb: jnp.argmax(plain.apply(v, xb, train=False), -1))

  variants = [("plain", None, plain_layers())]
  variants += [
    (f"jact{b}", int(b), jact_layers(int(b), PerGroup(int(b), group_size=group_size))) for b in bits
  ]
  rows = []
  for variant, b, layers in variants:
    model = SmallCNN(num_classes, widths, layers)
    step_fn = _train_step(model, tx)
    state = (params, batch_stats, jax.jit(tx.init)(params))
    y0 = jnp.asarray(ytr[:batch_size])
    with timing.Stopwatch() as compiling:
      compiled = jax.jit(step_fn).lower(state, x0, y0, jnp.int32(0), rng_key).compile()
    compile_s = compiling.seconds
    temp_bytes = memory.compiled_memory_of(compiled).temp_bytes
    loss_fn = _loss_fn(model)
    loss_only = lambda *a: loss_fn(*a)[0]
    saved = residual_bytes(loss_only, params, batch_stats, x0, y0, jnp.int32(0), rng_key)

    losses, times = [], []
    it = data_lib.batches(xtr, ytr, batch_size, seed=seed)
    bar = _progress(range(steps), variant, progress)
    for step in bar:
      xb, yb = next(it)
      with timing.Stopwatch() as stepping:  # float(loss) waits for the step
        state, loss = compiled(state, jnp.asarray(xb), jnp.asarray(yb), jnp.int32(step), rng_key)
        loss = float(loss)
      times.append(stepping.seconds)
      losses.append(loss)
      if progress and step % 10 == 0:
        bar.set_postfix(loss=f"{loss:.3f}")
    acc = _accuracy(predict, {"params": state[0], "batch_stats": state[1]}, xte, yte)
    rows.append(
      dict(
        variant=variant,
        bits=b,
        dataset=name,
        steps=steps,
        batch_size=batch_size,
        final_loss=float(np.mean(losses[-_LAST:])),
        test_accuracy=acc,
        residual_bytes=saved,
        temp_bytes=temp_bytes,
        step_time_s=statistics.median(times),
        compile_s=compile_s,
        losses=losses,
      )
    )
  base = rows[0]
  for row in rows:
    row["residual_ratio"] = row["residual_bytes"] / base["residual_bytes"]
    row["temp_ratio"] = (
      row["temp_bytes"] / base["temp_bytes"]
      if row["temp_bytes"] is not None and base["temp_bytes"]
      else None
    )
    row["time_ratio"] = row["step_time_s"] / base["step_time_s"]
  return rows


def _bytes(n):
  if n is None:
    return "n/a"
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def _ratio(r):
  return "n/a" if r is None else f"{r:.3f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """A fixed-width text table of `run_comparison` rows."""
  header = (
    "variant",
    "final loss",
    "test acc",
    "residual",
    "x plain",
    "temp",
    "x plain",
    "step ms",
    "x plain",
  )
  body = [
    (
      r["variant"],
      f"{r['final_loss']:.4f}",
      f"{r['test_accuracy']:.4f}",
      _bytes(r["residual_bytes"]),
      _ratio(r["residual_ratio"]),
      _bytes(r["temp_bytes"]),
      _ratio(r["temp_ratio"]),
      f"{1e3 * r['step_time_s']:.1f}",
      _ratio(r["time_ratio"]),
    )
    for r in rows
  ]
  widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
  fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
  lines = [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(b) for b in body]
  if rows:
    r = rows[0]
    lines.append(
      f"dataset={r['dataset']} steps={r['steps']} batch={r['batch_size']} "
      f"backend={jax.default_backend()}"
    )
  return "\n".join(lines)


def run_metadata(argv=None) -> dict:
  """Device, versions, date and command of a run, stored with its results."""
  return metadata.run_metadata("experiments.compare", argv)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  p = argparse.ArgumentParser(
    prog="python -m experiments.compare",
    description=__doc__.split("\n\n")[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2])
  p.add_argument("--dataset", default="auto", choices=data_lib.DATASETS)
  p.add_argument("--widths", type=int, nargs="+", default=[32, 64, 128])
  p.add_argument("--optimizer", default="momentum", choices=["momentum", "adam"])
  p.add_argument("--lr", type=float, default=None)
  p.add_argument("--group-size", type=int, default=256)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--train-size", type=int, default=None)
  p.add_argument("--test-size", type=int, default=None)
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
  a = p.parse_args(argv)
  rows = run_comparison(
    steps=a.steps,
    batch_size=a.batch,
    bits=a.bits,
    dataset=a.dataset,
    widths=a.widths,
    optimizer=a.optimizer,
    learning_rate=a.lr,
    group_size=a.group_size,
    seed=a.seed,
    train_size=a.train_size,
    test_size=a.test_size,
    progress=not a.no_progress,
  )
  print(format_table(rows))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"meta": run_metadata(argv), "rows": rows}, f, indent=2)
  return rows


if __name__ == "__main__":
  main()
