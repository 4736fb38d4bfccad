"""Notebook 07's live part: a stacked LM whose plain step does not fit a budget, the
configuration `jact.fit` returns, and both trained side by side on tiny Shakespeare."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import optax

import jact
from experiments.lib import fit_subjects, zoo
from jact._fit.steps import configure, step_peak

__all__ = ["demo", "bench_table"]


def _train(loss, params, steps: int, batch: int, length: int, keyed: bool, seed: int = 0):
  opt = optax.adam(3e-3)

  @jax.jit
  def step(params, state, tokens, labels, key):
    kw = {"key": key} if keyed else {}
    value, grads = jax.value_and_grad(loss)(params, tokens, labels, **kw)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  state, curve = opt.init(params), []
  for i in range(steps):
    tokens, labels = fit_subjects.shakespeare(batch, length, seed=seed + i)
    params, state, value = step(params, state, tokens, labels, jax.random.key(i))
    curve.append(float(value))
  return curve


def demo(
  fraction: int = 4,
  steps: int = 60,
  batch: int = 16,
  length: int = 128,
  d: int = 128,
  blocks: int = 8,
):
  """Fits the stack LM into 1/`fraction` of its plain compiled peak and trains both. fit is
  given the arguments' shapes only, so it takes each residual's sensitivity as its size
  (the bench estimates them; here that would triple the cell's time). The notebook runs 2
  blocks at 1/3: about 50 s on a 2-core CPU with the tests' quick-compile flags, most of it
  compiling (jact's steps compile several times slower than plain ones)."""
  params = fit_subjects.stack_params(jax.random.key(0), zoo.LM_CONFIG.vocab_size, blocks, d, 4 * d)
  plain = fit_subjects.stack_lm(blocks, segments=False)
  loss = fit_subjects.stack_lm(blocks, segments=True)
  tokens, labels = fit_subjects.shakespeare(batch, length)
  plain_peak = step_peak(configure(plain, None, None), (params, tokens, labels), (0,))
  budget = plain_peak // fraction
  t = time.perf_counter()
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, tokens, labels))
  fitted = jact.fit(loss, *shapes, budget_bytes=budget, max_candidates=4)
  search = time.perf_counter() - t
  return {
    "plain_peak": plain_peak,
    "budget": budget,
    "fit": fitted,
    "search_seconds": search,
    "plain_curve": _train(plain, params, steps, batch, length, keyed=False),
    "fit_curve": _train(fitted.loss_fn, params, steps, batch, length, keyed=True),
  }


def bench_table(path: Path) -> str:
  """Markdown table of `bench_fit`'s rows."""
  data = json.loads(Path(path).read_text())
  mib = lambda b: f"{b / 2**20:.1f}" if b is not None else ""
  lines = [
    "| model | budget | fit peak MiB | remat | compilations | search s | variance (fit) "
    "| best uniform | variance (uniform) |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, subject in data["subjects"].items():
    for r in subject["rows"]:
      budget = f"{r['fraction']} ({mib(r['budget_bytes'])} MiB)"
      if not r["fits"]:
        smallest = mib(r["smallest_peak_bytes"])
        lines.append(f"| {name} | {budget} | nothing fits (smallest {smallest}) | | | | | | |")
        continue
      uniform = f"{r['uniform_bits']} bits" if r["uniform_bits"] else "none fits"
      lines.append(
        f"| {name} | {budget} | {mib(r['peak_bytes'])} | {len(r['remat'])} | "
        f"{r['compilations']} | {r['search_seconds']} | {r['variance']:.3g} | {uniform} | "
        f"{r.get('uniform_variance', float('nan')):.3g} |"
      )
  return "\n".join(lines)
