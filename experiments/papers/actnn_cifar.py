"""ActNN's CIFAR-10 experiment: one pre-activation ResNet, every compressor, same init and data.

Trains `experiments.lib.preact`'s ResNet-20 (3 stages of 16/32/64 channels, 3
blocks each, the BN -> ReLU -> conv units BLPA compresses) on the full 50k
CIFAR-10 training set with SGD (Nesterov momentum 0.9, weight decay 5e-4,
warm-up then cosine learning rate), random crops and flips, once per variant:

| variant | what is stored for the backward pass |
|---|---|
| fp | full precision (plain JAX) |
| actnn_l2 | ActNN L2: 4-bit per-group quantization of every layer |
| pergroup2 | 2-bit per-group quantization of every layer |
| actnn_l3 | ActNN L3: 2 bits on average, per-layer and per-sample widths from the analytic sensitivity |
| blpa4, blpa2 | BLPA: each BN -> ReLU -> conv unit keeps a 4- / 2-bit pre-ReLU copy |
| division | DIVISION: 8x8-block low-pass in bf16 + 2-bit high-frequency part |
| acgc | AC-GC AutoQuant: round-to-nearest fixed point, widths from Table 1's bounds at e^2 = 0.5 |
| acgc_scale | acgc with the batch norms' scale gradients bounded too (`scale_bound=True`, not in Table 1) |

Every variant starts from the same parameters and sees the same batches in
the same order with the same augmentation; only the stored residuals differ
(the forward values are identical, so test accuracy is evaluated with the
plain forward). Test accuracy on the 10k test images after every epoch (BN
uses the statistics of each 500-image test batch: the preact model keeps no
running averages). Runs checkpoint every `--checkpoint-every` steps under
`--runs` and resume where they stopped; results go to
`<results>/<variant>.json` with the memory of the train step (bytes saved
for the backward pass and compiled temp, batch `--batch`).

    python -m experiments.papers.actnn_cifar --variants fp actnn_l2 --epochs 3

Small version (a minute): `--dataset cifar10 --train-size 512 --test-size 500
--epochs 1 --widths 8 --blocks 1 --batch 64`.
"""  # noqa: E501 (tables and commands in this docstring)

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jact
from experiments.lib import data as data_lib
from experiments.lib import metadata, paths, preact, resumable, summary_table

__all__ = ["VARIANTS", "variant_settings", "augment", "train_variant", "main"]

VARIANTS = tuple(summary_table.ACTNN_VARIANTS)  # the variants, in the key table's order
RESULTS = paths.RESULTS / "actnn_cifar"
RUNS = paths.ACTNN_CIFAR_RUNS
ACGC_ERROR = 0.5  # AC-GC's e^2 (the paper: "e^2 > 0.5 decreases accuracy"); `--acgc-error`


def variant_settings(name: str, acgc_error: float = ACGC_ERROR) -> dict:
  """The loss keywords (form, bits / compressor) and controller settings of a variant."""
  table = {
    "fp": dict(form="plain"),
    "actnn_l2": dict(form="layers", bits=4),
    "pergroup2": dict(form="layers", bits=2),
    "actnn_l3": dict(  # jact.levels.get("actnn:L3"): joint allocation at 1..8 bits
      form="layers",
      bits=2,
      controller=dict(
        estimator="analytic",
        avg_bits=2.0,
        per_sample=True,
        allowed=jact.allocate.ACTNN_WIDTHS,
      ),
    ),
    "blpa4": dict(form="blpa", bits=4),
    "blpa2": dict(form="blpa", bits=2),
    "division": dict(form="layers", compressor=jact.compressors.Division(block=8, bits=2)),
    # AutoQuant: every bounded residual in Fixpoint(b) at the width its bound needs (2..16
    # bits, each stored in exactly b bits; wider than 16: kept exact); the call sites'
    # Fixpoint(8) stores the rest.
    "acgc": dict(
      form="layers",
      compressor=jact.compressors.Fixpoint(8),
      controller=dict(estimator="acgc", error=acgc_error, compressor=jact.compressors.Fixpoint(8)),
    ),
    "acgc_scale": dict(
      form="layers",
      compressor=jact.compressors.Fixpoint(8),
      controller=dict(
        estimator="acgc",
        error=acgc_error,
        compressor=jact.compressors.Fixpoint(8),
        scale_bound=True,
      ),
    ),
  }
  if name not in table:
    raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")
  return dict(table[name])


