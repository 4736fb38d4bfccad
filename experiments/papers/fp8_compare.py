"""FP8 residual storage vs 8/4/2-bit per-group integer codes, on the ResNet-20 and a char LM.

The FP8 training stacks (COAT, TransformerEngine's MXFP8, `torch.compile`'s
FP8 activations) store activations as float8 codes with a scale per block;
ActNN and GACT store per-group integer codes. This compares both with every
compressed residual stored by one method (`jact.compressors.Float8` e4m3
round-to-nearest, e4m3 stochastic, e5m2 round-to-nearest; `PerGroup` 8, 4, 2
bits stochastic and 8 bits round-to-nearest; a plan naming every residual),
at the same parameters, batch and rounding keys, on `--model`:

* `resnet20`: the `experiments.papers.actnn_cifar` ResNet-20 on CIFAR-10, at
  its seed's initialization (`--epoch` > 0: the fp run of that seed after
  that epoch);
* `char_lm`: `experiments.papers.bit_plans`' 2-block character transformer on
  tiny Shakespeare, after `--lm-steps` exact Adam steps from its seed's
  initialization.

Per seed (the initialization and the batches):

* sampling variance: summed per-coordinate variance of exact gradients of
  `--sampling-batches` minibatches (the scale to compare with);
* per method, on the first batch: `variance`, the summed variance of the
  compressed gradient over `--keys` keys (0 for a deterministic method, which
  is computed once); `error`, the mean over keys of ||g_hat - g||^2 (bias and
  variance together); `mean_error`, ||mean_k g_hat - g||^2 (what is left
  after averaging over keys: the bias, plus variance / keys); each also over
  the sampling variance; `bytes_per_value`, the bytes the method stores for
  the compressed residuals over their number of values (`stored_bytes`), and
  `residual_bytes`, everything the loss keeps for the backward pass
  (`jact.residual_report`).

Writes `<results>/fp8_compare.json` (ResNet) or `fp8_compare_char_lm.json`
(`_small` before `.json` with `--small`) after every seed, with the mean and
standard deviation over seeds of each method's ratios in `summary`.

    python -m experiments.papers.fp8_compare --seeds 0 1 2                  # ResNet-20, batch 128
    python -m experiments.papers.fp8_compare --model char_lm --seeds 0 1 2  # char LM, batch 32
    python -m experiments.papers.fp8_compare --small --seeds 0              # a minute: small net
"""  # noqa: E501 (commands in this docstring)

from __future__ import annotations

import argparse
import dataclasses
import functools
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jact
from jact import compressors as C
from experiments.lib import data as data_lib
from experiments.lib import metadata, paths, plan_models, preact, resumable
from experiments.papers.grad_variance import flat_gradient, sampling_variance

__all__ = ["METHODS", "method_row", "measure_seed", "summarize", "main"]

METHODS = {
  "fp8_e4m3": C.Float8("e4m3"),
  "fp8_e4m3_sr": C.Float8("e4m3", stochastic=True),
  "fp8_e5m2": C.Float8("e5m2"),
  "int8": C.PerGroup(8),
  "int8_rtn": C.PerGroup(8, stochastic=False),
  "int4": C.PerGroup(4),
  "int2": C.PerGroup(2),
}
RATIOS = ("variance", "error", "mean_error")


@dataclasses.dataclass(frozen=True)
class Model:
  """A model under comparison: its jact loss (residuals named, stored as a plan
  says), its exact gradient, and how to get parameters and batches for a seed."""

  name: str
  loss: Callable
  exact: Callable  # jitted (params, batch, key, plan=None) -> gradient
  params: Callable  # seed -> parameters
  batches: Callable  # (seed, count) -> batches


def _planned_gradient(loss):
  return jax.jit(jact.planned(jax.grad(loss)), static_argnames="plan")


def resnet20(*, widths, blocks, batch: int, runs: Path, epoch: int, train_size: int) -> Model:
  """The `experiments.papers.actnn_cifar` ResNet on CIFAR-10 (its seed's initialization, or
  its fp run's parameters after `epoch`)."""
  x, y, _, _ = data_lib.load_image_dataset("cifar10_full", train_size=train_size, test_size=1)

  def batches(seed, count):
    rng = np.random.default_rng(seed)
    picks = (rng.choice(len(x), batch, replace=False) for _ in range(count))
    return [tuple(map(jnp.asarray, (x[i], y[i]))) for i in picks]

  exact = jax.jit(
    lambda p, b, k, plan=None: jax.grad(functools.partial(preact.loss, form="plain"))(p, b, k)
  )
  return Model(
    "resnet20",
    functools.partial(preact.loss, form="layers", bits=2),
    exact,
    lambda seed: _resnet_params(seed, epoch, runs, widths, blocks),
    batches,
  )


