"""A whole model in one `jact.compressed` call cuts compiled memory like
per-block wrapping does (compile-only: XLA's temp memory of the gradient).

Residuals are compressed as soon as the forward pass is done with them and
rebuilt just before their first use in the backward pass; compressed only
after the whole forward pass (and rebuilt all at its start) they would all
be alive at full precision at once and the peak would not move.
"""

import pytest

from experiments.bench_whole_model import measure

pytestmark = pytest.mark.slow  # three compilations of an 8-block stack's gradient (~15 s)


def test_whole_model_wrap_matches_per_block_wrap_on_a_cnn_stack():
  temp = {row["mode"]: row["temp_bytes"] for row in measure("relu_cnn", bits=2)}
  assert temp["whole"] <= 1.3 * temp["per_block"], temp
  assert temp["whole"] * 3 <= temp["plain"], temp
