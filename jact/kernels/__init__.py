"""Kernel registry: an XLA reference for every op, GPU kernels when importable.

Each op name maps to implementations keyed by name. The `"xla"` reference is
always registered (it is the test oracle); the Pallas kernels
(`"pallas_triton"`, Triton backend) register themselves for GPUs, as does
a jax-triton kernel of "quantize" (`"jax_triton"`, chosen only when asked), and
`select` picks one by backend unless the caller (`implementation=`) or a
`use(...)` context asks for a specific implementation. Every implementation
of an op returns the same bits for the same inputs and seed. `dispatch`
returns what jact's ops call: a kernel chosen automatically is staged with
`lax.platform_dependent`, so it runs only where it is lowered for a platform
it supports (the Pallas kernels: cuda) and the reference runs everywhere else
-- a CPU device or host computation on a GPU machine, ROCm. A kernel forced
off GPU runs in interpret mode (slow: for tests). `jact.residual_report`
shows which kernel produced each residual.

Layout: one package per op family, the reference next to its kernels (as
tokamax's `ops/normalization/`), each with one module per implementation and
an `api` module holding the op's validated entry point:

* `quantize/`: ops "quantize" / "dequantize", per-group quantization;
  entry points `jact.kernels._quantize.api.quantize` / `dequantize`
  (`jact.quantize`, `jact.dequantize`);
* `per_sample/`: ops "quantize_per_sample" / "dequantize_per_sample", one
  width per sample in one static buffer (`jact._core.persample`);
* `relu_mask/`: op "relu_mask", ReLU / leaky ReLU output and its packed 1-bit
  mask (`jact.ops.relu`);
* `division/`: op "division_compress", DIVISION's pooled LFC and quantized
  HFC (`jact.compressors.Division`).

In each: `reference.py` (the "xla" implementation, every kernel's oracle),
`pallas_triton.py` (the "pallas_triton" kernel), `jax_triton.py` where one
exists ("jax_triton", quantize only) and `api.py` (the entry point: it
validates its arguments, then runs the implementation this table picks for
it; callers call that function, never the table by op name). The numerics
the implementations share stay in `jact._core` (`Packed`, `group_codes`,
`decode_groups`, pooling). Shared Triton pieces: `_triton.py` (Pallas) and
`_jax_triton.py` (the jax-triton launcher); `registry.py` is the generic
table (it imports nothing from jact); `api.py` re-exports the entry points.
This module builds the table (`REGISTRY`) from the references and kernels.
The op packages import nothing themselves, so the table imports their
modules without a cycle (an entry point imports this table, not the
reverse).

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
from jact.kernels._per_sample.reference import (dequantize_per_sample_reference,
                                               quantize_per_sample_reference)
from jact.kernels._quantize.reference import dequantize_reference, quantize_reference
from jact.kernels._registry import Implementation, Registry
from jact.kernels._relu_mask.reference import relu_mask_reference

__all__ = ["Implementation", "Registry", "REGISTRY", "available", "select", "dispatch", "use"]

_REFERENCES = [
    Implementation("quantize", "xla", quantize_reference),
    Implementation("dequantize", "xla", dequantize_reference),
    Implementation("relu_mask", "xla", relu_mask_reference),
    Implementation("quantize_per_sample", "xla", quantize_per_sample_reference),
    Implementation("dequantize_per_sample", "xla", dequantize_per_sample_reference),
    Implementation("division_compress", "xla", division_compress_reference),
]


def _pallas_triton() -> list[Implementation]:
  """The Pallas (Triton backend) kernels, when this jax has that backend."""
  try:
    from jax.experimental.pallas import triton as _  # noqa: F401
  except ImportError:  # a jax without Pallas' Triton backend: the references only  # pragma: no cover
    return []
  from jact.kernels._division import pallas_triton as division
  from jact.kernels._per_sample import pallas_triton as per_sample
  from jact.kernels._quantize import pallas_triton as quantize
  from jact.kernels._relu_mask import pallas_triton as relu_mask

  # inline PTX (`_triton.mul`, ...) makes them NVIDIA-only
  gpu = dict(platforms=("gpu",), priority=10, max_size=2**31 - 1, lowering_platforms=("cuda",))
  return [Implementation(op, "pallas_triton", fn, **gpu) for op, fn in [
      ("quantize", quantize.quantize),
      ("dequantize", quantize.dequantize),
      ("relu_mask", relu_mask.relu_mask),
      ("quantize_per_sample", per_sample.quantize_per_sample),
      ("dequantize_per_sample", per_sample.dequantize_per_sample),
      ("division_compress", division.division_compress)]]


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
  return [Implementation("quantize", "jax_triton", _quantize_jax_triton, platforms=("gpu",),
                         priority=5, max_size=2**31 - 1, lowering_platforms=("cuda",))]


REGISTRY = Registry(_REFERENCES + _pallas_triton() + _jax_triton_kernels())
"""jact's kernel table (immutable; `REGISTRY.extended(...)` makes a new one)."""

available = REGISTRY.available
select = REGISTRY.select
dispatch = REGISTRY.dispatch
use = REGISTRY.use
