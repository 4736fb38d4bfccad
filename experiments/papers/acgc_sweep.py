"""AC-GC's e^2 -> widths and compression on the CIFAR ResNet-20 (AutoQuant, Table 1).

AC-GC (Sec. 5-6) turns an allowed loss increase (1 + e^2) into a tolerance per
stored value and a fixed-point width per layer; at its e^2 = 0.5 the paper
reports 7.5x average compression for AutoQuantZ (fixed point + zero-value
compression; 4.2x on a CIFAR ResNet-50). This measures, on
`experiments.papers.actnn_cifar`'s pre-activation ResNet-20, what the same bounds ask
for: `jact.acgc.error_bounded` with the round-to-nearest `Fixpoint` compressor,
statistics from `--batches` minibatches summarized by their mean (the paper's
ten-entry window), at the initialization and, when `--snapshot` names a saved
run, at trained parameters. The tolerance is linear in e^2 (every Table 1 row
is e^2 times a statistic), so one estimation gives every e^2 of the sweep:
needed levels = measured levels at e^2 = 1, divided by e^2.

Per e^2 the result lists the widths and three compression ratios against
float32, computed from the widths: jact's (`Fixpoint` widths 2..16, each
stored in exactly its bits; beyond 16: exact), any width up to 16 bits (the
paper's fixpoint: now the same) and AutoQuantZ's accounting (a 1-bit zero mask
plus the non-zero values at the needed width, with the measured exact-zero
fraction of each residual: the ReLU outputs the convolutions store). Per
residual at the paper's e^2 = 0.5: the needed bits with Table 1's bounds and
with jact's optional batch-norm scale bound (`scale_bound=True`), which shows
which bound binds.

`stored` holds what is *measured* at the paper's e^2: the bytes the train step
saves for the backward pass (`jact.residual_report` of the gradient under the
plan, i.e. the stored arrays' shapes and dtypes) for the plan of
`jact.acgc.error_bounded` (`acgc`), for the same plan restricted to the widths
jact had before (2, 4, 8; wider: exact, `acgc_248`) and for AutoQuantZ
(`autoquantz`: each convolution input in `ZeroValue(Fixpoint(b))` with a static
capacity of the largest non-zero fraction measured over the batches, rounded
up to 1/64; a denser batch would fall back to dense fixed point in the same
bytes). Per plan: the bounded residuals' bytes against float32 (the paper's
activation compression) and the whole step's saved bytes against the plain
float32 network's.

    python -m experiments.papers.acgc_sweep --snapshot runs/actnn_cifar/fp_seed1/snapshots/epoch3
    python -m experiments.papers.acgc_sweep --small        # seconds: small net, 2 batches
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jact
from experiments.lib import data as data_lib
from experiments.lib import metadata, paths, preact, resumable

__all__ = ["ERRORS", "needed_levels", "needed_bits", "sweep", "paper_plans", "stored", "main"]

ERRORS = (0.05, 0.125, 0.5, 2.0, 8.0, 32.0, 128.0, 512.0, 2048.0)
PAPER_ERROR = 0.5
MAX_BITS = 16  # widest fixpoint the sweep's "any width" column allows


def needed_bits(levels_sq: float, widest: int = MAX_BITS) -> int | None:
  """The smallest signed fixed-point width b >= 2 with 2^(b-1) - 1 >= sqrt(levels_sq);
  None when wider than `widest` (kept exact).

  >>> needed_bits(1.0), needed_bits(9.0), needed_bits(1e12)
  (2, 3, None)
  """
  need = math.sqrt(max(float(levels_sq), 0.0))
  for b in range(2, widest + 1):
    if (1 << (b - 1)) - 1 >= need:
      return b
  return None


def needed_levels(loss_fn, params, batches, key, *, scale_bound: bool = False) -> dict:
  """name -> squared fixed-point levels each residual needs at e^2 = 1 (mean over batches)."""
  bounds = jact.acgc.error_bounded(
    loss_fn,
    error=1.0,
    window=len(batches),
    compressor=jact.compressors.Fixpoint(8),
    scale_bound=scale_bound,
  )
  state = bounds.init(params, batches[0], key)
  for i, batch in enumerate(batches):
    state = bounds.update(state, params, batch, jax.random.fold_in(key, i))
  levels = np.nanmean(np.asarray(state.levels_sq, np.float64), axis=0)
  return dict(zip(state.names, levels.tolist()))


def _densities(params, batches, summary=np.mean) -> dict:
  """name -> mean (or `summary`) fraction of non-zero values over the batches
  (conv inputs: the ReLU outputs)."""
  apply = jax.jit(lambda p, x: _collect(p, x))
  per_batch = [apply(params, b[0]) for b in batches]
  return {n: float(summary([float(d[n]) for d in per_batch])) for n in per_batch[0]}


def _collect(params, x):
  densities = {}
  preact.apply(params, x, form="plain", densities=densities)
  return densities


def _ratio(sizes: dict, bits_per_value: dict) -> float:
  total = sum(sizes.values())
  return 32.0 * total / sum(sizes[n] * bits_per_value[n] for n in sizes)


def sweep(levels: dict, sizes: dict, densities: dict, errors=ERRORS) -> list[dict]:
  """Rows per e^2: widths, bits per value and compression (jact / any width / AutoQuantZ)."""
  rows = []
  for e2 in errors:
    jact_bits = {n: jact.acgc.bits_for_levels(levels[n] / e2, signed=True) for n in sizes}
    jact_bits = {n: 32 if b is None else b for n, b in jact_bits.items()}
    any_bits = {n: needed_bits(levels[n] / e2) or 32 for n in sizes}
    zvc = {n: 1.0 + densities.get(n, 1.0) * any_bits[n] for n in sizes}
    rows.append(
      dict(
        error=e2,
        jact_bits=jact_bits,
        any_bits=any_bits,
        jact_average_bits=sum(sizes[n] * jact_bits[n] for n in sizes) / sum(sizes.values()),
        any_average_bits=sum(sizes[n] * any_bits[n] for n in sizes) / sum(sizes.values()),
        compression_jact=_ratio(sizes, jact_bits),
        compression_any_width=_ratio(sizes, any_bits),
        compression_autoquantz=_ratio(sizes, zvc),
        kept_exact_jact=sum(b == 32 for b in jact_bits.values()),
      )
    )
  return rows


def paper_plans(loss_fn, levels: dict, capacities: dict, error: float = PAPER_ERROR) -> dict:
  """The plans whose stored bytes `stored` measures at e^2 = `error`: "acgc"
  (`error_bounded`'s plan from levels measured at e^2 = 1), "acgc_248" (its
  widths rounded up to 2, 4 or 8, wider kept exact: jact before widths 3..16)
  and "autoquantz" (acgc, the residuals of `capacities` in ZeroValue)."""
  names = tuple(sorted(levels))
  state = jact.acgc.ACGCState(
    jnp.asarray([[levels[n] / error for n in names]], jnp.float32), jnp.ones((), jnp.int32), names
  )
  bounds = jact.acgc.error_bounded(
    loss_fn, error=error, window=1, compressor=jact.compressors.Fixpoint(8)
  )
  acgc = dict(bounds.plan(state))
  old = lambda c: next((b for b in (2, 4, 8) if c is not None and c.bits <= b), None)
  zvc = lambda n, c: (
    jact.compressors.ZeroValue(c, capacity=capacities[n]) if n in capacities and c else c
  )
  return dict(
    acgc=jact.BitPlan(acgc),
    acgc_248=jact.BitPlan(
      {n: old(c) and jact.compressors.Fixpoint(old(c)) for n, c in acgc.items()}
    ),
    autoquantz=jact.BitPlan({n: zvc(n, c) for n, c in acgc.items()}),
  )


def stored(loss_fn, plain_loss, params, batch, plans: dict, sizes: dict) -> dict:
  """Measured bytes saved for the backward pass under each plan: per bounded
  residual, their sum against float32, and the whole step against the plain
  float32 network's."""
  key = jax.random.key(0)
  fp_bytes = jact.residual_report(plain_loss, params, batch, key).total_bytes
  out = dict(float32_bounded_bytes=4 * sum(sizes.values()), fp_step_bytes=int(fp_bytes))
  for name, plan in plans.items():
    with jact.use_plan(plan):
      report = jact.residual_report(loss_fn, params, batch, key)
    groups = report.by_name()
    per = {n: int(groups[n].bytes) for n in sizes}
    out[name] = dict(
      bits={n: _plan_entry(plan[n]) for n in sizes},
      bytes=per,
      bounded_bytes=sum(per.values()),
      compression_bounded=out["float32_bounded_bytes"] / sum(per.values()),
      step_bytes=int(report.total_bytes),
      compression_step=fp_bytes / report.total_bytes,
    )
  return out


