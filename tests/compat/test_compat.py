"""jact's private / undocumented JAX and Flax accesses live in the jact._compat package only.

* One test per accessor runs its probe (`jact._compat.check`): when an
  installed JAX changes what jact reads, the failure names the access and the
  module to update.
* The probe gate is derived from the modules: every public name of every
  `jact._compat` module has a probe registered beside it, and every package
  re-exports its modules' accessors.
* Import isolation: `import jact` loads no test helper (`jact._compat.testing`),
  and `jact._compat` loads no Flax.
* Behaviour through jact: the names, residual layout and policies the compat
  functions feed are seen end to end.
* Grep gate: no file of jact/ outside jact/_compat/ touches private or internal
  JAX (`test_no_private_jax_access_outside_compat`, file:line on failure).
  Another library's gate adds its own pattern table and test function built on
  `_violations` (tests/compat/test_compat_flax.py does for Flax).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import pathlib
import pkgutil
import re
import subprocess
import sys
import tokenize

import jax
import jax.numpy as jnp
import pytest

import jact
from jact import _compat
from jact._compat import _probes
from jact._compat import flax as _flax_compat  # noqa: F401 (registers the Flax probes)
from jact._compat import testing as compat_testing

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPAT_DIR = "jact/_compat/"
INFRASTRUCTURE = {"CompatError", "CHECKS", "check"}  # what a package re-exports from _probes


def _compat_modules() -> dict[str, object]:
  """Every module of the jact._compat package (subpackages included), by name."""
  found = {"jact._compat": _compat}
  for info in pkgutil.walk_packages(_compat.__path__, "jact._compat."):
    found[info.name] = importlib.import_module(info.name)
  return found


MODULES = _compat_modules()
LEAVES = {
  n: m
  for n, m in MODULES.items()
  if not hasattr(m, "__path__") and n.rsplit(".", 1)[1] != "_probes"
}
PACKAGES = {n: m for n, m in MODULES.items() if hasattr(m, "__path__")}
JAX_PROBES = sorted(
  n for n, p in _compat.CHECKS.items() if not p.module.startswith("jact._compat.flax")
)


# ----------------------------------------------------------------------------- probes


@pytest.mark.slow
@pytest.mark.parametrize("name", JAX_PROBES)
def test_compat_access_still_works(name):
  _compat.check([name])


def test_the_modules_are_enumerated():
  assert {
    "jact._compat.jaxpr",
    "jact._compat.calls",
    "jact._compat.vjp",
    "jact._compat.testing",
    "jact._compat.flax.linen",
    "jact._compat.flax.nnx",
  } <= set(LEAVES), sorted(LEAVES)
  assert set(PACKAGES) == {"jact._compat", "jact._compat.flax"}, sorted(PACKAGES)


@pytest.mark.parametrize("module_name", sorted(LEAVES))
def test_every_public_name_of_a_compat_module_is_an_accessor_with_a_probe_beside_it(module_name):
  """Public = defined in the module without a leading underscore; each is in
  `__all__` and has a probe registered from the same module."""
  module = LEAVES[module_name]
  defined = {
    name
    for name, value in vars(module).items()
    if not name.startswith("_")
    and getattr(value, "__module__", None) == module_name
    and (inspect.isfunction(value) or inspect.isclass(value))
  }
  assert defined == set(module.__all__), (
    f"{module_name}: public but not in __all__: {sorted(defined - set(module.__all__))}; "
    f"in __all__ but not defined here: {sorted(set(module.__all__) - defined)}"
  )
  unprobed = [
    n for n in module.__all__ if n not in _compat.CHECKS or _compat.CHECKS[n].module != module_name
  ]
  assert not unprobed, (
    f"{module_name}: no probe beside {unprobed}; decorate one with "
    f"@probes(name='what it reads') in that module"
  )


def test_every_probe_belongs_to_an_accessor():
  accessors = {(n, m) for m, module in LEAVES.items() for n in module.__all__}
  stale = sorted((n, p.module) for n, p in _compat.CHECKS.items() if (n, p.module) not in accessors)
  assert not stale, f"probes of no accessor: {stale}"


@pytest.mark.parametrize("package_name", sorted(PACKAGES))
def test_a_compat_package_re_exports_each_accessor_of_its_modules(package_name):
  package = PACKAGES[package_name]
  modules = [
    m
    for n, m in LEAVES.items()
    if n.rsplit(".", 1)[0] == package_name and n != "jact._compat.testing"
  ]
  expected = {n: getattr(m, n) for m in modules for n in m.__all__}
  assert set(package.__all__) == set(expected) | INFRASTRUCTURE, sorted(
    set(package.__all__) ^ (set(expected) | INFRASTRUCTURE)
  )
  assert all(getattr(package, n) is v for n, v in expected.items())
  assert package.check is _probes.check and package.CompatError is _probes.CompatError


def test_check_names_the_broken_access(monkeypatch):
  """A probe failing is reported with the accessor's module and name."""
  probe = _compat.CHECKS["checkpoint_name"]
  monkeypatch.setitem(_compat.CHECKS, "checkpoint_name", probe._replace(run=lambda: 1 / 0))
  with pytest.raises(
    _compat.CompatError, match=r"jact\._compat\.vjp\.checkpoint_name \(.*ZeroDivision"
  ) as err:
    _compat.check(["checkpoint_name", "is_var"])
  assert "is_var" not in str(err.value) and jax.__version__ in str(err.value)
  with pytest.raises(ValueError, match="no compat check named"):
    _compat.check(["not_a_function"])


