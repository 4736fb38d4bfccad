"""FP8 residual storage vs 8/4/2-bit per-group integer codes on the CIFAR ResNet-20.

The FP8 training stacks (COAT, TransformerEngine's MXFP8, `torch.compile`'s
FP8 activations) store activations as float8 codes with a scale per block;
ActNN and GACT store per-group integer codes. This compares both on the
`experiments.papers.actnn_cifar` ResNet-20, every compressed residual stored
by one method (`jact.compressors.Float8` e4m3 round-to-nearest, e4m3
stochastic, e5m2 round-to-nearest; `PerGroup` 8, 4, 2 bits stochastic and 8
bits round-to-nearest), at the same parameters, batch and rounding keys. Per
seed (the network's initialization and the batches; `--epoch` > 0 takes the
parameters of the fp run of that seed after that epoch instead):

* sampling variance: summed per-coordinate variance of exact gradients of
  `--sampling-batches` minibatches of `--batch` images (the scale to compare with);
* per method, on the first batch: `variance`, the summed variance of the
  compressed gradient over `--keys` keys (0 for a deterministic method, which
  is computed once); `error`, the mean over keys of ||g_hat - g||^2 (bias and
  variance together); `mean_error`, ||mean_k g_hat - g||^2 (what is left
  after averaging over keys: the bias, plus variance / keys); each also over
  the sampling variance; `bytes_per_value`, the bytes the method stores for
  the compressed residuals over their number of values (`stored_bytes`), and
  `residual_bytes`, everything the loss keeps for the backward pass
  (`jact.residual_report`).

Writes `<results>/fp8_compare.json` (`fp8_compare_small.json` with `--small`)
after every seed, with the mean and standard deviation over seeds of each
method's ratios in `summary`.

    python -m experiments.papers.fp8_compare --seeds 0 1 2      # ResNet-20, batch 128
    python -m experiments.papers.fp8_compare --small --seeds 0  # a minute: small net
"""  # noqa: E501 (commands in this docstring)

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jact
from jact import compressors as C
from experiments.lib import data as data_lib
from experiments.lib import metadata, paths, preact, resumable
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


@functools.cache
def _gradient(compressor):
  """The jitted gradient of the ResNet's loss with every residual stored by `compressor`."""
  loss = functools.partial(preact.loss, form="layers", compressor=compressor)
  return jax.jit(lambda p, b, k, plan=None: jax.grad(loss)(p, b, k))


@functools.cache
def _exact():
  loss = functools.partial(preact.loss, form="plain")
  return jax.jit(lambda p, b, k, plan=None: jax.grad(loss)(p, b, k))


def _bytes(compressor, params, batch) -> tuple[float, int]:
  """(stored bytes per value of the compressed residuals, all residual bytes)."""
  loss = functools.partial(preact.loss, form="layers", compressor=compressor)
  key = jax.random.key(1)
  sites = jact.sensitivity.find_residuals(loss, params, batch, key)
  stored = sum(compressor.stored_bytes(s.shape, s.dtype) for s in sites.values())
  values = sum(s.size for s in sites.values())
  report = jact.residual_report(lambda p: loss(p, batch, key), params)
  return stored / values, int(report.total_bytes)


def method_row(name: str, params, batch, exact: np.ndarray, keys: int, sampled: float) -> dict:
  """One method's row at these parameters (see the module docstring)."""
  c = METHODS[name]
  grad = _gradient(c)
  n = keys if c.needs_key else 1  # a deterministic method gives the same gradient for every key
  draws = np.stack([flat_gradient(grad, params, batch, jax.random.key(1000 + i)) for i in range(n)])
  per_value, residual_bytes = _bytes(c, params, batch)
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


def measure_seed(params, batches, *, keys: int, methods=tuple(METHODS)) -> dict:
  """The sampling variance and every method's row at one set of parameters."""
  exact = flat_gradient(_exact(), params, batches[0], jax.random.key(0))
  sampled = sampling_variance(_exact(), params, batches)
  rows = [method_row(m, params, batches[0], exact, keys, sampled) for m in methods]
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


def _params(seed: int, epoch: int, runs: Path, widths, blocks):
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
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--epoch", type=int, default=0, help="the fp run's epoch (0: initialization)")
  p.add_argument("--batch", type=int, default=128)
  p.add_argument("--keys", type=int, default=8)
  p.add_argument("--sampling-batches", type=int, default=16)
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
  p.add_argument("--runs", type=Path, default=paths.ACTNN_CIFAR_RUNS)
  p.add_argument("--results", type=Path, default=paths.RESULTS)
  p.add_argument(
    "--small", action="store_true", help="small ResNet (widths 8/16/32, 1 block), batch 32"
  )
  p.add_argument(
    "--widths",
    type=int,
    nargs="+",
    default=None,
    help="the ResNet's stage widths (default 16 32 64; --small: 8 16 32)",
  )
  a = p.parse_args(argv)
  widths, blocks = ((8, 16, 32), 1) if a.small else ((16, 32, 64), 3)
  if a.widths:
    widths = tuple(a.widths)
  if a.small:
    a.batch, a.keys, a.sampling_batches = 32, 4, 4
  x, y, _, _ = data_lib.load_image_dataset(
    "cifar10_full", train_size=a.batch * a.sampling_batches * (1 if a.small else 8), test_size=1
  )
  settings = dict(
    epoch=a.epoch,
    batch=a.batch,
    keys=a.keys,
    sampling_batches=a.sampling_batches,
    methods=list(a.methods),
    widths=list(widths),
    blocks=blocks,
  )
  path = a.results / ("fp8_compare_small.json" if a.small else "fp8_compare.json")
  result = dict(
    meta=metadata.run_metadata("experiments.papers.fp8_compare", argv),
    **settings,
    seeds={},
    complete=False,
  )
  for seed in a.seeds:
    rng = np.random.default_rng(seed)
    batches = [
      tuple(map(jnp.asarray, (x[i], y[i])))
      for i in (rng.choice(len(x), a.batch, replace=False) for _ in range(a.sampling_batches))
    ]
    params = _params(seed, a.epoch, a.runs, widths, blocks)
    measured = measure_seed(params, batches, keys=a.keys, methods=tuple(a.methods))
    result["seeds"][str(seed)] = measured
    for r in measured["rows"]:
      print(
        f"seed {seed} {r['method']:<12} {r['bytes_per_value']:.3f} B/value "
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
