"""Devices of a CUDA GPU that is not there: XLA:GPU compilation on any host.

`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`
(public, experimental) returns compile-only devices for a GPU described by an
XLA `GpuTargetConfig` text proto; a mesh of them lets `jit(...).lower(...)
.compile()` run XLA:GPU's whole pipeline (fusion, scheduling, buffer assignment)
on a machine without a GPU or NVIDIA libraries. It needs the CUDA PJRT plugin of
the installed jax (`pip install "jax[cuda12-local]"`, which pins it).

On a machine without CUDA the plugin refuses to initialize at JAX start-up unless
`JAX_PLATFORMS` excludes cuda or `JAX_SKIP_CUDA_CONSTRAINTS_CHECK` is set; then it
is not registered and the topology is "not implemented". `cuda_devices`
initializes it once more with that check skipped (the plugin's own switch).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from typing import Iterator

from jax.experimental import topologies

from jact._compat._probes import probes

__all__ = ["cuda_devices", "cudnn_for_target"]

_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def _register_plugin() -> None:
  """Initializes the installed CUDA plugin with its CUDA version check skipped;
  ModuleNotFoundError when none is installed."""
  for name in _PLUGINS:
    try:
      plugin = importlib.import_module(name)
    except ImportError:
      continue
    previous = os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    try:
      plugin.initialize()
    finally:
      if previous is None:
        del os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"]
      else:
        os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = previous
    return
  raise ModuleNotFoundError(f"no CUDA PJRT plugin installed (looked for {', '.join(_PLUGINS)})")


@functools.lru_cache(maxsize=None)
def _devices(target_config: str, topology: str) -> tuple:
  def describe():
    return topologies.get_topology_desc(
      platform="cuda", topology_name="cuda", target_config=target_config, topology=topology
    )

  try:
    return tuple(describe().devices)
  except NotImplementedError:
    _register_plugin()
    return tuple(describe().devices)


def cuda_devices(target_config: str, topology: str = "1x1x1") -> tuple:
  """Compile-only CUDA devices for a `GpuTargetConfig` text proto (`topology`:
  "1x1x1" is one GPU). Raises ModuleNotFoundError without a CUDA PJRT plugin,
  NotImplementedError when the plugin gives no topology (a version mismatch).

  Public (experimental): `jax.experimental.topologies.get_topology_desc`. None
  public: initializing the plugin late (watch: `jax_plugins.xla_cuda12.initialize`
  and `JAX_SKIP_CUDA_CONSTRAINTS_CHECK`)."""
  return _devices(target_config, topology)


@probes(
  cuda_devices=(
    "jax.experimental.topologies.get_topology_desc; the CUDA plugin's initialize(), "
    "where one is installed"
  )
)
def _check_cuda_devices():
  assert callable(topologies.get_topology_desc)
  for name in _PLUGINS:
    try:
      plugin = importlib.import_module(name)
    except ImportError:
      continue
    assert callable(getattr(plugin, "initialize", None)), f"{name} has no initialize()"


def _fused_attention():
  from jax._src.cudnn import fused_attention_stablehlo  # private: see cudnn_for_target

  return fused_attention_stablehlo


@contextlib.contextmanager
def cudnn_for_target(version: int) -> Iterator[None]:
  """Context in which `jax.nn.dot_product_attention(..., implementation="cudnn")` traces
  for a target's cuDNN `version` (e.g. 90700) on a machine without the cuDNN library;
  where the library loads, nothing changes.

  None public: jax asks the cuDNN library for its version while tracing
  (`jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version`) and refuses
  ("cuDNN is not detected") without it; the version is stood in for by the target's."""
  module = _fused_attention()
  original = module.check_cudnn_version
  try:
    original()
    available = True
  except RuntimeError:
    available = False
  if available:
    yield
    return
  module.check_cudnn_version = lambda: version
  try:
    yield
  finally:
    module.check_cudnn_version = original


@probes(cudnn_for_target="jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version (private)")
def _check_cudnn_for_target():
  module = _fused_attention()
  assert callable(module.check_cudnn_version), "no check_cudnn_version to stand in for"
  with cudnn_for_target(90700):
    try:
      version = module.check_cudnn_version()
    except RuntimeError as e:  # pragma: no cover
      raise AssertionError(f"the cuDNN version check still refuses: {e}") from e
  assert isinstance(version, int)
