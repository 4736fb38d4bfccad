"""experiments.lib.frontier_models: every model at tiny sizes runs, its gradient is unchanged by
`jax.checkpoint` around the blocks, the checkpoint names are marked, and full sizes count right."""

from __future__ import annotations

import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.lib import frontier_models as fm

# Tiny sizes of each model, and the bound of its integer inputs/labels.
TINY = {
  "lm_6x512": (dict(layers=2, width=16, heads=2, mlp=32, length=8, batch=2), 65),
  "resnet50_224": (dict(stages=(2, 1), width=4, image=32, batch=4, classes=10), 10),
  "vit_b16": (
    dict(layers=2, width=16, heads=2, mlp=32, image=16, patch=8, batch=2, classes=10),
    10,
  ),
  "llama1b_2048": (
    dict(layers=2, width=32, heads=4, kv_heads=2, mlp=64, vocab=50, length=8, batch=2),
    50,
  ),
  "llama1b_8192": (
    dict(layers=3, width=32, heads=4, kv_heads=1, mlp=48, vocab=50, length=16, batch=1),
    50,
  ),
}
NAMES = {"conv_out"}
TRANSFORMER_NAMES = {"qkv", "attn_out", "mlp_in", "mlp_out"}


def identity(block):
  return lambda p, x, key: block(p, x)


def remat(block, policy=None):
  return jax.checkpoint(lambda p, x, key: block(p, x), policy=policy)


def names_of(name):
  return NAMES if name.startswith("resnet") else TRANSFORMER_NAMES


def arrays(model, high, seed=0):
  """Random params (normal * 0.1) and a batch (normal images, integers in [0, high)); numpy's
  generator, not jax.random's (one small compile per shape)."""
  rng = np.random.default_rng(seed)

  def fill(s):
    if jnp.issubdtype(s.dtype, jnp.integer):
      return jnp.asarray(rng.integers(0, high, s.shape), s.dtype)
    return jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype)

  return jax.tree.map(fill, model.params), jax.tree.map(fill, model.batch)


def test_models_are_the_five():
  assert fm.MODELS == ("lm_6x512", "resnet50_224", "vit_b16", "llama1b_2048", "llama1b_8192")
  assert set(TINY) == set(fm.MODELS)


@pytest.mark.parametrize("name", fm.MODELS)
def test_tiny_loss_is_finite_and_checkpoint_leaves_the_gradient(name):
  overrides, high = TINY[name]
  model = fm.build(name, **overrides)
  params, batch = arrays(model, high)
  key = jax.random.key(1)
  value, grads = jax.jit(jax.value_and_grad(model.loss(identity)))(params, batch, key)
  assert value.shape == () and value.dtype == jnp.float32 and np.isfinite(value)
  remat_grads = jax.jit(jax.grad(model.loss(remat)))(params, batch, key)
  bf16 = name.startswith("llama")
  for g, r, p in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads), jax.tree.leaves(params)):
    assert g.dtype == r.dtype == p.dtype and g.shape == p.shape
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    np.testing.assert_allclose(
      np.asarray(g, np.float32),
      np.asarray(r, np.float32),
      rtol=2e-2 if bf16 else 1e-4,
      atol=1e-3 if bf16 else 1e-6,
    )


