"""GACT's claims at CPU scale: jact applied from outside to ordinary Flax models.

Every model here is ordinary Flax code (flax.linen layers, `nn.gelu`,
`jax.ops.segment_sum`); jact is applied from outside: `jact.convert` for the
transformers, `jact.compressed` around the graph networks, `jact.Controller`
(GACT's numeric sensitivity, Algorithm 1) for the adaptive bit plans, with the
plan a static argument of `jax.jit(jact.planned(step), static_argnames="plan")`.

| task | model, data | variants |
|---|---|---|
| sst2 | embedding + 2 pre-LN encoder blocks (`nn.MultiHeadDotProductAttention`, gelu MLP), masked mean pool, Dense head; SST-2 sentences | fp, gact_l1, fixed2, gact_cb1, fixed4, adaptive2 |
| shakespeare | `experiments.lib.zoo.TransformerLM` (`LMConfig()`: 2 causal blocks, width 128); tiny Shakespeare characters | fp, gact_l1, fixed2, gact_cb1, fixed4, adaptive2 |
| cora_gcn, cora_gat | 2-layer GCN (16 hidden) and GAT (8 heads x 8, then 1 head) on Cora, standard Planetoid split, full batch | fp, fixed4, adaptive2 |

Variants:

* fp -- the plain model.
* fixed2 / fixed4 -- every residual at 2 / 4 bits (`jact.convert(model, bits=2)`,
  `jact.compressed(model, bits=4)`).
* gact_l1 -- GACT L1: `jact.levels.get("gact:L1").controller(loss)`, i.e.
  `jact.Controller(loss, estimator="numeric", avg_bits=4)` on the 4-bit converted model.
* gact_cb1 -- GACT CB1: L1 with every block a compressed checkpoint segment: the
  block class wrapped as `jact.compressed(Block, bits=4, policy=jact.save_inputs_only(),
  compress_argnums=(0,))` (`checkpointed_block`). The forward pass keeps only a
  4-bit copy of each block's input; the backward pass recomputes the block from
  it with the converted layers' residuals compressed, as `jact.checkpoint` does
  for functions (`jact.checkpoint` takes functions, not linen classes). This is
  the one model-side change: the model must take its block class as a field
  (the `nn.remat(Block)` idiom of Flax examples). The SST-2 model has it; the
  zoo's `TransformerLM` builds `DecoderBlock` itself, so CB1 runs `BlockFieldLM`,
  a subclass that only makes the block class a field (same parameters).
* adaptive2 -- `jact.Controller(loss, estimator="numeric", avg_bits=2)` on the
  compressed model (GACT's "adaptive 2 bits"; on the transformers the 4-bit
  converted model of gact_l1, so fixed4 / gact_l1 and fixed2 / adaptive2 are the
  fixed-vs-adaptive pairs at equal average bits).

All variants of a task start from the same parameters and see the same batches
(and dropout masks) in the same order; only the stored residuals differ, so
evaluation runs the plain model's forward. Per variant the task's JSON records
the loss curve (mean of every `log_every` steps), held-out metrics (accuracy
for classification, loss for the LM; best and final), the bytes saved for the
backward pass (`jact.residual_report(loss, ...).total_bytes`) and the compiled
temp of the train step (XLA's memory analysis of the compiled step, the figure
`jact.compiled_memory(step, ...).temp_bytes` gives, read off the executable
the training used instead of compiling it a second time), the adaptive plans
(average bits, GACT's variance ratio at each adaptation), the median step
seconds (steps that compiled excluded) and the controller's seconds.

Full-run scale (`TASKS`): SST-2 2 epochs (216 steps of 64 sentences of at most
64 words, width 128, 4 heads, MLP 512, 8000-word vocabulary; Adam 1e-3 with
10% warm-up and cosine decay); Shakespeare 300 steps of 32 windows of 128
characters (`LMConfig()`, same optimizer); Cora 200 full-graph epochs per model
(Adam 0.01 / 0.005, weight decay 5e-4, dropout 0.5 / 0.6). Adaptive variants
re-plan at steps 0, 100, 200 (Cora: every 50 epochs). Estimated from probes
(CPU seconds per step and per compile / adaptation): about 45-50 minutes for
everything on two free CPU cores -- SST-2 ~18, Shakespeare ~21, Cora ~10; the
adaptive variants take 2-3x their fixed twins (the controller's estimator is
1 + L gradients per adaptation, L ~ 32 residuals, plus a compile per new plan).

    python -m experiments.papers.gact_tasks                      # writes experiments/results/gact/<task>.json
    python -m experiments.papers.gact_tasks --small --results /tmp/gact   # every task and variant, tiny

`--small` runs tiny models (one block, width 32; Cora as it is) for 4 steps
with one adaptation. Its cost is compiling, not training: a jact train step
compiles in ~10-25 s of CPU, the controller's first adaptation (the estimator's
and the sampling-variance check's compiles) in ~20-70 s, so the whole
small run takes 5-8 minutes of CPU (500 s measured on a busy 2-core machine),
80% of it in the six adaptive variants; `--tasks cora_gcn --variants fp fixed4`
takes ~15 s.

>>> [name for name in TASKS], VARIANTS["cora_gat"]
(['sst2', 'shakespeare', 'cora_gcn', 'cora_gat'], ('fp', 'fixed4', 'adaptive2'))
"""  # noqa: E501 (tables and commands in this docstring)

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import optax

