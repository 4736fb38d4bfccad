"""Compile every Pallas kernel for a Hopper GPU on a machine without one, and read the machine code.

Lowering for cuda from the CPU (what the kernel tests do) stops at Triton IR.
This goes on: each kernel's Triton module, captured while JAX lowers it, is
compiled by the `triton` package (`pip install triton`) through PTX to a
cubin for sm_90a, and the result is read for what decides speed and
bit-exactness on the device:

* registers and spill (local + stack) bytes per thread, from the cubin;
* the widths of global loads and stores (`v4.b32` = 16-byte vector accesses,
  what a bandwidth-bound kernel wants; scalar accesses cost instructions);
* fused multiply-adds: `fma` instructions in the PTX (Triton and LLVM fuse
  a plain `a * b + c`) and unrounded multiplies feeding an unrounded add or
  subtract, which ptxas may still fuse -- either way the kernel would round
  once where the XLA reference rounds twice (the kernels emit `mul.rn` and
  `add.rn` to prevent exactly this);
* approximate float division (`div.approx`/`div.full`), also not bit-exact.

Triton's version differs from the one inside XLA, so a kernel compiling here
is strong evidence, not proof, that it compiles on the device; and static
facts are no timing (see `experiments.bench.bench_kernels` for that).

    python -m experiments.bench.compile_kernels [--arch 90] [--json experiments/results/compile_kernels.json]
"""  # noqa: E501 (tables and commands in this docstring)

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import subprocess
import tempfile
from collections import Counter
from typing import Callable

import jax
import jax.numpy as jnp

from experiments.lib import metadata
from jact import _compat
from jact.kernels._division import pallas_triton as division
from jact.kernels._float8 import pallas_triton as float8
from jact.kernels._per_sample import pallas_triton as persample
from jact.kernels._per_sample.reference import quantize_per_sample_reference
from jact.kernels._quantize import pallas_triton as pergroup
from jact.kernels._quantize.reference import quantize_reference
from jact.kernels._relu_mask import pallas_triton as relu

__all__ = [
  "TritonModule",
  "CompiledKernel",
  "KERNELS",
  "triton_modules",
  "compile_module",
  "ptx_facts",
  "compile_kernel",
  "main",
]


@dataclasses.dataclass(frozen=True)
class TritonModule:
  """One `pallas_call`'s Triton IR (text) with its launch parameters."""

  name: str
  ir: str
  num_warps: int
  num_stages: int


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
  """Static facts about one kernel compiled for the GPU."""

  name: str
  num_warps: int
  registers: int
  spill_bytes: int
  shared_bytes: int
  loads: dict[str, int]  # PTX global load instruction -> count, e.g. {"ld.global.v4.b32": 8}
  stores: dict[str, int]
  fused_multiply_adds: int  # float FMAs in the PTX plus multiply-add pairs ptxas may fuse
  approximate_divisions: int

  @property
  def vector_load_fraction(self) -> float:
    """Share of the bytes loaded (per thread, static count) that vector loads move."""
    total = vector = 0
    for op, count in self.loads.items():
      lanes = re.search(r"\.v(\d)\.", op)
      nbytes = (
        count * (int(lanes.group(1)) if lanes else 1) * int(re.search(r"(\d+)$", op).group(1)) // 8
      )
      total += nbytes
      vector += nbytes if lanes else 0
    return vector / total if total else 0.0


@contextlib.contextmanager
def _capturing():
  """Collects the Triton module text of every pallas_call lowered inside."""
  from jax._src.pallas.triton import pallas_call_registration as registration

  lowering = registration.lowering
  original = lowering.lower_jaxpr_to_triton_module
  texts = []

  def capture(jaxpr, *args, **kwargs):
    result = original(jaxpr, *args, **kwargs)
    texts.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  lowering.lower_jaxpr_to_triton_module = capture
  try:
    yield texts
  finally:
    lowering.lower_jaxpr_to_triton_module = original


_LAUNCH = re.compile(r'name = "(\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')


def triton_modules(fn: Callable, *args) -> list[TritonModule]:
  """The Triton modules of the pallas_calls in `jax.jit(fn)(*args)` lowered for cuda.

  >>> x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
  >>> [m.name for m in triton_modules(lambda x: relu.relu_mask(x, interpret=False), x)]
  ['jact_relu_mask']
  """
  with _capturing() as texts:
    hlo = _compat.lower_for_cuda(fn, *args).as_text()
  launches = _LAUNCH.findall(hlo)
  if len(launches) != len(texts):
    raise RuntimeError(
      f"found {len(texts)} Triton modules but {len(launches)} launch configs; "
      "the pallas_call lowering changed, update `_LAUNCH`"
    )
  return [
    TritonModule(name, ir, int(warps), int(stages))
    for ir, (name, stages, warps) in zip(texts, launches)
  ]


