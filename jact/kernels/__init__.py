"""Kernel registry: an XLA reference for every op, GPU kernels when importable.

Each op ("quantize", "dequantize", "relu_mask", "quantize_per_sample",
"dequantize_per_sample", "division_compress", "float8_compress") has the "xla" reference (the
tests' oracle) and, where available, "pallas_triton" / "jax_triton" kernels
returning the same bits. `select` picks one by backend, `implementation=` or
a `use(...)` context; `dispatch` stages an automatic choice with
`lax.platform_dependent` so a kernel runs only where it is lowered for its
platform. Package layout and dispatch rules: docs/design.md, "The kernel
registry".

>>> import jax
>>> from jact import kernels
>>> sorted(kernels.available("quantize"))
['jax_triton', 'pallas_triton', 'xla']
>>> kernels.select("quantize").name
'xla'
>>> with kernels.use(quantize="xla"):
...   kernels.select("quantize").name
'xla'
"""

from __future__ import annotations

import importlib.util

from jact.kernels._division.reference import division_compress_reference
from jact.kernels._float8.reference import float8_compress_reference
from jact.kernels._per_sample.reference import (
  dequantize_per_sample_reference,
  quantize_per_sample_reference,
)
from jact.kernels._quantize.reference import dequantize_reference, quantize_reference
from jact.kernels._registry import Implementation, Registry
from jact.kernels._relu_mask.reference import relu_mask_reference

__all__ = [
  "Implementation",
  "Registry",
  "REGISTRY",
  "available",
  "select",
  "dispatch",
  "use",
  "lowering_for",
]

_REFERENCES = [
  Implementation("quantize", "xla", quantize_reference),
  Implementation("dequantize", "xla", dequantize_reference),
  Implementation("relu_mask", "xla", relu_mask_reference),
  Implementation("quantize_per_sample", "xla", quantize_per_sample_reference),
  Implementation("dequantize_per_sample", "xla", dequantize_per_sample_reference),
  Implementation("division_compress", "xla", division_compress_reference),
  Implementation("float8_compress", "xla", float8_compress_reference),
]


def _pallas_triton() -> list[Implementation]:
  """The Pallas (Triton backend) kernels, when this jax has that backend."""
  try:
    from jax.experimental.pallas import triton as _  # noqa: F401
  except (
    ImportError
  ):  # a jax without Pallas' Triton backend: the references only  # pragma: no cover
    return []
  from jact.kernels._division import pallas_triton as division
  from jact.kernels._float8 import pallas_triton as float8
  from jact.kernels._per_sample import pallas_triton as per_sample
  from jact.kernels._quantize import pallas_triton as quantize
  from jact.kernels._relu_mask import pallas_triton as relu_mask

  # inline PTX (`_triton.mul`, ...) makes them NVIDIA-only
  gpu = dict(platforms=("gpu",), priority=10, max_size=2**31 - 1, lowering_platforms=("cuda",))
  return [
    Implementation(op, "pallas_triton", fn, **gpu)
    for op, fn in [
      ("quantize", quantize.quantize),
      ("dequantize", quantize.dequantize),
      ("relu_mask", relu_mask.relu_mask),
      ("quantize_per_sample", per_sample.quantize_per_sample),
      ("dequantize_per_sample", per_sample.dequantize_per_sample),
      ("division_compress", division.division_compress),
      ("float8_compress", float8.float8_compress),
    ]
  ]


def _quantize_jax_triton(*args, **kwargs):
  """`jact.kernels._quantize.jax_triton.quantize`, imported (with `triton`) when first called."""
  from jact.kernels._quantize import jax_triton

  return jax_triton.quantize(*args, **kwargs)


def _jax_triton_kernels() -> list[Implementation]:
  """The kernels written in Triton's language and launched with jax-triton, when
  the `triton` package is installed. Below the Pallas kernels in priority:
  chosen by `use(quantize="jax_triton")` or `implementation="jax_triton"`
  (jax 0.12 deprecates Pallas' Triton backend; these do not depend on it)."""
  if importlib.util.find_spec("triton") is None:  # pragma: no cover
    return []
  return [
    Implementation(
      "quantize",
      "jax_triton",
      _quantize_jax_triton,
      platforms=("gpu",),
      priority=5,
      max_size=2**31 - 1,
      lowering_platforms=("cuda",),
    )
  ]


REGISTRY = Registry(_REFERENCES + _pallas_triton() + _jax_triton_kernels())
"""jact's kernel table (immutable; `REGISTRY.extended(...)` makes a new one)."""

available = REGISTRY.available
select = REGISTRY.select
dispatch = REGISTRY.dispatch
use = REGISTRY.use
lowering_for = REGISTRY.lowering_for
