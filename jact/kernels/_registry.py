"""A kernel registry: an immutable table of implementations per op, with
selection by platform, size and priority, and staging by lowering platform.

This module imports nothing from jact; `jact.kernels` builds jact's table.

>>> import jax.numpy as jnp
>>> table = Registry([Implementation("double", "xla", lambda x: 2 * x),
...                   Implementation("double", "fast", lambda x: x + x, platforms=("gpu",),
...                                  priority=10)])
>>> table.select("double", platform="cpu").name, table.select("double", platform="gpu").name
('xla', 'fast')
>>> with table.use(double="fast"):
...   table.select("double", platform="cpu").name
'fast'

Kernels are chosen for the platform a program is lowered for: `dispatch` stages
the kernel with `lax.platform_dependent`. On a GPU that is automatic; on a host
without one, `lowering_for("cuda")` stages them too, for a program that will be
lowered for cuda (a deviceless XLA:GPU compile, an export):

>>> table = Registry([Implementation("double", "xla", lambda x: 2 * x),
...                   Implementation("double", "fast", lambda x, interpret=True: x + x,
...                                  platforms=("gpu",), priority=10,
...                                  lowering_platforms=("cuda",))])
>>> table.dispatch("double").__name__                      # on this CPU: the reference
'<lambda>'
>>> with table.lowering_for("cuda"):
...   table.dispatch("double").__name__
'double_fast_or_xla'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import types
from typing import Callable, Iterable, Iterator, Mapping

import jax
import numpy as np

__all__ = ["Implementation", "Registry"]

_IDS = itertools.count()


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of an op.

  Attributes:
    op: the op it implements ("quantize", "dequantize", ...).
    name: its name ("xla", "jax_triton", "pallas_triton", ...).
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
    return self.takes(size)

  def takes(self, size: int | None) -> bool:
    """Takes an input of `size` elements (None: any), whatever the platform."""
    return size is None or self.max_size is None or size <= self.max_size


def _backend() -> str:
  return jax.default_backend()


class Registry:
  """An immutable table op -> {name: Implementation}; every op has an "xla"
  reference, which empty inputs and staged kernels fall back to.

  `extended(*implementations)` returns a new table (the original is never
  changed); `use(op=name)` chooses implementations for the current context.
  """

  def __init__(self, implementations: Iterable[Implementation]):
    table: dict[str, dict[str, Implementation]] = {}
    for impl in implementations:
      table.setdefault(impl.op, {})[impl.name] = impl
    for op, impls in table.items():
      if "xla" not in impls:
        raise ValueError(f"op {op!r} has no 'xla' reference implementation; register one first")
    self._implementations = tuple(i for impls in table.values() for i in impls.values())
    self._table = types.MappingProxyType(
      {op: types.MappingProxyType(dict(impls)) for op, impls in table.items()}
    )
    self._choices: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar(
      f"jact_kernel_choices_{next(_IDS)}", default=types.MappingProxyType({})
    )
    self._targets: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
      f"jact_kernel_targets_{next(_IDS)}", default=()
    )

  @property
  def ops(self) -> tuple[str, ...]:
    """The op names, sorted."""
    return tuple(sorted(self._table))

  def extended(self, *implementations: Implementation) -> "Registry":
    """A new table with `implementations` added (replacing same-named ones)."""
    return Registry(self._implementations + implementations)

  def available(self, op: str) -> Mapping[str, Implementation]:
    """Implementations of `op`, by name (read-only)."""
    if op not in self._table:
      raise KeyError(f"no kernels registered for op {op!r}; known ops: {sorted(self._table)}")
    return self._table[op]

  def select(
    self,
    op: str,
    implementation: str | None = None,
    platform: str | None = None,
    size: int | None = None,
  ) -> Implementation:
    """The implementation to use for `op`: the explicit one, the `use()` one, or
    the highest-priority one supporting the platform (default: jax's backend)
    and an input of `size` elements. Empty inputs always use the reference."""
    impls = self.available(op)
    if size == 0:
      return impls["xla"]
    name = implementation or self._choices.get().get(op)
    if name is not None:
      if name not in impls:
        raise ValueError(f"unknown implementation {name!r} for {op!r}; available: {sorted(impls)}")
      return impls[name]
    platform = platform or _backend()
    candidates = [i for i in impls.values() if i.supports(platform, size)]
    return max(candidates, key=lambda i: i.priority)

  def dispatch(
    self, op: str, implementation: str | None = None, size: int | None = None
  ) -> Callable:
    """The callable to run for `op` (the reference's signature).

    An explicit `implementation` or a `use()` choice is returned as is. An
    automatic choice that lowers only for some platforms is staged: on each
    platform it supports it runs with `interpret=False`, anywhere else the XLA
    reference runs. On a host without the kernel's backend the trace holds the
    reference alone, unless inside `lowering_for(platform)`, which stages the
    kernel whatever the trace-time backend. (Lowering for several platforms at
    once, e.g. `jax.export` to cuda and cpu, fails: a Pallas call has no
    compiled CPU lowering; force `implementation="xla"` there.)
    """
    impl = self.select(op, implementation, size=size)
    forced = implementation is not None or op in self._choices.get()
    if forced:
      return impl.fn
    if self._targets.get() and size != 0:
      impl = self._for_targets(op, size) or impl
    if not impl.lowering_platforms:
      return impl.fn
    return _staged(impl, self.available(op)["xla"])

  def _for_targets(self, op: str, size: int | None) -> Implementation | None:
    """The highest-priority kernel of `op` lowering for a `lowering_for` platform, whatever
    the trace-time backend."""
    targets = set(self._targets.get())
    candidates = [
      i
      for i in self.available(op).values()
      if targets & set(i.lowering_platforms) and i.takes(size)
    ]
    return max(candidates, key=lambda i: i.priority) if candidates else None

  def lowering_targets(self) -> tuple[str, ...]:
    """The platforms of the enclosing `lowering_for` contexts (empty outside them)."""
    return self._targets.get()

  @contextlib.contextmanager
  def lowering_for(self, *platforms: str) -> Iterator[None]:
    """Context in which automatic choices stage the kernels that lower for
    `platforms` ("cuda", ...) even where the trace-time backend has none, so a
    program traced on a CPU and lowered for cuda holds the GPU kernels.

    Outside it a CPU trace holds the reference only: staging traces both
    branches (about twice a quantize's trace time), which CPU programs would pay
    for nothing. JAX caches traces by function and shapes, not by this context:
    trace a function here that was not traced outside it (`jact.compile_for`
    makes sure of that)."""
    known = ("cpu", "cuda", "rocm", "tpu")
    unknown = [p for p in platforms if p not in known]
    if unknown or not platforms:
      raise ValueError(f"lowering_for takes platforms among {known}, got {platforms!r}")
    token = self._targets.set(tuple(dict.fromkeys(self._targets.get() + platforms)))
    try:
      yield
    finally:
      self._targets.reset(token)

  @contextlib.contextmanager
  def use(self, **choices: str) -> Iterator[None]:
    """Context in which `select(op)` returns the named implementation (`use(quantize="xla")`)."""
    for op, name in choices.items():
      if name not in self.available(op):
        raise ValueError(
          f"unknown implementation {name!r} for {op!r}; available: {sorted(self.available(op))}"
        )
    token = self._choices.set(types.MappingProxyType({**self._choices.get(), **choices}))
    try:
      yield
    finally:
      self._choices.reset(token)


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
    return jax.lax.platform_dependent(
      [args[i] for i in positions],
      {k: kwargs[k] for k in names},
      default=branch(reference.fn),
      **per_platform,
    )

  run.__name__ = f"{kernel.op}_{kernel.name}_or_{reference.name}"
  return run
