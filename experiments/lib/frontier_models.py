"""Models for the memory/time frontier benchmark, written as ordinary JAX/Flax code, in blocks.

`build(name)` gives a `FrontierModel`: the shapes of its parameters and of one
batch (`jax.ShapeDtypeStruct`s from `jax.eval_shape`, so full sizes cost no
memory; compile with `jact.compile_for(..., target="h200")`) and `loss(wrap)`,
the mean cross-entropy with every block `(block_params, x) -> x` replaced by
`wrap(block)`, called as `(block_params, x, key)` with the loss's key folded by
the block's index. Blocks are pure functions of (params, x); inside them the
values MaxText-style policies save are marked with `checkpoint_name`: "qkv"
(the q/k/v projections), "attn_out" (attention after its output projection),
"mlp_in" (the MLP's first matmul(s), before the activation), "mlp_out"; in
ResNet blocks "conv_out" after every convolution.

Attention is written out (`softmax(q k^T / sqrt(d) + mask) v`, softmax in
float32) or, with `attention="cudnn"`, `jax.nn.dot_product_attention(...,
implementation="cudnn")` (cuDNN takes half precision only: float32 models cast
q, k, v to bfloat16 for that call and its output back; jax's cuDNN training
path takes even sequence lengths only, so ViT's 197 tokens are padded to 198
and the pad masked by `query_seq_lengths` / `key_value_seq_lengths`). jax asks
the cuDNN library for its version while *tracing* that path, so without cuDNN
installed even a compile-only trace raises "cuDNN not found". ResNet has no
attention: it takes `attention="xla"` only.

Sizes can be overridden (`build("llama1b_2048", layers=2, width=64, ...)`);
the fields of each family are those of `_Transformer`, `_ResNet`, `_Llama`.

>>> m = build("lm_6x512", layers=1, width=16, heads=2, mlp=32, length=8, batch=2)
>>> m.batch[0].shape, parameter_count(m.params)
((2, 8), 4465)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["FrontierModel", "build", "MODELS", "attend", "parameter_count"]

Block = Callable[[Any, jax.Array], jax.Array]
WrappedBlock = Callable[[Any, jax.Array, jax.Array], jax.Array]
Wrap = Callable[[Block], WrappedBlock]

ATTENTIONS = ("xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class FrontierModel:
  """A model of the frontier benchmark (see the module docstring)."""

  name: str  # e.g. "lm_6x512", "resnet50_224", "vit_b16", "llama1b_2048"
  params: Any  # pytree of jax.ShapeDtypeStruct (from jax.eval_shape of the init)
  batch: Any  # pytree of jax.ShapeDtypeStruct: (inputs, labels)
  loss: Callable[[Wrap], Callable]  # loss(wrap) -> loss_fn(params, batch, key) -> scalar
  description: str


def parameter_count(params: Any) -> int:
  """How many numbers `params` holds (arrays or `ShapeDtypeStruct`s)."""
  return sum(math.prod(p.shape) for p in jax.tree.leaves(params))


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


def attend(q, k, v, *, causal: bool, attention: str = "xla"):
  """Attention of q (B, T, H, D) over k, v (B, S, K, D); K divides H (grouped-query)."""
  b, t, h, d = q.shape
  s, kv = k.shape[1], k.shape[2]
  if attention == "cudnn":
    dtype = q.dtype
    if dtype not in (jnp.bfloat16, jnp.float16):
      q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
    lengths = {}
    if t % 2 or s % 2:  # jax's cuDNN training path wants even lengths: pad, mask by length
      pad = lambda a: jnp.pad(a, ((0, 0), (0, a.shape[1] % 2), (0, 0), (0, 0)))
      q, k, v = pad(q), pad(k), pad(v)
      lengths = dict(
        query_seq_lengths=jnp.full((b,), t, jnp.int32),
        key_value_seq_lengths=jnp.full((b,), s, jnp.int32),
      )
    out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn", **lengths)
    return out[:, :t].astype(dtype)
  q = q.reshape(b, t, kv, h // kv, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) / math.sqrt(d)
  if causal:
    logits = logits + jnp.where(jnp.tril(jnp.ones((t, s), bool)), 0.0, -1e30)
  weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", weights, v).reshape(b, t, h, d)


# ----------------------------------------------------------------------------- GPT LM and ViT


@dataclasses.dataclass(frozen=True)
class _Transformer:
  """Sizes of the GPT-style LM (`length`, `vocab`) and the ViT (`image`, `patch`, `classes`)."""

  layers: int
  width: int
  heads: int
  mlp: int
  batch: int
  length: int = 0
  vocab: int = 0
  image: int = 0
  patch: int = 0
  classes: int = 0
  dtype: str = "float32"


class TransformerBlock(nn.Module):
  """Pre-LayerNorm block: multi-head self-attention, then a gelu MLP (both residual)."""

  heads: int
  mlp: int
  causal: bool
  attention: str = "xla"
  attn_bias: bool = True
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    width = x.shape[-1]
    dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.dtype)
    proj = functools.partial(
      nn.DenseGeneral,
      (self.heads, width // self.heads),
      use_bias=self.attn_bias,
      dtype=self.dtype,
      param_dtype=self.dtype,
    )
    y = nn.LayerNorm(dtype=self.dtype, param_dtype=self.dtype, name="ln_attn")(x)
    q = checkpoint_name(proj(name="query")(y), "qkv")
    k = checkpoint_name(proj(name="key")(y), "qkv")
    v = checkpoint_name(proj(name="value")(y), "qkv")
    o = attend(q, k, v, causal=self.causal, attention=self.attention)
    o = nn.DenseGeneral(
      width,
      axis=(-2, -1),
      use_bias=self.attn_bias,
      dtype=self.dtype,
      param_dtype=self.dtype,
      name="out",
    )(o)
    x = x + checkpoint_name(o, "attn_out")
    y = nn.LayerNorm(dtype=self.dtype, param_dtype=self.dtype, name="ln_mlp")(x)
    h = checkpoint_name(dense(self.mlp, name="mlp_in")(y), "mlp_in")
    y = checkpoint_name(dense(width, name="mlp_out")(jax.nn.gelu(h)), "mlp_out")
    return x + y


def _transformer(name: str, cfg: _Transformer, attention: str, lm: bool) -> FrontierModel:
  dtype = jnp.dtype(cfg.dtype)
  block_mod = TransformerBlock(
    cfg.heads, cfg.mlp, causal=lm, attention=attention, attn_bias=not lm, dtype=dtype
  )
  norm = nn.LayerNorm(dtype=dtype, param_dtype=dtype)
  out = cfg.vocab if lm else cfg.classes
  head = nn.Dense(out, dtype=dtype, param_dtype=dtype)
  patch = nn.Conv(
    cfg.width, (cfg.patch,) * 2, cfg.patch, padding="VALID", dtype=dtype, param_dtype=dtype
  )
  tokens = cfg.length if lm else (cfg.image // cfg.patch) ** 2 + 1

  def init(key):
    ks = jax.random.split(key, cfg.layers + 4)
    x = jnp.zeros((1, tokens, cfg.width), dtype)
    params = {
      "pos_embedding": 0.02 * jax.random.normal(ks[0], (1, tokens, cfg.width), dtype),
      "blocks": [block_mod.init(ks[4 + i], x)["params"] for i in range(cfg.layers)],
      "final_norm": norm.init(ks[1], x)["params"],
      "head": head.init(ks[2], x)["params"],
    }
    if lm:  # zoo.TransformerLM's nn.Embed(embedding_init=normal(1.0))
      params["embed"] = jax.random.normal(ks[3], (cfg.vocab, cfg.width), dtype)
    else:
      image = jnp.zeros((1, cfg.image, cfg.image, 3), dtype)
      params["patch_embed"] = patch.init(ks[3], image)["params"]
      params["cls"] = jnp.zeros((1, 1, cfg.width), dtype)
    return params

  def block(p, x):
    return block_mod.apply({"params": p}, x)

  block.module = block_mod  # the Flax module it applies (frontier's jact.convert rows)

  def loss(wrap: Wrap) -> Callable:
    blocks = [wrap(block) for _ in range(cfg.layers)]

    def loss_fn(params, batch, key):
      inputs, labels = batch
      if lm:
        x = params["embed"][inputs] + params["pos_embedding"][:, : inputs.shape[1]]
      else:
        x = patch.apply({"params": params["patch_embed"]}, inputs.astype(dtype))
        x = x.reshape(x.shape[0], -1, cfg.width)
        cls = jnp.broadcast_to(params["cls"], (x.shape[0], 1, cfg.width))
        x = jnp.concatenate([cls, x], axis=1) + params["pos_embedding"]
      for i, wrapped in enumerate(blocks):
        x = wrapped(params["blocks"][i], x, jax.random.fold_in(key, i))
      x = norm.apply({"params": params["final_norm"]}, x)
      if not lm:
        x = x[:, 0]
      return _xent(head.apply({"params": params["head"]}, x), labels)

    return loss_fn

  if lm:
    batch = (
      jax.ShapeDtypeStruct((cfg.batch, cfg.length), jnp.int32),
      jax.ShapeDtypeStruct((cfg.batch, cfg.length), jnp.int32),
    )
    what = (
      f"GPT-style pre-LayerNorm decoder: {cfg.layers} layers, width {cfg.width}, {cfg.heads} "
      f"heads, gelu MLP {cfg.mlp}, causal, length {cfg.length}, batch {cfg.batch}, vocab "
      f"{cfg.vocab}, {cfg.dtype} (zoo.TransformerLM / gpu_lm sizes)"
    )
  else:
    batch = (
      jax.ShapeDtypeStruct((cfg.batch, cfg.image, cfg.image, 3), dtype),
      jax.ShapeDtypeStruct((cfg.batch,), jnp.int32),
    )
    what = (
      f"ViT: {cfg.image}x{cfg.image} images, patch {cfg.patch} ({tokens} tokens with cls), "
      f"{cfg.layers} pre-LayerNorm layers, width {cfg.width}, {cfg.heads} heads, gelu MLP "
      f"{cfg.mlp}, batch {cfg.batch}, {cfg.classes} classes, {cfg.dtype}"
    )
  params = jax.eval_shape(init, jax.random.key(0))
  return FrontierModel(name, params, batch, loss, f"{what}; attention {attention}")


# ----------------------------------------------------------------------------- ResNet-50


@dataclasses.dataclass(frozen=True)
class _ResNet:
  stages: tuple[int, ...] = (3, 4, 6, 3)
  width: int = 64
  image: int = 224
  batch: int = 128
  classes: int = 1000


class BatchNorm(nn.Module):
  """Train-mode batch normalization: the batch's own mean and variance, no running averages.

  A pure function of (params, x) -- the statistics are computed in the block and
  no `batch_stats` collection is kept, so a block can be checkpointed or
  compressed like any other. (Evaluation would need running averages; the
  benchmark only trains.)
  """

  epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
    bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],))
    mean = jnp.mean(x, axis=(0, 1, 2))
    var = jnp.var(x, axis=(0, 1, 2))
    return (x - mean) * jax.lax.rsqrt(var + self.epsilon) * scale + bias


class Bottleneck(nn.Module):
  """ResNet v1.5 bottleneck (stride in the 3x3 conv), projection shortcut when shapes change."""

  filters: int
  strides: int = 1

  @nn.compact
  def __call__(self, x):
    conv = functools.partial(nn.Conv, use_bias=False)
    y = checkpoint_name(conv(self.filters, (1, 1), name="conv1")(x), "conv_out")
    y = jax.nn.relu(BatchNorm(name="bn1")(y))
    y = checkpoint_name(conv(self.filters, (3, 3), self.strides, name="conv2")(y), "conv_out")
    y = jax.nn.relu(BatchNorm(name="bn2")(y))
    y = checkpoint_name(conv(4 * self.filters, (1, 1), name="conv3")(y), "conv_out")
    y = BatchNorm(name="bn3")(y)
    if x.shape != y.shape:
      x = checkpoint_name(conv(4 * self.filters, (1, 1), self.strides, name="proj")(x), "conv_out")
      x = BatchNorm(name="proj_bn")(x)
    return jax.nn.relu(x + y)


class _Stem(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.width, (7, 7), 2, padding=[(3, 3), (3, 3)], use_bias=False, name="conv")(x)
    x = jax.nn.relu(BatchNorm(name="bn")(x))
    return nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))


def _applying(mod: nn.Module) -> Callable:
  """The block `(params, x) -> mod.apply(...)`, its module as `.module`."""

  def block(p, x):
    return mod.apply({"params": p}, x)

  block.module = mod
  return block


def _resnet(name: str, cfg: _ResNet, attention: str) -> FrontierModel:
  if attention != "xla":
    raise ValueError(f"{name} has no attention; attention={attention!r} does not apply")
  stem, head = _Stem(cfg.width), nn.Dense(cfg.classes)
  mods = [
    Bottleneck(cfg.width * 2**i, 2 if i > 0 and j == 0 else 1)
    for i, n in enumerate(cfg.stages)
    for j in range(n)
  ]

  def init(key):
    ks = jax.random.split(key, len(mods) + 2)
    x = jnp.zeros((1, cfg.image, cfg.image, 3), jnp.float32)
    params = {"stem": stem.init(ks[0], x)["params"], "blocks": []}
    x = stem.apply({"params": params["stem"]}, x)
    for mod, k in zip(mods, ks[2:]):
      params["blocks"].append(mod.init(k, x)["params"])
      x = mod.apply({"params": params["blocks"][-1]}, x)
    params["head"] = head.init(ks[1], jnp.mean(x, axis=(1, 2)))["params"]
    return params

  def loss(wrap: Wrap) -> Callable:
    blocks = [wrap(_applying(mod)) for mod in mods]

    def loss_fn(params, batch, key):
      images, labels = batch
      x = stem.apply({"params": params["stem"]}, images)
      for i, wrapped in enumerate(blocks):
        x = wrapped(params["blocks"][i], x, jax.random.fold_in(key, i))
      return _xent(head.apply({"params": params["head"]}, jnp.mean(x, axis=(1, 2))), labels)

    return loss_fn

  batch = (
    jax.ShapeDtypeStruct((cfg.batch, cfg.image, cfg.image, 3), jnp.float32),
    jax.ShapeDtypeStruct((cfg.batch,), jnp.int32),
  )
  what = (
    f"ResNet-50 v1.5: bottleneck stages {cfg.stages}, widths {cfg.width}..."
    f"{4 * cfg.width * 2 ** (len(cfg.stages) - 1)}, train-mode BatchNorm (no running averages), "
    f"relu, imagenet stem (7x7/2 conv, 3x3/2 max pool), {cfg.image}x{cfg.image} images, batch "
    f"{cfg.batch}, {cfg.classes} classes, float32 (models.ResNet50 / bench_train_step)"
  )
  params = jax.eval_shape(init, jax.random.key(0))
  return FrontierModel(name, params, batch, loss, what)


# ----------------------------------------------------------------------------- Llama-style 1B


@dataclasses.dataclass(frozen=True)
class _Llama:
  length: int
  batch: int
  layers: int = 16
  width: int = 2048
  heads: int = 32
  kv_heads: int = 8
  mlp: int = 8192
  vocab: int = 32000
  rope_theta: float = 10000.0
  dtype: str = "bfloat16"


def rms_norm(x, scale, eps: float = 1e-5):
  """RMSNorm computed in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x, theta: float):
  """Rotary position embedding of x (B, T, H, D) at positions 0..T-1 (rotate-half form)."""
  t, d = x.shape[1], x.shape[-1]
  freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
  angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq
  cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def llama_block(p, x, *, attention: str = "xla", theta: float = 10000.0):
  """One Llama layer: RMSNorm, GQA attention with rotary embeddings, RMSNorm, SwiGLU MLP."""
  y = rms_norm(x, p["attn_norm"])
  q = checkpoint_name(jnp.einsum("btd,dhk->bthk", y, p["wq"]), "qkv")
  k = checkpoint_name(jnp.einsum("btd,dhk->bthk", y, p["wk"]), "qkv")
  v = checkpoint_name(jnp.einsum("btd,dhk->bthk", y, p["wv"]), "qkv")
  o = attend(rope(q, theta), rope(k, theta), v, causal=True, attention=attention)
  x = x + checkpoint_name(jnp.einsum("bthk,hkd->btd", o, p["wo"]), "attn_out")
  y = rms_norm(x, p["mlp_norm"])
  gate = checkpoint_name(y @ p["w_gate"], "mlp_in")
  up = checkpoint_name(y @ p["w_up"], "mlp_in")
  return x + checkpoint_name((jax.nn.silu(gate) * up) @ p["w_down"], "mlp_out")


