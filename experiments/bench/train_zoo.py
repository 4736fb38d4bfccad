"""Training check: unmodified zoo models, plain vs `jact.convert`, on real data.

Trains ResNet-18 on CIFAR-10 (10k subset), the BiLSTM on SST-2 and the
decoder LM on tiny Shakespeare (`experiments/lib/zoo.py`, data from the offline
kit) for `--steps` Adam steps: the plain model with seeds 0 and 1 (their
difference is the run-to-run noise) and the converted model
(`jact.convert(model, bits=B)`) with seed 0 (same initialization and data
order as plain seed 0; only the rounding noise differs). Reports the final
training loss (mean of the last 30 steps), a held-out loss, and whether any
loss was NaN.

    python -m experiments.bench.train_zoo [--steps 300] [--bits 4] [--models ...] [--json PATH]

writes `experiments/results/train_zoo.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

from experiments.lib import metadata, paths, zoo_data
from experiments.lib.zoo import CASES
from experiments.lib.zoo_harness import variant_fns

RESULTS = paths.RESULTS
MODELS = ("resnet18", "bilstm_sst2", "transformer_lm")


# ----------------------------------------------------------------------------- training


def train(case, variant, bits, seed, steps, lr=1e-3):
  fns = variant_fns(case, variant, bits, seed=seed)
  opt = optax.adam(lr)
  train_it, test = zoo_data.DATA[case.name](seed)

  @jax.jit
  def step(params, state, opt_state, batch, key):
    (loss, state), grads = jax.value_and_grad(fns.loss, has_aux=True)(params, state, batch, key)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), state, opt_state, loss

  eval_loss = jax.jit(lambda p, s, b, k: fns.loss(p, s, b, k)[0])
  params, state, opt_state = fns.params, fns.state, opt.init(fns.params)
  key = jax.random.key(1000 + seed)
  losses = []
  for i in range(steps):
    if i == 1:
      start = time.perf_counter()  # after the first step, which compiles
    params, state, opt_state, loss = step(
      params, state, opt_state, next(train_it), jax.random.fold_in(key, i)
    )
    losses.append(float(loss))
  seconds = (time.perf_counter() - start) / max(steps - 1, 1)
  held_out = float(
    np.mean([eval_loss(params, state, b, jax.random.fold_in(key, steps)) for b in test])
  )
  return {
    "model": case.name,
    "variant": variant,
    "bits": bits,
    "seed": seed,
    "steps": steps,
    "final_loss": float(np.mean(losses[-30:])),
    "held_out_loss": held_out,
    "first_loss": losses[0],
    "any_nan": bool(not np.all(np.isfinite(losses))),
    "seconds_per_step": seconds,
    "losses_every_10": losses[::10],
  }


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--bits", type=int, default=4)
  parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  parser.add_argument("--json", default=str(RESULTS / "train_zoo.json"))
  args = parser.parse_args(argv)
  runs, summary = [], []
  for name in args.models:
    case = CASES[name]
    for variant, bits, seed in (("plain", None, 0), ("plain", None, 1), ("convert", args.bits, 0)):
      try:
        run = train(case, variant, bits, seed, args.steps)
      except Exception as e:  # pylint: disable=broad-except  # recorded; the others still run
        run = {
          "model": name,
          "variant": variant,
          "bits": bits,
          "seed": seed,
          "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
        }
      runs.append(run)
      print({k: v for k, v in run.items() if k != "losses_every_10"}, flush=True)
    plain0, plain1, conv = runs[-3:]
    if all("error" not in r for r in (plain0, plain1, conv)):
      noise = abs(plain0["final_loss"] - plain1["final_loss"])
      gap = abs(conv["final_loss"] - plain0["final_loss"])
      summary.append(
        {
          "model": name,
          "plain_seed0": plain0["final_loss"],
          "plain_seed1": plain1["final_loss"],
          "convert": conv["final_loss"],
          "noise": noise,
          "gap": gap,
          "within_noise": gap <= max(noise, 1e-3),
          "held_out": [plain0["held_out_loss"], plain1["held_out_loss"], conv["held_out_loss"]],
          "nan": conv["any_nan"],
        }
      )
      print(summary[-1], flush=True)
  path = Path(args.json)
  path.parent.mkdir(parents=True, exist_ok=True)
  run_meta = metadata.run_metadata("experiments.bench.train_zoo", argv)
  path.write_text(json.dumps({"meta": run_meta, "summary": summary, "runs": runs}, indent=1) + "\n")
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
