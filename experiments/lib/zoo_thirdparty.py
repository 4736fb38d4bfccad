"""Third-party-style models: how vision code in the wild writes them (issue 31).

Written here in the style of common Flax/JAX research code (not copied): a
small ViT (patch-embedding convolution, class token, learned position
embedding, pre-LayerNorm blocks with `nn.MultiHeadDotProductAttention` and a
gelu MLP), an MLP-Mixer, an nnx ConvNeXt stack (depthwise convolution,
LayerNorm, gelu, layer scale), a ResNet with GroupNorm and weight-standardized
convolutions (`StdConv`, a subclass of `nn.Conv`), and blocks that stress what
a shared quantization grid cannot hold: inputs with a large offset feeding
LayerNorm/RMSNorm/GroupNorm, a hand-written RMS normalization, an L2
normalization and a division chain.

Heads are randomly initialized (a zero-initialized head, as some of these
codebases use, leaves every other parameter without a gradient at step 0).
Every model comes as an `experiments.lib.zoo.Case`, so `experiments.lib.zoo_harness`
drives it plain, converted (`jact.convert`) or wrapped whole
(`jact.compressed`). No dropout: plain and jact forwards compare value for
value. Sizes are small (CPU).

>>> case = CASES["vit"]
>>> case.logits_plain(case.init(0), case.batch(0)).shape
(8, 10)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.lib.zoo import Case

__all__ = [
  "ViT",
  "MlpMixer",
  "ConvNeXt",
  "GNResNet",
  "StdConv",
  "OffsetNormNet",
  "NormChain",
  "CASES",
]


# ----------------------------------------------------------------------------- ViT (linen)


class MlpBlock(nn.Module):
  """Dense -> gelu -> Dense, the feed-forward of a transformer block."""

  mlp_dim: int

  @nn.compact
  def __call__(self, x):
    out_dim = x.shape[-1]
    y = nn.Dense(
      self.mlp_dim,
      kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(stddev=1e-6),
    )(x)
    y = nn.gelu(y)
    return nn.Dense(
      out_dim,
      kernel_init=nn.initializers.xavier_uniform(),
      bias_init=nn.initializers.normal(stddev=1e-6),
    )(y)


class Encoder1DBlock(nn.Module):
  """Pre-LN transformer block: x + attn(LN(x)), then x + mlp(LN(x))."""

  mlp_dim: int
  num_heads: int

  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(
      num_heads=self.num_heads, kernel_init=nn.initializers.xavier_uniform()
    )(y, y)
    x = x + y
    y = nn.LayerNorm()(x)
    return x + MlpBlock(self.mlp_dim)(y)


class ViT(nn.Module):
  """Vision Transformer: conv patches, class token, learned positions, pre-LN encoder."""

  num_classes: int = 10
  patch: int = 4
  hidden: int = 32
  depth: int = 2
  num_heads: int = 2
  mlp_dim: int = 64

  @nn.compact
  def __call__(self, images):
    x = nn.Conv(
      self.hidden,
      (self.patch, self.patch),
      strides=(self.patch, self.patch),
      padding="VALID",
      name="embedding",
    )(images)
    n, h, w, c = x.shape
    x = x.reshape(n, h * w, c)
    cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
    x = jnp.concatenate([jnp.tile(cls, (n, 1, 1)), x], axis=1)
    pos = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (1, x.shape[1], c))
    x = x + pos
    for i in range(self.depth):
      x = Encoder1DBlock(self.mlp_dim, self.num_heads, name=f"encoderblock_{i}")(x)
    x = nn.LayerNorm(name="encoder_norm")(x)
    return nn.Dense(self.num_classes, name="head")(x[:, 0])


# ----------------------------------------------------------------------------- MLP-Mixer (linen)


class MixerBlock(nn.Module):
  """Token mixing across patches, then channel mixing, each pre-LN and residual."""

  tokens_mlp_dim: int
  channels_mlp_dim: int

  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(x)
    y = jnp.swapaxes(y, 1, 2)
    y = MlpBlock(self.tokens_mlp_dim, name="token_mixing")(y)
    y = jnp.swapaxes(y, 1, 2)
    x = x + y
    y = nn.LayerNorm()(x)
    return x + MlpBlock(self.channels_mlp_dim, name="channel_mixing")(y)


class MlpMixer(nn.Module):
  num_classes: int = 10
  patch: int = 4
  hidden: int = 32
  depth: int = 2
  tokens_mlp_dim: int = 32
  channels_mlp_dim: int = 64

  @nn.compact
  def __call__(self, images):
    x = nn.Conv(
      self.hidden, (self.patch, self.patch), strides=(self.patch, self.patch), name="stem"
    )(images)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    for _ in range(self.depth):
      x = MixerBlock(self.tokens_mlp_dim, self.channels_mlp_dim)(x)
    x = nn.LayerNorm(name="pre_head_layer_norm")(x)
    x = jnp.mean(x, axis=1)
    return nn.Dense(self.num_classes, name="head")(x)


# ----------------------------------------------------------------------------- ConvNeXt (nnx)


class ConvNeXtBlock(nnx.Module):
  """Depthwise 7x7 conv, LayerNorm, pointwise MLP with gelu, layer scale, residual."""

  def __init__(self, dim: int, *, layer_scale: float = 1e-6, rngs: nnx.Rngs):
    self.dwconv = nnx.Conv(
      dim, dim, kernel_size=(7, 7), padding=3, feature_group_count=dim, rngs=rngs
    )
    self.norm = nnx.LayerNorm(dim, epsilon=1e-6, rngs=rngs)
    self.pwconv1 = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.pwconv2 = nnx.Linear(4 * dim, dim, rngs=rngs)
    self.gamma = nnx.Param(jnp.full((dim,), layer_scale))

  def __call__(self, x):
    y = self.dwconv(x)
    y = self.norm(y)
    y = self.pwconv2(nnx.gelu(self.pwconv1(y)))
    return x + self.gamma[...] * y


class ConvNeXt(nnx.Module):
  """A 4x4 patchify stem with LayerNorm, ConvNeXt blocks, a downsampling layer, a head."""

  def __init__(
    self,
    dims=(16, 32),
    depths=(1, 1),
    num_classes: int = 10,
    *,
    layer_scale: float = 1e-6,
    rngs: nnx.Rngs,
  ):
    self.stem = nnx.Conv(3, dims[0], kernel_size=(4, 4), strides=(4, 4), rngs=rngs)
    self.stem_norm = nnx.LayerNorm(dims[0], epsilon=1e-6, rngs=rngs)
    stages, downs = [], []
    for i, (dim, depth) in enumerate(zip(dims, depths)):
      if i > 0:
        downs.append(
          (
            nnx.LayerNorm(dims[i - 1], epsilon=1e-6, rngs=rngs),
            nnx.Conv(dims[i - 1], dim, kernel_size=(2, 2), strides=(2, 2), rngs=rngs),
          )
        )
      stages.append(
        nnx.List([ConvNeXtBlock(dim, layer_scale=layer_scale, rngs=rngs) for _ in range(depth)])
      )
    self.stages = nnx.List(stages)
    self.downsample = nnx.List([nnx.List(d) for d in downs])
    self.head_norm = nnx.LayerNorm(dims[-1], epsilon=1e-6, rngs=rngs)
    self.head = nnx.Linear(dims[-1], num_classes, rngs=rngs)

  def __call__(self, x):
    x = self.stem_norm(self.stem(x))
    for i, stage in enumerate(self.stages):
      if i > 0:
        norm, conv = self.downsample[i - 1]
        x = conv(norm(x))
      for block in stage:
        x = block(x)
    return self.head(self.head_norm(jnp.mean(x, axis=(1, 2))))


# -------------------------------------------------------------- GroupNorm + StdConv ResNet (linen)


def weight_standardize(w, axis, eps):
  """Each output filter of `w` to zero mean and unit variance over `axis`."""
  w = w - jnp.mean(w, axis=axis)
  return w / jnp.sqrt(jnp.mean(jnp.square(w), axis=axis) + eps)


class StdConv(nn.Conv):
  """A convolution whose kernel is weight-standardized on every use."""

  def param(self, name: str, *args, **kwargs):
    value = super().param(name, *args, **kwargs)
    if name == "kernel":
      value = weight_standardize(value, axis=[0, 1, 2], eps=1e-5)
    return value


class ResidualUnit(nn.Module):
  """Pre-activation-free bottleneck unit: GN+relu after each StdConv, projection when needed."""

  features: int
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    conv = functools.partial(StdConv, use_bias=False)
    norm = functools.partial(nn.GroupNorm, num_groups=4)
    residual = x
    if x.shape[-1] != self.features * 2 or self.strides != (1, 1):
      residual = conv(self.features * 2, (1, 1), self.strides, name="conv_proj")(residual)
      residual = norm(name="gn_proj")(residual)
    y = nn.relu(norm(name="gn1")(conv(self.features, (1, 1), name="conv1")(x)))
    y = nn.relu(norm(name="gn2")(conv(self.features, (3, 3), self.strides, name="conv2")(y)))
    y = norm(name="gn3")(conv(self.features * 2, (1, 1), name="conv3")(y))
    return nn.relu(residual + y)


class GNResNet(nn.Module):
  """BiT-style ResNet: StdConv stem, GroupNorm, max pool, bottleneck units, global mean."""

  num_classes: int = 10
  width: int = 8
  units: tuple[int, ...] = (1, 1)

  @nn.compact
  def __call__(self, x):
    x = StdConv(self.width * 2, (3, 3), use_bias=False, name="conv_root")(x)
    x = nn.GroupNorm(num_groups=4, name="gn_root")(x)
    x = nn.relu(x)
    x = nn.max_pool(x, (2, 2), strides=(2, 2), padding="SAME")
    for i, n in enumerate(self.units):
      for j in range(n):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = ResidualUnit(self.width * 2**i, strides, name=f"block{i}_unit{j}")(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, name="head")(x)


# -------------------------------------------------------------------------- offsets and statistics


class OffsetNormNet(nn.Module):
  """Sensor-style inputs with a large offset straight into normalization layers.

  LayerNorm on the raw input, a Dense, RMSNorm, a GroupNorm over channels,
  and a second offset (a learned bias of 100 added before the last LayerNorm).
  The input LayerNorm computes its variance as E[(x - E[x])^2]: Flax's fast
  E[x^2] - E[x]^2 cancels to nothing in float32 on 1000 + 0.01 noise, so
  plain Flax's own forward is meaningless there (that case is checked on the
  layer alone, `experiments.bench.whole_model_error.offset_layer_norm_error`)."""

  hidden: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm(use_fast_variance=False, name="input_norm")(x)
    x = nn.Dense(self.hidden, name="dense1")(x)
    x = nn.RMSNorm(name="rms")(x)
    x = nn.gelu(x)
    x = nn.Dense(self.hidden, name="dense2")(x)
    x = nn.GroupNorm(num_groups=8, name="gn")(x)
    x = x + self.param("offset", nn.initializers.constant(100.0), (self.hidden,))
    x = nn.LayerNorm(use_fast_variance=False, name="late_norm")(x)
    return nn.Dense(self.num_classes, name="head")(jnp.mean(x, axis=1))


class NormChain(nn.Module):
  """Hand-written statistics: RMS normalization, L2 normalization (cosine
  features) and a division chain x / (1 + |y|), as research code writes them."""

  hidden: int = 64
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.hidden, name="dense1")(x)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
    y = nn.Dense(self.hidden, name="dense2")(x)
    y = y / (1.0 + jnp.abs(nn.Dense(self.hidden, name="gate")(x)))
    y = y / jnp.linalg.norm(y, axis=-1, keepdims=True)
    z = nn.Dense(self.hidden, name="dense3")(y) + 50.0
    z = (z - jnp.mean(z, axis=-1, keepdims=True)) / jnp.std(z, axis=-1, keepdims=True)
    return nn.Dense(self.num_classes, name="head")(jnp.mean(z, axis=1))


# ----------------------------------------------------------------------------- cases


def _images(seed, shape, batch_size, num_classes=10):
  rng = np.random.default_rng(seed)
  return {
    "inputs": (jnp.asarray(rng.standard_normal((batch_size, *shape)), jnp.float32),),
    "labels": jnp.asarray(rng.integers(0, num_classes, batch_size), jnp.int32),
  }


def _offset_signals(
  seed, batch_size=8, length=16, channels=64, offset=1000.0, spread=0.01, num_classes=10
):
  """Readings around `offset` varying by `spread` (a temperature or pressure sensor)."""
  rng = np.random.default_rng(seed)
  x = offset + spread * rng.standard_normal((batch_size, length, channels))
  return {
    "inputs": (jnp.asarray(x, jnp.float32),),
    "labels": jnp.asarray(rng.integers(0, num_classes, batch_size), jnp.int32),
  }


def _nnx_case(name: str, build: Callable[[], Any], batch) -> Case:
  return Case(name, "nnx", build, batch)


CASES: dict[str, Case] = {
  c.name: c
  for c in [
    Case("vit", "linen", ViT, lambda s: _images(s, (16, 16, 3), 8)),
    Case("mixer", "linen", MlpMixer, lambda s: _images(s, (16, 16, 3), 8)),
    _nnx_case(
      "convnext_nnx", lambda: ConvNeXt(rngs=nnx.Rngs(0)), lambda s: _images(s, (32, 32, 3), 4)
    ),
    Case("gn_resnet", "linen", GNResNet, lambda s: _images(s, (16, 16, 3), 4)),
    Case("offset_norms", "linen", OffsetNormNet, _offset_signals),
    Case("norm_chain", "linen", NormChain, lambda s: _offset_signals(s, offset=0.0, spread=1.0)),
  ]
}
