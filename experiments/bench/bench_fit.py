"""`jact.fit` against uniform widths: budgets at 1/2, 1/4, 1/8 and 1/12 of the plain step's
compiled peak, on the subjects of `experiments.lib.fit_subjects` (real data).

For every row: the configuration `jact.fit` returns (compiled peak, search wall time,
compilations), the best uniform-width configuration that fits (every residual at the widest of
8/4/2/1 bits that compiles within the budget, no remat), and both configurations' gradient
variance *measured* over rounding keys on the same batch. Then `jact.largest_batch` (plain, the
fit, any configuration) against the true maximum found by bisection over compiled memory.

  python -m experiments.bench.bench_fit [--subjects stack8 zoo_lm resnet50_224]
      [--fractions 2 4 8 12] [--keys 4] [--no-batch] [--out experiments/results/bench_fit.json]

Each subject's run replaces its entry in `--out` and keeps the others' (run them apart).
Sensitivities are estimated once per subject (GACT's numeric estimator on a small calibration
batch, timed separately) and passed to every `jact.fit` call.
"""  # noqa: E501 (the command line)

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import jact
from experiments.lib import fit_subjects, metadata, resumable
from jact._fit.batch import _smallest
from jact._fit.search import _estimate, _Survey
from jact._fit.segments import Layout
from jact._fit.steps import configure, step_peak

__all__ = ["main", "measured_variance"]

UNIFORM = (8, 4, 2, 1)


def measured_variance(loss, args, keys: int, key_arg=None) -> float:
  """Sum over parameters of the unbiased variance of the gradient over `keys` rounding keys
  (fit's `key=` and, at `key_arg`, the loss's own)."""
  grad = jax.jit(jax.grad(loss))

  def with_key(k):
    key = jax.random.key(100 + k)
    full = list(args)
    if key_arg is not None:
      full[key_arg] = jax.random.fold_in(key, 1)
    return grad(*full, key=key)

  gs = [with_key(k) for k in range(keys)]
  leaves = [
    np.stack([np.asarray(x, np.float64) for x in ls]) for ls in zip(*map(jax.tree.leaves, gs))
  ]
  return float(sum(x.var(axis=0, ddof=1).sum() for x in leaves))


def _uniform(subject, args, names, budget, peaks):
  """The widest uniform width whose compiled step fits, or None; peaks memoized."""
  for b in UNIFORM:
    if b not in peaks:
      loss = configure(subject.loss, Layout(), jact.BitPlan({n: b for n in names}))
      peaks[b] = step_peak(loss, args, (0,))
    if peaks[b] <= budget:
      return b
  return None


def _bisect(loss, args_for, budget, lo, hi):
  """The true largest batch in [lo, hi) by bisection over compiled memory (lo fits)."""
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if step_peak(loss, tuple(args_for(mid)), (0,)) <= budget else (lo, mid)
  return lo