def test_an_accessor_name_is_probed_in_one_module_only():
  def probe_elsewhere():
    pass

  probe_elsewhere.__module__ = "elsewhere"
  with pytest.raises(
    ValueError, match=r"'is_var' is probed in both jact\._compat\.jaxpr and elsewhere"
  ):
    _probes.probes(is_var="a second probe")(probe_elsewhere)
  assert _compat.CHECKS["is_var"].module == "jact._compat.jaxpr"


def test_vjp_residuals_rejects_an_object_that_is_no_residual_pytree():
  with pytest.raises(_compat.CompatError, match=r"jact\._compat\.vjp_residuals"):
    _compat.vjp_residuals(lambda ct: ct)


# ----------------------------------------------------------------------------- import isolation


def _fresh(code: str) -> str:
  """Stdout of `code` run by a fresh interpreter in the repository root."""
  done = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
  )
  assert done.returncode == 0, done.stderr
  return done.stdout.strip()


@pytest.mark.slow  # a fresh interpreter imports jact and Flax (~3 s)
def test_import_jact_loads_no_test_helper():
  """The tests' accessors (and their `jax._src.ad_checkpoint` fallback) stay off
  jact's import path: no loaded jact module is or holds the helpers' module."""
  out = _fresh(
    "import sys, jact, jax._src.ad_checkpoint as private\n"
    "mods = {n: m for n, m in list(sys.modules.items()) if n == 'jact' or n.startswith('jact.')}\n"
    "holders = sorted(n for n, m in mods.items() if any(v is private for v in vars(m).values()))\n"
    "print('jact._compat.testing' in mods, 'jact._compat.flax' in mods, holders)"
  )
  assert out == "False True []", out


def test_jact_compat_imports_no_flax():
  """`jact._compat` (jact's lowest layer) loaded alone, without jact/__init__."""
  out = _fresh(
    "import sys, types\n"
    "pkg = types.ModuleType('jact'); pkg.__path__ = ['jact']; sys.modules['jact'] = pkg\n"
    "import jact._compat\n"
    "print(len(jact._compat.CHECKS) > 40, 'flax' in sys.modules,"
    " sorted(n for n in sys.modules if n.startswith('jact.')))"
  )
  assert out.startswith("True False ["), out
  loaded = ast.literal_eval(out[len("True False ") :])
  assert not [
    n
    for n in loaded
    if n.startswith(("jact._compat.flax", "jact._compat.testing"))
    or not n.startswith("jact._compat")
  ], loaded


# ----------------------------------------------------------------------------- through jact


