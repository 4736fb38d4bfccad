"""experiments.gpu_campaign: its chunk list, and a smoke run on CPU.

The smoke run of all eleven chunks takes about 160 s of CPU time (3-6 minutes
of wall time on a 2-core machine): too much for every CI run. The test runs
the chunks whose measurement code exists only for the campaign
(`experiments.gpu_measures`) plus the kernels' bit-exactness chunk, and checks
that each command line is accepted by its script, runs to exit code 0 and
leaves its JSON, and that the summary says loudly that it is no GPU figure.
The whole smoke run: `python -m experiments.gpu_campaign --smoke --out DIR`.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import gpu_campaign

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOKE_CHUNKS = ["kernels_exact", "kernel_extras", "offload_attention", "ordering"]


def test_list_prints_every_chunk_with_its_commands(capsys):
  assert gpu_campaign.main(["--list"]) == 0
  out = capsys.readouterr().out
  for group in gpu_campaign.GROUPS:
    assert f"{group} (about" in out
  for chunk in gpu_campaign.CHUNKS:
    assert chunk.name in out and f"-m experiments.{chunk.module}" in out
  assert out.count("    gpu:   python -m experiments.") == len(gpu_campaign.CHUNKS)
  assert out.count("    smoke: python -m experiments.") == len(gpu_campaign.CHUNKS)


def test_groups_fit_three_device_calls_of_nine_minutes():
  assert gpu_campaign.GROUPS == ("group1", "group2", "group3")
  for group in gpu_campaign.GROUPS:
    chunks = gpu_campaign.select([group])
    assert chunks and all(c.group == group for c in chunks)
    assert sum(c.gpu_minutes for c in chunks) <= 9
  assert gpu_campaign.select(None) == list(gpu_campaign.CHUNKS)
  assert [c.name for c in gpu_campaign.select(["ordering", "group1"])][-1] == "ordering"
  with pytest.raises(ValueError, match="unknown chunks"):
    gpu_campaign.select(["group9"])
  cmd = gpu_campaign.command(gpu_campaign.CHUNKS[0], smoke=True, json_path="x.json")
  assert cmd[:3] == [sys.executable, "-m", "experiments.bench_kernels"]
  assert cmd[-2:] == ["--json", "x.json"]


@pytest.mark.slow
def test_a_chunk_past_its_timeout_or_the_deadline_is_recorded(tmp_path):
  assert gpu_campaign.main(["--out", str(tmp_path), "--chunks", "memory_scaling",
                            "--timeout-s", "1"]) == 1
  entry = json.loads((tmp_path / "memory_scaling.json").read_text())
  assert entry["timed_out"] and entry["exit_code"] != 0 and entry["result"] is None
  assert gpu_campaign.main(["--out", str(tmp_path), "--chunks", "ordering",
                            "--deadline-s", "1"]) == 1
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert set(summary["chunks"]) == {"memory_scaling", "ordering"}  # earlier entries kept
  assert summary["chunks"]["ordering"]["skipped"] and not summary["all_exit_zero"]


@pytest.mark.slow
def test_smoke_run_on_cpu(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, "-m", "experiments.gpu_campaign", "--out", str(tmp_path),
                        "--chunks", *SMOKE_CHUNKS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
  assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
  assert "SMOKE RUN ON CPU: NO GPU FIGURE" in run.stdout
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["smoke"] and not summary["on_gpu"] and summary["backend"] == "cpu"
  assert summary["note"] == "smoke run on cpu: no GPU figure"
  assert summary["jax"] and summary["jaxlib"] and summary["date"] and summary["all_exit_zero"]
  assert list(summary["chunks"]) == SMOKE_CHUNKS
  for chunk in gpu_campaign.select(SMOKE_CHUNKS):
    entry = summary["chunks"][chunk.name]
    assert entry["exit_code"] == 0 and not entry["timed_out"] and not entry["gpu_figure"]
    assert entry["command"].startswith(f"python -m experiments.{chunk.module} ")
    assert entry["seconds"] > 0 and entry["device"] and entry["jax"]
    record = json.loads((tmp_path / f"{chunk.name}.json").read_text())
    assert record["note"] == "smoke run on cpu: no GPU figure"
    assert record["result"], f"{chunk.name} wrote no JSON"