def _plan_entry(c):
  """A plan entry for the JSON: its width, "zvc<width>@<capacity>", or None (exact)."""
  if c is None:
    return None
  if isinstance(c, jact.compressors.ZeroValue):
    return f"zvc{c.bits}@{c.capacity:g}"
  return c.bits


def _loss():
  return functools.partial(preact.loss, form="layers", compressor=jact.compressors.Fixpoint(8))


def measure(params, batches, key, errors=ERRORS) -> dict:
  """Statistics over `batches` at `params`, then `summarize`."""
  loss_fn = _loss()
  return summarize(
    params,
    batches[0],
    needed_levels(loss_fn, params, batches, key),
    _densities(params, batches),
    _densities(params, batches, np.max),
    needed_levels(loss_fn, params, batches, key, scale_bound=True),
    errors,
  )


def summarize(params, batch, table1, densities, peaks, with_scale=None, errors=ERRORS) -> dict:
  """Per residual statistics and widths, the sweep's rows and the bytes stored at
  the paper's e^2, from levels at e^2 = 1 (Table 1's; `with_scale`: with the
  scale bound, None if unknown) and mean / largest non-zero fractions."""
  loss_fn = _loss()
  sites = jact.sensitivity.find_residuals(loss_fn, params, batch, jax.random.key(0))
  sizes = {n: s.size for n, s in sites.items()}
  capacities = {n: math.ceil(d * 64) / 64 for n, d in peaks.items()}
  plans = paper_plans(loss_fn, table1, capacities)
  plain = functools.partial(preact.loss, form="plain")
  layers = {}
  for n in sorted(sizes):
    layers[n] = dict(
      size=sizes[n],
      density=densities.get(n, 1.0),
      density_max=peaks.get(n, 1.0),
      levels_sq_at_1=table1[n],
      bits_at_paper_error=needed_bits(table1[n] / PAPER_ERROR) or 32,
    )
    if with_scale is not None:
      layers[n]["levels_sq_at_1_scale_bound"] = with_scale[n]
      layers[n]["bits_with_scale_bound"] = needed_bits(with_scale[n] / PAPER_ERROR) or 32
  out = dict(layers=layers, rows=sweep(table1, sizes, densities, errors))
  if with_scale is not None:
    out["rows_with_scale_bound"] = sweep(with_scale, sizes, densities, errors)
  out["stored"] = stored(loss_fn, plain, params, batch, plans, sizes)
  return out


