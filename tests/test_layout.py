"""The package layout is the design: imports flow one way through the layers, with no cycles.

Layers, lowest first (a module imports only from its own package or from lower layers):
`_compat` -> `_core` -> `kernels` -> `compressors` -> `_engine` -> `ops` -> `_transforms` ->
`_planning`, `_flax` -> `nn`, `nnx`, `_report` -> `_convert` -> `jact/__init__`. Imports are read
from the source with `ast`, including those inside functions, so a cycle hidden behind a lazy
import is found too.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jact"

# The first prefix that matches names the layer. Every package is one layer: no exceptions.
LAYERS = [
  ("jact._compat", -1),
  ("jact._core", 0),
  ("jact.kernels", 1),
  ("jact.compressors", 2),
  ("jact._engine", 3),
  ("jact.ops", 4),
  ("jact._transforms", 5),
  ("jact._planning", 6),
  ("jact._flax", 6),
  ("jact.nn", 7),
  ("jact.nnx", 7),
  ("jact._report", 7),
  ("jact._gpu_targets", 7),
  ("jact._gpu_target", 7.5),
  ("jact._step_time", 7.6),
  ("jact._convert", 8),
  ("jact._compiled_memory", 8),
  ("jact._fit", 9),
  ("jact", 10),
]

# The public API: these modules and what their `__all__` lists. Every other module is internal
# and says so with an underscore in its path (equinox's and optax's rule: private unless
# re-exported by a public module).
PUBLIC = {
  "jact",
  "jact.ops",
  "jact.compressors",
  "jact.kernels",
  "jact.nn",
  "jact.nnx",
  "jact.sensitivity",
  "jact.acgc",
  "jact.levels",
  "jact.allocate",
  "jact.rng",
}

# Imports inside functions, each with the reason it cannot sit at the top of its module; the
# kernel registry's GPU backends are added from the tree (`_kernel_backends`).
LAZY_ALLOWED: set[tuple[str, str]] = set()


def _module_names() -> dict[str, pathlib.Path]:
  names = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    names[".".join(parts)] = path
  return names


def _imports(name: str, path: pathlib.Path, modules) -> list[tuple[str, int, bool]]:
  """(imported jact module, line, inside a function) for every import in the file."""
  tree = ast.parse(path.read_text())
  lazy_nodes = {
    id(inner)
    for node in ast.walk(tree)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    for inner in ast.walk(node)
  }
  package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
      targets = [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
        for alias in node.names
      ]
    else:
      continue
    found += [
      (t, node.lineno, id(node) in lazy_nodes)
      for t in targets
      if t == "jact" or t.startswith("jact.")
    ]
  return found


def _layer(module: str) -> tuple[int, str]:
  for prefix, level in LAYERS:
    if module == prefix or module.startswith(prefix + "."):
      return level, prefix
  raise AssertionError(f"{module} is in no layer; add its package to LAYERS")


MODULES = _module_names()
EDGES = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def _kernel_backends() -> set[tuple[str, str]]:
  """(importer, module) for each GPU backend of a kernel package: every module of
  `jact/kernels/_<op>/` but its `reference` (the XLA oracle) and `api`. The registry
  (`jact.kernels`) imports them inside functions: the Pallas kernels only when this jax has
  Pallas' Triton backend, the jax-triton kernel (it imports `triton`) when first called."""
  return {
    ("jact.kernels", name)
    for name in MODULES
    if len(parts := name.split(".")) == 4
    and parts[:2] == ["jact", "kernels"]
    and parts[2].startswith("_")
    and parts[3] not in ("reference", "api")
  }


LAZY_ALLOWED |= _kernel_backends()


def test_each_layer_is_a_whole_package():
  """No package has a sub-package in another layer (an exception would hide an upward arrow)."""
  prefixes = [prefix for prefix, _ in LAYERS if prefix != "jact"]
  nested = [(a, b) for a in prefixes for b in prefixes if b.startswith(a + ".")]
  assert not nested


def test_the_kernel_backends_are_found_in_the_tree():
  assert ("jact.kernels", "jact.kernels._quantize.jax_triton") in LAZY_ALLOWED
  assert ("jact.kernels", "jact.kernels._relu_mask.pallas_triton") in LAZY_ALLOWED
  assert not any(target.endswith((".reference", ".api")) for _, target in LAZY_ALLOWED)


def test_the_import_reader_sees_imports():
  assert ("jact._core.packing", False) in [
    (t, lazy) for t, _, lazy in EDGES["jact.ops._activation"]
  ]
  assert ("jact.kernels._quantize.pallas_triton", True) in [
    (t, lazy) for t, _, lazy in EDGES["jact.kernels"]
  ]
  assert len(MODULES) > 50


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_flow_down_the_layers(name):
  level, prefix = _layer(name)
  wrong = []
  for target, line, _lazy in EDGES[name]:
    if target == "jact" and name != "jact":
      wrong.append(f"{MODULES[name]}:{line}: imports the top package jact; import the module")
      continue
    target_level, target_prefix = _layer(target)
    if target_prefix != prefix and target_level >= level and name != "jact":
      wrong.append(
        f"{MODULES[name]}:{line}: {prefix} (layer {level}) imports {target} (layer {target_level})"
      )
  assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_unexplained_lazy_imports(name):
  lazy = [
    f"{MODULES[name]}:{line}: {target}"
    for target, line, is_lazy in EDGES[name]
    if is_lazy and (name, target) not in LAZY_ALLOWED
  ]
  assert not lazy, (
    "imports inside functions (move them to the top of the module, or add the "
    "pair to LAZY_ALLOWED with the reason):\n" + "\n".join(lazy)
  )


def test_the_kernel_registry_imports_nothing_from_jact():
  assert not EDGES["jact.kernels._registry"]


def test_no_import_cycles():
  graph = {
    name: {t for t, _, lazy in EDGES[name] if t in MODULES and t != name} for name in MODULES
  }
  # a package imports its submodules; a submodule importing its package's __init__ is a cycle
  state, stack, cycles = {}, [], []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
      elif nxt not in state:
        visit(nxt)
    stack.pop()
    state[node] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name)
  assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_every_module_outside_the_public_api_is_underscore_private():
  public_paths = [
    name for name in MODULES if not any(part.startswith("_") for part in name.split("."))
  ]
  assert sorted(set(public_paths) - PUBLIC) == []


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_modules_list_their_api(name):
  assert name in MODULES, f"{name} is listed as public but is no module of jact"
  module = importlib.import_module(name)
  assert module.__all__, name
  missing = [n for n in module.__all__ if not hasattr(module, n)]
  assert not missing, f"{name}.__all__ names what it does not define: {missing}"


# Flax's packages: the public twins and the private machinery.
FLAX_PACKAGES = ("jact._flax", "jact.nn", "jact.nnx", "jact._convert", "jact._compat.flax")


def test_compat_test_helpers_and_flax_accessors_are_imported_only_where_they_belong():
  """`jact._compat.testing` by no jact module (tests only); `jact._compat.flax`
  by jact's Flax modules only, so jact's core never reaches Flax internals."""
  wrong = []
  for name, edges in EDGES.items():
    for target, line, _ in edges:
      flax_outside = target.startswith("jact._compat.flax") and not name.startswith(FLAX_PACKAGES)
      if target.startswith("jact._compat.testing") or flax_outside:
        wrong.append(f"{MODULES[name]}:{line}: {name} imports {target}")
  assert not wrong, "\n".join(wrong)
  assert any(t.startswith("jact._compat.flax") for edges in EDGES.values() for t, _, _ in edges)