def test_report_reads_names_of_jact_ops_and_user_names():
  x, w = jnp.ones((8, 64)), jnp.ones((64, 32))

  def loss(w):
    h = jact.ops.dense(x, w, bits=None, name="dense")
    return jnp.sum(jax.ad_checkpoint.checkpoint_name(jnp.sin(h), "mine") * h)  # mul keeps it

  groups = jact.residual_report(loss, w).by_name()
  assert "dense.lhs" in groups and "mine" in groups, sorted(map(str, groups))


def test_report_source_is_file_and_line():
  x = jnp.ones((4, 256))
  (residual,) = jact.residual_report(lambda x: jnp.sin(x).sum(), x).residuals
  assert re.search(r"test_compat\.py:\d+", residual.source), residual.source


def test_save_compressed_policy_sees_jact_names():
  """An empty report here would mean the policy saved nothing."""
  w, x = jnp.eye(256) / 16, jnp.ones((64, 256))
  block = jact.compressed(
    lambda w, x: jnp.tanh(x @ w) @ w,
    name="b",
    compressor=jact.compressors.PerGroup(4, stochastic=False),
  )
  step = jax.checkpoint(lambda w, x: block(w, x).sum(), policy=jact.save_compressed("b"))
  names = jact.residual_report(step, w, x).by_name()
  assert any(str(n).startswith("b.") for n in names), sorted(map(str, names))
  plain = jax.checkpoint(lambda w, x: block(w, x).sum(), policy=jact.save_compressed("other"))
  assert not any(str(n).startswith("b.") for n in jact.residual_report(plain, w, x).by_name())


def test_compressed_residual_names_follow_vjp_leaf_positions():
  """`name.i` is leaf i of the VJP object (`_compat.vjp_residuals`): the
  inputs among the leaves are kept by reference, the others compressed."""
  x, w = jnp.ones((64, 32)), jnp.ones((32, 48)) / 32
  fn = lambda x, w: jnp.tanh(x @ w)
  _, vjp = jax.vjp(fn, x, w)
  leaves, _ = _compat.vjp_residuals(vjp)
  expected = {f"t.{i}" for i, leaf in enumerate(leaves) if leaf is not x and leaf is not w}
  f = jact.compressed(fn, name="t", compressor=jact.compressors.PerGroup(8, stochastic=False))
  names = set(jact.residual_report(lambda x, w: f(x, w).sum(), x, w).by_name())
  assert len(expected) == len(leaves) - 2 and names == expected, (names, expected)


def test_saved_residuals_helper_matches_jax_description():
  x = jnp.ones((3,))
  ((aval, src),) = compat_testing.saved_residuals(lambda x: jnp.sin(x).sum(), x)
  assert aval.shape == (3,) and "cos" in src, src


# ----------------------------------------------------------------------------- grep gates


def _code_lines(path: pathlib.Path) -> list[str]:
  """The lines of `path` with comments and docstrings blanked (prose may
  name private APIs; code may not)."""
  source = path.read_text()
  lines = source.splitlines()
  docstrings = {
    (n.lineno, n.col_offset)
    for n in ast.walk(ast.parse(source))
    if isinstance(n, ast.Expr)
    and isinstance(n.value, ast.Constant)
    and isinstance(n.value.value, str)
  }
  blank = [list(line) for line in lines]
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT or (
      tok.type == tokenize.STRING and (tok.start[0], tok.start[1]) in docstrings
    ):
      (r0, c0), (r1, c1) = tok.start, tok.end
      for r in range(r0, r1 + 1):
        row = blank[r - 1]
        start, end = (c0 if r == r0 else 0), (c1 if r == r1 else len(row))
        row[start:end] = " " * (end - start)
  return ["".join(row) for row in blank]


