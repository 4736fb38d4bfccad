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
bfloat16). Python ints among the operands are runtime scalars (`int32`): sizes
passed that way, not as `tl.constexpr`, let one compiled kernel serve every
call site of a shape class (jax-triton caches compiled kernels by their
constants and operand types).

Lowered for cuda on a host without a GPU (`jact.kernels.lowering_for("cuda")`,
a deviceless XLA:GPU compile), the kernels are compiled for compute capability
`TARGET_CAPABILITY` (9.0: H100, H200), which jax-triton cannot read from a device.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
import threading
import zlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jact import _compat

__all__ = [
  "call",
  "compile_ptx",
  "on_gpu",
  "operand_type",
  "flat_operand",
  "lowered_kernels",
  "TARGET_CAPABILITY",
]

TARGET_CAPABILITY = 90
"""The compute capability (major * 10 + minor) kernels are compiled for when
lowered for cuda on a host without a GPU."""

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


def operand_type(dtype):
  """The element type a kernel reads or writes `dtype` as (bfloat16 as its uint16 bits)."""
  return jnp.uint16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


def flat_operand(x: jax.Array) -> jax.Array:
  """`x` flattened as a kernel takes it (bfloat16 as its uint16 bits)."""
  flat = x.reshape(-1)
  return jax.lax.bitcast_convert_type(flat, jnp.uint16) if flat.dtype == jnp.bfloat16 else flat


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
    jax_triton = _import_jax_triton()
    capability = None if on_gpu() else TARGET_CAPABILITY  # deviceless: name the target
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
        compute_capability=capability,
        **constants,
      )
    )
  arrays = [i for i, a in enumerate(args) if not _is_scalar(a)]
  host = functools.partial(_interpret, kernel, grid, out_shape, constants, args, arrays)
  fills = () if initial is None else tuple(jnp.asarray(f) for f in initial)
  n = len(arrays)
  return tuple(
    jax.pure_callback(lambda *a: host(a[:n], a[n:]), out_shape, *(args[i] for i in arrays), *fills)
  )


def _is_scalar(a) -> bool:
  return isinstance(a, (int, float, np.integer, np.floating)) and not isinstance(a, bool)


def _import_jax_triton():
  """The `jax_triton` module, or an ImportError that says what to install."""
  try:
    jax_triton = _compat.import_jax_triton()
  except ModuleNotFoundError as e:  # pragma: no cover - a GPU machine without it
    raise ImportError(
      "the 'jax_triton' kernels need the jax-triton package: pip install -r "
      "requirements-gpu.txt (offline: pip install --no-index --no-deps "
      "gpu_data/wheels/jax_triton-*.whl, made by scripts/gpu_bundle.sh), or choose "
      "implementation='xla'"
    ) from e
  except ImportError as e:  # pragma: no cover - installed, but not for this jax/triton
    raise ImportError(
      f"jax-triton is installed but does not import with jax {jax.__version__}: {e}. "
      "requirements-gpu.txt pins the jax-triton that matches each jax; or choose "
      "implementation='xla'"
    ) from e
  return jax_triton


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


def _interpret(kernel, grid, out_shape, constants, args, arrays, inputs, fills):
  """Runs `kernel` in Triton's interpreter: `inputs` are the host values of
  `args`' arrays (at positions `arrays`), the other `args` scalars."""
  outs = [np.empty(o.shape, o.dtype) for o in out_shape]
  for out, fill in zip(outs, fills):
    out[...] = np.asarray(fill).astype(out.dtype)
  operands = list(args)
  for i, value in zip(arrays, inputs):
    operands[i] = _HostBuffer(np.array(value))
  buffers = [_HostBuffer(o) for o in outs]
  with _INTERPRET_LOCK, _jit_functions_interpreted(), np.errstate(over="ignore"):
    _interpreted(kernel.fn)[(grid,)](*operands, *buffers, **constants)  # uint32 hashing wraps
  return tuple(b.array.reshape(o.shape) for b, o in zip(buffers, out_shape))


def compile_ptx(
  kernel, arg_dtypes: Sequence, *, arch: int = 90, num_warps: int = 4, **constants
) -> str:
  """PTX of `kernel` compiled by the `triton` package for sm_`arch` on any host,
  with the launch settings `call` uses on a GPU (no contraction, one stage).
  `arg_dtypes` are the pointer arguments' element types, outputs included; "i32"
  stands for a runtime int scalar (a Python int operand of `call`)."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource

  names = kernel.arg_names
  signature = {
    n: t if t == "i32" else "*" + _TRITON_TYPES[str(jnp.dtype(t))]
    for n, t in zip(names, arg_dtypes)
  }
  signature.update({n: "constexpr" for n in constants})
  source = ASTSource(kernel, signature=signature, constexprs=dict(constants))
  with _triton_cache_dir():
    compiled = triton.compile(
      source,
      target=GPUTarget("cuda", arch, 32),
      options={"num_warps": num_warps, "num_stages": 1, "enable_fp_fusion": False},
    )
  return compiled.asm["ptx"]


@contextlib.contextmanager
def _triton_cache_dir():
  """A cache folder for `triton.compile`: importing jax-triton sets TRITON_CACHE_DIR to ""
  (it compiles without Triton's cache), after which `triton.compile` finds no folder and
  raises "Could not create or locate cache dir"."""
  if os.environ.get("TRITON_CACHE_DIR", None) != "":
    yield
    return
  os.environ["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), "jact-triton-cache")
  try:
    yield
  finally:
    os.environ["TRITON_CACHE_DIR"] = ""


_BACKEND_CONFIG = re.compile(r'@triton_kernel_call\(.*?backend_config = "((?:[^"\\]|\\.)*)"')


def _mlir_bytes(escaped: str) -> bytes:
  """The bytes of an MLIR string attribute as printed (`\\XX` hex escapes, `\\\\`, `\\"`)."""
  out, i = bytearray(), 0
  while i < len(escaped):
    if escaped[i] != "\\":
      out += escaped[i].encode()
      i += 1
    elif escaped[i + 1] in '\\"':
      out += escaped[i + 1].encode()
      i += 2
    else:
      out.append(int(escaped[i + 1 : i + 3], 16))
      i += 3
  return bytes(out)


def lowered_kernels(stablehlo: str) -> list[tuple[str, str]]:
  """(name, PTX) of each jax-triton kernel launch in a lowered program's text
  (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",)).as_text()`): jax-triton
  compiles the kernel while lowering and stores its name and PTX, zlib-compressed, in
  the `triton_kernel_call` custom call's backend config. A name is jact's `name=`
  (`jact_...`) where the launch has one, else the kernel function's name."""
  launches = []
  for escaped in _BACKEND_CONFIG.findall(stablehlo):
    config = zlib.decompress(_mlir_bytes(escaped))
    names = re.findall(rb"jact_[a-z0-9_]+", config)
    start = config.find(b"//\n// Generated by LLVM NVPTX")
    end = config.rfind(b"// -- End function")  # LLVM closes each function with it
    ptx = config[start:end].decode("ascii", "replace") if 0 <= start < end else ""
    launches.append((names[0].decode() if names else "?", ptx))
  return launches