def from_previous(params, batch, previous: dict, errors=ERRORS) -> dict:
  """`summarize` of a former result's checkpoint (its per-residual statistics),
  for parameters not at hand: the widths and bytes follow from the statistics
  and the shapes alone. A result without `density_max` gives capacities from
  the mean density plus 1/64; without the scale-bound levels, its
  `bits_with_scale_bound` are kept and `rows_with_scale_bound` left out."""
  layers = previous["layers"]
  table1 = {n: v["levels_sq_at_1"] for n, v in layers.items()}
  densities = {n: v["density"] for n, v in layers.items() if n.endswith("conv.lhs")}
  peaks = {n: layers[n].get("density_max") or min(densities[n] + 1 / 64, 1.0) for n in densities}
  scale = {n: v.get("levels_sq_at_1_scale_bound") for n, v in layers.items()}
  with_scale = None if None in scale.values() else scale
  out = summarize(params, batch, table1, densities, peaks, with_scale, errors)
  measured_peaks = all(layers[n].get("density_max") for n in densities)
  for n, v in out["layers"].items():
    if with_scale is None:
      v["bits_with_scale_bound"] = layers[n]["bits_with_scale_bound"]
    if not measured_peaks:
      v["density_max"] = None  # not measured: the capacities are the mean + 1/64
  out["from_previous"] = dict(
    previous.get("from_previous") or dict(measured=previous.get("measured")),
    capacity="density_max" if measured_peaks else "density + 1/64",
  )
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(
    prog="python -m experiments.papers.acgc_sweep", description=__doc__.split("\n")[0]
  )
  p.add_argument("--batches", type=int, default=10)
  p.add_argument("--batch", type=int, default=128)
  p.add_argument(
    "--snapshot",
    type=Path,
    default=None,
    help="a saved run's snapshot folder (experiments.papers.actnn_cifar) for trained "
    "parameters, beside the initialization",
  )
  p.add_argument(
    "--previous",
    type=Path,
    default=None,
    help="a former acgc_sweep result: its checkpoints not measured by this run (e.g. "
    "'trained' without --snapshot) are recomputed from its per-residual statistics",
  )
  p.add_argument("--small", action="store_true")
  p.add_argument("--results", type=Path, default=paths.RESULTS)
  a = p.parse_args(argv)
  widths, blocks = ((8, 16), 1) if a.small else ((16, 32, 64), 3)
  if a.small:
    a.batches, a.batch = 2, 16
  x, y, _, _ = data_lib.load_image_dataset(
    "cifar10_full", train_size=a.batch * a.batches, test_size=1
  )
  batches = [
    (
      jnp.asarray(x[i * a.batch : (i + 1) * a.batch]),
      jnp.asarray(y[i * a.batch : (i + 1) * a.batch]),
    )
    for i in range(a.batches)
  ]
  init = preact.init(jax.random.key(0), widths=widths, blocks=blocks)
  checkpoints = {"init": init}
  if a.snapshot is not None:
    restored = resumable.restore(a.snapshot, dict(params=init))
    if restored is None:
      raise SystemExit(f"no snapshot under {a.snapshot}")
    checkpoints["trained"] = restored[0]["params"]
  result = dict(
    meta=metadata.run_metadata("experiments.papers.acgc_sweep", argv),
    batches=a.batches,
    batch=a.batch,
    widths=list(widths),
    blocks=blocks,
    paper_error=PAPER_ERROR,
    snapshot=None if a.snapshot is None else str(a.snapshot),
    checkpoints={},
  )
  for name, params in checkpoints.items():
    result["checkpoints"][name] = measure(params, batches, jax.random.key(1))
  if a.previous is not None:
    if not a.previous.exists():
      raise SystemExit(f"no former result at {a.previous}")
    previous = json.loads(a.previous.read_text())
    for name, c in previous["checkpoints"].items():
      if name not in result["checkpoints"]:
        measured = {k: previous["meta"].get(k) for k in ("date", "command")}
        c = dict(c, measured=measured)
        result["checkpoints"][name] = from_previous(init, batches[0], c)
  for name in result["checkpoints"]:
    for r in result["checkpoints"][name]["rows"]:
      print(
        f"{name} e2 {r['error']:>7g}: jact {r['jact_average_bits']:5.2f} bits "
        f"{r['compression_jact']:5.2f}x ({r['kept_exact_jact']} exact) | any width "
        f"{r['compression_any_width']:5.2f}x | AutoQuantZ {r['compression_autoquantz']:5.2f}x",
        flush=True,
      )
    measured = result["checkpoints"][name]["stored"]
    for plan in ("acgc", "acgc_248", "autoquantz"):
      m = measured[plan]
      print(
        f"{name} e2 {PAPER_ERROR:g} stored {plan}: bounded residuals "
        f"{m['compression_bounded']:5.2f}x, whole step {m['compression_step']:5.2f}x "
        "(paper: 7.5x AutoQuantZ)",
        flush=True,
      )
  out = a.results / ("acgc_sweep_small.json" if a.small else "acgc_sweep.json")
  resumable.write_json(out, result)
  return result


if __name__ == "__main__":
  main()