def char_lm(*, d: int, blocks: int, batch: int, length: int, steps: int) -> Model:
  """`experiments.papers.bit_plans`' character transformer on tiny Shakespeare, after
  `steps` exact Adam steps from its seed's initialization."""
  from experiments.papers.bit_plans import _text_batches

  vocab, first = next(_text_batches(batch, length))
  loss = plan_models.transformer_loss
  grad = _planned_gradient(loss)
  init = plan_models.transformer_params(jax.random.key(0), vocab, d=d, blocks=blocks, length=length)
  sites = jact.sensitivity.find_residuals(loss, init, first, jax.random.key(0))
  exact_plan = jact.BitPlan.uniform({n: s.size for n, s in sites.items()}, None)  # kept exact

  def exact(p, b, k, plan=None):
    return grad(p, b, k, plan=exact_plan)

  def params(seed):
    p = plan_models.transformer_params(
      jax.random.key(seed), vocab, d=d, blocks=blocks, length=length
    )
    tx = optax.adam(3e-3)
    state = tx.init(p)

    @jax.jit
    def step(p, state, b):
      g = exact(p, b, jax.random.key(0))
      updates, state = tx.update(g, state, p)
      return optax.apply_updates(p, updates), state

    stream = _text_batches(batch, length, seed=10_000 + seed)  # not the measured batches
    for _ in range(steps):
      p, state = step(p, state, next(stream)[1])
    return p

  def batches(seed, count):
    stream = _text_batches(batch, length, seed=seed)
    return [next(stream)[1] for _ in range(count)]

  return Model("char_lm", loss, exact, params, batches)


def _bytes(model: Model, plan, params, batch) -> tuple[float, int]:
  """(stored bytes per value of the compressed residuals, all residual bytes) under `plan`."""
  key = jax.random.key(1)
  sites = jact.sensitivity.find_residuals(model.loss, params, batch, key)
  stored = sum(plan.bits_for(n).stored_bytes(s.shape, s.dtype) for n, s in sites.items())
  values = sum(s.size for s in sites.values())
  with jact.use_plan(plan):
    report = jact.residual_report(lambda p: model.loss(p, batch, key), params)
  return stored / values, int(report.total_bytes)


def method_row(model: Model, name: str, params, batch, exact, keys: int, sampled: float) -> dict:
  """One method's row at these parameters (see the module docstring)."""
  c = METHODS[name]
  sites = jact.sensitivity.find_residuals(model.loss, params, batch, jax.random.key(1))
  plan = jact.BitPlan({n: c for n in sites}, sizes={n: s.size for n, s in sites.items()})
  grad = _planned_gradient(model.loss)
  n = keys if c.needs_key else 1  # a deterministic method gives the same gradient for every key
  draws = np.stack(
    [flat_gradient(grad, params, batch, jax.random.key(1000 + i), plan) for i in range(n)]
  )
  per_value, residual_bytes = _bytes(model, plan, params, batch)
  row = dict(
    method=name,
    compressor=c.to_dict(),
    unbiased=c.unbiased,
    keys=n,
    variance=float(draws.var(axis=0, ddof=1).sum()) if n > 1 else 0.0,
    error=float(((draws - exact) ** 2).sum(axis=1).mean()),
    mean_error=float(((draws.mean(axis=0) - exact) ** 2).sum()),
    bytes_per_value=per_value,
    residual_bytes=residual_bytes,
  )
  for k in RATIOS:
    row[f"{k}_over_sampling"] = row[k] / sampled
  return row


def measure_seed(model: Model, params, batches, *, keys: int, methods=tuple(METHODS)) -> dict:
  """The sampling variance and every method's row at one set of parameters."""
  exact = flat_gradient(model.exact, params, batches[0], jax.random.key(0))
  sampled = sampling_variance(model.exact, params, batches)
  rows = [method_row(model, m, params, batches[0], exact, keys, sampled) for m in methods]
  return dict(sampling_variance=sampled, gradient_norm_sq=float((exact**2).sum()), rows=rows)


