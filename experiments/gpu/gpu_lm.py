"""A transformer LM's train step on one device: plain vs jact 8/4/2 bits vs `jact.checkpoint`.

The decoder LM of `experiments.lib.zoo` (pre-LayerNorm blocks, causal attention,
gelu MLP) on windows of tiny Shakespeare characters, trained five ways
(`experiments.lib.blockwise`'s loss functions): `plain`, `jact8`/`jact4`/
`jact2` (`jact.convert(model, bits=)`) and `jact_checkpoint` (each block in
`jact.checkpoint(bits=4)`: a 4-bit copy of its input, the block recomputed).
For each: seconds to lower and compile the jitted step, XLA's compiled temp
and needed bytes, the allocator's peak after running it (GPU only: it never
goes down, so it shows a method only where it is the largest so far), and the
median step time of `--repeats` blocks of `--steps` steps. The JSON is
rewritten after every method, so a run cut short keeps what finished.

    python -m experiments.gpu.gpu_lm [--layers 6 --width 512 --length 512 --batch 32] --json PATH
    python -m experiments.gpu.gpu_lm --small --json /tmp/lm.json     # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from experiments.lib import blockwise, memory, metadata, resumable, zoo

__all__ = ["METHODS", "measure", "main"]

METHODS = ("plain", "jact8", "jact4", "jact2", "jact_checkpoint")


def measure(method: str, cfg: zoo.LMConfig, params, batch, steps: int, repeats: int) -> dict:
  """One method's compile seconds, compiled memory, step time and allocator peak."""
  step = blockwise.train_step(blockwise.lm_loss(method, cfg), blockwise.optimizer())
  params, opt_state, batch = blockwise.on_device(params, batch)
  key = jax.random.key(0)
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batch, key).compile()
  compile_s = time.perf_counter() - t0
  mem = memory.compiled_memory_of(compiled)
  row = {
    "method": method,
    "compile_s": round(compile_s, 2),
    "temp_bytes": mem.temp_bytes,
    "needed_bytes": memory.needed_bytes(mem),
  }
  params, opt_state, loss = compiled(params, opt_state, batch, key)  # warm-up
  jax.block_until_ready(loss)
  times = []
  for r in range(repeats):
    t0 = time.perf_counter()
    for i in range(steps):
      params, opt_state, loss = compiled(
        params, opt_state, batch, jax.random.key(1 + r * steps + i)
      )
    jax.block_until_ready((params, loss))
    times.append((time.perf_counter() - t0) / steps)
  device = memory.device_memory()  # None on CPU
  row.update(
    step_ms=round(1e3 * statistics.median(times), 3),
    loss=float(loss),
    peak_bytes_in_use=None if device is None else device["peak_bytes_in_use"],
  )
  return row


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m experiments.gpu.gpu_lm", description=__doc__.splitlines()[0]
  )
  p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  p.add_argument("--layers", type=int, default=6)
  p.add_argument("--width", type=int, default=512)
  p.add_argument("--length", type=int, default=512, help="tokens per sequence")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--small", action="store_true", help="a 1-layer width-16 LM (CPU smoke run)")
  p.add_argument("--json", required=True)
  a = p.parse_args(argv)
  if a.small:
    a.layers, a.width, a.length, a.batch, a.steps, a.repeats = 1, 16, 16, 2, 1, 1
  cfg = zoo.LMConfig(
    emb_dim=a.width,
    num_heads=max(1, a.width // 64),
    num_layers=a.layers,
    mlp_dim=4 * a.width,
    max_len=a.length,
  )
  config = blockwise.Config(
    widths=(8,),
    blocks=1,
    lm=cfg,
    cap_mib=0,
    start=1,
    granularity=1,
    upper=1,
    time_batch=a.batch,
    time_steps=a.steps,
  )
  params = blockwise.init_params("transformer_lm", config)
  batch = blockwise.shakespeare_batch(a.batch, a.length)
  out = {
    "meta": metadata.run_metadata("experiments.gpu.gpu_lm", argv),
    "config": {
      "layers": a.layers,
      "width": a.width,
      "heads": cfg.num_heads,
      "length": a.length,
      "batch": a.batch,
      "steps": a.steps,
      "repeats": a.repeats,
      "data": "tiny Shakespeare characters",
    },
    "rows": [],
  }
  for method in a.methods:
    try:
      row = measure(method, cfg, params, batch, a.steps, a.repeats)
    except Exception as e:  # noqa: BLE001 - recorded (out of memory on a device), next method
      row = {"method": method, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    out["rows"].append(row)
    print(row, flush=True)
    resumable.write_json(a.json, out)
  return 0 if all("error" not in r for r in out["rows"]) else 1


if __name__ == "__main__":
  raise SystemExit(main())
