"""The models `experiments.bench.bench_fit` fits into budgets, each on real data: an 8-block
plain-JAX transformer LM whose blocks are `jact.segment`s (bits and remat), the zoo's linen
transformer LM through `jact.convert` (bits) and ResNet-50 at 224x224 through `jact.convert`
(bits; CIFAR-10 images resized to 224)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jact
from experiments.lib import data, models, zoo

__all__ = ["Subject", "SUBJECTS", "stack_block", "stack_lm", "stack_params", "shakespeare"]


@dataclasses.dataclass(frozen=True)
class Subject:
  """A loss to fit: `plain(*args)` is the unconverted model (the budgets' reference),
  `loss(*args)` the one `jact.fit` configures; `args_for(batch)` real arguments."""

  name: str
  plain: Callable[..., Any]
  loss: Callable[..., Any]
  args_for: Callable[[int], tuple]
  batch: int
  calibration_batch: int
  key_arg: int | None = None  # the position of the loss's own rounding key (converted models)


def _layer_norm(h, scale):
  mu = h.mean(-1, keepdims=True)
  return (h - mu) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-6) * scale


def stack_block(p, x, heads=4):
  """A pre-LN causal transformer block in plain JAX."""
  b, s, d = x.shape
  h = _layer_norm(x, p["ln1"])
  q, k, v = jnp.split((h @ p["wqkv"]).reshape(b, s, 3 * heads, d // heads), 3, axis=2)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
  logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e9)
  a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v).reshape(b, s, d)
  x = x + a @ p["wo"]
  return x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["w1"]) @ p["w2"]


def stack_params(key, vocab, blocks, d, mlp):
  ks = iter(jax.random.split(key, 4 * blocks + 2))
  n = lambda *s: jax.random.normal(next(ks), s) / math.sqrt(s[0])
  block = lambda: {
    "ln1": jnp.ones(d),
    "ln2": jnp.ones(d),
    "wqkv": n(d, 3 * d),
    "wo": n(d, d),
    "w1": n(d, mlp),
    "w2": n(mlp, d),
  }
  return {
    "embed": n(vocab, d) * math.sqrt(vocab),
    "blocks": [block() for _ in range(blocks)],
    "head": n(d, vocab),
  }


def stack_lm(blocks: int = 8, segments: bool = True):
  """`loss(params, tokens, labels)` of an LM whose blocks are `jact.segment`s (or plain)."""
  wrap = lambda i: (
    jact.segment(stack_block, name=f"block{i}", compress_argnums=(1,)) if segments else stack_block
  )
  layers = [wrap(i) for i in range(blocks)]

  def loss(params, tokens, labels):
    x = params["embed"][tokens]
    for layer, p in zip(layers, params["blocks"]):
      x = layer(p, x)
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss


def shakespeare(batch, length, seed=0):
  """`batch` windows of tiny Shakespeare (character ids): inputs and next-character labels."""
  text = data._data_file("tinyshakespeare/input.txt").read_text()  # pylint: disable=protected-access
  vocab = sorted(set(text))
  lookup = np.zeros(max(map(ord, vocab)) + 1, np.int32)
  lookup[[ord(c) for c in vocab]] = np.arange(len(vocab))
  ids = lookup[np.frombuffer(text.encode("ascii"), np.uint8)]
  starts = np.random.default_rng(seed).integers(0, len(ids) - length - 1, batch)
  seq = np.stack([ids[s : s + length + 1] for s in starts])
  return jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:])


def _stack_subject(batch=16, length=256, d=256, mlp=1024) -> Subject:
  params = stack_params(jax.random.key(0), zoo.LM_CONFIG.vocab_size, 8, d, mlp)
  args_for = lambda b: (params, *shakespeare(b, length))
  return Subject("stack8", stack_lm(8, False), stack_lm(8, True), args_for, batch, 4)


def _zoo_lm_subject(batch=32, length=256) -> Subject:
  cfg = dataclasses.replace(zoo.LM_CONFIG, num_layers=4, max_len=length)
  plain_model = zoo.TransformerLM(cfg)
  model = jact.convert(plain_model, bits=4)
  tokens, _ = shakespeare(2, length)
  params = plain_model.init(jax.random.key(0), tokens)

  def plain(params, tokens, labels, key):
    logits = plain_model.apply(params, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def loss(params, tokens, labels, key):
    logits = model.apply(params, tokens, rngs={"jact": key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  args_for = lambda b: (params, *shakespeare(b, length), jax.random.key(1))
  return Subject("zoo_lm", plain, loss, args_for, batch, 4, key_arg=3)


def _resnet50_subject(batch=8) -> Subject:
  layers = lambda L: models.ResNet50(num_classes=10, stem="imagenet", layers=L)
  plain_model, model = layers(models.plain_layers()), jact.convert(layers(models.plain_layers()))
  x, y, _, _ = data.load_image_dataset("cifar10")
  mean, std = x.mean(axis=(0, 1, 2)), x.std(axis=(0, 1, 2))

  def images(b):
    small = jnp.asarray((x[:b] - mean) / std, jnp.float32)
    return jax.image.resize(small, (b, 224, 224, 3), "bilinear"), jnp.asarray(y[:b])

  variables = plain_model.init(jax.random.key(0), jnp.zeros((1, 224, 224, 3)), train=False)

  def plain(params, images, labels, key):
    out, _ = plain_model.apply(
      {**variables, "params": params}, images, train=True, mutable=["batch_stats"]
    )
    return optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()

  def loss(params, images, labels, key):
    out, _ = model.apply(
      {**variables, "params": params},
      images,
      train=True,
      mutable=["batch_stats"],
      rngs={"jact": key},
    )
    return optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()

  args_for = lambda b: (variables["params"], *images(b), jax.random.key(1))
  return Subject("resnet50_224", plain, loss, args_for, batch, 2, key_arg=3)


SUBJECTS = {
  "stack8": _stack_subject,
  "zoo_lm": _zoo_lm_subject,
  "resnet50_224": _resnet50_subject,
}
