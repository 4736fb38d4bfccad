"""experiments.bench.frontier and its report: each kind of configuration keeps the plain gradient
(JAX's policies exactly, jact's within its 8-bit error), and README's frontier line is the one
generated from the committed results."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import pytest

from experiments.bench import frontier
from experiments.lib import frontier_models, frontier_report, paths

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _real(tree, seed=0):
  leaves, treedef = jax.tree.flatten(tree)
  rng = np.random.default_rng(seed)
  values = [
    rng.integers(0, 10, leaf.shape).astype(leaf.dtype)
    if np.issubdtype(leaf.dtype, np.integer)
    else (0.1 * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
    for leaf in leaves
  ]
  return jax.tree.unflatten(treedef, values)


# one configuration of each kind (the others differ by a policy or a width): JAX's policies,
# offload, jact.compressed, jact.convert and jact.checkpoint
KINDS = ("remat_nothing", "remat_names", "offload_inputs", "jact8", "convert8", "jact_ckpt4")


@pytest.fixture(scope="module")
def small_lm():
  """The 2-layer LM, real parameters and batch, a key and the plain gradient: the reference
  every configuration below is compared with, computed once."""
  model = frontier_models.build("lm_6x512", **dict(frontier.SMALL["lm_6x512"], layers=2))
  params, batch = _real(model.params), _real(model.batch)
  key = jax.random.key(0)
  plain = jax.grad(model.loss(frontier.wrap_for("plain")))(params, batch, key)
  return model, params, batch, key, plain


@pytest.mark.slow
@pytest.mark.parametrize("config", KINDS)
def test_every_kind_of_configuration_keeps_the_plain_gradient(small_lm, config):
  model, params, batch, key, plain = small_lm
  got = jax.grad(model.loss(frontier.wrap_for(config)))(params, batch, key)
  # JAX's policies recompute exactly; jact's rounding adds unbiased noise: the whole gradient's
  # relative error (seed 0; measured 7e-4 / 1.2e-2 / 6.2e-2 at 8 / 4 / 2 bits, ~1.2x that with
  # jact.checkpoint), bounded at about 3x
  tol = {"jact8": 0.003, "jact4": 0.04, "jact2": 0.2, "jact_ckpt4": 0.05, "jact_ckpt2": 0.3}
  tol.update({f"convert{b}": tol[f"jact{b}"] for b in (8, 4, 2)})  # measured 6.7e-4 .. 5.9e-2
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  err = np.linalg.norm(flat(got) - flat(plain)) / np.linalg.norm(flat(plain))
  assert err <= tol.get(config, 1e-6), (config, err)


def test_unknown_configuration_is_refused():
  with pytest.raises(ValueError, match="unknown configuration"):
    frontier.wrap_for("remat_everything")


def test_readme_frontier_line_is_generated_from_the_results():
  payload = frontier_report.load(paths.RESULTS / "frontier.json")
  readme = (ROOT / "README.md").read_text()
  found = re.search(r"<!-- frontier:begin -->\n(.*?)\n<!-- frontier:end -->", readme, re.S)
  assert found, "README has no frontier line between <!-- frontier:begin/end --> markers"
  assert " ".join(found.group(1).split()) == frontier_report.summary_line(payload), (
    "README's frontier line differs from experiments/results/frontier.json: paste "
    "frontier_report.summary_line(load(...))"
  )


def test_report_sides_and_floors():
  rows = [
    dict(model="m", attention="xla", config=c, peak_bytes=p, predicted_ms=t, compile_s=1.0)
    for c, p, t in [("plain", 8, 10.0), ("remat_nothing", 2, 13.0), ("jact2", 3, 15.0)]
  ]
  payload = {"rows": rows}
  assert [frontier_report.kind(r["config"]) for r in rows] == ["jax", "jax", "jact"]
  assert frontier_report.kind("fit_0.5") == "fit"
  assert frontier_report.floors(payload, "m", "xla") == {
    "jax": ("remat_nothing", 2, 13.0),
    "jact": ("jact2", 3, 15.0),
  }
  assert "| jact2 |" in frontier_report.table(payload, "m", "xla")