import jact
from experiments.lib import memory, metadata, paths, resumable
from experiments.papers.gact_setups import (
  SMALL,
  TASKS,
  VARIANTS,
  TaskSetup,
  setup_task,
)

__all__ = [
  "TASKS",
  "SMALL",
  "VARIANTS",
  "TaskSetup",
  "setup_task",
  "train_variant",
  "run_task",
  "main",
]

RESULTS = paths.RESULTS / "gact"
# ----------------------------------------------------------------------------- training


def _step_memory(step_fn, loss_fn, args, plan) -> dict:
  """Bytes saved for the backward pass at `plan`, and the compiled temp of the train
  step (its executable, which the training already compiled, is looked up, not rebuilt)."""
  params, _, batch, key, *extra = args
  with jact.use_plan(plan):
    saved = jact.residual_report(lambda p: loss_fn(p, batch, key, *extra), params)
  compiled = step_fn.lower(*args, plan=plan).compile()
  return dict(
    saved_bytes=int(saved.total_bytes), temp_bytes=memory.compiled_memory_of(compiled).temp_bytes
  )


def _mean_windows(losses: list[float], every: int) -> list[dict]:
  return [
    dict(step=min(i + every, len(losses)), loss=float(np.mean(losses[i : i + every])))
    for i in range(0, len(losses), every)
  ]


def train_variant(
  setup: TaskSetup,
  variant: str,
  *,
  steps: int,
  log_every: int,
  eval_every: int,
  seed: int = 0,
  verbose: bool = True,
) -> dict:
  """Trains one variant from the task's initial parameters; returns its record."""
  loss_fn = setup.losses[variant]
  tx = setup.optimizer

  def train_step(params, opt_state, batch, key, *extra):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, key, *extra)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step_fn = jax.jit(jact.planned(train_step), static_argnames="plan")
  params, opt_state = setup.params, tx.init(setup.params)
  base_key = jax.random.key(seed + 1)
  controller = cstate = None
  if variant in setup.controllers:
    settings = dict(setup.controllers[variant])
    controller_loss = lambda p, b, k: loss_fn(p, b, k, *setup.extra)
    controller = jact.Controller(controller_loss, **settings)
    cstate = controller.init(params, setup.batch(0), base_key)
  losses, seconds, compiled_steps, plans, history = [], [], [], [], []
  controller_seconds, alerts, plan, best = 0.0, 0, None, None
  for step in range(steps):
    batch, key = setup.batch(step), jax.random.fold_in(base_key, step)
    if controller is not None:
      started = time.perf_counter()
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jact.CompressionVarianceWarning)
        cstate = controller.update(cstate, params, batch, key)
      alerts += sum(issubclass(w.category, jact.CompressionVarianceWarning) for w in caught)
      controller_seconds += time.perf_counter() - started
      if cstate.plan != plan:
        compiled_steps.append(step)
      if controller.due(step):
        plans.append(dict(cstate.report, plan=cstate.plan.to_dict()))
      plan = cstate.plan
    elif step == 0:
      compiled_steps.append(0)
    started = time.perf_counter()
    params, opt_state, loss = step_fn(params, opt_state, batch, key, *setup.extra, plan=plan)
    losses.append(float(loss))
    seconds.append(time.perf_counter() - started)
    if not np.isfinite(losses[-1]):
      if verbose:
        print(f"  [{variant}] loss {losses[-1]} at step {step}: stopped", flush=True)
      break
    if (step + 1) % eval_every == 0 or step + 1 == steps:
      metrics = dict(step=step + 1, **setup.evaluate(params))
      history.append(metrics)
      score = metrics[setup.metric]
      if best is None or (
        score > best[setup.metric] if setup.higher_is_better else score < best[setup.metric]
      ):
        best = metrics
    if verbose and ((step + 1) % log_every == 0 or step + 1 == steps):
      print(
        f"  [{variant}] step {step + 1}/{steps} loss {np.mean(losses[-log_every:]):.4f} "
        f"({seconds[-1]:.3f} s/step)"
        + (f" {history[-1]}" if history and history[-1]["step"] == step + 1 else ""),
        flush=True,
      )
  timed = [s for i, s in enumerate(seconds) if i not in compiled_steps]
  step_memory = _step_memory(
    step_fn, loss_fn, (params, opt_state, setup.batch(0), base_key, *setup.extra), plan
  )
  return dict(
    variant=variant,
    steps=len(losses),
    finite=bool(np.all(np.isfinite(losses))),
    first_loss=losses[0],
    final_loss=float(np.mean(losses[-log_every:])),
    losses=_mean_windows(losses, log_every),
    history=history,
    final=history[-1] if history else None,
    best=best,
    best_by=setup.metric,
    **step_memory,
    average_bits=None if plan is None else float(plan.average_bits()),
    plans=plans,
    variance_alerts=alerts,
    controller=setup.controllers.get(variant),
    controller_seconds=controller_seconds,
    median_step_s=float(np.median(timed if timed else seconds)),
    compiled_at=compiled_steps,
  )


