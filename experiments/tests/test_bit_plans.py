"""`experiments.papers.bit_plans`: its plans are checked before they are written, and the
committed results hold real widths for every model (a plan that leaves every
residual uncompressed means the names did not match, as once for the transformer)."""

from __future__ import annotations

import json

import pytest

from experiments.lib import paths
from experiments.papers import bit_plans

RESULTS = paths.RESULTS


def _model(names, analytic, numeric):
  return dict(names=names, times=["step 0"] * len(analytic), analytic=analytic, numeric=numeric)


def test_check_plans_rejects_names_that_are_not_strings():
  with pytest.raises(ValueError, match="names must be strings"):
    bit_plans.check_plans(_model([("b0.fc.lhs", 512)], [[2]], [[2]]), "transformer")


def test_check_plans_rejects_plans_that_compress_nothing():
  with pytest.raises(ValueError, match="uncompressed"):
    bit_plans.check_plans(_model(["a", "b"], [[None, None]], [[None, None]]), "transformer")


def test_check_plans_accepts_real_widths_and_residuals_left_uncompressed():
  bit_plans.check_plans(_model(["a", "b"], [[None, 4]], [[2, 2]]), "transformer")


@pytest.mark.parametrize("model", ["resnet", "transformer"])
def test_committed_plans_give_widths(model):
  result = json.loads((RESULTS / "bit_plans.json").read_text())
  bit_plans.check_plans(result[model], model)
  assert result[model]["times"], f"{model}: no plan recorded"
