"""Behaviour snapshot: compressed gradients and compiled memory, to compare two trees.

A refactor that must not change behaviour runs this script on the tree before
and after it and compares: gradients of the zoo's models (`experiments.lib.zoo`
and `zoo_thirdparty`, batches of 4, the deep ones one block per stage as in
`tests/test_zoo.py`) converted with `jact.convert(model, bits=2)` and wrapped
whole in `jact.compressed(bits=2)`; direct calls of `jact.ops`,
`jact.compressed`, `jact.checkpoint` at bits 1/2/4/8 and with a few
compressors; a `jact.BitPlan` and a per-sample budget. All with fixed keys,
through the public API only. Memory: `experiments.bench.bench_memory`'s
measures (residual bytes, XLA:CPU temp bytes, and XLA:GPU H200 temp bytes
compiled without a GPU where a CUDA plugin is installed).

    python -m experiments.bench.behaviour_snapshot --out DIR   # DIR/grads.npz, DIR/memory.json
    python -m experiments.bench.behaviour_snapshot --compare DIR_A DIR_B

`--compare` prints, per entry, the largest absolute difference and whether it is
bit-identical (memory: equal or not), and exits with 1 if anything differs or
is missing on one side. To snapshot an older commit, run this file from a
worktree of it with `PYTHONPATH=<worktree>` (the run prints `jact.__file__`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jact
from jact import compressors

KEY = jax.random.key(1)
BITS = (1, 2, 4, 8)
# XLA's HLO passes run, LLVM's optimizations do not: values are compared, not speed.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


# ----------------------------------------------------------------------------- zoo gradients


def _zoo_cases():
  from experiments.lib import zoo, zoo_thirdparty

  shallow = {  # the depth tests/test_zoo.py builds (same classes, one block per stage)
    "resnet18": lambda: zoo.ResNet(stage_sizes=(1, 1, 1, 1), num_filters=16),
    "transformer_lm": lambda: zoo.TransformerLM(dataclasses.replace(zoo.LM_CONFIG, num_layers=1)),
    "gemma_nnx": lambda: zoo.GemmaLike(num_layers=1, rngs=nnx.Rngs(0)),
  }

  @dataclasses.dataclass(frozen=True)
  class Small(zoo.Case):
    """A case on 4 examples whose linen variables are initialized in one compiled call."""

    def init(self, seed: int = 0):
      if self.framework == "nnx":
        return self.build()
      init = lambda key, *inputs: self.build().init(key, *inputs, **self.train_kwargs)
      return jax.jit(init)(jax.random.key(seed, impl="rbg"), *self.batch(seed)["inputs"])

  cases = {**zoo.CASES, **zoo_thirdparty.CASES}
  for name, case in cases.items():
    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(case)}
    small = lambda s, case=case: jax.tree.map(lambda a: a[:4], case.batch(s))
    yield name, Small(**{**fields, "build": shallow.get(name, case.build), "batch": small})


def zoo_grads(out: dict):
  from experiments.lib.zoo_harness import flat, variant_fns

  for name, case in _zoo_cases():
    for variant, bits in (("convert", 2), ("compressed", 2)):
      t0 = time.perf_counter()
      fns = variant_fns(case, variant, bits)
      loss = lambda p, s, b, k, fns=fns: fns.loss(p, s, b, k)[0]
      grads = _jit(jax.grad(loss))(fns.params, fns.state, case.batch(0), KEY)
      out[f"zoo/{name}/{variant}{bits}"] = np.asarray(flat(grads))
      print(f"zoo/{name}/{variant}{bits}: {time.perf_counter() - t0:.1f} s", flush=True)


# ----------------------------------------------------------------------------- op gradients


def _normal(i, shape):
  return jax.random.normal(jax.random.fold_in(jax.random.key(0), i), shape, jnp.float32)


def _weighted(y):
  """A loss whose cotangent differs per output value (a plain sum's would be all ones)."""
  return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape))


