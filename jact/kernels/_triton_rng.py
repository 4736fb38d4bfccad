"""`jact.rng`'s element hash in Triton's language, for the kernels launched with jax-triton.

`hash_uint32(seed, index)` is `jact._core.rng.hash_uint32`: the same uint32
operations (wrapping multiplies, shifts, xors), so a kernel's stochastic
rounding draws the reference's bits for each flat element index.
`uniform(seed, index)` is `rng.uniform_from_bits` of those bits. The kernels'
contract tests (tests/kernels/test_kernel_contract.py) check both against the
reference through the kernels that call them.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["hash_uint32", "uniform"]


@triton.jit
def _lowbias32(h):
  h = h ^ (h >> 16)
  h = h * 0x7FEB352D
  h = h ^ (h >> 15)
  h = h * 0x846CA68B
  return h ^ (h >> 16)


@triton.jit
def hash_uint32(seed, index):
  """lowbias32(lowbias32(index * golden + lowbias32(seed)) ^ seed), all uint32."""
  h = _lowbias32(seed)
  h = _lowbias32(index * 0x9E3779B9 + h)
  return _lowbias32(h ^ seed)


@triton.jit
def uniform(seed, index):
  """float32 uniform [0, 1) on a 2^-24 grid from `hash_uint32(seed, index)`."""
  return (hash_uint32(seed, index) >> 8).to(tl.float32) * 5.9604644775390625e-08
