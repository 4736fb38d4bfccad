"""jact's private / undocumented JAX accesses live in jact/_compat.py only.

* One test per compat function runs its probe (`jact._compat.check`): when an
  installed JAX changes what jact reads, the failure names the access and the
  function to update.
* Behaviour through jact: the names, residual layout and policies the compat
  functions feed are seen end to end.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jact
from jact import _compat


# ----------------------------------------------------------------------------- probes


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
  block = jact.compressed(lambda w, x: jnp.tanh(x @ w) @ w, bits=4, name="b", stochastic=False)
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
  f = jact.compressed(fn, bits=8, name="t", stochastic=False)
  names = set(jact.residual_report(lambda x, w: f(x, w).sum(), x, w).by_name())
  assert len(expected) == len(leaves) - 2 and names == expected, (names, expected)


def test_saved_residuals_helper_matches_jax_description():
  x = jnp.ones((3,))
  (aval, src), = _compat.saved_residuals(lambda x: jnp.sin(x).sum(), x)
  assert aval.shape == (3,) and "cos" in src, src
