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

import importlib
import importlib.util
import re
from typing import Callable

from jact import _compat

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
  "KERNEL_CALL_TARGETS",
  "kernel_launches",
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


_GPU = dict(platforms=("gpu",), max_size=2**31 - 1, lowering_platforms=("cuda",))
"""Every Triton kernel: NVIDIA GPUs only (inline PTX, Triton's CUDA target), int32 indexing."""

JAX_TRITON_PRIORITY = 20 if _compat.has_jax_triton() else 5
"""The jax-triton kernels' priority: above the Pallas ones (10) where jax-triton is
installed, the way forward since jax 0.11 deprecates Pallas' Triton backend; below
them where it is not (they could not launch), chosen then only by name."""


def _pallas_triton() -> list[Implementation]:
  """The Pallas (Triton backend) kernels, when this jax still has that backend."""
  if not _compat.has_pallas_triton():  # pragma: no cover - removed from jax
    return []
  from jact.kernels._division import pallas_triton as division
  from jact.kernels._float8 import pallas_triton as float8
  from jact.kernels._per_sample import pallas_triton as per_sample
  from jact.kernels._quantize import pallas_triton as quantize
  from jact.kernels._relu_mask import pallas_triton as relu_mask

  return [
    Implementation(op, "pallas_triton", fn, priority=10, **_GPU)
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


JAX_TRITON_KERNELS: tuple[tuple[str, str, str], ...] = (
  ("quantize", "jact.kernels._quantize.jax_triton", "quantize"),
  ("dequantize", "jact.kernels._quantize.jax_triton", "dequantize"),
  ("relu_mask", "jact.kernels._relu_mask.jax_triton", "relu_mask"),
  ("float8_compress", "jact.kernels._float8.jax_triton", "float8_compress"),
  ("division_compress", "jact.kernels._division.jax_triton", "division_compress"),
  ("quantize_per_sample", "jact.kernels._per_sample.jax_triton", "quantize_per_sample"),
  ("dequantize_per_sample", "jact.kernels._per_sample.jax_triton", "dequantize_per_sample"),
)
"""(op, module, function) of every kernel written in Triton's language and launched
with jax-triton. Each module imports `triton` and has a `PTX` dict: op -> a function
compiling the kernel for sm_90 on any host, with the op's arguments
(`tests/kernels/test_kernel_contract.py` checks it)."""


def _lazy(module: str, function: str) -> Callable:
  """`module.function`, imported (with `triton`) when first called."""

  def call(*args, **kwargs):
    return getattr(importlib.import_module(module), function)(*args, **kwargs)

  call.__name__ = call.__qualname__ = f"{function}_jax_triton"
  call.__doc__ = f"`{module}.{function}`, imported when first called."
  return call


def _jax_triton_kernels() -> list[Implementation]:
  """The kernels written in Triton's language and launched with jax-triton, when the
  `triton` package is installed (their interpreter runs them on any host)."""
  if importlib.util.find_spec("triton") is None:  # pragma: no cover
    return []
  return [
    Implementation(op, "jax_triton", _lazy(module, fn), priority=JAX_TRITON_PRIORITY, **_GPU)
    for op, module, fn in JAX_TRITON_KERNELS
  ]


KERNEL_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call")
"""The custom-call targets jact's GPU kernels lower to: Pallas' Triton calls, jax-triton's."""


_LAUNCH = re.compile(
  r'custom_call_target="(?:__gpu\$xla\.gpu\.triton|triton_kernel_call)"'  # compiled HLO
  r"|@(?:__gpu\$xla\.gpu\.triton|triton_kernel_call)\("  # lowered StableHLO
)


def kernel_launches(program_text: str) -> int:
  """How many of jact's GPU kernel calls (Pallas or jax-triton) a lowered or compiled
  program's text holds (`lowered.as_text()`, `compiled.as_text()`): custom calls to
  `KERNEL_CALL_TARGETS`, not mentions in metadata.

  >>> kernel_launches('custom_call_target="triton_kernel_call", op_name="triton_kernel_call"')
  1
  """
  return len(_LAUNCH.findall(program_text))


REGISTRY = Registry(_REFERENCES + _pallas_triton() + _jax_triton_kernels())
"""jact's kernel table (immutable; `REGISTRY.extended(...)` makes a new one)."""

available = REGISTRY.available
select = REGISTRY.select
dispatch = REGISTRY.dispatch
use = REGISTRY.use
lowering_for = REGISTRY.lowering_for
