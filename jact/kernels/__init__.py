"""Kernel registry: an XLA reference for every op, GPU kernels when importable.

Each op name maps to implementations keyed by name. The `"xla"` reference is
always registered (it is the test oracle); the Pallas kernels
(`"pallas_triton"`, Triton backend) register themselves for GPUs, and
`select` picks one by backend unless the caller (`implementation=`) or a
`use(...)` context asks for a specific implementation. Every implementation
of an op returns the same bits for the same inputs and seed. `dispatch`
returns what jact's ops call: a kernel chosen automatically is staged with
`lax.platform_dependent`, so it runs only where it is lowered for a platform
it supports (the Pallas kernels: cuda) and the reference runs everywhere else
-- a CPU device or host computation on a GPU machine, ROCm. A kernel forced
off GPU runs in interpret mode (slow: for tests). `jact.residual_report`
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
import numpy as np

from jact.quantize import dequantize_reference, quantize_reference

__all__ = ["Implementation", "register", "available", "select", "dispatch", "use"]


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
    lowering_platforms: the `lax.platform_dependent` platforms it can be
      lowered for ("cuda", ...); empty means every platform.
  """
  op: str
  name: str
  fn: Callable
  platforms: tuple[str, ...] = ()
  priority: int = 0
  max_size: int | None = None
  lowering_platforms: tuple[str, ...] = ()

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
  platform = platform or _backend()
  candidates = [i for i in impls.values() if i.supports(platform, size)]
  return max(candidates, key=lambda i: i.priority)


def _backend() -> str:
  return jax.default_backend()


def dispatch(op: str, implementation: str | None = None, size: int | None = None) -> Callable:
  """The callable jact's ops run for `op` (the reference's signature).

  An explicit `implementation` or a `use()` choice is returned as is. An
  automatic choice that lowers only for some platforms is staged: on each
  platform it supports it runs with `interpret=False`, anywhere else the XLA
  reference runs. The choice is made when the computation is lowered, not
  from the default backend at trace time. (Lowering for several platforms at
  once, e.g. `jax.export` to cuda and cpu, fails: a Pallas call has no
  compiled CPU lowering; force `implementation="xla"` there.)
  """
  impl = select(op, implementation, size=size)
  forced = implementation is not None or op in _OVERRIDES.get()
  if forced or not impl.lowering_platforms:
    return impl.fn
  return _staged(impl, available(op)["xla"])


def _is_arrays(value) -> bool:
  leaves = jax.tree.leaves(value)
  return bool(leaves) and all(isinstance(v, (jax.Array, np.ndarray, np.generic)) for v in leaves)


def _staged(kernel: Implementation, reference: Implementation) -> Callable:
  """`kernel.fn` on its lowering platforms, `reference.fn` elsewhere; arguments
  that hold arrays are traced operands, the others stay static."""
  def run(*args, **kwargs):
    positions = [i for i, a in enumerate(args) if _is_arrays(a)]
    names = [k for k, v in kwargs.items() if _is_arrays(v)]

    def branch(fn, **extra):
      def call(dynamic_args, dynamic_kwargs):
        full = list(args)
        for i, a in zip(positions, dynamic_args):
          full[i] = a
        return fn(*full, **{**kwargs, **dynamic_kwargs, **extra})
      return call

    per_platform = {p: branch(kernel.fn, interpret=False) for p in kernel.lowering_platforms}
    return jax.lax.platform_dependent([args[i] for i in positions], {k: kwargs[k] for k in names},
                                      default=branch(reference.fn), **per_platform)
  run.__name__ = f"{kernel.op}_{kernel.name}_or_{reference.name}"
  return run


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
  # inline PTX (`_triton.mul`, ...) makes them NVIDIA-only
  _GPU = dict(platforms=("gpu",), priority=10, max_size=2**31 - 1, lowering_platforms=("cuda",))
  for _op, _module, _name in [
      ("quantize", "jact.kernels.pergroup", "quantize"),
      ("dequantize", "jact.kernels.pergroup", "dequantize"),
      ("relu_mask", "jact.kernels.relu", "relu_mask"),
      ("quantize_per_sample", "jact.kernels.persample", "quantize_per_sample"),
      ("dequantize_per_sample", "jact.kernels.persample", "dequantize_per_sample"),
      ("division_compress", "jact.kernels.division", "division_compress")]:
    register(Implementation(_op, "pallas_triton", _lazy(_module, _name), **_GPU))
