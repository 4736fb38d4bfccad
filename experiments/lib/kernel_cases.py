"""The kernel benchmark's cases: each `jact.kernels` op's configurations, the inputs they are
timed on and the minimal bytes each moves (`experiments.bench.bench_kernels`,
`experiments.gpu.kernel_diff`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jact import kernels
from jact._core.persample import per_sample_capacity
from jact._core.quantize import effective_group_size
from jact.kernels._quantize.reference import quantize_reference

__all__ = ["CASES", "Case", "MB", "nbytes_of", "quantize_case"]

MB = 2**20


@dataclasses.dataclass(frozen=True)
class Case:
  """One kernel configuration.

  Attributes:
    op: the `jact.kernels` op.
    label: its configuration ("2 bit f32", ...).
    make: (input bytes, key) -> the positional arguments of the op's implementations.
    kwargs: keyword arguments of the implementations.
    traffic: (args, outputs) -> minimal bytes read + written.
  """

  op: str
  label: str
  make: Callable[[int, jax.Array], tuple]
  kwargs: dict
  traffic: Callable[[tuple, Any], int]


def nbytes_of(tree) -> int:
  return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree)))


def _activation(nbytes: int, key, dtype=jnp.float32, row: int = 16384):
  """Real-valued data (normal, with a ReLU-like zero half) of about `nbytes`, rows of `row`
  values."""
  n = max(1, nbytes // (jnp.dtype(dtype).itemsize * row))
  x = jax.random.normal(key, (n, row), jnp.float32)
  return jnp.where(x > -0.1, x, 0.5 * x).astype(dtype)


def _map(nbytes: int, key, hw: int = 64, c: int = 64):
  """A channels-last activation map (N, hw, hw, c) of about `nbytes` float32."""
  n = max(1, nbytes // (4 * hw * hw * c))
  return jax.random.normal(key, (n, hw, hw, c), jnp.float32)


def _seed(key):
  return jax.random.bits(key, (), jnp.uint32)


def quantize_case(bits: int, dtype=jnp.float32) -> Case:
  def make(nbytes, key):
    x = _activation(nbytes, key, dtype)
    return (x, _seed(key))

  g = effective_group_size(16384, 256)
  return Case(
    "quantize",
    f"{bits} bit {jnp.dtype(dtype).name}",
    make,
    dict(bits=bits, group_size=g, stochastic=True),
    lambda args, out: nbytes_of(args[0]) + nbytes_of(out),
  )


def _dequantize_case(bits: int) -> Case:
  def make(nbytes, key):
    x = _activation(nbytes, key)
    return (quantize_reference(x, _seed(key), bits=bits, group_size=256),)

  return Case(
    "dequantize",
    f"{bits} bit f32",
    make,
    dict(dtype=jnp.float32),
    lambda args, out: nbytes_of(args[0]) + nbytes_of(out),
  )


def _relu_case() -> Case:
  return Case(
    "relu_mask",
    "relu f32",
    lambda nbytes, key: (_activation(nbytes, key),),
    dict(negative_slope=None),
    lambda args, out: nbytes_of(args[0]) + nbytes_of(out),
  )


def _per_sample_widths(n: int):
  """Widths 1/2/4 (probabilities 1/4, 1/2, 1/4): 2.25 bits a value on average."""
  return jnp.asarray(
    np.random.default_rng(0).choice([1, 2, 4], size=n, p=[0.25, 0.5, 0.25]), jnp.int32
  )


def _quantize_per_sample_case() -> Case:
  def make(nbytes, key):
    x = _activation(nbytes, key, row=4096)
    return (x, _per_sample_widths(x.shape[0]))

  return Case(
    "quantize_per_sample",
    "mixed 1/2/4 bit f32",
    make,
    dict(group_size=256, seed=jnp.uint32(7)),
    lambda args, out: nbytes_of(args[0]) + nbytes_of(out),
  )


def _dequantize_per_sample_case() -> Case:
  def make(nbytes, key):
    x, widths = _quantize_per_sample_case().make(nbytes, key)
    capacity = per_sample_capacity(x.shape, 4.0)
    fn = kernels.available("quantize_per_sample")["xla"].fn
    return (fn(x, widths, capacity_bytes=capacity, group_size=256, seed=jnp.uint32(7)),)

  return Case(
    "dequantize_per_sample",
    "mixed 1/2/4 bit f32",
    make,
    dict(dtype=jnp.float32),
    lambda args, out: nbytes_of(args[0]) + nbytes_of(out),
  )


def _division_case(bits: int = 2, block: int = 8) -> Case:
  return Case(
    "division_compress",
    f"B={block} Q={bits} f32 64x64x64",
    lambda nbytes, key: (_map(nbytes, key), _seed(key)),
    dict(block=block, bits=bits, group_size=256, lfc_dtype=jnp.dtype(jnp.bfloat16)),
    lambda args, out: nbytes_of(args[0]) + nbytes_of(out),
  )


def _float8_case(fmt: str = "e4m3", stochastic: bool = False, dtype=jnp.bfloat16) -> Case:
  return Case(
    "float8_compress",
    f"{fmt} {'stochastic' if stochastic else 'nearest'} {jnp.dtype(dtype).name} MXFP8 blocks",
    lambda nbytes, key: (_activation(nbytes, key, dtype), _seed(key)),
    dict(format=fmt, block_size=32, scale="pow2", stochastic=stochastic),
    lambda args, out: nbytes_of(args[0]) + nbytes_of(out),
  )


CASES = {
  "quantize": [quantize_case(b) for b in (1, 2, 4, 8)] + [quantize_case(2, jnp.bfloat16)],
  "dequantize": [_dequantize_case(b) for b in (2, 4, 8)],
  "relu_mask": [_relu_case()],
  "quantize_per_sample": [_quantize_per_sample_case()],
  "dequantize_per_sample": [_dequantize_per_sample_case()],
  "division_compress": [_division_case()],
  "float8_compress": [_float8_case(), _float8_case(stochastic=True)],
}
