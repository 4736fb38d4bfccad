"""Where the compile time of a compressed gradient goes (XLA:CPU).

For one zoo model's `jact.convert` gradient (default: the transformer LM at 4
bits), compiles, as in `experiments.bench.compile_time`:

* plain -- the model without jact;
* jact -- as shipped;
* exact residuals -- jact with every residual kept exact (no quantizer, no
  dequantizer), everything else (custom VJPs, seeds, names, ordering) kept:
  the cost of the plumbing;
* no CPU ordering -- jact without the XLA:CPU ordering devices (always-true
  selects, runtime-1.0 divisions), and both removed. *Attribution only*:
  without the ordering the compiled step holds far more memory (its
  `temp_bytes` shows how much), it is not a program jact would run;
* quantizers alone -- the model's own quantize calls (recorded while tracing
  it: shapes, dtypes, widths, group sizes) compiled in one program, their
  seeds once derived from a constant per call (as each residual's site seed
  is) and once passed as parameters (then the quantize kernels of equal
  shapes are identical and XLA:CPU compiles one of them);
* opaque quantizers -- jact with its quantize and dequantize kernels replaced
  by opaque calls of the same shapes (`jax.pure_callback`, zeros: compile
  attribution only, the numbers are wrong): the best any separately compiled
  CPU kernel (an FFI custom call) could do for the compile time, with and
  without the CPU ordering;
* minimal quantizers -- the same calls through a bare per-group stochastic
  quantizer (min/max, hashed noise, floor, 4-bit packing; none of jact's
  non-finite, wide-range or low-precision handling), a lower bound for any
  per-group quantizer written in XLA.

Each row has compile CPU-seconds, optimized HLO instructions, fusions and
the number of distinct fused computations (fusions that differ only in
names count once: roughly the kernels XLA:CPU generates code for).

    python -m experiments.bench.compile_anatomy [--model transformer_lm] [--bits 4] [--json PATH]

writes `experiments/results/compile_anatomy.json` (default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jact.kernels
from experiments.lib import memory, metadata, paths
from experiments.lib.zoo import CASES
from experiments.lib.zoo_harness import variant_fns
from jact._core import rng, xla_cpu
from jact._core.packing import pack_bits
from jact._core.quantize import Packed, grouped
from jact._engine import store


def distinct_fusions(hlo: str) -> int:
  """Fused computations of an optimized HLO text that differ in more than names."""
  bodies = re.findall(r"\n(%fused_computation[^\s]* .*?\n})", hlo, re.S)

  def normalized(body):
    body = re.sub(r", metadata=\{[^}]*\}", "", body)
    body = re.sub(r"%[\w.\-]+", "%", body)
    return re.sub(r"(param_\d+)\.\d+", r"\1", body)

  return len({normalized(b) for b in bodies})


def compile_row(fn, args) -> dict:
  """Compile CPU-seconds and sizes of `jax.jit(fn)` at `args`."""
  lowered = jax.jit(fn).lower(*args)
  start = time.process_time()
  compiled = lowered.compile()
  seconds = time.process_time() - start
  hlo = compiled.as_text()
  return {
    "compile_cpu_s": seconds,
    "hlo_instructions": sum(1 for line in hlo.splitlines() if " = " in line),
    "fusions": hlo.count(" fusion("),
    "distinct_fusions": distinct_fusions(hlo),
    "temp_bytes": memory.compiled_memory_of(compiled).temp_bytes,
  }


@contextlib.contextmanager
def patched(module, name: str, value):
  old = getattr(module, name)
  setattr(module, name, value)
  try:
    yield
  finally:
    setattr(module, name, old)


@contextlib.contextmanager
def exact_residuals():
  """Every jact module's `compress_residual` returns the residual unchanged."""
  original = store.compress_residual
  keep = lambda x, *args, **kwargs: x
  owners = [
    m
    for m in list(sys.modules.values())
    if getattr(m, "__name__", "").startswith("jact")
    and getattr(m, "compress_residual", None) is original
  ]
  with contextlib.ExitStack() as stack:
    for module in owners:
      stack.enter_context(patched(module, "compress_residual", keep))
    yield


def no_cpu_ordering():
  return patched(xla_cpu, "on_cpu", lambda rule, values, anchors: list(values))


@contextlib.contextmanager
def recording_quantize_calls(calls: list):
  """Records (shape, dtype, bits, group size, stochastic) of every quantize kernel call."""
  dispatch = jact.kernels.dispatch

  def recording(op, implementation=None, **kwargs):
    fn = dispatch(op, implementation, **kwargs)
    if op != "quantize":
      return fn

    def call(x, seed, *, bits, group_size, stochastic):
      calls.append((tuple(x.shape), jnp.dtype(x.dtype).name, bits, group_size, stochastic))
      return fn(x, seed, bits=bits, group_size=group_size, stochastic=stochastic)

    return call

  with patched(jact.kernels, "dispatch", recording):
    yield


