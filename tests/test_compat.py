"""jact's private / undocumented JAX accesses live in jact/_compat.py only.

* One test per compat function runs its probe (`jact._compat.check`): when an
  installed JAX changes what jact reads, the failure names the access and the
  function to update.
* Behaviour through jact: the names, residual layout and policies the compat
  functions feed are seen end to end.
* Grep gate: no file of jact/ other than the compat modules touches private
  or internal JAX (`test_no_private_jax_access_outside_compat`, file:line on
  failure). Another library's gate adds its own pattern table and test
  function built on `_violations` (Flax accesses belong in jact/flax/_compat.py).
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import jax
import jax.numpy as jnp
import pytest

import jact
from jact import _compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPAT_MODULES = ("jact/_compat.py", "jact/flax/_compat.py")


# ----------------------------------------------------------------------------- probes


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(_compat.CHECKS))
def test_compat_access_still_works(name):
  _compat.check([name])


def test_every_compat_function_has_a_probe():
  functions = set(_compat.__all__) - {"CompatError", "CHECKS", "check"}
  assert functions == set(_compat.CHECKS), (
      f"without a probe in _compat.CHECKS: {sorted(functions - set(_compat.CHECKS))}; "
      f"probes of no function: {sorted(set(_compat.CHECKS) - functions)}")


def test_check_names_the_broken_access(monkeypatch):
  """A probe failing is reported with the compat function's name."""
  what, _ = _compat.CHECKS["checkpoint_name"]
  monkeypatch.setitem(_compat.CHECKS, "checkpoint_name", (what, lambda: 1 / 0))
  with pytest.raises(_compat.CompatError, match=r"jact\._compat\.checkpoint_name \(.*ZeroDivision"):
    _compat.check(["checkpoint_name", "is_var"])
  with pytest.raises(ValueError, match="no compat check named"):
    _compat.check(["not_a_function"])


def test_vjp_residuals_rejects_an_object_that_is_no_residual_pytree():
  with pytest.raises(_compat.CompatError, match=r"jact\._compat\.vjp_residuals"):
    _compat.vjp_residuals(lambda ct: ct)


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
  residual, = jact.residual_report(lambda x: jnp.sin(x).sum(), x).residuals
  assert re.search(r"test_compat\.py:\d+", residual.source), residual.source


def test_save_compressed_policy_sees_jact_names():
  """An empty report here would mean the policy saved nothing."""
  w, x = jnp.eye(256) / 16, jnp.ones((64, 256))
  block = jact.compressed(lambda w, x: jnp.tanh(x @ w) @ w, name="b",
                          compressor=jact.compressors.PerGroup(4, stochastic=False))
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
  (aval, src), = _compat.saved_residuals(lambda x: jnp.sin(x).sum(), x)
  assert aval.shape == (3,) and "cos" in src, src


# ----------------------------------------------------------------------------- grep gates


def _code_lines(path: pathlib.Path) -> list[str]:
  """The lines of `path` with comments and docstrings blanked (prose may
  name private APIs; code may not)."""
  source = path.read_text()
  lines = source.splitlines()
  docstrings = {(n.lineno, n.col_offset) for n in ast.walk(ast.parse(source))
                if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                and isinstance(n.value.value, str)}
  blank = [list(line) for line in lines]
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING
                                        and (tok.start[0], tok.start[1]) in docstrings):
      (r0, c0), (r1, c1) = tok.start, tok.end
      for r in range(r0, r1 + 1):
        row = blank[r - 1]
        start, end = (c0 if r == r0 else 0), (c1 if r == r1 else len(row))
        row[start:end] = " " * (end - start)
  return ["".join(row) for row in blank]


def _violations(patterns: dict[str, str], exclude=COMPAT_MODULES, root=ROOT) -> list[str]:
  """'file:line: what: code' for every code line of jact/**/*.py (under
  `root`) outside `exclude` that matches one of `patterns` (what -> regex)."""
  compiled = {what: re.compile(rx) for what, rx in patterns.items()}
  found = []
  for path in sorted((root / "jact").rglob("*.py")):
    rel = path.relative_to(root).as_posix()
    if rel in exclude:
      continue
    for number, line in enumerate(_code_lines(path), 1):
      for what, rx in compiled.items():
        if rx.search(line):
          found.append(f"{rel}:{number}: {what}: {line.strip()}")
  return found


# Private or undocumented JAX, allowed only in jact/_compat.py. Public
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
    "VJP object layout": (r"\b(tree|tree_util)\.(tree_)?(flatten|leaves|structure|unflatten)\("
                          r"[^)]*\b(vjp\w*|out_shape\[1\])"),
}


def test_no_private_jax_access_outside_compat():
  found = _violations(JAX_PATTERNS)
  assert not found, ("private/internal JAX access outside jact/_compat.py (add a small named "
                     "function there, with its public replacement and a probe in CHECKS):\n"
                     + "\n".join(found))


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
  (pkg / "prose.py").write_text('"""' + "\n".join(samples.values()) + '"""\n'
                                + "\n".join(f"# {line}" for line in samples.values()) + "\n")
  (pkg / "_compat.py").write_text(body)  # the compat module may
  found = _violations(JAX_PATTERNS, root=tmp_path)
  assert all(f.startswith("jact/bad.py:") for f in found), found
  assert {f.split(": ")[1] for f in found} == set(samples)
