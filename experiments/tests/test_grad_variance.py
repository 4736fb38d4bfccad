"""`experiments.papers.grad_variance --small` on the real CIFAR-10 kit, and its resumption.

Checked: every method has a finite positive variance; the uniform plans' compression
variance falls as bits rise (at 1/2/4/8 bits the (2^b - 1)^-2 factor differs by 9x or
more between neighbours, far above the 4-seed spread); the result is written as
complete; a second run with the same settings keeps the measured checkpoint (same
rows, `kept_from` recorded) instead of measuring it again, and `--fresh` does not.

The net is `--small`'s with one stage (`--widths 8`: stem, one pre-act block, head):
the properties are about the quantizer's (2^b - 1)^-2 factor and the resumption,
not depth; each plan compiles the gradient once, so one stage costs a third of three.
"""

import json
import math

import pytest

from experiments.papers import grad_variance

pytestmark = pytest.mark.slow  # compiles the ResNet's gradient per plan and both estimators


def test_small_run_and_resume(tmp_path, monkeypatch):
  args = ["--small", "--widths", "8", "--results", str(tmp_path), "--runs", str(tmp_path / "runs")]
  first = grad_variance.main(args)
  rows = first["checkpoints"]["0"]
  assert first["complete"] and [r["method"] for r in rows][:5] == ["sampling"] + ["uniform"] * 4
  assert {r["method"] for r in rows} >= set(grad_variance.ESTIMATORS)
  assert all(math.isfinite(r["variance"]) and r["variance"] > 0 for r in rows)
  uniform = [r["variance"] for r in rows if r["method"] == "uniform"]
  assert all(a > b for a, b in zip(uniform, uniform[1:])), uniform
  written = json.loads((tmp_path / "grad_variance_small.json").read_text())
  assert written["checkpoints"] == first["checkpoints"]

  def must_not_measure(*a, **k):
    raise AssertionError("a kept checkpoint was measured again")

  with monkeypatch.context() as m:
    m.setattr(grad_variance, "measure_checkpoint", must_not_measure)
    again = grad_variance.main(args)
  assert again["checkpoints"] == first["checkpoints"] and again["complete"]
  assert again["meta"]["kept_from"]["date"] == first["meta"]["date"]
  with monkeypatch.context() as m:
    m.setattr(grad_variance, "measure_checkpoint", must_not_measure)
    with pytest.raises(AssertionError, match="measured again"):
      grad_variance.main([*args, "--fresh"])
