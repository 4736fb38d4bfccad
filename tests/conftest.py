import importlib.metadata
import os
import subprocess
import sys

import pytest

# XLA:CPU's experimental YNN fusion in jaxlib 0.10.2 miscompiles a row
# reduction whose operand is broadcast along a leading batch axis -- exactly
# the shape of vmapping a gradient over many PRNG keys in the statistical tests
# (reproduced: max error 0.76 instead of 0; pinned by
# tests/test_stats.py::test_vmap_over_keys_matches_each_key). Turn it off for
# the test process before jax initializes its backend -- but only where this
# jaxlib knows the flag: XLA aborts on an unknown flag in XLA_FLAGS.
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def xla_flag_supported(flag: str, timeout: float = 120.0) -> bool:
  """Whether jax starts its CPU backend with `flag` in XLA_FLAGS (probed in a
  subprocess, so an unknown flag cannot abort this process)."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  try:
    probe = subprocess.run(
      [sys.executable, "-c", "import jax; jax.devices('cpu')"],
      env=env,
      capture_output=True,
      timeout=timeout,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return False
  return probe.returncode == 0


def _cached_supported(config, flag: str) -> bool:
  """`xla_flag_supported`, remembered in pytest's cache per jaxlib version."""
  cache = getattr(config, "cache", None)
  key = f"jact/xla_flag/{importlib.metadata.version('jaxlib')}/{flag.strip('-=')}"
  known = cache.get(key, None) if cache is not None else None
  if known is None:
    known = xla_flag_supported(flag)
    if cache is not None:
      cache.set(key, known)
  return known


def add_xla_flag(flag: str, config=None) -> bool:
  """Appends `flag` to XLA_FLAGS when this jaxlib supports it; whether it is set."""
  flags = os.environ.get("XLA_FLAGS", "")
  if flag in flags:
    return True
  if not _cached_supported(config, flag):
    return False
  os.environ["XLA_FLAGS"] = (flags + " " + flag).strip()
  return True


def pytest_configure(config):
  add_xla_flag(YNN_FLAG, config)


SUITES = ("tests", "experiments/tests")
"""Where this suite's shared fixtures are defined (experiments/tests/conftest.py registers
this file when the experiments' tests run alone)."""


def shared_fixture(item) -> str | None:
  """The first module- or session-scoped fixture of this test suite that `item`
  uses (as "its/defining/file.py::name"), or None."""
  info = getattr(item, "_fixtureinfo", None)
  if info is None:
    return None
  for name in item.fixturenames:
    definitions = info.name2fixturedefs.get(name)
    if not definitions:
      continue
    definition = definitions[-1]
    if definition.scope in ("module", "session") and definition.baseid.startswith(SUITES):
      return f"{definition.baseid}::{name}"
  return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
  """The kernels' doctests (`jact/kernels/<op>/pallas_triton.py`, `jax_triton.py`) run in
  interpret mode (5-15 s each on a CPU core): slow. The XLA references and entry points
  beside them are not.

  Tests that share a module- or session-scoped fixture (an 8-device subprocess,
  a compiled model, a training run) go to one xdist worker (`--dist loadgroup`
  in pyproject.toml), so the fixture is built once rather than once per worker.
  """
  del config
  for item in items:
    if (
      isinstance(item, pytest.DoctestItem)
      and item.nodeid.startswith("jact/kernels/")
      and item.nodeid.split("::")[0].endswith(("/pallas_triton.py", "/jax_triton.py"))
    ):
      item.add_marker(pytest.mark.slow)
    group = shared_fixture(item)
    if group is not None and item.get_closest_marker("xdist_group") is None:
      item.add_marker(pytest.mark.xdist_group(group))


sys.path.insert(0, os.path.dirname(__file__))