def _violations(patterns: dict[str, str], exclude=(COMPAT_DIR,), root=ROOT) -> list[str]:
  """'file:line: what: code' for every code line of jact/**/*.py (under
  `root`) outside the paths starting with one of `exclude` that matches one
  of `patterns` (what -> regex)."""
  compiled = {what: re.compile(rx) for what, rx in patterns.items()}
  found = []
  for path in sorted((root / "jact").rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if rel.startswith(tuple(exclude)):
      continue
    for number, line in enumerate(_code_lines(path), 1):
      for what, rx in compiled.items():
        if rx.search(line):
          found.append(f"{rel}:{number}: {what}: {line.strip()}")
  return found


# Private or undocumented JAX, allowed only in jact/_compat/. Public
# experimental `jax.experimental.pallas` (the kernels' API) is not gated.
JAX_PATTERNS = {
  "private jax module": r"\bjax\._src\b|\b_src\.|from\s+jax\s+import\s+_src\b",
  "jax.interpreters": r"\bjax\.interpreters\b",
  "jax.extend (semi-public)": r"\bjax\.extend\b|\bjex_core\b",
  "jax.core": r"\bjax\.core\b|from\s+jax\s+import\s+(\(\s*)?([\w\s,]*,\s*)?core\b",
  "primitive compared by name": r"\bprim(itive)?\.name\s*(==|!=|\bin\b|\bnot\s+in\b)",
  "class compared by name": r"\"CheckpointName\"|'CheckpointName'|__name__\s*(==|!=)\s*[\"']",
  "equation params": r"\.params\s*(\[|\.get\b|\.items\b|\.keys\b|\.values\b)|get_bind_params",
  "equation context": r"\bctx\.manager\b",
  "checkpoint name from policy params": r"\bparams\.get\(\s*[\"']name[\"']\s*\)",
  "literal value": r"\.val\b",
  "jaxpr rebuilt": r"\.replace\(\s*invars\s*=",
  "aval duck-typing": r"hasattr\([^)]*[\"']aval[\"']\s*\)",
  "device client": r"\.client\b|\bplatform_version\b",
  "VJP object layout": (
    r"\b(tree|tree_util)\.(tree_)?(flatten|leaves|structure|unflatten)\("
    r"[^)]*\b(vjp\w*|out_shape\[1\])"
  ),
}


def test_no_private_jax_access_outside_compat():
  found = _violations(JAX_PATTERNS)
  assert not found, (
    "private/internal JAX access outside jact/_compat/ (add a small named "
    "function there, with its public replacement and a probe beside it):\n" + "\n".join(found)
  )


def test_gate_catches_each_pattern(tmp_path):
  """Each JAX pattern matches its idiom in code and ignores it in prose."""
  samples = {
    "private jax module": "from jax._src import core",
    "jax.interpreters": "from jax.interpreters import ad",
    "jax.extend (semi-public)": "from jax.extend import core as jex_core",
    "jax.core": "x = jax.core.Tracer",
    "primitive compared by name": "ok = eqn.primitive.name == 'cond'",
    "class compared by name": "ok = type(p).__name__ == 'CheckpointName'",
    "equation params": "b = eqn.params['branches']",
    "equation context": "with eqn.ctx.manager: pass",
    "checkpoint name from policy params": "name = params.get('name')",
    "literal value": "read = lambda v: env[v] if ok else v.val",
    "jaxpr rebuilt": "p = jaxpr.replace(invars=[])",
    "aval duck-typing": "ok = hasattr(x, 'aval')",
    "device client": "v = jax.devices()[0].client.platform_version",
    "VJP object layout": "leaves, tree = jax.tree.flatten(vjp)",
  }
  assert set(samples) == set(JAX_PATTERNS)
  pkg = tmp_path / "jact"
  pkg.mkdir()
  body = "\n".join(f"def f{i}():\n  {line}\n" for i, line in enumerate(samples.values()))
  (pkg / "bad.py").write_text(body)
  (pkg / "prose.py").write_text(
    '"""'
    + "\n".join(samples.values())
    + '"""\n'
    + "\n".join(f"# {line}" for line in samples.values())
    + "\n"
  )
  (pkg / "_compat").mkdir()
  (pkg / "_compat" / "calls.py").write_text(body)  # the compat modules may
  found = _violations(JAX_PATTERNS, root=tmp_path)
  assert all(f.startswith("jact/bad.py:") for f in found), found
  assert {f.split(": ")[1] for f in found} == set(samples)