def _name_params(jaxpr, found):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "name":
      found.add(eqn.params["name"])
    for v in eqn.params.values():
      for sub in v if isinstance(v, (tuple, list)) else (v,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          _name_params(sub, found)
  return found


@pytest.mark.parametrize("name", fm.MODELS)
def test_checkpoint_names_are_marked_and_saved_by_a_names_policy(name, capsys):
  overrides, _ = TINY[name]
  model = fm.build(name, **overrides)
  names = names_of(name)
  policy = jax.checkpoint_policies.save_only_these_names(*names)
  loss = model.loss(lambda block: remat(block, policy))
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  jaxpr = jax.make_jaxpr(loss)(model.params, model.batch, key)
  assert _name_params(jaxpr.jaxpr, set()) == names
  if name.startswith("llama"):  # residuals of a scan are the scan's outputs, not named
    return
  jax.ad_checkpoint.print_saved_residuals(loss, model.params, model.batch, key)
  saved = capsys.readouterr().out
  saved_names = {n for n in names if f"named '{n}'" in saved}
  # "mlp_out" only feeds the residual add (whose gradient needs no operand): never a residual.
  assert saved_names == names - {"mlp_out"}, saved


def test_full_size_parameter_counts():
  counts = {name: fm.parameter_count(fm.build(name).params) for name in fm.MODELS}
  assert 0.9e9 <= counts["llama1b_2048"] == counts["llama1b_8192"] <= 1.4e9
  assert 85e6 <= counts["vit_b16"] <= 88e6  # ViT-B/16: 86.6 M
  assert 25e6 <= counts["resnet50_224"] <= 26e6  # ResNet-50: 25.6 M
  assert counts["lm_6x512"] == 19_231_809  # zoo.TransformerLM at gpu_lm's sizes


def test_full_size_shapes():
  llama = fm.build("llama1b_2048")
  assert llama.params["layers"]["wq"].shape == (16, 2048, 32, 64)
  assert llama.params["layers"]["wk"].shape == (16, 2048, 8, 64)
  assert llama.params["embed"].dtype == jnp.bfloat16
  assert [s.shape for s in llama.batch] == [(8, 2048)] * 2
  assert [s.shape for s in fm.build("llama1b_8192").batch] == [(2, 8192)] * 2
  assert fm.build("lm_6x512").batch[0].shape == (32, 512)
  assert fm.build("vit_b16").batch[0].shape == (64, 224, 224, 3)
  resnet = fm.build("resnet50_224")
  assert resnet.batch[0].shape == (128, 224, 224, 3) and len(resnet.params["blocks"]) == 16
  assert resnet.params["head"]["kernel"].shape == (2048, 1000)


def test_bad_arguments_say_what_is_allowed():
  with pytest.raises(ValueError, match="unknown model"):
    fm.build("gpt5")
  with pytest.raises(ValueError, match="no size"):
    fm.build("vit_b16", depth=3)
  with pytest.raises(ValueError, match="attention must be"):
    fm.build("lm_6x512", attention="flash")
  with pytest.raises(ValueError, match="no attention"):
    fm.build("resnet50_224", attention="cudnn")


@pytest.mark.parametrize("name", ["lm_6x512", "vit_b16", "llama1b_2048"])
def test_cudnn_attention_traces(name, monkeypatch):
  """Traced only (cuDNN runs on a GPU); without the cuDNN library jax refuses even to trace, so
  its version check is stubbed here."""
  fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
  if not hasattr(fa, "check_cudnn_version"):
    pytest.skip("this jax has no cuDNN version check to stub")
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
  overrides, _ = TINY[name]
  overrides = dict(overrides, width=32, heads=2)  # cuDNN: head dim a multiple of 8
  model = fm.build(name, attention="cudnn", **overrides)
  assert "attention cudnn" in model.description
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  grads = jax.eval_shape(jax.grad(model.loss(identity)), model.params, model.batch, key)
  assert jax.tree.map(lambda g: (g.shape, g.dtype), grads) == jax.tree.map(
    lambda p: (p.shape, p.dtype), model.params
  )
  text = str(jax.make_jaxpr(jax.grad(model.loss(identity)))(model.params, model.batch, key))
  assert "dot_product_attention_fwd" in text and "dot_product_attention_bwd" in text


def test_attention_as_written_matches_jax():
  q, k, v = jax.random.normal(jax.random.key(0), (3, 2, 8, 4, 16))
  for causal in (False, True):
    ours = fm.attend(q, k, v, causal=causal)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
  kv = jax.random.normal(jax.random.key(1), (2, 2, 8, 2, 16))  # grouped-query: 4 heads over 2
  ours = fm.attend(q, kv[0], kv[1], causal=True)
  ref = jax.nn.dot_product_attention(q, kv[0], kv[1], is_causal=True, implementation="xla")
  np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(
  importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
  reason="no CUDA PJRT plugin to compile for a GPU",
)
def test_full_size_lm_compiles_for_h200():
  import jact

  model = fm.build("lm_6x512")
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  t0 = time.perf_counter()
  mem = jact.compiled_memory(
    jax.grad(model.loss(identity)), model.params, model.batch, key, target="h200"
  )
  print(
    f"lm_6x512 grad on h200: temp {mem.temp_bytes / 2**20:.0f} MiB, "
    f"compiled in {time.perf_counter() - t0:.0f} s"
  )
  assert 0 < mem.temp_bytes < 141e9