def opaque_quantize(x, seed, *, bits, group_size, stochastic):
  """A `Packed` of the right shapes from an opaque host call (zeros)."""
  n = x.shape[0] if x.ndim else 1
  groups = -(-(x.size // max(n, 1)) // group_size)
  shapes = (
    jax.ShapeDtypeStruct((n, groups, group_size * bits // 8), jnp.uint8),
    jax.ShapeDtypeStruct((n, groups), jnp.bfloat16),
    jax.ShapeDtypeStruct((n, groups), jnp.bfloat16),
  )
  zeros = lambda *_: tuple(np.zeros(s.shape, s.dtype) for s in shapes)
  seed = jnp.uint32(0) if seed is None else seed
  data, minimum, scale = jax.pure_callback(zeros, shapes, x, seed)
  return Packed(data, minimum, scale, tuple(x.shape), jnp.dtype(x.dtype), bits, group_size)


def opaque_dequantize(packed, dtype=None):
  """The reconstruction's shape from an opaque host call (zeros)."""
  out = jax.ShapeDtypeStruct(packed.view_shape or packed.shape, jnp.dtype(dtype or packed.dtype))
  zeros = lambda *_: np.zeros(out.shape, out.dtype)
  return jax.pure_callback(zeros, out, packed.data, packed.minimum, packed.scale)


def opaque_quantizers():
  """jact's quantize / dequantize kernels replaced by opaque host calls."""
  dispatch = jact.kernels.dispatch
  opaque = {"quantize": opaque_quantize, "dequantize": opaque_dequantize}
  return patched(
    jact.kernels,
    "dispatch",
    lambda op, implementation=None, **kw: opaque.get(op) or dispatch(op, implementation, **kw),
  )


def gradient_program(case, bits: int):
  fns = variant_fns(case, "convert" if bits else "plain", bits)
  return jax.grad(fns.loss, has_aux=True), (fns.params, fns.state, case.batch(0), jax.random.key(1))


def minimal_quantize(x, seed, bits: int, group_size: int):
  """A bare per-group stochastic quantizer (the lower bound; not jact's rounding)."""
  g, _ = grouped(x.astype(jnp.float32), group_size)
  lo, hi = jnp.min(g, axis=-1), jnp.max(g, axis=-1)
  step = (hi - lo) / (2**bits - 1)
  noise = rng.uniform_from_bits(rng.element_bits(seed, g.shape))
  codes = jnp.floor((g - lo[..., None]) / step[..., None] + noise).astype(jnp.uint8)
  return lo.astype(jnp.bfloat16), step.astype(jnp.bfloat16), pack_bits(codes, bits)


def quantizer_programs(calls):
  """(name, fn, args) of the recorded calls' quantizers compiled alone."""
  quantize = jact.kernels.dispatch("quantize", "xla")
  inputs = [jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)) for shape, dtype, *_ in calls]
  one_seed = jax.ShapeDtypeStruct((), jnp.uint32)

  def constant_seeds(xs, seed):
    return [
      quantize(x, rng.split_seed(seed, i), bits=b, group_size=g, stochastic=s)
      for i, (x, (_, _, b, g, s)) in enumerate(zip(xs, calls))
    ]

  def seed_parameters(xs, seeds):
    return [
      quantize(x, seed, bits=b, group_size=g, stochastic=s)
      for x, seed, (_, _, b, g, s) in zip(xs, seeds, calls)
    ]

  def minimal(xs, seeds):
    return [minimal_quantize(x, seed, b, g) for x, seed, (_, _, b, g, _) in zip(xs, seeds, calls)]

  return [
    ("quantizers alone, constant seeds", constant_seeds, (inputs, one_seed)),
    ("quantizers alone, seeds as parameters", seed_parameters, (inputs, [one_seed] * len(calls))),
    ("minimal quantizers, seeds as parameters", minimal, (inputs, [one_seed] * len(calls))),
  ]


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="transformer_lm", choices=sorted(CASES))
  parser.add_argument("--bits", type=int, default=4)
  parser.add_argument("--json", type=Path, default=paths.RESULTS / "compile_anatomy.json")
  args = parser.parse_args(argv)
  case, info, rows = (
    CASES[args.model],
    metadata.run_metadata(
      "experiments.bench.compile_anatomy", argv, load_average_start=os.getloadavg()
    ),
    [],
  )

  def add(name, make, *contexts):
    with contextlib.ExitStack() as stack:
      for context in contexts:
        stack.enter_context(context)
      fn, fn_args = make()
      row = {"program": name, **compile_row(fn, fn_args)}
    rows.append(row)
    print(
      f"{name:42s} compile {row['compile_cpu_s']:6.2f} CPU-s  HLO {row['hlo_instructions']:6d}"
      f"  fusions {row['fusions']:4d} ({row['distinct_fusions']:4d} distinct)"
      f"  temp {row['temp_bytes'] / 2**20:8.1f} MiB",
      flush=True,
    )

  calls = []
  add("plain", lambda: gradient_program(case, None))
  add("jact", lambda: gradient_program(case, args.bits), recording_quantize_calls(calls))
  add("jact, exact residuals", lambda: gradient_program(case, args.bits), exact_residuals())
  add("jact, no CPU ordering", lambda: gradient_program(case, args.bits), no_cpu_ordering())
  add(
    "jact, exact residuals, no CPU ordering",
    lambda: gradient_program(case, args.bits),
    exact_residuals(),
    no_cpu_ordering(),
  )
  add("jact, opaque quantizers", lambda: gradient_program(case, args.bits), opaque_quantizers())
  add(
    "jact, opaque quantizers, no CPU ordering",
    lambda: gradient_program(case, args.bits),
    opaque_quantizers(),
    no_cpu_ordering(),
  )
  for name, fn, fn_args in quantizer_programs(calls):
    add(name, lambda fn=fn, fn_args=fn_args: (fn, fn_args))
  info.update(
    model=args.model,
    bits=args.bits,
    quantize_calls=len(calls),
    distinct_quantize_calls=len(set(calls)),
    load_average_end=os.getloadavg(),
  )
  args.json.parent.mkdir(parents=True, exist_ok=True)
  args.json.write_text(json.dumps({"meta": info, "rows": rows}, indent=1) + "\n")
  print(f"{len(calls)} quantize calls ({len(set(calls))} distinct); wrote {args.json}")


if __name__ == "__main__":
  main()
