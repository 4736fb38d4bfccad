"""Hooks for the experiments' tests.

The library suite's hooks (`tests/conftest.py`: the XLA flag workaround, xdist
groups, the kernels' slow doctests) apply here too: pytest loads that file when
the run includes `tests/`; run alone, this file registers it. Tests that read a
file of the offline data kit are skipped, naming the fix, on a checkout with no
data folder at all.
"""

import contextlib
import importlib.util
import pathlib

import pytest

from experiments.lib.data import DataKitMissing

LIBRARY_CONFTEST = pathlib.Path(__file__).resolve().parents[2] / "tests" / "conftest.py"


def pytest_configure(config):
  """Registers tests/conftest.py unless pytest already loaded it."""
  for plugin in config.pluginmanager.get_plugins():
    if getattr(plugin, "__file__", None) and pathlib.Path(plugin.__file__) == LIBRARY_CONFTEST:
      return
  spec = importlib.util.spec_from_file_location("jact_tests_conftest", LIBRARY_CONFTEST)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config.pluginmanager.register(module, "jact_tests_conftest")


@contextlib.contextmanager
def skip_without_data_kit(who: str = "this test"):
  """A test that reads a file of the offline data kit is skipped, naming the fix,
  on a checkout with no data folder at all (`DataKitMissing`); a file missing
  from a data folder that exists still fails the test."""
  try:
    yield
  except DataKitMissing as err:
    pytest.skip(
      f"{who} needs {err.relative!r} from the data kit: set JACT_DATA=/path/to/data (the data kit)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
  with skip_without_data_kit(item.nodeid.split("::")[0]):  # fixtures that load kit data
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  with skip_without_data_kit(item.nodeid.split("::")[0]):
    return (yield)
