"""`experiments.papers.fp8_compare --small` on the real CIFAR-10 kit (one stage, two seeds)
and on tiny Shakespeare (the char LM, one seed).

Checked: the deterministic methods (round-to-nearest FP8 and 8-bit codes) have no
variance over keys and the stochastic ones some; the integer codes' error falls as
their width rises (the (2^b - 1)^-2 factor: 9x and more between 2, 4 and 8 bits, far
above the spread of two seeds), e5m2's (2 mantissa bits) is above e4m3's (3); the bytes
per value are the compressors' (8.25 bits for MXFP8, 8/4/2 + 1/8 for groups of 256);
the summary has each method over both seeds, and the JSON is written complete.
"""

import json

import pytest

from experiments.papers import fp8_compare

pytestmark = pytest.mark.slow  # compiles the ResNet's gradient once per method


def test_small_run(tmp_path):
  args = ["--small", "--widths", "8", "--seeds", "0", "1", "--results", str(tmp_path)]
  result = fp8_compare.main(args)
  assert result["complete"]
  assert json.loads((tmp_path / "fp8_compare_small.json").read_text())["seeds"] == json.loads(
    json.dumps(result["seeds"])
  )
  for measured in result["seeds"].values():
    rows = {r["method"]: r for r in measured["rows"]}
    assert set(rows) == set(fp8_compare.METHODS)
    for r in rows.values():
      assert (r["variance"] > 0) == r["unbiased"], r
      assert r["error"] > 0
    assert rows["int2"]["error"] > rows["int4"]["error"] > rows["int8"]["error"]
    assert rows["fp8_e5m2"]["error"] > rows["fp8_e4m3"]["error"]
    per_value = {m: r["bytes_per_value"] for m, r in rows.items()}
    assert per_value["fp8_e4m3"] == per_value["fp8_e5m2"] == pytest.approx(8.25 / 8, rel=1e-3)
    assert per_value["int8"] == pytest.approx(8.125 / 8, rel=1e-2)
    assert per_value["int2"] == pytest.approx(2.125 / 8, rel=1e-2)
  summary = result["summary"]
  assert set(summary) == set(fp8_compare.METHODS)
  assert all(
    s["seeds"] == 2 and s["error_over_sampling"]["std"] is not None for s in summary.values()
  )


def test_small_char_lm_run(tmp_path):
  args = ["--small", "--model", "char_lm", "--seeds", "0", "--results", str(tmp_path)]
  result = fp8_compare.main(args)
  assert result["complete"] and (tmp_path / "fp8_compare_char_lm_small.json").exists()
  rows = {r["method"]: r for r in result["seeds"]["0"]["rows"]}
  assert all((r["variance"] > 0) == r["unbiased"] and r["error"] > 0 for r in rows.values())
  assert rows["int2"]["error"] > rows["int4"]["error"] > rows["int8"]["error"]
  assert rows["fp8_e5m2"]["error"] > rows["fp8_e4m3"]["error"]
