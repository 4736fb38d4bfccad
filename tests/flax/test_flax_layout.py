"""The Flax side's layout: public `jact.nn` / `jact.nnx`, private `jact._flax`, and all of its
implicit state in `jact._flax.context`."""

import ast
import importlib
import pathlib

import pytest

import jact
from jact._flax import context

JACT = pathlib.Path(jact.__file__).parent
FLAX_SIDE = [JACT / "_flax", JACT / "nn", JACT / "nnx"]


def _context_vars_made(path: pathlib.Path) -> list[int]:
  """Lines of `path` that call `ContextVar(...)` (as `contextvars.ContextVar` or a bare name)."""
  tree = ast.parse(path.read_text())
  return [
    node.lineno
    for node in ast.walk(tree)
    if isinstance(node, ast.Call)
    and getattr(node.func, "attr", getattr(node.func, "id", None)) == "ContextVar"
  ]


def test_every_flax_context_variable_is_made_in_the_context_module():
  made = {path: _context_vars_made(path) for root in FLAX_SIDE for path in root.rglob("*.py")}
  elsewhere = [
    f"{path}:{line}"
    for path, lines in made.items()
    for line in lines
    if path != JACT / "_flax" / "context.py"
  ]
  assert not elsewhere, "make the ContextVar in jact/_flax/context.py:\n" + "\n".join(elsewhere)
  assert made[JACT / "_flax" / "context.py"], "the context module makes no ContextVar"


def test_bound_restores_the_outer_value_on_exit_and_on_error():
  assert context.LINEN_IN_MODEL.get() is False
  with context.bound(context.LINEN_IN_MODEL, True):
    with pytest.raises(RuntimeError):
      with context.bound(context.LINEN_IN_MODEL, "inner"):
        assert context.LINEN_IN_MODEL.get() == "inner"
        raise RuntimeError("the block fails")
    assert context.LINEN_IN_MODEL.get() is True
  assert context.LINEN_IN_MODEL.get() is False


@pytest.mark.parametrize(
  "old",
  [
    "jact.flax.linen",
    "jact.flax.nnx",
    "jact.flax.convert",
    "jact.flax.conversion_report",
    "jact.flax.compressed_module",
  ],
)
def test_one_namespace_per_concept_no_old_flax_paths(old):
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module(old)


@pytest.mark.parametrize("package", ["jact.nn", "jact.nnx"])
def test_the_twin_packages_are_jacts_attributes_and_keep_their_modules_private(package):
  module = importlib.import_module(package)
  assert getattr(jact, package.split(".")[1]) is module
  homes = {
    getattr(module, name).__module__
    for name in module.__all__
    if hasattr(getattr(module, name), "__module__")
  }
  public = [home for home in homes if not any(part.startswith("_") for part in home.split("."))]
  assert not public, public