def _llama(name: str, cfg: _Llama, attention: str) -> FrontierModel:
  dtype = jnp.dtype(cfg.dtype)
  n, d, hd = cfg.layers, cfg.width, cfg.width // cfg.heads

  def init(key):
    ks = iter(jax.random.split(key, 9))
    normal = lambda *shape: (0.02 * jax.random.normal(next(ks), shape, jnp.float32)).astype(dtype)
    ones = lambda *shape: jnp.ones(shape, dtype)
    return {
      "embed": normal(cfg.vocab, d),
      "layers": {  # stacked: leading axis = layer
        "attn_norm": ones(n, d),
        "wq": normal(n, d, cfg.heads, hd),
        "wk": normal(n, d, cfg.kv_heads, hd),
        "wv": normal(n, d, cfg.kv_heads, hd),
        "wo": normal(n, cfg.heads, hd, d),
        "mlp_norm": ones(n, d),
        "w_gate": normal(n, d, cfg.mlp),
        "w_up": normal(n, d, cfg.mlp),
        "w_down": normal(n, cfg.mlp, d),
      },
      "final_norm": ones(d),
      "head": normal(d, cfg.vocab),
    }

  block = functools.partial(llama_block, attention=attention, theta=cfg.rope_theta)

  def loss(wrap: Wrap) -> Callable:
    wrapped = wrap(block)

    def loss_fn(params, batch, key):
      tokens, labels = batch

      def body(x, layer):
        p, i = layer
        return wrapped(p, x, jax.random.fold_in(key, i)), None

      x = params["embed"][tokens]
      x, _ = jax.lax.scan(body, x, (params["layers"], jnp.arange(n)))
      return _xent(rms_norm(x, params["final_norm"]) @ params["head"], labels)

    return loss_fn

  batch = (
    jax.ShapeDtypeStruct((cfg.batch, cfg.length), jnp.int32),
    jax.ShapeDtypeStruct((cfg.batch, cfg.length), jnp.int32),
  )
  what = (
    f"Llama-style decoder: {n} layers (stacked params, lax.scan), width {d}, {cfg.heads} query / "
    f"{cfg.kv_heads} key-value heads, SwiGLU MLP {cfg.mlp}, RMSNorm, rotary embeddings, vocab "
    f"{cfg.vocab}, {cfg.dtype} params and activations (float32 loss), length {cfg.length}, "
    f"batch {cfg.batch}; attention {attention}"
  )
  params = jax.eval_shape(init, jax.random.key(0))
  return FrontierModel(name, params, batch, loss, what)


