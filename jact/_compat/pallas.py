"""Platforms and Pallas: the lowering platform, Pallas kernel names, lowering for CUDA anywhere.

jact's kernels are chosen per platform and checked by lowering them for a GPU
on any host; telling CUDA from ROCm and naming the target GPU go through
semi-public or private JAX.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Sequence

import jax
import jax.extend.backend
import jax.numpy as jnp
from jax.experimental import pallas as _pallas

from jact._compat._probes import probes, trace_eqns

try:  # deprecated since jax 0.11, to be removed: the jax-triton kernels replace it
  from jax.experimental.pallas import triton as _pallas_triton
except ImportError:  # pragma: no cover - a jax without Pallas' Triton backend
  _pallas_triton = None

__all__ = [
  "lowering_platform",
  "pallas_kernel_name",
  "lower_for_cuda",
  "gpu_mesh_context",
  "has_pallas_triton",
  "pallas_triton_deprecated",
  "has_jax_triton",
  "kernel_launch_name",
  "import_jax_triton",
]


# ----------------------------------------------------------------------------- backends


PALLAS_TRITON_DEPRECATED_IN = (0, 11)
"""The jax release whose Pallas changelog deprecates the Triton backend ("migrate to
Mosaic GPU, or to the official Triton bindings and jax_triton")."""


def has_pallas_triton() -> bool:
  """This jax still has Pallas' Triton backend (`jax.experimental.pallas.triton`).

  Public (experimental, deprecated since jax 0.11): the module's import."""
  return _pallas_triton is not None


def pallas_triton_deprecated() -> bool:
  """This jax's Pallas changelog deprecates the Triton backend (jax >= 0.11): the
  jax-triton kernels are chosen above it. The deprecation is in the changelog only
  (importing the module warns of nothing), so it is read from the version."""
  version = tuple(int(p) for p in jax.__version__.split(".")[:2])
  return version >= PALLAS_TRITON_DEPRECATED_IN


def import_jax_triton():
  """The `jax_triton` module, imported without its side effect on the process: importing it
  sets TRITON_CACHE_DIR to "" (it compiles without Triton's file cache), after which every
  `triton.compile` in the process raises "Could not create or locate cache dir". The
  variable is put back as it was.

  Public: `jax_triton.triton_call`; the variable it sets is its module-level code."""
  before = os.environ.get("TRITON_CACHE_DIR")
  import jax_triton

  if before is None:
    if os.environ.get("TRITON_CACHE_DIR") == "":
      del os.environ["TRITON_CACHE_DIR"]
  else:
    os.environ["TRITON_CACHE_DIR"] = before
  return jax_triton


def has_jax_triton() -> bool:
  """The jax-triton package (`jax_triton.triton_call`) is installed: found, not
  imported (it imports `triton` and jaxlib's CUDA Triton bindings)."""
  import importlib.util

  return importlib.util.find_spec("jax_triton") is not None


@probes(
  has_pallas_triton="jax.experimental.pallas.triton imports (deprecated since jax 0.11)",
  pallas_triton_deprecated="jax.__version__ >= 0.11",
)
def _check_backends():
  assert has_pallas_triton() == (_pallas_triton is not None)
  if not pallas_triton_deprecated():
    assert has_pallas_triton(), f"jax {jax.__version__} predates the deprecation yet lacks it"


# ----------------------------------------------------------------------------- platform


def lowering_platform() -> str:
  """The `lax.platform_dependent` name of the default backend: "cpu",
  "cuda", "rocm" or "tpu".

  Public (semi): `jax.extend.backend.get_backend().platform_version` tells
  CUDA from ROCm (`jax.default_backend()` says only "gpu"). No default on a
  missing attribute: a silent "cuda" would pick the wrong branch."""
  backend = jax.default_backend()
  if backend != "gpu":
    return backend
  version = jax.extend.backend.get_backend().platform_version
  return "rocm" if "rocm" in str(version).lower() else "cuda"


@probes(lowering_platform="jax.extend.backend.get_backend().platform_version")
def _check_lowering_platform():
  platform = lowering_platform()
  assert platform in ("cpu", "cuda", "rocm", "tpu"), platform
  if jax.default_backend() != "gpu":
    assert platform == jax.default_backend()
  version = jax.extend.backend.get_backend().platform_version
  assert isinstance(version, str) and version, f"platform_version is {version!r}"


# ----------------------------------------------------------------------------- kernels


def pallas_kernel_name(eqn) -> str | None:
  """The name of the Pallas kernel `eqn` runs ("pallas_call" when unnamed),
  or None when `eqn` is no `pallas_call`.

  Public (experimental): `jax.experimental.pallas.pallas_call_p` by
  identity; its `params["name"]` is undocumented (the `name=` given to
  `pl.pallas_call`). Watch: older versions kept `name_and_src_info`."""
  if eqn.primitive is not _pallas.pallas_call_p:
    return None
  return str(eqn.params.get("name") or "pallas_call")


def kernel_launch_name(eqn) -> str | None:
  """The name of the GPU kernel `eqn` launches: a Pallas call's (`pallas_kernel_name`) or
  a jax-triton call's (`jax_triton.triton_call(..., name=)`), or None for any other eqn.

  Public: `jax_triton.triton_call`; its primitive's name "triton_kernel_call" and
  `params["name"]` are not (read by name, so jax-triton need not be imported)."""
  if eqn.primitive.name == "triton_kernel_call":
    return str(eqn.params.get("name") or "triton_kernel_call")
  return pallas_kernel_name(eqn)


@probes(
  kernel_launch_name="jax-triton's triton_kernel_call primitive, by name, and its params['name']",
  has_jax_triton="importlib.util.find_spec('jax_triton')",
  import_jax_triton="import jax_triton, and the TRITON_CACHE_DIR it sets",
)
def _check_kernel_launch_name():
  assert kernel_launch_name(trace_eqns(jnp.sin, 1.0)[0]) is None
  if not has_jax_triton():  # nothing else to read: the Pallas names are probed below
    return
  import triton
  import triton.language as tl

  jax_triton = import_jax_triton()
  assert os.environ.get("TRITON_CACHE_DIR") != "", "jax-triton's import left TRITON_CACHE_DIR empty"

  @triton.jit
  def double(x_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, tl.load(x_ptr + i) * 2.0)

  call = lambda x: jax_triton.triton_call(
    x,
    kernel=double,
    out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
    grid=(1,),
    name="jact_probe",
    N=8,
  )
  (eqn,) = [e for e in trace_eqns(call, jnp.ones(8)) if kernel_launch_name(e) is not None]
  assert kernel_launch_name(eqn) == "jact_probe", f"launch name read as {kernel_launch_name(eqn)!r}"


@probes(pallas_kernel_name="jax.experimental.pallas.pallas_call_p and its params['name']")
def _check_pallas_kernel_name():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  call = _pallas.pallas_call(
    kernel, out_shape=jax.ShapeDtypeStruct((8,), jnp.float32), interpret=True, name="jact_probe"
  )
  (eqn,) = trace_eqns(call, jnp.ones(8))
  assert pallas_kernel_name(eqn) == "jact_probe", f"kernel name read as {pallas_kernel_name(eqn)!r}"
  assert pallas_kernel_name(trace_eqns(jnp.sin, 1.0)[0]) is None


# ----------------------------------------------------------------------------- cuda from any host


def _abstract_gpu(device_kind: str):
  """Context naming the GPU a Pallas Triton kernel is lowered for, or None
  where JAX needs none. jax 0.10.2 lowers for compute capability 9.0 when no
  GPU is attached; jax >= 0.11 reads the target from the device kind of the
  context's abstract mesh (`jax._src.pallas.triton.gpu_info`, private) and
  fails without a GPU or one. None public: `jax.sharding.AbstractMesh(...,
  abstract_device=)` is public, its `AbstractDevice` is not exported (watch:
  `jax._src.mesh.AbstractDevice`'s fields)."""
  try:
    from jax._src.pallas.triton import gpu_info  # noqa: F401  # jax >= 0.11
  except ImportError:
    return None
  from jax._src.mesh import AbstractDevice

  mesh = jax.sharding.AbstractMesh(
    (1,),
    ("jact_cuda_target",),
    abstract_device=AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu"),
  )
  return jax.sharding.use_abstract_mesh(mesh)


def gpu_mesh_context(mesh):
  """Context in which a trace is made for the GPU of `mesh`'s compile-only
  devices (`jax.experimental.topologies`): `mesh` as the context mesh. Pallas
  Triton kernels read the target's device kind from its abstract devices on
  jax >= 0.11 (jax 0.10.2 lowers for sm_90 without a GPU), and the context
  mesh is part of JAX's trace-cache key, so a function traced before for the
  CPU is traced again (with jact's GPU kernels staged in).
  Public: `jax.set_mesh`."""
  return jax.set_mesh(mesh)


@probes(gpu_mesh_context="jax.set_mesh as a context manager")
def _check_gpu_mesh_context():
  mesh = jax.sharding.Mesh(jax.devices()[:1], ("jact_probe",))
  with gpu_mesh_context(mesh):
    out = jax.jit(lambda x: x + 1)(jnp.ones(2))
  assert float(out[0]) == 2.0


def lower_for_cuda(
  fn: Callable, *args, device_kind: str = "NVIDIA H100", platforms: Sequence[str] = ("cuda",)
):
  """`jax.jit(fn)` traced at `args` and lowered for cuda (with any other
  `platforms`) on any host, a machine without a GPU included, its Pallas
  Triton kernels compiled to Triton IR for `device_kind` ("NVIDIA H100":
  sm_90). Array arguments count by shape and dtype only.

  Public: `jit(f).trace(*args).lower(lowering_platforms=...)`; naming the
  target GPU is not (see `_abstract_gpu`)."""
  abstract = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if isinstance(a, jax.Array) else a, args
  )
  target = _abstract_gpu(device_kind) if "cuda" in platforms else None
  with target if target is not None else contextlib.nullcontext():
    return jax.jit(fn).trace(*abstract).lower(lowering_platforms=tuple(platforms))


@probes(
  lower_for_cuda=(
    "a Pallas Triton kernel lowered for cuda on any host: the abstract mesh's "
    "AbstractDevice on jax >= 0.11"
  ),
)
def _check_lower_for_cuda():
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  if not has_pallas_triton():  # pragma: no cover - removed from jax: nothing to lower
    return
  call = _pallas.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    name="jact_probe",
    compiler_params=_pallas_triton.CompilerParams(num_warps=4, num_stages=1),
  )
  text = lower_for_cuda(call, jnp.ones((8, 128))).as_text()
  assert "__gpu$xla.gpu.triton" in text and "jact_probe" in text, "no Triton call in the lowering"
