"""experiments.bench.memory_batch: the batch search, the block-wise models, and the small run."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from experiments.bench import memory_batch as mb
from experiments.lib import batch_search, preact, zoo


def affine_probe(per_example: float, fixed: float, calls: list):
  def probe(batch):
    calls.append(batch)
    return {"batch": batch, "step_mib": fixed + per_example * batch}

  return probe


@pytest.mark.parametrize(
  "per_example,fixed,start", [(3.0, 10.0, 16), (0.7, 5.0, 64), (50.0, 0.0, 64), (1.0, 0.0, 8)]
)
def test_search_finds_the_last_batch_within_the_cap(per_example, fixed, start):
  calls = []
  cap, granularity, upper = 400.0, 8, 1024
  best, probes = batch_search.search_batch(
    affine_probe(per_example, fixed, calls), cap, start, granularity, upper
  )
  exact = min(upper, int((cap - fixed) / per_example) // granularity * granularity)
  assert best == exact
  assert len(calls) == len(set(calls))  # each batch measured once
  assert [p["batch"] for p in probes] == sorted(calls)
  assert all(b % granularity == 0 and b <= upper for b in calls)
  assert batch_search.check_search(best, probes, cap, granularity, upper) == {
    "consistent": True,
    "monotone": True,
  }


def test_search_when_nothing_or_everything_fits():
  assert batch_search.search_batch(lambda b: {"batch": b, "step_mib": 1e9}, 10, 64, 16, 256)[0] == 0
  assert (
    batch_search.search_batch(lambda b: {"batch": b, "step_mib": 0.0}, 10, 64, 16, 256)[0] == 256
  )
  errors = lambda b: {"batch": b, "error": "boom"} if b > 32 else {"batch": b, "step_mib": 1.0}
  assert batch_search.search_batch(errors, 10, 64, 16, 256)[0] == 32  # an error does not fit


def test_check_search_flags_an_unbacked_answer():
  fits, over = {"step_mib": 1.0}, {"step_mib": 99.0}
  probes = [{"batch": 16, **fits}, {"batch": 32, **over}, {"batch": 48, **fits}]
  assert batch_search.check_search(16, probes, 10, 16, 256) == {
    "consistent": True,
    "monotone": False,
  }
  assert not batch_search.check_search(48, probes, 10, 16, 256)["consistent"]  # 64 never measured


@pytest.mark.slow
def test_blockwise_resnet_is_preacts_network():
  params = preact.init(jax.random.key(0), widths=(4, 8), blocks=1)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 8, 3)), jnp.float32)
  want = jax.jit(functools.partial(preact.apply, form="plain"))(params, x)
  for method in ("plain", "remat", "jact_checkpoint", "offload"):
    got = jax.jit(mb.resnet_blockwise_logits, static_argnums=3)(
      params, x, jax.random.key(1), method
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=method)


@pytest.mark.slow
def test_blockwise_lm_is_the_zoo_model():
  cfg = zoo.LMConfig(emb_dim=16, num_heads=2, num_layers=2, mlp_dim=32, max_len=8)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 65, (2, 8)), jnp.int32)
  params = mb.init_params("transformer_lm", dataclasses.replace(mb.SMALL, lm=cfg))
  want = jax.jit(zoo.TransformerLM(cfg).apply)({"params": params}, tokens)
  for method in ("plain", "remat", "jact_checkpoint", "offload"):
    got = jax.jit(mb.lm_blockwise_logits, static_argnums=(3, 4))(
      params, tokens, jax.random.key(1), cfg, method
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=method)


def test_compressed_differentiates_through_pad():
  # jact.checkpoint of preact's block (a zero-padded shortcut) once raised
  # "unhashable type: 'Literal'" while planning its residuals.
  x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)
  f = jact.compressed(lambda w, x: jnp.tanh(jnp.pad(x, ((0, 0), (0, 4))) * w), bits=4)
  grad = jax.jit(jax.grad(lambda x: f(2.0, x, key=jax.random.key(0)).sum()))(x)
  want = jax.grad(lambda x: jnp.tanh(x * 2.0).sum())(x)
  np.testing.assert_allclose(grad, want, atol=0.1)


def test_offload_is_reported_unsupported_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU answer")
  support = mb.offload_support()
  assert support["supported"] is False
  assert support["reason"].startswith("unsupported on cpu")


@pytest.mark.slow
def test_small_run(tmp_path):
  """The small mode end to end: every probe in its own process, real RSS."""
  config = mb.SMALL
  out = mb.run(
    mb.SMALL_MODELS,
    mb.SMALL_METHODS,
    config,
    tmp_path,
    argv=["--small"],
    suffix="_small",
    log=lambda line: None,
  )
  written = json.loads((tmp_path / "memory_batch_small.json").read_text())
  assert written["meta"]["command"] == "python -m experiments.bench.memory_batch --small"
  assert written["settings"]["cap_mib"] == config.cap_mib
  result = out["models"]["resnet20"]
  assert (tmp_path / "memory_batch_small_resnet20.png").stat().st_size > 0
  largest = {}
  for method in mb.SMALL_METHODS:
    row = result["methods"][method]
    assert row["status"] == "measured" and row["consistent"] and row["monotone"], row
    by_batch = {p["batch"]: p for p in row["probes"]}
    best = largest[method] = row["largest_batch"]
    assert best > 0 and by_batch[best]["step_mib"] <= config.cap_mib
    above = best + config.granularity
    if above <= config.upper:
      assert by_batch[above]["step_mib"] > config.cap_mib
    for p in row["probes"]:
      assert p["loss"] is not None and p["compiled_step_mib"] > 0
      assert p["with_program_mib"] >= p["step_mib"] > 0
  assert largest["jact2"] >= largest["plain"]
  timing = result["timing"]
  assert timing["batch"] <= min(largest.values())
  assert timing["methods"]["plain"]["ratio_vs_plain"] == 1.0
  assert timing["methods"]["jact2"]["ratio_vs_plain"] > 0


def test_a_rerun_keeps_models_measured_with_the_same_settings(tmp_path, monkeypatch):
  """A stopped run resumes at the next model; other settings or `fresh` measure again."""
  measured = []

  def fake_measure(model, methods, config, offload, cache_dir, log):
    measured.append(model)
    return {"methods": {}, "note": f"{model} #{len(measured)}"}

  monkeypatch.setattr(mb, "measure_model", fake_measure)
  monkeypatch.setattr(mb, "plot", lambda model, result, config, path: str(path))
  methods = ("plain",)
  mb.run(("resnet20",), methods, mb.SMALL, tmp_path, suffix="_t", log=lambda line: None)
  out = mb.run(mb.MODELS, methods, mb.SMALL, tmp_path, suffix="_t", log=lambda line: None)
  assert measured == ["resnet20", "transformer_lm"]
  assert out["models"]["resnet20"]["note"] == "resnet20 #1"
  written = json.loads((tmp_path / "memory_batch_t.json").read_text())
  assert set(written["models"]) == set(mb.MODELS)

  mb.run(
    mb.MODELS,
    methods,
    dataclasses.replace(mb.SMALL, cap_mib=41),
    tmp_path,
    suffix="_t",
    log=lambda line: None,
  )
  assert measured[2:] == list(mb.MODELS)
  mb.run(
    ("resnet20",),
    methods,
    dataclasses.replace(mb.SMALL, cap_mib=41),
    tmp_path,
    suffix="_t",
    log=lambda line: None,
    fresh=True,
  )
  assert measured[4:] == ["resnet20"]
