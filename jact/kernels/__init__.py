"""Kernel registry: an XLA reference for every op, GPU kernels when importable.

Each op name maps to implementations keyed by name. The `"xla"` reference is
always registered (it is the test oracle); the Pallas kernels
(`"pallas_triton"`, Triton backend) register themselves for GPUs, and
`select` picks one by backend unless the caller (`implementation=`) or a
`use(...)` context asks for a specific implementation. Every implementation
of an op returns the same bits for the same inputs and seed. Off GPU a Pallas
kernel runs in interpret mode (slow: for tests). `jact.residual_report`
shows which kernel produced each residual.

Ops (each implementation takes the reference's arguments):

* "quantize" / "dequantize": per-group quantization (`jact.quantize`);
* "relu_mask": ReLU / leaky ReLU output and its packed 1-bit mask;
* "quantize_per_sample" / "dequantize_per_sample": one width per sample in
  one static buffer (`jact.persample`);
* "division_compress": DIVISION's pooled LFC and quantized HFC
  (`jact.compressors.Division`).

>>> import jax
>>> from jact import kernels
>>> sorted(kernels.available("quantize"))
['pallas_triton', 'xla']
>>> kernels.select("quantize").name
'xla'
>>> with kernels.use(quantize="xla"):
...   kernels.select("quantize").name
'xla'
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import dataclasses
from typing import Callable, Iterator

import jax

from jact.quantize import dequantize_reference, quantize_reference

__all__ = ["Implementation", "register", "available", "select", "use"]


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of an op.

  Attributes:
    op: the op it implements ("quantize", "dequantize", ...).
    name: its name ("xla", "pallas_triton", ...).
    fn: the callable, with the reference's signature.
    platforms: backends it runs on (`jax.default_backend()` values); empty
      means every backend.
    priority: higher wins when several apply.
    max_size: largest input (elements) it handles, or None (no limit).
  """
  op: str
  name: str
  fn: Callable
  platforms: tuple[str, ...] = ()
  priority: int = 0
  max_size: int | None = None

  def supports(self, platform: str, size: int | None = None) -> bool:
    """Runs on `platform` and takes an input of `size` elements (None: any)."""
    if self.platforms and platform not in self.platforms:
      return False
    return size is None or self.max_size is None or size <= self.max_size


_REGISTRY: dict[str, dict[str, Implementation]] = {}
_OVERRIDES: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("jact_kernels", default={})


def register(impl: Implementation) -> Implementation:
  """Adds (or replaces) an implementation."""
  _REGISTRY.setdefault(impl.op, {})[impl.name] = impl
  return impl


def available(op: str) -> dict[str, Implementation]:
  """Implementations registered for `op`."""
  if op not in _REGISTRY:
    raise KeyError(f"no kernels registered for op {op!r}; known ops: {sorted(_REGISTRY)}")
  return dict(_REGISTRY[op])


def select(op: str, implementation: str | None = None, platform: str | None = None,
           size: int | None = None) -> Implementation:
  """The implementation to use for `op`: the explicit one, the `use()` one, or
  the highest-priority one supporting the platform (default: jax's backend)
  and an input of `size` elements. Empty inputs always use the reference."""
  impls = available(op)
  if size == 0:
    return impls["xla"]
  name = implementation or _OVERRIDES.get().get(op)
  if name is not None:
    if name not in impls:
      raise ValueError(f"unknown implementation {name!r} for {op!r}; available: {sorted(impls)}")
    return impls[name]
  platform = platform or jax.default_backend()
  candidates = [i for i in impls.values() if i.supports(platform, size)]
  return max(candidates, key=lambda i: i.priority)


@contextlib.contextmanager
def use(**choices: str) -> Iterator[None]:
  """Context in which `select(op)` returns the named implementation, e.g. `use(quantize="xla")`."""
  for op, name in choices.items():
    if name not in available(op):
      raise ValueError(f"unknown implementation {name!r} for {op!r}; available: {sorted(available(op))}")
  token = _OVERRIDES.set({**_OVERRIDES.get(), **choices})
  try:
    yield
  finally:
    _OVERRIDES.reset(token)


def _lazy(module: str, name: str) -> Callable:
  """`module.name`, imported at the first call (modules that import this one)."""
  def fn(*args, **kwargs):
    return getattr(importlib.import_module(module), name)(*args, **kwargs)
  fn.__name__ = fn.__qualname__ = name
  fn.__module__ = module
  return fn


register(Implementation("quantize", "xla", quantize_reference))
register(Implementation("dequantize", "xla", dequantize_reference))
register(Implementation("relu_mask", "xla", _lazy("jact.ops.activation", "relu_mask_reference")))
register(Implementation("quantize_per_sample", "xla",
                        _lazy("jact.persample", "quantize_per_sample_reference")))
register(Implementation("dequantize_per_sample", "xla",
                        _lazy("jact.persample", "dequantize_per_sample_reference")))
register(Implementation("division_compress", "xla",
                        _lazy("jact.compressors.division", "division_compress_reference")))

try:
  from jax.experimental.pallas import triton as _pltriton  # noqa: F401
except ImportError:  # a jax without Pallas' Triton backend: the references only  # pragma: no cover
  _pltriton = None

if _pltriton is not None:
  _GPU = dict(platforms=("gpu",), priority=10, max_size=2**31 - 1)
  for _op, _module, _name in [
      ("quantize", "jact.kernels.pergroup", "quantize"),
      ("dequantize", "jact.kernels.pergroup", "dequantize"),
      ("relu_mask", "jact.kernels.relu", "relu_mask"),
      ("quantize_per_sample", "jact.kernels.persample", "quantize_per_sample"),
      ("dequantize_per_sample", "jact.kernels.persample", "dequantize_per_sample"),
      ("division_compress", "jact.kernels.division", "division_compress")]:
    register(Implementation(_op, "pallas_triton", _lazy(_module, _name), **_GPU))
