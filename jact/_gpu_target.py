"""Compiling a step for a GPU that is not there: XLA:GPU's own memory figures on any machine.

XLA:CPU does not realize what `jax.checkpoint` saves (it CSEs the recomputation
with the forward), so memory comparisons that matter to GPU users are made on
XLA:GPU's program. `compile_for(fn, *args, target="h200")` runs XLA:GPU's whole
pipeline -- fusion, scheduling, buffer assignment -- for an H100 or H200 on a
machine without a GPU (it needs the CUDA PJRT plugin of the installed jax:
`pip install "jax[cuda12-local]==<jax version>"`, or jact's `gpu-aot` extra);
`compiled_memory(..., target="h200")` reports that program's buffers. jact's GPU
kernels are staged into the program (`jact.kernels.lowering_for("cuda")`), and
JAX's cuDNN fused attention traces for the target's cuDNN, so it is the program a
GPU would run.

>>> import jax, jax.numpy as jnp
>>> gpu_target("h200").memory_bandwidth
4800000000000.0
>>> compiled = compile_for(lambda x: jnp.tanh(x).sum(), jax.ShapeDtypeStruct((1024,), jnp.float32),
...                        target="h200")                                      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jact import kernels
from jact import _compat
from jact._report import _check_callable, _over_traceable_leaves

__all__ = ["GpuTarget", "gpu_target", "compile_for", "GpuCompilerMissing"]


class GpuCompilerMissing(RuntimeError):
  """XLA:GPU cannot compile here: the CUDA PJRT plugin of the installed jax is missing."""


def install_hint() -> str:
  """The command that installs the CUDA plugin matching the installed jax."""
  return (
    f'pip install "jax[cuda12-local]=={jax.__version__}" (the CUDA 12 PJRT plugin of jax '
    f'{jax.__version__}; no NVIDIA libraries), or pip install -e ".[gpu-aot]" in a jact checkout'
  )


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """A GPU to compile for, and the peaks a roofline needs.

  Attributes:
    name: the short name ("h100", "h200").
    device_kind: what `jax.devices()[0].device_kind` says on that GPU.
    config: XLA's `GpuTargetConfig` text proto (compute capability, SMs, memory, cuDNN).
    memory_bytes: device memory.
    memory_bandwidth: HBM bytes per second (the datasheet's).
    matmul_flops: dense bf16/f16 tensor-core FLOP/s (the datasheet's).
    tf32_flops: dense tf32 tensor-core FLOP/s (float32 matmuls at XLA's default precision).
    vector_flops: float32 FLOP/s off the tensor cores.
    host_memory: whether the target has host memory to offload to.
  """

  name: str
  device_kind: str
  config: str
  memory_bytes: int
  memory_bandwidth: float
  matmul_flops: float
  tf32_flops: float
  vector_flops: float
  host_memory: bool = True

  @property
  def cudnn_version(self) -> int:
    """The target's cuDNN version as cuDNN numbers it (9.7 -> 90700)."""
    info = self.config.split("dnn_version_info")[1].split("}")[0]
    field = lambda name: int(info.split(f"{name}:")[1].split()[0]) if f"{name}:" in info else 0
    return field("major") * 10000 + field("minor") * 100 + field("patch")

  def devices(self) -> tuple:
    """Compile-only devices of this target (one GPU); raises `GpuCompilerMissing` with the fix."""
    try:
      return _compat.cuda_devices(self.config)
    except ModuleNotFoundError as e:
      raise GpuCompilerMissing(
        f"compiling for {self.name!r} needs the CUDA PJRT plugin of jax {jax.__version__}, "
        f"which is not installed: {install_hint()}"
      ) from e
    except NotImplementedError as e:
      raise GpuCompilerMissing(
        f"the installed CUDA PJRT plugin gives no compile-only {self.name!r} ({e}); it must "
        f"match jax {jax.__version__}: {install_hint()}"
      ) from e

  def mesh(self, axis_name: str = "gpu") -> Mesh:
    """A one-device mesh of this target's compile-only device."""
    return Mesh(self.devices(), (axis_name,))


def _config(name: str) -> str:
  return importlib.resources.files("jact._gpu_targets").joinpath(f"{name}.pbtxt").read_text()


# H100 SXM5 and H200 SXM: the same GH100 die (132 SMs, sm_90, 50 MB L2), HBM3 at 3.35 TB/s
# (80 GB) and HBM3e at 4.8 TB/s (141 GB); NVIDIA's datasheet peaks, dense (no sparsity).
_GH100 = dict(matmul_flops=989e12, tf32_flops=494.5e12, vector_flops=66.9e12)
_TARGETS = {
  "h100": dict(device_kind="NVIDIA H100 80GB HBM3", memory_bandwidth=3.35e12, **_GH100),
  "h200": dict(device_kind="NVIDIA H200", memory_bandwidth=4.8e12, **_GH100),
}


def gpu_target(name: str | GpuTarget) -> GpuTarget:
  """The `GpuTarget` named `name` ("h100" or "h200"); a `GpuTarget` is returned as is."""
  if isinstance(name, GpuTarget):
    return name
  key = str(name).lower()
  if key not in _TARGETS:
    raise ValueError(f"unknown GPU target {name!r}; known targets: {sorted(_TARGETS)}")
  return _named(key)


@functools.lru_cache(maxsize=None)
def _named(key: str) -> GpuTarget:
  config = _config(key)
  memory = int(config.split("device_memory_size:")[1].split()[0])
  return GpuTarget(name=key, config=config, memory_bytes=memory, **_TARGETS[key])


def _on_target(value: Any, sharding: NamedSharding) -> Any:
  if isinstance(value, (jax.Array, jax.ShapeDtypeStruct)) or hasattr(value, "dtype"):
    own = getattr(value, "sharding", None)
    if own is not None and len(getattr(own, "device_set", ())) > 1:
      raise ValueError(
        "jact.compile_for compiles for one GPU, but an argument is sharded over "
        f"{len(own.device_set)} devices; pass unsharded arguments (one device's step), or "
        "measure the sharded step on this machine's devices (jact.compiled_memory, target=None)"
      )
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
  return value


def compile_for(
  fn: Callable[..., Any],
  *args: Any,
  target: str | GpuTarget = "h200",
  static_argnums: int | Sequence[int] = (),
  compiler_options: dict[str, Any] | None = None,
  **kwargs: Any,
) -> jax.stages.Compiled:
  """`jax.jit(fn)` compiled by XLA:GPU for `target`, on any machine (nothing runs).

  Array arguments count by shape and dtype only (arrays or
  `jax.ShapeDtypeStruct` values; other leaves are held fixed, as in
  `compiled_memory`). jact's GPU kernels are staged into the program, so a
  jact step compiles as it would on that GPU.

  Args:
    fn: the function (e.g. a whole training step).
    args, kwargs: arrays, `jax.ShapeDtypeStruct` values or pytrees of them.
    target: "h100", "h200" or a `GpuTarget`.
    static_argnums: as for `jax.jit`.
    compiler_options: XLA:GPU options for this compile, e.g.
      `{"xla_gpu_enable_triton_gemm": False}` (cuBLAS for every matmul: without a
      GPU to autotune on, XLA's Triton gemm tiling can fail on odd shapes,
      "Couldn't find output tile sizes").

  Returns:
    The `jax.stages.Compiled`: `.memory_analysis()`, `.as_text()` (XLA:GPU's scheduled HLO).

  Raises:
    GpuCompilerMissing: the CUDA PJRT plugin of the installed jax is missing; the message
      names the install command.
  """
  _check_callable(fn, "compile_for")
  spec = gpu_target(target)
  mesh = spec.mesh()
  replicated = NamedSharding(mesh, PartitionSpec())
  if static_argnums == ():
    fn, args, kwargs = _over_traceable_leaves(fn, args, kwargs)
  args, kwargs = jax.tree.map(lambda v: _on_target(v, replicated), (args, kwargs))
  with (
    kernels.lowering_for("cuda"),
    _compat.gpu_mesh_context(mesh),
    _compat.cudnn_for_target(spec.cudnn_version),
  ):
    lowered = (
      jax.jit(fn, static_argnums=static_argnums)
      .trace(*args, **kwargs)
      .lower(lowering_platforms=("cuda",))
    )
  return lowered.compile(compiler_options=compiler_options)