def _op_cases(**how):
  """name -> (function of (args, key) returning an array, args) at one setting `how`."""
  x, w = _normal(1, (8, 256)), _normal(2, (256, 16)) / 16
  w2 = _normal(3, (16, 256)) / 4
  img, kern = _normal(4, (2, 8, 8, 16)), _normal(5, (3, 3, 16, 8)) / 12

  def mlp(p, x):
    return jnp.tanh(jax.nn.gelu(x @ p[0]) @ p[1])

  compressed_mlp = jact.compressed(mlp, **how)
  checkpointed = jact.checkpoint(mlp, compress_argnums=(1,), **how)
  return {
    "dense": (lambda a, k: jact.ops.dense(a[0], a[1], a[2], key=k, **how), (x, w, w[0])),
    "gelu": (lambda a, k: jact.ops.gelu(a[0], key=k, **how), (x,)),
    "layer_norm": (
      lambda a, k: jact.ops.layer_norm(a[0], a[1], a[2], key=k, **how),
      (x * 3 + 1, 1 + w2[0], w2[1]),
    ),
    "conv": (lambda a, k: jact.ops.conv(a[0], a[1], key=k, **how), (img, kern)),
    "compressed_mlp": (lambda a, k: compressed_mlp(a[:2], a[2], key=k), (w, w2, x)),
    "checkpoint_mlp": (lambda a, k: checkpointed(a[:2], a[2], key=k), (w, w2, x)),
  }


def _grad(f, args, key=KEY):
  grads = _jit(jax.grad(lambda a, k: _weighted(f(a, k))))(args, key)
  return np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])


def _plan_cases():
  x = _normal(6, (16, 256)) * jnp.arange(1, 17)[:, None]  # samples of unequal scale
  w, w2 = _normal(7, (256, 64)) / 16, _normal(8, (64, 256)) / 8

  def net(a, k):
    k1, k2, k3 = jax.random.split(k, 3)
    h = jact.ops.gelu(jact.ops.dense(a[0], a[1], key=k1, name="fc1"), key=k2, name="act")
    return jact.ops.dense(h, a[2], key=k3, name="fc2")

  def planned(plan):
    def f(a, k):
      with jact.use_plan(plan):
        return net(a, k)

    return f

  mixed = jact.BitPlan({"fc1.lhs": 8, "act.dydx": 1}, default=2)
  with_compressor = jact.BitPlan({"fc2.lhs": compressors.Division()})
  budget = jact.BitPlan(budgets={"fc1.lhs": 2.0})
  args = (x, w, w2)
  return {
    f"plan/{n}": (planned(p), args)
    for n, p in (("mixed", mixed), ("compressor", with_compressor), ("budget", budget))
  }


def op_grads(out: dict):
  settings = {f"bits{b}": {"bits": b} for b in BITS}
  settings.update(
    division={"compressor": compressors.Division()},
    blpa={"compressor": compressors.BLPA()},
    fixpoint={"compressor": compressors.Fixpoint()},
  )
  for label, how in settings.items():
    for name, (f, args) in _op_cases(**how).items():
      if label in ("blpa", "fixpoint") and name not in ("dense", "compressed_mlp"):
        continue  # one linear and one generic call per further compressor
      out[f"ops/{name}/{label}"] = _grad(f, args)
  for name, (f, args) in _plan_cases().items():
    out[name] = _grad(f, args)
  print(f"ops and plans: {len(out)} entries so far", flush=True)


# ----------------------------------------------------------------------------- compiled memory


# target -> (bench_memory.MODELS entries and bit widths, bench_memory.STACK_MODES entries);
# the stack is smaller than bench_memory's (2 blocks, 4x128x256 tokens) to keep compiles short.
MEMORY = {
  None: (
    [("resnet18_cifar", b) for b in (None, 8, 4, 2)] + [("transformer", b) for b in (None, 2)],
    [("ops", None), ("remat", None), ("compressed", 4), ("compressed", 2)]
    + [("checkpoint", 4), ("checkpoint", 2), ("ops", 4), ("ops", 2)],
  ),
  "h200": (
    [("resnet18_cifar", None), ("resnet18_cifar", 2), ("transformer", None), ("transformer", 2)],
    [("ops", None), ("compressed", 2), ("checkpoint", 2), ("ops", 2)],
  ),
}
STACK = {"depth": 2, "x_shape": (4, 128, 256)}