def augment(images: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
  """Random crops of the zero-padded images and random horizontal flips.

  >>> x = np.arange(2 * 4 * 4 * 1, dtype=np.float32).reshape(2, 4, 4, 1)
  >>> augment(x, np.random.default_rng(0), pad=1).shape
  (2, 4, 4, 1)
  """
  n, h, w, _ = images.shape
  padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  dy, dx = rng.integers(0, 2 * pad + 1, n), rng.integers(0, 2 * pad + 1, n)
  rows = dy[:, None] + np.arange(h)[None]
  cols = dx[:, None] + np.arange(w)[None]
  out = padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
  flip = rng.random(n) < 0.5
  out[flip] = out[flip, :, ::-1]
  return out


def _batch(x, y, step: int, batch_size: int, seed: int):
  """The step's batch: epoch permutation seeded by (seed, epoch), augmentation by (seed, step)."""
  per_epoch = len(x) // batch_size
  epoch, index = divmod(step, per_epoch)
  order = np.random.default_rng((seed, epoch)).permutation(len(x))
  idx = order[index * batch_size : (index + 1) * batch_size]
  return augment(x[idx], np.random.default_rng((seed, 1, step))), y[idx]


_logits = jax.jit(functools.partial(preact.apply, form="plain"))  # one compile for all variants


def _accuracy(params, x, y, batch_size=500) -> float:
  logits = _logits
  hits = sum(
    int(
      jnp.sum(
        jnp.argmax(logits(params, jnp.asarray(x[i : i + batch_size])), -1)
        == jnp.asarray(y[i : i + batch_size])
      )
    )
    for i in range(0, len(x), batch_size)
  )
  return hits / len(x)


def _memory(loss_fn, params, batch, plan) -> dict:
  """Bytes saved for the backward pass and compiled temp of the gradient, at this plan."""
  key = jax.random.key(0)
  grad = jact.planned(jax.grad(loss_fn))
  with jact.use_plan(plan):
    saved = jact.residual_report(loss_fn, params, batch, key).total_bytes
  temp = jact.compiled_memory(functools.partial(grad, plan=plan), params, batch, key).temp_bytes
  return dict(saved_bytes=int(saved), temp_bytes=int(temp))


def run_name(variant: str, seed: int) -> str:
  """A run's folder and result name: the variant, and the seed unless it is 0 (older runs)."""
  return variant if seed == 0 else f"{variant}_seed{seed}"


def train_variant(
  name: str,
  *,
  data,
  epochs: int,
  batch_size: int = 128,
  widths=(16, 32, 64),
  blocks: int = 3,
  lr: float = 0.1,
  weight_decay: float = 5e-4,
  seed: int = 0,
  acgc_error: float = ACGC_ERROR,
  adapt_interval: int = 100,
  checkpoint_every: int = 100,
  runs: Path = RUNS,
  log_every: int = 50,
  stop_after_s: float | None = None,
  verbose: bool = True,
  on_epoch=None,
) -> dict:
  """Trains (or resumes) one variant; returns its result dict (complete or partial).

  `on_epoch(partial_result)`, if given, is called after every epoch's evaluation
  (e.g. to write the running result where notebooks read it).
  """
  x_train, y_train, x_test, y_test = data
  settings = variant_settings(name, acgc_error)
  control = settings.pop("controller", None)
  loss_fn = functools.partial(preact.loss, **settings)
  per_epoch = len(x_train) // batch_size
  total = epochs * per_epoch
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(200, total // 10 + 1), total)
  tx = optax.chain(
    optax.add_decayed_weights(weight_decay), optax.sgd(schedule, momentum=0.9, nesterov=True)
  )

  def train_step(params, opt_state, batch, key):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step_fn = jax.jit(jact.planned(train_step), static_argnames="plan")
  params = preact.init(jax.random.key(seed), widths=widths, blocks=blocks)
  opt_state = tx.init(params)
  key = jax.random.key(seed + 1)
  first = tuple(map(jnp.asarray, _batch(x_train, y_train, 0, batch_size, seed)))
  controller = cstate = None
  if control:
    controller = jact.Controller(loss_fn, adapt_interval=adapt_interval, **control)
    cstate = controller.init(params, first, key)

  run_dir = Path(runs) / run_name(name, seed)
  progress = dict(step=0, history=[], losses=[], step_seconds=[], plans=[])
  restored = resumable.restore(run_dir, dict(params=params, opt_state=opt_state))
  if restored is not None:
    state, progress, folder = restored
    params, opt_state = state["params"], state["opt_state"]
    if controller is not None:
      cstate = controller.restore(folder / "controller", cstate)
    if verbose:
      print(f"[{name}] resumed at step {progress['step']} of {total}", flush=True)

  def checkpoint():
    resumable.save(
      run_dir,
      dict(params=params, opt_state=opt_state),
      progress,
      None if controller is None else lambda folder: controller.save(cstate, folder / "controller"),
    )

  started = time.perf_counter()
  window = []
  while progress["step"] < total:
    step = progress["step"]
    batch = tuple(map(jnp.asarray, _batch(x_train, y_train, step, batch_size, seed)))
    k = jax.random.fold_in(key, step)
    plan = None
    if controller is not None:
      before = cstate.plan
      cstate = controller.update(cstate, params, batch, k)
      plan = cstate.plan
      if cstate.report and (step == 0 or plan != before or step % (10 * adapt_interval) == 0):
        progress["plans"].append(dict(step=step, plan=plan.to_dict(), report=cstate.report))
    t0 = time.perf_counter()
    params, opt_state, loss = step_fn(params, opt_state, batch, k, plan=plan)
    loss = float(loss)
    progress["step_seconds"].append(time.perf_counter() - t0)
    window.append(loss)
    progress["step"] = step + 1
    if not np.isfinite(loss):
      raise FloatingPointError(f"[{name}] loss is {loss} at step {step}")
    if len(window) == log_every or progress["step"] == total:
      progress["losses"].append(dict(step=progress["step"], loss=float(np.mean(window))))
      if verbose:
        print(
          f"[{name}] step {progress['step']}/{total} loss {np.mean(window):.4f} "
          f"({np.median(progress['step_seconds'][-log_every:]):.2f} s/step)",
          flush=True,
        )
      window = []
    if progress["step"] % per_epoch == 0:
      acc = _accuracy(params, x_test, y_test)
      progress["history"].append(
        dict(epoch=progress["step"] // per_epoch, step=progress["step"], test_accuracy=acc)
      )
      if verbose:
        print(
          f"[{name}] epoch {progress['step'] // per_epoch}: test accuracy {acc:.4f}", flush=True
        )
      resumable.save(
        run_dir / "snapshots" / f"epoch{progress['step'] // per_epoch}",
        dict(params=params),
        dict(step=progress["step"]),
      )
      if on_epoch is not None and progress["step"] < total:
        on_epoch(_result(name, settings, control, epochs, batch_size, total, progress, cstate))
    if progress["step"] % checkpoint_every == 0 or progress["step"] == total:
      checkpoint()
    if stop_after_s is not None and time.perf_counter() - started > stop_after_s:
      checkpoint()
      break
  return _result(
    name, settings, control, epochs, batch_size, total, progress, cstate, loss_fn, params, first
  )


def _result(
  name,
  settings,
  control,
  epochs,
  batch_size,
  total,
  progress,
  cstate,
  loss_fn=None,
  params=None,
  first=None,
) -> dict:
  """The variant's result; memory and final figures once it is complete."""
  plan = cstate.plan if cstate is not None else None
  result = dict(
    variant=name,
    settings={k: repr(v) for k, v in settings.items()},
    controller=None
    if control is None
    else {k: v if isinstance(v, (bool, int, float, str)) else repr(v) for k, v in control.items()},
    epochs=epochs,
    batch_size=batch_size,
    steps=progress["step"],
    total_steps=total,
    complete=progress["step"] >= total,
    history=progress["history"],
    losses=progress["losses"],
    plans=progress["plans"],
    median_step_s=float(np.median(progress["step_seconds"])) if progress["step_seconds"] else None,
  )
  if result["complete"] and params is not None:
    result["final_test_accuracy"] = progress["history"][-1]["test_accuracy"]
    result["memory"] = _memory(loss_fn, params, first, plan)
    if plan is not None:
      result["final_average_bits"] = float(plan.average_bits())
  return result


def main(argv=None):
  p = argparse.ArgumentParser(
    prog="python -m experiments.papers.actnn_cifar", description=__doc__.split("\n")[0]
  )
  p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
  p.add_argument("--epochs", type=int, default=3)
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--widths", type=int, nargs="+", default=[16, 32, 64])
  p.add_argument("--blocks", type=int, default=3)
  p.add_argument("--lr", type=float, default=0.1)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--acgc-error", type=float, default=ACGC_ERROR)
  p.add_argument("--adapt-interval", type=int, default=100)
  p.add_argument(
    "--dataset",
    default="cifar10_full",
    choices=["cifar10_full", "cifar10"],
    help="cifar10: the kit's 10k/2k subset (small runs)",
  )
  p.add_argument("--train-size", type=int, default=None)
  p.add_argument("--test-size", type=int, default=None)
  p.add_argument("--checkpoint-every", type=int, default=100)
  p.add_argument(
    "--stop-after",
    type=float,
    default=None,
    metavar="SECONDS",
    help="checkpoint and stop a variant after this long (resume later)",
  )
  p.add_argument("--runs", type=Path, default=RUNS)
  p.add_argument("--results", type=Path, default=RESULTS)
  p.add_argument(
    "--json",
    type=Path,
    default=None,
    help="also write every variant's result into this one file (the GPU campaign)",
  )
  a = p.parse_args(argv)
  x_tr, y_tr, x_te, y_te = data_lib.load_image_dataset(
    a.dataset, train_size=a.train_size, test_size=a.test_size
  )
  meta = metadata.run_metadata("experiments.papers.actnn_cifar", argv)
  combined = {"meta": meta, "variants": {}}
  for name in a.variants:

    def write(result, name=name):
      result.update(
        meta=meta,
        train_size=len(x_tr),
        test_size=len(x_te),
        widths=list(a.widths),
        blocks=a.blocks,
        lr=a.lr,
        seed=a.seed,
      )
      resumable.write_json(a.results / f"{run_name(name, a.seed)}.json", result)
      if a.json is not None:
        combined["variants"][name] = result
        resumable.write_json(a.json, combined)

    result = train_variant(
      name,
      data=(x_tr, y_tr, x_te, y_te),
      epochs=a.epochs,
      batch_size=a.batch,
      widths=tuple(a.widths),
      blocks=a.blocks,
      lr=a.lr,
      seed=a.seed,
      acgc_error=a.acgc_error,
      adapt_interval=a.adapt_interval,
      checkpoint_every=a.checkpoint_every,
      runs=a.runs,
      stop_after_s=a.stop_after,
      on_epoch=write,
    )
    write(result)
    print(
      f"[{name}] {'done' if result['complete'] else 'stopped'}: "
      f"{result.get('final_test_accuracy')} {result.get('memory')}",
      flush=True,
    )


if __name__ == "__main__":
  main()