def _earlier_variants(path: Path, config: dict, seed: int, rerun) -> dict:
  """The variants an earlier run of the same task, settings and seed wrote to `path` (those
  not run again), each with the run's metadata: a run of some variants keeps the others."""
  if not path.exists():
    return {}
  earlier = json.loads(path.read_text())
  if json.loads(json.dumps(config)) != earlier.get("config") or earlier.get("seed") != seed:
    return {}
  return {
    name: dict(record, meta=record.get("meta", earlier.get("meta", {})))
    for name, record in earlier["variants"].items()
    if name not in rerun
  }


def run_task(
  task: str,
  cfg: dict,
  *,
  variants=None,
  steps: int | None = None,
  results: Path = RESULTS,
  meta: dict | None = None,
  seed: int = 0,
  verbose: bool = True,
) -> dict:
  """Trains every variant of `task`; writes `<results>/<task>.json` after each one."""
  variants = list(variants or VARIANTS[task])
  steps = cfg["steps"] if steps is None else steps
  started = time.perf_counter()
  setup = setup_task(task, cfg, seed, steps)
  config = {
    k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v) for k, v in cfg.items()
  }
  out = dict(
    meta=meta or {},
    task=task,
    config=dict(config, steps=steps),
    seed=seed,
    data=setup.description,
    variants=_earlier_variants(
      Path(results) / f"{task}.json", dict(config, steps=steps), seed, variants
    ),
  )
  for variant in variants:
    if verbose:
      print(f"[{task}] {variant}", flush=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    record = train_variant(
      setup,
      variant,
      steps=steps,
      log_every=cfg["log_every"],
      eval_every=cfg["eval_every"],
      seed=seed,
      verbose=verbose,
    )
    record["seconds"] = time.perf_counter() - t0
    record["cpu_seconds"] = time.process_time() - cpu0
    record["meta"] = meta or {}
    out["variants"][variant] = record
    out["seconds"] = time.perf_counter() - started
    resumable.write_json(Path(results) / f"{task}.json", out)
    if verbose:
      best = record["best"][record["best_by"]] if record["best"] else float("nan")
      print(
        f"[{task}] {variant}: {record['best_by']} best {best:.4f}, saved "
        f"{record['saved_bytes'] / 2**20:.2f} MiB, temp {record['temp_bytes'] / 2**20:.2f} MiB, "
        f"bits {record['average_bits']}, {record['median_step_s']:.3f} s/step, "
        f"{record['seconds']:.0f} s",
        flush=True,
      )
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(
    prog="python -m experiments.papers.gact_tasks", description=__doc__.split("\n")[0]
  )
  p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
  p.add_argument(
    "--variants", nargs="+", default=None, help="only these variants (of those each task has)"
  )
  p.add_argument(
    "--steps", type=int, default=None, help="training steps (Cora: epochs) per variant"
  )
  p.add_argument("--small", action="store_true", help="tiny models, a few steps (CI)")
  p.add_argument("--results", type=Path, default=RESULTS)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quiet", action="store_true")
  a = p.parse_args(argv)
  meta = metadata.run_metadata("experiments.papers.gact_tasks", argv)
  sizes = SMALL if a.small else TASKS
  out = {}
  for task in a.tasks:
    variants = [v for v in VARIANTS[task] if a.variants is None or v in a.variants]
    out[task] = run_task(
      task,
      sizes[task],
      variants=variants,
      steps=a.steps,
      results=a.results,
      meta=dict(meta, small=a.small),
      seed=a.seed,
      verbose=not a.quiet,
    )
  return out


if __name__ == "__main__":
  main()
