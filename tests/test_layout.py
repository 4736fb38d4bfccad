"""The package layout is the design: imports flow one way through the layers, with no cycles.

Layers, lowest first (a module imports only from its own package or from lower layers):
`_compat` -> `core` -> `kernels` -> `compressors` -> `engine` -> `ops` -> `transforms` ->
`planning`, `flax` -> `report` -> `jact/__init__`. Imports are read from the source with `ast`,
including those inside functions, so a cycle hidden behind a lazy import is found too.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jact"

LAYERS = [("jact._compat", -1), ("jact.core", 0), ("jact.kernels", 1), ("jact.compressors", 2),
          ("jact.engine", 3), ("jact.ops", 4), ("jact.transforms", 5), ("jact.planning", 6),
          ("jact.flax", 6), ("jact.report", 7), ("jact", 8)]

# The XLA references moved from `jact.core` to `jact.kernels.<op>.reference` (kernels grouped by
# op). Each old module keeps their names importable for code written against it: a module
# `__getattr__` imports the new module when such a name is first read, once both are loaded.
# These are the only imports allowed up the layers, they are left out of the cycle check, and no
# jact module reads the old names (`test_jact_imports_no_reference_from_its_old_module`).
MOVED = {
    ("jact.core.quantize", "jact.kernels.quantize.reference"):
        ("quantize_reference", "dequantize_reference", "quantize_rows_reference"),
    ("jact.core.persample", "jact.kernels.per_sample.reference"):
        ("quantize_per_sample_reference", "dequantize_per_sample_reference"),
    ("jact.core.packing", "jact.kernels.relu_mask.reference"): ("relu_mask_reference",),
    ("jact.core.division", "jact.kernels.division.reference"): ("division_compress_reference",),
}

# Imports inside functions, each with the reason it cannot sit at the top of its module.
LAZY_ALLOWED = {
    # the Pallas kernels are registered only when this jax has Pallas' Triton backend
    ("jact.kernels", "jact.kernels.division.pallas_triton"),
    ("jact.kernels", "jact.kernels.quantize.pallas_triton"),
    ("jact.kernels", "jact.kernels.per_sample.pallas_triton"),
    ("jact.kernels", "jact.kernels.relu_mask.pallas_triton"),
    # the jax-triton kernel imports `triton`: only when it is first called
    ("jact.kernels", "jact.kernels.quantize.jax_triton"),
    # a moved reference is imported from its old module only when read there (MOVED)
    *MOVED,
}


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
  lazy_nodes = {id(inner) for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                for inner in ast.walk(node)}
  package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
      targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    else:
      continue
    found += [(t, node.lineno, id(node) in lazy_nodes) for t in targets
              if t == "jact" or t.startswith("jact.")]
  return found


def _layer(module: str) -> tuple[int, str]:
  for prefix, level in LAYERS:
    if module == prefix or module.startswith(prefix + "."):
      return level, prefix
  raise AssertionError(f"{module} is in no layer; add its package to LAYERS")


MODULES = _module_names()
EDGES = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def test_the_import_reader_sees_imports():
  assert ("jact.core.packing", False) in [(t, lazy) for t, _, lazy in EDGES["jact.ops.activation"]]
  assert ("jact.kernels.quantize.pallas_triton", True) in [
      (t, lazy) for t, _, lazy in EDGES["jact.kernels"]]
  assert len(MODULES) > 50


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_flow_down_the_layers(name):
  level, prefix = _layer(name)
  wrong = []
  for target, line, lazy in EDGES[name]:
    if lazy and (name, target) in MOVED:
      continue
    if target == "jact" and name != "jact":
      wrong.append(f"{MODULES[name]}:{line}: imports the top package jact; import the module")
      continue
    target_level, target_prefix = _layer(target)
    if target_prefix != prefix and target_level >= level and name != "jact":
      wrong.append(f"{MODULES[name]}:{line}: {prefix} (layer {level}) imports {target} "
                   f"(layer {target_level})")
  assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_unexplained_lazy_imports(name):
  lazy = [f"{MODULES[name]}:{line}: {target}" for target, line, is_lazy in EDGES[name]
          if is_lazy and (name, target) not in LAZY_ALLOWED]
  assert not lazy, ("imports inside functions (move them to the top of the module, or add the "
                    "pair to LAZY_ALLOWED with the reason):\n" + "\n".join(lazy))


def test_the_kernel_registry_imports_nothing_from_jact():
  assert not EDGES["jact.kernels.registry"]


def test_no_import_cycles():
  graph = {name: {t for t, _, lazy in EDGES[name]
                  if t in MODULES and t != name and not (lazy and (name, t) in MOVED)}
           for name in MODULES}
  # a package imports its submodules; a submodule importing its package's __init__ is a cycle
  state, stack, cycles = {}, [], []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
      elif nxt not in state:
        visit(nxt)
    stack.pop()
    state[node] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name)
  assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_jact_imports_no_reference_from_its_old_module():
  old_names = {(old, n) for (old, _), names in MOVED.items() for n in names}
  wrong = []
  for path in MODULES.values():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        wrong += [f"{path}:{node.lineno}: {node.module}.{alias.name}" for alias in node.names
                  if (node.module, alias.name) in old_names]
      elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        # `persample.quantize_per_sample_reference` after `from jact.core import persample`
        wrong += [f"{path}:{node.lineno}: {old}.{node.attr}" for old, n in old_names
                  if n == node.attr and old.endswith("." + node.value.id)]
  assert not wrong, "import the references from jact.kernels.<op>.reference:\n" + "\n".join(wrong)


@pytest.mark.parametrize("old, new", sorted(MOVED))
def test_moved_references_keep_their_old_import_path(old, new):
  old_module, new_module = importlib.import_module(old), importlib.import_module(new)
  for name in MOVED[old, new]:
    assert getattr(old_module, name) is getattr(new_module, name)
    assert name in new_module.__all__ and name not in old_module.__all__
  with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
    old_module.no_such_name  # noqa: B018 (the attribute read is the test)


# Flax's packages: today's `jact.flax`, and the names issue 34 moves them to.
FLAX_PACKAGES = ("jact.flax", "jact._flax", "jact.nn", "jact.nnx", "jact._compat.flax")


def test_compat_test_helpers_and_flax_accessors_are_imported_only_where_they_belong():
  """`jact._compat.testing` by no jact module (tests only); `jact._compat.flax`
  by jact's Flax modules only, so jact's core never reaches Flax internals."""
  wrong = []
  for name, edges in EDGES.items():
    for target, line, _ in edges:
      flax_outside = (target.startswith("jact._compat.flax")
                      and not name.startswith(FLAX_PACKAGES))
      if target.startswith("jact._compat.testing") or flax_outside:
        wrong.append(f"{MODULES[name]}:{line}: {name} imports {target}")
  assert not wrong, "\n".join(wrong)
  assert any(t.startswith("jact._compat.flax") for edges in EDGES.values() for t, _, _ in edges)