# ----------------------------------------------------------------------------- registry

_CONFIGS = {
  "lm_6x512": _Transformer(layers=6, width=512, heads=8, mlp=2048, batch=32, length=512, vocab=65),
  "resnet50_224": _ResNet(),
  "vit_b16": _Transformer(
    layers=12, width=768, heads=12, mlp=3072, batch=64, image=224, patch=16, classes=1000
  ),
  "llama1b_2048": _Llama(length=2048, batch=8),
  "llama1b_8192": _Llama(length=8192, batch=2),
}
MODELS: tuple[str, ...] = tuple(_CONFIGS)


def build(name: str, attention: str = "xla", **overrides) -> FrontierModel:
  """The model `name` (one of `MODELS`), its sizes changed by `overrides` (e.g. `layers=2`)."""
  if name not in _CONFIGS:
    raise ValueError(f"unknown model {name!r}; one of {MODELS}")
  if attention not in ATTENTIONS:
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
  default = _CONFIGS[name]
  fields = {f.name for f in dataclasses.fields(default)}
  unknown = set(overrides) - fields
  if unknown:
    raise ValueError(f"{name} has no size(s) {sorted(unknown)}; it has {sorted(fields)}")
  cfg = dataclasses.replace(default, **overrides)
  if isinstance(cfg, _ResNet):
    return _resnet(name, cfg, attention)
  if isinstance(cfg, _Llama):
    return _llama(name, cfg, attention)
  return _transformer(name, cfg, attention, lm=name.startswith("lm"))
