"""Building blocks shared by the Pallas (Triton backend) kernels.

Bit-exactness with the XLA reference rests on three rules:

* Every float operation is a single IEEE operation rounded to nearest. On the
  GPU, Triton contracts a multiply feeding an add into one fused
  multiply-add and lowers float32 division to an approximate instruction;
  `mul`, `add` and `div` below therefore emit explicitly rounded PTX
  (`mul.rn.f32`, ...), which neither LLVM nor ptxas rewrites. In interpret
  mode (CPU) they are the plain jnp operations the reference uses.
* The rounding noise is `jact.rng`'s hash of (seed, flat element index),
  computed here in uint32 exactly as in the reference.
* Group statistics go through the same directed bf16 rounding
  (`bf16_down`, `bf16_up`: the reference's own `bf16_round_directed`) and the same
  finite-only min/max.

Triton blocks must have power-of-two sizes: kernels load power-of-two tiles
with masks (`load` with `other`) and address the input through flat offsets.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jact._core import rng
from jact._core.quantize import bf16_round_directed

__all__ = [
  "mul",
  "add",
  "div",
  "bf16_down",
  "bf16_up",
  "noise",
  "load",
  "store",
  "next_pow2",
  "call",
  "compiler_params",
  "on_gpu",
  "check_int32",
]


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def next_pow2(n: int) -> int:
  return 1 << max(0, math.ceil(math.log2(max(1, n))))


def check_int32(n: int, what: str) -> None:
  if n >= 2**31:
    raise ValueError(
      f"{what} has {n} elements; the Pallas kernels address with int32 "
      "offsets (< 2**31). Use implementation='xla' for tensors this large."
    )


def _asm(op: str, a: jax.Array, b: jax.Array) -> jax.Array:
  a, b = jnp.broadcast_arrays(a.astype(jnp.float32), b.astype(jnp.float32))
  return pltriton.elementwise_inline_asm(
    f"{op}.rn.f32 $0, $1, $2;",
    args=[a, b],
    constraints="=r,r,r",
    pack=1,
    result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
  )[0]


def mul(a, b, interpret: bool):
  """a * b in float32, rounded once (never fused into a following add)."""
  return a * b if interpret else _asm("mul", a, b)


def add(a, b, interpret: bool):
  """a + b in float32, rounded once (never fused with a preceding multiply)."""
  return a + b if interpret else _asm("add", a, b)


def div(a, b, interpret: bool):
  """a / b in float32, IEEE (correctly rounded) division."""
  return a / b if interpret else _asm("div", a, b)


bf16_down = functools.partial(bf16_round_directed, up=False)
bf16_up = functools.partial(bf16_round_directed, up=True)


def noise(seed: jax.Array, index: jax.Array) -> jax.Array:
  """Uniform [0, 1) noise of the reference for uint32 flat indices."""
  return rng.uniform_from_bits(rng.hash_uint32(seed, index))


def load(ref, offsets, mask, other):
  """Masked gather of ref[offsets] (flat offsets into a 1-D ref)."""
  return pltriton.load(ref.at[offsets], mask=mask, other=other)


def store(ref, offsets, value, mask):
  pltriton.store(ref.at[offsets], value, mask=mask)


def compiler_params(num_warps: int = 4, num_stages: int = 1) -> pltriton.CompilerParams:
  """Explicit Triton-backend parameters (a plain `pallas_call` on GPU lowers to Mosaic GPU)."""
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def call(
  kernel,
  *,
  grid: int | tuple[int, ...],
  out_shape,
  name: str,
  interpret: bool,
  num_warps: int = 4,
  num_stages: int = 1,
):
  """`pl.pallas_call` on the Triton backend over a grid (an int: 1-D) with whole-array refs.

  Every kernel makes its Pallas calls through this function: the kernel
  contract tests replace it with one that pre-fills the outputs with garbage
  (interpret mode starts them as zeros or NaN, which can hide an unwritten
  element), so a kernel must write every element of its outputs.
  """
  return pl.pallas_call(
    kernel,
    out_shape=out_shape,
    grid=grid if isinstance(grid, tuple) else (grid,),
    interpret=interpret,
    name=name,
    compiler_params=compiler_params(num_warps, num_stages),
  )
