"""`experiments.bench.bench_whole_model` on a CNN stack: a whole model in one
`jact.compressed` call cuts compiled memory like per-block wrapping does."""

import pytest

from experiments.bench.bench_whole_model import measure

pytestmark = pytest.mark.slow  # three compilations of an 8-block stack's gradient (~15 s)


@pytest.fixture(scope="module")
def cnn_temp():
  return {row["mode"]: row["temp_bytes"] for row in measure("relu_cnn", bits=2)}


def test_whole_model_wrap_cuts_a_cnn_stack_3x_below_plain(cnn_temp):
  assert cnn_temp["whole"] * 3 <= cnn_temp["plain"], cnn_temp


def test_whole_model_wrap_within_1_3x_of_per_block_wrap_on_a_cnn_stack(cnn_temp):
  assert cnn_temp["whole"] <= 1.3 * cnn_temp["per_block"], cnn_temp
