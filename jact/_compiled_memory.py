"""`compiled_memory`: XLA's own buffer sizes for a compiled function.

`temp_bytes` is the scratch memory the compiled program needs besides its arguments and outputs:
the figure that decides whether a step fits. It lowers and compiles only; on CPU a peak or device
statistic would be meaningless and is not reported.

>>> import jax, jax.numpy as jnp
>>> m = compiled_memory(lambda x: 2 * x, jax.ShapeDtypeStruct((1024,), jnp.float32))
>>> m.output_bytes
4096
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax

from jact._gpu_target import compile_for
from jact._report import _check_callable, _over_traceable_leaves, format_bytes

__all__ = ["CompiledMemory", "compiled_memory"]


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """XLA's buffer sizes for one compiled function (bytes).

  Attributes:
    temp_bytes: scratch memory besides arguments and outputs.
    argument_bytes: the arguments' buffers.
    output_bytes: the outputs' buffers.
    alias_bytes: outputs that reuse (donated) argument buffers.
    generated_code_bytes: size of the generated code.
  """

  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  generated_code_bytes: int

  def __str__(self) -> str:
    fields = [
      ("temp", self.temp_bytes),
      ("arguments", self.argument_bytes),
      ("outputs", self.output_bytes),
      ("aliased", self.alias_bytes),
      ("code", self.generated_code_bytes),
    ]
    return "\n".join(f"{k:<10} {format_bytes(v):>12}" for k, v in fields)


def compiled_memory(
  fn: Callable[..., Any],
  *args: Any,
  static_argnums: int | Sequence[int] = (),
  in_shardings: Any = None,
  out_shardings: Any = None,
  target: Any = None,
  **kwargs: Any,
) -> CompiledMemory:
  """Compiles `jax.jit(fn, static_argnums=...)` for `args` and reports its buffers.

  Lowers and compiles only -- nothing runs and, with `jax.ShapeDtypeStruct`
  arguments, nothing is allocated, so tensors larger than the machine's
  memory can be measured. The figures are one device's: with sharded
  arguments (sharded arrays, `ShapeDtypeStruct(..., sharding=...)` or
  `in_shardings`) they are per device.

  Args:
    fn: the function (e.g. a whole training step).
    args, kwargs: arrays, `jax.ShapeDtypeStruct`s or pytrees of them;
      positions in `static_argnums` are hashable Python values. Without
      `static_argnums` and `in_shardings`, leaves that are not arrays (an
      Equinox module's functions and flags) are held fixed, as
      `equinox.filter_jit` holds them.
    static_argnums: as for `jax.jit`.
    in_shardings, out_shardings: as for `jax.jit` (left to jit when None).
    target: None (this machine's backend), or a GPU to compile for on any
      machine, "h100", "h200" or a `jact.GpuTarget`: XLA:GPU's figures, the
      ones that decide whether a step fits there (`jact.compile_for`; XLA:CPU
      does not realize what `jax.checkpoint` saves). Single-device only.

  Returns:
    A `CompiledMemory`.

  >>> import jax, jax.numpy as jnp
  >>> big = jax.ShapeDtypeStruct((2**16, 2**16), jnp.float32)   # 16 GiB, never allocated
  >>> m = compiled_memory(lambda x: x.sum(0), big)
  >>> m.argument_bytes == 2**34, m.output_bytes == 2**18
  (True, True)
  """
  _check_callable(fn, "compiled_memory")
  if target is not None:
    if in_shardings is not None or out_shardings is not None:
      raise ValueError(
        "compiled_memory(target=...) compiles for one GPU; pass no in_shardings/out_shardings "
        "(measure sharded steps on this machine's devices, target=None)"
      )
    return memory_of(compile_for(fn, *args, target=target, static_argnums=static_argnums, **kwargs))
  shardings = {
    name: value
    for name, value in (("in_shardings", in_shardings), ("out_shardings", out_shardings))
    if value is not None
  }
  if not shardings and static_argnums == ():
    fn, args, kwargs = _over_traceable_leaves(fn, args, kwargs)
  compiled = (
    jax.jit(fn, static_argnums=static_argnums, **shardings).lower(*args, **kwargs).compile()
  )
  return memory_of(compiled)


def memory_of(compiled: jax.stages.Compiled) -> CompiledMemory:
  """The `CompiledMemory` of an already compiled function."""
  stats = compiled.memory_analysis()
  if stats is None:
    raise RuntimeError(
      f"the {jax.default_backend()!r} backend gives no memory analysis for compiled "
      "functions; measure on CPU or GPU, or use residual_report for saved bytes."
    )
  return CompiledMemory(
    temp_bytes=int(stats.temp_size_in_bytes),
    argument_bytes=int(stats.argument_size_in_bytes),
    output_bytes=int(stats.output_size_in_bytes),
    alias_bytes=int(stats.alias_size_in_bytes),
    generated_code_bytes=int(stats.generated_code_size_in_bytes),
  )