def memory(target: str | None) -> dict:
  """`bench_memory`'s residual and temp bytes (its functions) compiled for `target`."""
  from experiments.bench import bench_memory as bm

  models, stack_modes = MEMORY[target]
  original = bm.compiled_memory
  bm.compiled_memory = functools.partial(jact.compiled_memory, target=target)
  try:
    rows = {f"{n}/{b}": bm.measure(n, b) for n, b in models}
    rows.update({f"stack/{m}/{b}": bm.measure_stack(m, b, **STACK) for m, b in stack_modes})
    for what, r in rows.items():
      print(f"memory {target or 'cpu'} {what}: {r['temp_bytes']} B ({r['seconds']} s)")
    return {what: {k: r[k] for k in ("residual_bytes", "temp_bytes")} for what, r in rows.items()}
  finally:
    bm.compiled_memory = original


def snapshot(out_dir: Path):
  from experiments import bench

  print(f"jact: {jact.__file__}, experiments: {bench.__file__}, jax {jax.__version__}", flush=True)
  out_dir.mkdir(parents=True, exist_ok=True)
  t0, grads = time.perf_counter(), {}
  op_grads(grads)
  zoo_grads(grads)
  np.savez(out_dir / "grads.npz", **grads)
  mem = {"jact_file": jact.__file__, "cpu": memory(None)}  # compare skips jact_file
  try:
    mem["h200"] = memory("h200")
  except jact.GpuCompilerMissing as e:
    print(f"no XLA:GPU figures: {e}", flush=True)
  (out_dir / "memory.json").write_text(json.dumps(mem, indent=1, sort_keys=True))
  print(
    f"{len(grads)} gradients, memory rows written to {out_dir} in {time.perf_counter() - t0:.0f} s",
    flush=True,
  )


# ----------------------------------------------------------------------------- compare


def compare(a_dir: Path, b_dir: Path) -> int:
  """Prints every entry's difference; 1 if any gradient or memory figure differs or is missing."""
  a, b = np.load(a_dir / "grads.npz"), np.load(b_dir / "grads.npz")
  bad = 0
  for name in sorted(set(a.files) | set(b.files)):
    if name not in a.files or name not in b.files:
      print(f"MISSING  {name}: only in {'B' if name not in a.files else 'A'}")
      bad += 1
      continue
    x, y = a[name], b[name]
    if x.shape != y.shape:
      print(f"DIFFERS  {name}: shape {x.shape} vs {y.shape}")
      bad += 1
      continue
    same = x.tobytes() == y.tobytes()
    bad += not same
    diff = float(np.max(np.abs(x.astype(np.float64) - y))) if x.size else 0.0
    print(f"{'same' if same else 'DIFFERS':8s} {name}: max |a-b| = {diff:.3g}")
  ma = json.loads((a_dir / "memory.json").read_text())
  mb = json.loads((b_dir / "memory.json").read_text())
  for target in sorted((set(ma) | set(mb)) - {"jact_file"}):
    rows_a, rows_b = ma.get(target, {}), mb.get(target, {})
    for row in sorted(set(rows_a) | set(rows_b)):
      ra, rb = rows_a.get(row), rows_b.get(row)
      same = ra == rb
      bad += not same
      print(f"{'equal' if same else 'DIFFERS':8s} memory {target} {row}: {ra} vs {rb}")
  print(f"{bad} entries differ or are missing" if bad else "all entries identical")
  return 1 if bad else 0


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--out", type=Path, help="write DIR/grads.npz and DIR/memory.json")
  group.add_argument("--compare", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"))
  args = parser.parse_args(argv)
  if args.compare:
    return compare(*args.compare)
  snapshot(args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
