"""Kernel registry: an XLA reference for every op, GPU kernels when importable.

Each op name maps to implementations keyed by name. The `"xla"` reference is
always registered (it is the test oracle); faster kernels register themselves
for the platforms they support, and `select` picks one by backend unless the
caller or a `use(...)` context asks for a specific implementation.

>>> import jax
>>> from jact import kernels
>>> sorted(kernels.available("quantize"))
['xla']
>>> kernels.select("quantize").name
'xla'
>>> with kernels.use(quantize="xla"):
...   kernels.select("quantize").name
'xla'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Iterator

import jax

from jact.quantize import dequantize, quantize

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
  """
  op: str
  name: str
  fn: Callable
  platforms: tuple[str, ...] = ()
  priority: int = 0

  def supports(self, platform: str) -> bool:
    return not self.platforms or platform in self.platforms


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


def select(op: str, implementation: str | None = None, platform: str | None = None) -> Implementation:
  """The implementation to use for `op`: the explicit one, the `use()` one, or
  the highest-priority one supporting the platform (default: jax's backend)."""
  impls = available(op)
  name = implementation or _OVERRIDES.get().get(op)
  if name is not None:
    if name not in impls:
      raise ValueError(f"unknown implementation {name!r} for {op!r}; available: {sorted(impls)}")
    return impls[name]
  platform = platform or jax.default_backend()
  candidates = [i for i in impls.values() if i.supports(platform)]
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


register(Implementation("quantize", "xla", quantize))
register(Implementation("dequantize", "xla", dequantize))
