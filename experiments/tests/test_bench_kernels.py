"""The kernel benchmark runs end to end (tiny sizes, CPU) and writes its JSON."""

import json

import pytest

from experiments.bench import bench_kernels


@pytest.mark.slow
def test_bench_kernels_smoke(tmp_path):
  out = tmp_path / "bench.json"
  rows = bench_kernels.main(
    [
      "--sizes-mb",
      "0.25",
      "--reps",
      "2",
      "--rotate-mb",
      "0.5",
      "--impls",
      "xla",
      "--json",
      str(out),
    ]
  )
  ops = {r["op"] for r in rows}
  assert ops == set(bench_kernels.CASES)
  assert all(r["bit_exact_vs_xla_on_device"] and r["gbps"] > 0 and r["copy_gbps"] > 0 for r in rows)
  saved = json.loads(out.read_text())
  assert saved["meta"]["backend"] == "cpu" and len(saved["rows"]) == len(rows)


@pytest.mark.slow
def test_bench_kernels_compares_a_pallas_kernel_with_the_reference(tmp_path):
  rows = bench_kernels.main(
    [
      "--sizes-mb",
      "0.0625",
      "--reps",
      "1",
      "--rotate-mb",
      "0",
      "--impls",
      "xla",
      "pallas_triton",
      "--ops",
      "relu_mask",
      "--json",
      str(tmp_path / "b.json"),
    ]
  )
  pallas = [r for r in rows if r["impl"] == "pallas_triton"]
  assert len(pallas) == 1 and pallas[0]["bit_exact_vs_xla_on_device"]
  assert pallas[0]["speedup_vs_xla"] is not None
