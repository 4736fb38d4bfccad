"""Launching a Triton kernel written in Triton's own language from JAX.

On a GPU, `call` is `jax_triton.triton_call` with floating-point contraction
off (`enable_fp_fusion=False`: a multiply feeding an add stays two correctly
rounded operations, as in the XLA reference; division is written `tl.div_rn`).
Off GPU (`interpret=True`) the same kernel runs in Triton's interpreter on
host copies of the operands, inside `jax.pure_callback`: slow, for tests.
`compile_ptx` compiles a kernel for an NVIDIA architecture on any host (the
`triton` package carries its own compiler), which is what can be checked of
the GPU path on a machine without one.

Operands are float32/float16/uint8/uint16/uint32/int32 arrays; a kernel that
reads bfloat16 takes its bits as uint16 (numpy, and so the interpreter, has no
bfloat16).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["call", "compile_ptx", "on_gpu"]

_TRITON_TYPES = {
  "float32": "fp32",
  "float16": "fp16",
  "uint8": "u8",
  "uint16": "u16",
  "uint32": "u32",
  "int32": "i32",
}


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def call(
  kernel,
  *args: jax.Array,
  grid: int,
  out_shape: Sequence[jax.ShapeDtypeStruct],
  name: str,
  interpret: bool,
  num_warps: int = 4,
  initial: Sequence[Any] | None = None,
  **constants,
) -> tuple[jax.Array, ...]:
  """Runs the `@triton.jit` `kernel` over a 1-D `grid`: its pointer arguments
  are `args` then one per output of `out_shape`, its `tl.constexpr` ones
  `constants`. `initial` (host/CPU path only) fills the outputs before the
  kernel runs (the kernel contract tests pass garbage: a kernel must write
  every output element)."""
  out_shape = tuple(out_shape)
  if not interpret:
    if initial is not None:
      raise ValueError("`initial` outputs are for interpret mode (tests) only")
    try:
      import jax_triton
    except ImportError as e:  # pragma: no cover - GPU only
      raise ImportError(
        "the 'jax_triton' kernels need jax-triton on a CUDA jax: "
        "pip install 'jax-triton>=0.3.1' (or choose implementation='pallas_triton')"
      ) from e
    return tuple(
      jax_triton.triton_call(
        *args,
        kernel=kernel,
        out_shape=out_shape,
        grid=(grid,),
        name=name,
        num_warps=num_warps,
        num_stages=1,
        enable_fp_fusion=False,
        **constants,
      )
    )
  host = functools.partial(_interpret, kernel, grid, out_shape, constants)
  fills = () if initial is None else tuple(jnp.asarray(f) for f in initial)
  return tuple(
    jax.pure_callback(lambda *a: host(a[: len(args)], a[len(args) :]), out_shape, *args, *fills)
  )


class _HostBuffer:
  """A numpy array as Triton's interpreter takes a tensor (it reads a torch-like
  interface; every view of the array is the array itself)."""

  def __init__(self, array: np.ndarray):
    self.array = np.ascontiguousarray(array)
    self.dtype = f"torch.{self.array.dtype}"

  def data_ptr(self) -> int:
    return self.array.ctypes.data

  def untyped_storage(self):
    return self

  def cpu(self):
    return self

  def new_empty(self, *_, **__):
    return self

  def set_(self, *_):
    return self

  def storage_offset(self) -> int:
    return 0

  def size(self):
    return self.array.shape

  def stride(self):
    return tuple(s // self.array.itemsize for s in self.array.strides)

  def copy_(self, _):
    return self


@functools.lru_cache(maxsize=None)
def _interpreted(fn):
  from triton.runtime.interpreter import InterpretedFunction

  return InterpretedFunction(fn)


@contextlib.contextmanager
def _jit_functions_interpreted():
  """Triton's interpreter runs `@triton.jit` functions called from a kernel (its
  standard library's `tl.sum`, `tl.max`, ...) only when the whole process
  interprets (TRITON_INTERPRET=1 before `triton` is imported, which would stop
  compiled kernels); here they are interpreted while one kernel runs."""
  from triton.runtime import interpreter
  from triton.runtime.jit import JITFunction

  def device_call(self, *args, **kwargs):
    # What InterpretedFunction.__call__ does, except that it leaves triton.language
    # patched for the interpreter, which breaks every later compilation in the process.
    scope = interpreter._patch_lang(self.fn)  # noqa: SLF001
    try:
      return _interpreted(self.fn).rewrite()(*args, **kwargs)
    finally:
      scope.restore()

  compiled_call = JITFunction.__call__
  JITFunction.__call__ = device_call
  try:
    yield
  finally:
    JITFunction.__call__ = compiled_call


_INTERPRET_LOCK = threading.Lock()  # the patch above is process-wide


def _interpret(kernel, grid, out_shape, constants, args, fills):
  outs = [np.empty(o.shape, o.dtype) for o in out_shape]
  for out, fill in zip(outs, fills):
    out[...] = np.asarray(fill).astype(out.dtype)
  buffers = [_HostBuffer(np.array(a)) for a in args] + [_HostBuffer(o) for o in outs]
  with _INTERPRET_LOCK, _jit_functions_interpreted(), np.errstate(over="ignore"):
    _interpreted(kernel.fn)[(grid,)](*buffers, **constants)  # uint32 hashing wraps, as on a GPU
  return tuple(b.array.reshape(o.shape) for b, o in zip(buffers[len(args) :], out_shape))


def compile_ptx(
  kernel, arg_dtypes: Sequence, *, arch: int = 90, num_warps: int = 4, **constants
) -> str:
  """PTX of `kernel` compiled by the `triton` package for sm_`arch` on any host,
  with the launch settings `call` uses on a GPU (no contraction, one stage).
  `arg_dtypes` are the pointer arguments' element types, outputs included."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource

  names = kernel.arg_names
  signature = {n: "*" + _TRITON_TYPES[str(jnp.dtype(t))] for n, t in zip(names, arg_dtypes)}
  signature.update({n: "constexpr" for n in constants})
  source = ASTSource(kernel, signature=signature, constexprs=dict(constants))
  compiled = triton.compile(
    source,
    target=GPUTarget("cuda", arch, 32),
    options={"num_warps": num_warps, "num_stages": 1, "enable_fp_fusion": False},
  )
  return compiled.asm["ptx"]