def summarize(seeds: dict) -> dict:
  """Per method: mean and standard deviation over seeds of its ratios and bytes."""
  by_method: dict[str, list[dict]] = {}
  for measured in seeds.values():
    for r in measured["rows"]:
      by_method.setdefault(r["method"], []).append(r)
  out = {}
  for m, rows in by_method.items():
    s = dict(seeds=len(rows), bytes_per_value=float(np.mean([r["bytes_per_value"] for r in rows])))
    for k in RATIOS:
      v = np.array([r[f"{k}_over_sampling"] for r in rows])
      s[f"{k}_over_sampling"] = dict(
        mean=float(v.mean()), std=float(v.std(ddof=1)) if len(v) > 1 else None
      )
    out[m] = s
  return out


def _resnet_params(seed: int, epoch: int, runs: Path, widths, blocks):
  init = preact.init(jax.random.key(seed), widths=widths, blocks=blocks)  # actnn_cifar's
  if epoch == 0:
    return init
  from experiments.papers.actnn_cifar import run_name

  folder = runs / run_name("fp", seed) / "snapshots" / f"epoch{epoch}"
  restored = resumable.restore(folder, dict(params=init))
  if restored is None:
    raise SystemExit(
      f"no snapshot at {folder}: run `python -m experiments.papers.actnn_cifar --variants fp "
      f"--seed {seed}` first, or measure at --epoch 0 (initialization)"
    )
  return restored[0]["params"]


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(
    prog="python -m experiments.papers.fp8_compare", description=__doc__.split("\n")[0]
  )
  p.add_argument("--model", choices=("resnet20", "char_lm"), default="resnet20")
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--epoch", type=int, default=0, help="the fp run's epoch (0: initialization)")
  p.add_argument("--batch", type=int, default=None, help="default 128 (ResNet), 32 (char LM)")
  p.add_argument("--keys", type=int, default=8)
  p.add_argument("--sampling-batches", type=int, default=16)
  p.add_argument("--lm-steps", type=int, default=300, help="exact Adam steps before measuring")
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  p.add_argument("--runs", type=Path, default=paths.ACTNN_CIFAR_RUNS)
  p.add_argument("--results", type=Path, default=paths.RESULTS)
  p.add_argument(
    "--small",
    action="store_true",
    help="small nets (ResNet widths 8/16/32, 1 block, batch 32; a 1-block d=32 LM), 4 keys",
  )
  p.add_argument(
    "--widths",
    type=int,
    nargs="+",
    default=None,
    help="the ResNet's stage widths (default 16 32 64; --small: 8 16 32)",
  )
  a = p.parse_args(argv)
  if a.small:
    a.keys, a.sampling_batches = 4, 4
  settings = dict(
    model=a.model, keys=a.keys, sampling_batches=a.sampling_batches, methods=list(a.methods)
  )
  if a.model == "resnet20":
    widths, blocks = ((8, 16, 32), 1) if a.small else ((16, 32, 64), 3)
    widths = tuple(a.widths or widths)
    batch = a.batch or (32 if a.small else 128)
    train = batch * a.sampling_batches * (1 if a.small else 8)
    model = resnet20(
      widths=widths, blocks=blocks, batch=batch, runs=a.runs, epoch=a.epoch, train_size=train
    )
    settings.update(epoch=a.epoch, batch=batch, widths=list(widths), blocks=blocks)
  else:
    shape = dict(d=32, blocks=1, length=32) if a.small else dict(d=64, blocks=2, length=64)
    batch, steps = a.batch or (8 if a.small else 32), 5 if a.small else a.lm_steps
    model = char_lm(batch=batch, steps=steps, **shape)
    settings.update(batch=batch, lm_steps=steps, **shape)
  stem = "fp8_compare" if a.model == "resnet20" else "fp8_compare_char_lm"
  path = a.results / f"{stem}{'_small' if a.small else ''}.json"
  result = dict(
    meta=metadata.run_metadata("experiments.papers.fp8_compare", argv),
    **settings,
    seeds={},
    complete=False,
  )
  for seed in a.seeds:
    batches = model.batches(seed, a.sampling_batches)
    measured = measure_seed(
      model, model.params(seed), batches, keys=a.keys, methods=tuple(a.methods)
    )
    result["seeds"][str(seed)] = measured
    for r in measured["rows"]:
      print(
        f"{model.name} seed {seed} {r['method']:<12} {r['bytes_per_value']:.3f} B/value "
        f"variance x{r['variance_over_sampling']:.3g} error x{r['error_over_sampling']:.3g} "
        f"mean error x{r['mean_error_over_sampling']:.3g} (of the sampling variance)",
        flush=True,
      )
    result["summary"] = summarize(result["seeds"])
    resumable.write_json(path, result)  # a partial result survives an interrupted run
  result["complete"] = True
  resumable.write_json(path, result)
  return result


if __name__ == "__main__":
  main()