def run_subject(
  name: str, fractions, keys: int, batch_rows: bool, log=print, save=lambda partial: None
) -> dict:
  subject = fit_subjects.SUBJECTS[name]()
  args = subject.args_for(subject.batch)
  calib = subject.args_for(subject.calibration_batch)
  plain_peak = step_peak(configure(subject.plain, None, None), args, (0,))
  survey = _Survey.of(subject.loss, args)
  sites, order = survey.sites0, list(survey.order)
  t = time.perf_counter()
  sens = _estimate(subject.loss, Layout(), list(sites), sites, calib, (0,), jax.random.key(0))
  if order:
    sens.update(
      _estimate(
        subject.loss,
        survey.all_remat,
        survey.remat_inputs(),
        survey.sites1,
        calib,
        (0,),
        jax.random.key(0),
      )
    )
  estimate_s = time.perf_counter() - t
  log(
    f"{name}: plain peak {plain_peak / 2**20:.1f} MiB, {len(sens)} sensitivities in "
    f"{estimate_s:.0f} s"
  )
  rows, uniform_peaks = [], {}
  for frac in fractions:
    budget = plain_peak // frac
    row = {"fraction": f"1/{frac}", "budget_bytes": int(budget)}
    try:
      result = jact.fit(subject.loss, *args, budget_bytes=int(budget), sensitivity=sens)
    except jact.FitError as e:
      row.update(fits=False, smallest_peak_bytes=e.smallest_peak_bytes, error=str(e))
      rows.append(row)
      log(f"  1/{frac}: nothing fits ({e.smallest_peak_bytes / 2**20:.1f} MiB smallest)")
      save({"rows": rows})
      continue
    uniform = _uniform(subject, args, list(sites), budget, uniform_peaks)
    row.update(
      fits=True,
      peak_bytes=result.peak_bytes,
      within_budget=result.peak_bytes <= budget,
      compilations=result.compilations,
      search_seconds=round(result.search_seconds, 1),
      remat=list(result.remat),
      widths={str(k): v for k, v in _counts(result.plan).items()},
      predicted_variance=result.predicted_variance,
      variance=measured_variance(result.loss_fn, args, keys, subject.key_arg),
      uniform_bits=uniform,
      uniform_peak_bytes=uniform_peaks.get(uniform),
    )
    if uniform is not None:
      loss = configure(subject.loss, Layout(), jact.BitPlan({n: uniform for n in sites}))
      row["uniform_variance"] = measured_variance(loss, args, keys, subject.key_arg)
      row["at_least_as_good"] = row["variance"] <= row["uniform_variance"]
    rows.append(row)
    log(f"  1/{frac}: {row}")
    save({"rows": rows})
  out = {
    "plain_peak_bytes": int(plain_peak),
    "batch": subject.batch,
    "residuals": len(sites),
    "segments": order,
    "sensitivity_seconds": round(estimate_s, 1),
    "rows": rows,
  }
  if batch_rows:
    out["largest_batch"] = _batch_rows(subject, plain_peak // 4, log, sens)
  return out


def proxy_sensitivities(subject) -> dict:
  """Every residual's number of values (fit's own stand-in without estimates)."""
  survey = _Survey.of(subject.loss, subject.args_for(subject.batch))
  return {n: float(s.size) for n, s in {**survey.sites0, **survey.sites1}.items()}


def _counts(plan):
  counts = {}
  for _, b in plan.entries:
    counts[b or "exact"] = counts.get(b or "exact", 0) + 1
  return counts


BATCH_CONFIGS = ("plain", "fit", "any")


def _largest(subject, budget, sens, what):
  """(the loss whose batches are measured, `jact.largest_batch`'s answer) for one row."""
  if what == "plain":
    found = jact.largest_batch(subject.plain, subject.args_for, budget, start=subject.batch)
    return configure(subject.plain, None, None), found
  if what == "fit":
    fitted = jact.fit(
      subject.loss, *subject.args_for(subject.batch), budget_bytes=int(budget), sensitivity=sens
    )
    found = jact.largest_batch(
      subject.loss, subject.args_for, budget, config=fitted, start=subject.batch
    )
    return fitted.loss_fn, found
  found = jact.largest_batch(
    subject.loss, subject.args_for, budget, config="fit", start=subject.batch, sensitivity=sens
  )
  # the truth for "any configuration": the smallest one's largest batch
  return _smallest(subject.loss, tuple(subject.args_for(subject.batch)), (1, 2, 4, 8, None)), found


def _batch_rows(subject, budget, log, sens, configs=BATCH_CONFIGS) -> list[dict]:
  """largest_batch for the written step, the fit at the subject's batch, and any config."""
  rows = []
  for what in configs:
    t = time.perf_counter()
    try:
      loss, found = _largest(subject, budget, sens, what)
    except ValueError as e:  # even batch 1 is over the budget: a result, not a failure
      if "even batch 1" not in str(e):
        raise
      row = {"config": what, "budget_bytes": int(budget), "batch": 0, "why": str(e)}
      rows.append(row)
      log(f"  largest batch {row}")
      continue
    seconds = time.perf_counter() - t
    hi = found.failing_batch or found.batch + 1
    true = _bisect(loss, subject.args_for, budget, found.batch, hi)
    row = {
      "config": what,
      "budget_bytes": int(budget),
      "batch": found.batch,
      "failing_batch": found.failing_batch,
      "compilations": found.compilations,
      "seconds": round(seconds, 1),
      "true_max": true,
      "within_5_percent": None if true is None else found.batch >= true / 1.05,
    }
    rows.append(row)
    log(f"  largest batch {row}")
  return rows


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--subjects", nargs="+", default=list(fit_subjects.SUBJECTS))
  p.add_argument("--fractions", nargs="+", type=int, default=[2, 4, 8, 12])
  p.add_argument("--keys", type=int, default=4)
  p.add_argument("--no-batch", action="store_true")
  p.add_argument(
    "--only-batch",
    action="store_true",
    help="only the largest-batch rows, fit steered by residual sizes (no estimation)",
  )
  p.add_argument(
    "--batch-configs",
    nargs="+",
    choices=BATCH_CONFIGS,
    default=list(BATCH_CONFIGS),
    help="with --only-batch: which largest-batch rows (fit fails where nothing fits at the "
    "subject's batch)",
  )
  p.add_argument("--out", default="experiments/results/bench_fit.json")
  args = p.parse_args(argv)
  out = Path(args.out)
  payload = json.loads(out.read_text()) if out.is_file() else {"subjects": {}}
  for name in args.subjects:  # each subject's run replaces its entry, the others are kept
    meta = metadata.run_metadata("experiments.bench.bench_fit", argv)

    def save(partial, name=name, meta=meta):
      payload["subjects"][name] = {"meta": meta, "partial": True, **partial}
      resumable.write_json(out, payload)

    if args.only_batch:
      subject = fit_subjects.SUBJECTS[name]()
      args_at = subject.args_for(subject.batch)
      plain_peak = step_peak(configure(subject.plain, None, None), args_at, (0,))
      rows = _batch_rows(
        subject, plain_peak // 4, print, proxy_sensitivities(subject), args.batch_configs
      )
      entry = payload["subjects"].get(name, {})
      entry.update(largest_batch=rows, largest_batch_meta=meta, largest_batch_sensitivity="sizes")
      payload["subjects"][name] = entry
      resumable.write_json(out, payload)
      continue
    result = run_subject(name, args.fractions, args.keys, not args.no_batch, save=save)
    payload["subjects"][name] = {"meta": meta, **result}
    resumable.write_json(out, payload)
  return payload


if __name__ == "__main__":
  main()