_REG = r"(%[a-z]+\d+)"


def ptx_facts(ptx: str) -> dict:
  """Global access widths, fused (or fusable) multiply-adds and approximate divisions of PTX.

  >>> ptx = ("mul.f32 %f3, %f1, %f2;\\nadd.f32 %f4, %f3, %f1;\\n"
  ...        "mul.rn.f32 %f5, %f1, %f2;\\nadd.rn.f32 %f6, %f5, %f1;\\nfma.rn.f32 %f7, %f1, %f2, %f6;")
  >>> ptx_facts(ptx)["fused_multiply_adds"]
  2
  """  # noqa: E501 (tables and commands in this docstring)
  loads = Counter(re.findall(r"\bld\.global[\w.]*", ptx))
  stores = Counter(re.findall(r"\bst\.global[\w.]*", ptx))
  products = set(re.findall(rf"\bmul(?:\.ftz)?\.f32\s+{_REG}", ptx))  # unrounded multiplies
  pairs = 0
  for _, a, b in re.findall(rf"\b(?:add|sub)(?:\.ftz)?\.f32\s+{_REG},\s*{_REG},\s*{_REG}", ptx):
    pairs += a in products or b in products
  pairs += len(re.findall(r"\bfma\.[\w.]*f32", ptx))
  approximate = len(re.findall(r"\bdiv\.(?:approx|full)[\w.]*f32", ptx))
  return {
    "loads": dict(loads),
    "stores": dict(stores),
    "fused_multiply_adds": pairs,
    "approximate_divisions": approximate,
  }


def _cuobjdump() -> str:
  import triton

  path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
  if not os.path.exists(path):
    raise FileNotFoundError(f"no cuobjdump bundled with triton at {path}")
  return path


