"""`experiments.bench.time_model` (predicted step times for an H200) runs and writes its JSON."""

import importlib.util
import json

import pytest

from jact import _gpu_target

needs_plugin = pytest.mark.skipif(
  importlib.util.find_spec("jax_plugins.xla_cuda12") is None
  and importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
  reason=f"no CUDA PJRT plugin to compile for a GPU: {_gpu_target.install_hint()}",
)


@needs_plugin
@pytest.mark.slow
def test_time_model_small_runs_and_writes_its_json(tmp_path):
  from experiments.bench import time_model

  path = tmp_path / "tm.json"
  assert time_model.main(["--small", "--json", str(path)]) == 0
  out = json.loads(path.read_text())
  assert out["meta"]["target"] == "h200"
  assert {r["program"] for r in out["rows"]} >= {"resnet50/plain", "lm/plain"}
  assert all(r["predicted_ms"] > 0 for r in out["rows"])