def compile_module(module: TritonModule, arch: int = 90) -> CompiledKernel:
  """Compiles a Triton module to PTX and a cubin for sm_{arch}; reads its facts.

  Float fusion is left on (Triton's default): the kernels must be exact with it.
  """
  import triton
  from triton.backends.compiler import GPUTarget

  with tempfile.TemporaryDirectory() as tmp:
    source = os.path.join(tmp, f"{module.name}.ttir")
    with open(source, "w") as f:
      f.write(module.ir)
    compiled = triton.compile(
      source,
      target=GPUTarget("cuda", arch, 32),
      options={
        "num_warps": module.num_warps,
        "num_stages": module.num_stages,
        "enable_fp_fusion": True,
      },
    )
    cubin = os.path.join(tmp, "kernel.cubin")
    with open(cubin, "wb") as f:
      f.write(compiled.asm["cubin"])
    usage = subprocess.run(
      [_cuobjdump(), "--dump-resource-usage", cubin], capture_output=True, text=True, check=True
    ).stdout
  resources = dict(re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", usage))
  return CompiledKernel(
    module.name,
    module.num_warps,
    int(resources["REG"]),
    int(resources["LOCAL"]) + int(resources["STACK"]),
    int(resources["SHARED"]),
    **ptx_facts(compiled.asm["ptx"]),
  )


# ----------------------------------------------------------------------------- the kernels

_SEED = jax.ShapeDtypeStruct((), jnp.uint32)


def _spec(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _quantize(bits, dtype=jnp.float32, shape=(256, 12544), group=256, stochastic=True):
  fn = functools.partial(
    pergroup.quantize, bits=bits, group_size=group, stochastic=stochastic, interpret=False
  )
  return (lambda x, s: fn(x, s)) if stochastic else (lambda x: fn(x, None)), (
    (_spec(shape, dtype), _SEED) if stochastic else (_spec(shape, dtype),)
  )


def _dequantize(bits, dtype=jnp.float32, shape=(256, 12544), group=256):
  packed = jax.eval_shape(
    lambda x: quantize_reference(x, jnp.uint32(0), bits=bits, group_size=group), _spec(shape, dtype)
  )
  return lambda p: pergroup.dequantize(p, dtype, interpret=False), (packed,)


def _relu(dtype=jnp.float32, slope=None):
  return (
    lambda x: relu.relu_mask(x, negative_slope=slope, interpret=False),
    (_spec((64, 56, 56, 64), dtype),),
  )


_PER_SAMPLE = dict(shape=(64, 50176), group=256)


def _quantize_per_sample(dtype=jnp.float32):
  n, d = _PER_SAMPLE["shape"]
  kw = dict(capacity_bytes=n * d // 2, group_size=_PER_SAMPLE["group"], interpret=False)
  return (
    lambda x, b, s: persample.quantize_per_sample(x, b, seed=s, **kw),
    (_spec((n, d), dtype), _spec((n,), jnp.int32), _SEED),
  )


def _dequantize_per_sample(dtype=jnp.float32):
  n, d = _PER_SAMPLE["shape"]
  packed = jax.eval_shape(
    lambda x, b: quantize_per_sample_reference(
      x, b, capacity_bytes=n * d // 2, group_size=_PER_SAMPLE["group"], seed=None
    ),
    _spec((n, d), dtype),
    _spec((n,), jnp.int32),
  )
  return lambda p: persample.dequantize_per_sample(p, dtype, interpret=False), (packed,)


def _division(shape, block=8, bits=2, group=256, dtype=jnp.float32):
  fn = functools.partial(
    division.division_compress,
    block=block,
    bits=bits,
    group_size=group,
    lfc_dtype=jnp.bfloat16,
    interpret=False,
  )
  return (lambda x, s: fn(x, s)), (_spec(shape, dtype), _SEED)


def _float8(dtype=jnp.bfloat16, fmt="e4m3", scale="pow2", stochastic=False):
  fn = functools.partial(
    float8.float8_compress,
    format=fmt,
    block_size=32,
    scale=scale,
    stochastic=stochastic,
    interpret=False,
  )
  return (lambda x, s: fn(x, s)), (_spec((256, 16384), dtype), _SEED)


KERNELS: dict[str, Callable[[], tuple[Callable, tuple]]] = {
  **{f"quantize {b}-bit f32": functools.partial(_quantize, b) for b in (1, 2, 4, 8)},
  "quantize 2-bit bf16": functools.partial(_quantize, 2, jnp.bfloat16),
  "quantize 2-bit f32 nearest": functools.partial(_quantize, 2, stochastic=False),
  "quantize 2-bit f32 group 112": functools.partial(_quantize, 2, shape=(256, 784), group=112),
  "quantize 2-bit f32 group 100": functools.partial(_quantize, 2, shape=(256, 3000), group=100),
  **{f"dequantize {b}-bit f32": functools.partial(_dequantize, b) for b in (1, 2, 4, 8)},
  "dequantize 2-bit bf16": functools.partial(_dequantize, 2, jnp.bfloat16),
  "relu mask f32": _relu,
  "relu mask bf16": functools.partial(_relu, jnp.bfloat16),
  "leaky relu mask f32": functools.partial(_relu, slope=0.2),
  "quantize per sample f32": _quantize_per_sample,
  "quantize per sample bf16": functools.partial(_quantize_per_sample, jnp.bfloat16),
  "dequantize per sample f32": _dequantize_per_sample,
  "division fused 2-bit": functools.partial(_division, (64, 56, 56, 64)),
  "division pool + residual 2-bit 3-D": functools.partial(_division, (8, 8, 16, 16, 32), block=4),
  "float8 e4m3 bf16": _float8,
  "float8 e5m2 f32 float scale stochastic": functools.partial(
    _float8, jnp.float32, "e5m2", "float", True
  ),
}


def compile_kernel(kernel: str, arch: int = 90) -> list[CompiledKernel]:
  """Compiles the pallas_calls of one `KERNELS` entry."""
  fn, args = KERNELS[kernel]()
  return [compile_module(m, arch) for m in triton_modules(fn, *args)]


def _row(kernel: str, c: CompiledKernel) -> str:
  loads = " ".join(f"{k.removeprefix('ld.global.')}x{v}" for k, v in sorted(c.loads.items()))
  return (
    f"{kernel:34s} {c.name:28s} {c.registers:5d} {c.spill_bytes:6d} {c.shared_bytes:7d}  "
    f"{c.fused_multiply_adds:3d} {c.approximate_divisions:3d}  {loads}"
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100)")
  parser.add_argument("--json", default="experiments/results/compile_kernels.json")
  args = parser.parse_args(argv)
  import triton

  rows = []
  print(
    f"{'kernel':34s} {'pallas_call':28s} {'regs':>5s} {'spill':>6s} {'shared':>7s}  "
    f"fma div  global loads (PTX, per thread)"
  )
  for kernel in KERNELS:
    for c in compile_kernel(kernel, args.arch):
      print(_row(kernel, c), flush=True)
      rows.append({"kernel": kernel, **dataclasses.asdict(c)})
  meta = metadata.run_metadata(
    "experiments.bench.compile_kernels", argv, target=f"sm_{args.arch}a", triton=triton.__version__
  )
  if args.json:
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
      json.dump({"meta": meta, "kernels": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
