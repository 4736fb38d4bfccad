"""Flax linen models written once over a *layer set*.

A `LayerSet` names the layer classes a model uses (`L.Conv`, `L.BatchNorm`,
`L.ReLU`, ...). `plain_layers()` gives Flax's own layers (activations and
pooling wrapped as modules); `jact_layers(bits)` gives the compressed twins from
`jact.nn` with the same parameter names and shapes, so one set of
variables serves both models and the forward passes agree.

>>> import jax, jax.numpy as jnp
>>> model = SmallCNN(widths=(4, 8, 8), layers=plain_layers())
>>> variables = model.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1)), train=False)
>>> model.apply(variables, jnp.zeros((2, 8, 8, 1)), train=False).shape
(2, 10)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

__all__ = [
  "LayerSet",
  "plain_layers",
  "jact_layers",
  "ReLU",
  "LeakyReLU",
  "GELU",
  "SiLU",
  "Tanh",
  "Sigmoid",
  "Softmax",
  "MaxPool",
  "AvgPool",
  "SmallCNN",
  "ResNet",
  "ResNet18",
  "ResNet50",
  "TransformerEncoder",
]

LAYER_NAMES = (
  "Dense",
  "Conv",
  "BatchNorm",
  "LayerNorm",
  "RMSNorm",
  "Dropout",
  "Embed",
  "MultiHeadDotProductAttention",
  "SelfAttention",
  "ReLU",
  "LeakyReLU",
  "GELU",
  "SiLU",
  "Tanh",
  "Sigmoid",
  "Softmax",
  "MaxPool",
  "AvgPool",
)


# ----------------------------------------------------------------------------
# Plain activation and pooling modules (the jact twins have the same fields).


class ReLU(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.relu(x)


class LeakyReLU(nn.Module):
  negative_slope: float = 0.01

  @nn.compact
  def __call__(self, x):
    return nn.leaky_relu(x, self.negative_slope)


class GELU(nn.Module):
  approximate: bool = True

  @nn.compact
  def __call__(self, x):
    return nn.gelu(x, approximate=self.approximate)


class SiLU(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.silu(x)


class Tanh(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.tanh(x)


class Sigmoid(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.sigmoid(x)


class Softmax(nn.Module):
  axis: int = -1

  @nn.compact
  def __call__(self, x):
    return nn.softmax(x, axis=self.axis)


class MaxPool(nn.Module):
  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"

  @nn.compact
  def __call__(self, x):
    return nn.max_pool(x, tuple(self.window_shape), self.strides, self.padding)


class AvgPool(nn.Module):
  window_shape: Sequence[int]
  strides: Sequence[int] | None = None
  padding: Any = "VALID"
  count_include_pad: bool = True

  @nn.compact
  def __call__(self, x):
    return nn.avg_pool(
      x,
      tuple(self.window_shape),
      self.strides,
      self.padding,
      count_include_pad=self.count_include_pad,
    )


# ----------------------------------------------------------------------------
# Layer sets.


@dataclasses.dataclass(frozen=True)
class LayerSet:
  """The layer constructors a model is built from (one attribute per layer)."""

  kind: str
  Dense: Callable[..., nn.Module]
  Conv: Callable[..., nn.Module]
  BatchNorm: Callable[..., nn.Module]
  LayerNorm: Callable[..., nn.Module]
  RMSNorm: Callable[..., nn.Module]
  Dropout: Callable[..., nn.Module]
  Embed: Callable[..., nn.Module]
  MultiHeadDotProductAttention: Callable[..., nn.Module]
  SelfAttention: Callable[..., nn.Module]
  ReLU: Callable[..., nn.Module]
  LeakyReLU: Callable[..., nn.Module]
  GELU: Callable[..., nn.Module]
  SiLU: Callable[..., nn.Module]
  Tanh: Callable[..., nn.Module]
  Sigmoid: Callable[..., nn.Module]
  Softmax: Callable[..., nn.Module]
  MaxPool: Callable[..., nn.Module]
  AvgPool: Callable[..., nn.Module]


@functools.lru_cache(maxsize=None)
def plain_layers() -> LayerSet:
  """Flax's layers, with activations and pooling as parameter-free modules."""
  local = {
    "ReLU": ReLU,
    "LeakyReLU": LeakyReLU,
    "GELU": GELU,
    "SiLU": SiLU,
    "Tanh": Tanh,
    "Sigmoid": Sigmoid,
    "Softmax": Softmax,
    "MaxPool": MaxPool,
    "AvgPool": AvgPool,
  }
  return LayerSet(
    kind="plain", **{n: local[n] if n in local else getattr(nn, n) for n in LAYER_NAMES}
  )


@functools.lru_cache(maxsize=None)
def jact_layers(bits: int | None, compressor=None) -> LayerSet:
  """The compressed twins from `jact.nn`, with `bits` (or a
  `jact.compressors` object, e.g. `PerGroup(4, group_size=64)`) bound.

  Layers without rounding settings (exact ReLU masks, pooling, embeddings) are
  used as they are. Twins draw rounding noise from the RNG stream 'jact'.
  """
  from jact import nn as jl

  layers = {}
  for n in LAYER_NAMES:
    cls = getattr(jl, n)
    fields = getattr(cls, "__dataclass_fields__", {})
    given = dict(bits=bits) if compressor is None else dict(compressor=compressor)
    bound = {k: v for k, v in given.items() if k in fields}
    layers[n] = functools.partial(cls, **bound) if bound else cls
  return LayerSet(kind=f"jact{bits}", **layers)


def _layers(layers: LayerSet | None) -> LayerSet:
  return plain_layers() if layers is None else layers


# ----------------------------------------------------------------------------
# Models.


class SmallCNN(nn.Module):
  """(conv3x3-BN-ReLU) x3 with 2x2 max pooling after the first two, global
  average pooling and a dense classifier."""

  num_classes: int = 10
  widths: Sequence[int] = (32, 64, 128)
  layers: LayerSet | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    L = _layers(self.layers)
    for i, w in enumerate(self.widths):
      x = L.Conv(w, (3, 3), use_bias=False, name=f"conv{i}")(x)
      x = L.BatchNorm(use_running_average=not train, momentum=0.9, name=f"bn{i}")(x)
      x = L.ReLU(name=f"relu{i}")(x)
      if i < len(self.widths) - 1:
        x = L.MaxPool((2, 2), (2, 2), name=f"pool{i}")(x)
    x = jnp.mean(x, axis=(1, 2))
    return L.Dense(self.num_classes, name="head")(x)


class BasicBlock(nn.Module):
  filters: int
  strides: int = 1
  layers: LayerSet | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    L = _layers(self.layers)
    bn = functools.partial(L.BatchNorm, use_running_average=not train, momentum=0.9)
    y = L.Conv(self.filters, (3, 3), self.strides, use_bias=False, name="conv1")(x)
    y = L.ReLU(name="relu1")(bn(name="bn1")(y))
    y = L.Conv(self.filters, (3, 3), use_bias=False, name="conv2")(y)
    y = bn(name="bn2")(y)
    if x.shape != y.shape:
      x = L.Conv(self.filters, (1, 1), self.strides, use_bias=False, name="proj")(x)
      x = bn(name="proj_bn")(x)
    return L.ReLU(name="relu_out")(x + y)


class BottleneckBlock(nn.Module):
  filters: int
  strides: int = 1
  layers: LayerSet | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    L = _layers(self.layers)
    bn = functools.partial(L.BatchNorm, use_running_average=not train, momentum=0.9)
    y = L.Conv(self.filters, (1, 1), use_bias=False, name="conv1")(x)
    y = L.ReLU(name="relu1")(bn(name="bn1")(y))
    y = L.Conv(self.filters, (3, 3), self.strides, use_bias=False, name="conv2")(y)
    y = L.ReLU(name="relu2")(bn(name="bn2")(y))
    y = L.Conv(4 * self.filters, (1, 1), use_bias=False, name="conv3")(y)
    y = bn(name="bn3")(y)
    if x.shape != y.shape:
      x = L.Conv(4 * self.filters, (1, 1), self.strides, use_bias=False, name="proj")(x)
      x = bn(name="proj_bn")(x)
    return L.ReLU(name="relu_out")(x + y)


class ResNet(nn.Module):
  """ResNet v1.5 (stride in the 3x3 conv).

  stem="cifar": one 3x3 conv, no pooling (32x32 inputs); stem="imagenet": 7x7
  stride-2 conv and 3x3 stride-2 max pooling (224x224 inputs).
  """

  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  block: str = "basic"
  num_classes: int = 10
  width: int = 64
  stem: str = "cifar"
  layers: LayerSet | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    L = _layers(self.layers)
    if self.block not in ("basic", "bottleneck"):
      raise ValueError(f"block must be 'basic' or 'bottleneck', got {self.block!r}")
    if self.stem not in ("cifar", "imagenet"):
      raise ValueError(f"stem must be 'cifar' or 'imagenet', got {self.stem!r}")
    block_cls = BasicBlock if self.block == "basic" else BottleneckBlock
    if self.stem == "cifar":
      x = L.Conv(self.width, (3, 3), use_bias=False, name="stem_conv")(x)
    else:
      x = L.Conv(
        self.width, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False, name="stem_conv"
      )(x)
    x = L.BatchNorm(use_running_average=not train, momentum=0.9, name="stem_bn")(x)
    x = L.ReLU(name="stem_relu")(x)
    if self.stem == "imagenet":
      x = L.MaxPool((3, 3), (2, 2), padding=((1, 1), (1, 1)), name="stem_pool")(x)
    for i, n_blocks in enumerate(self.stage_sizes):
      for j in range(n_blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = block_cls(self.width * 2**i, strides, self.layers, name=f"stage{i}_block{j}")(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return L.Dense(self.num_classes, name="head")(x)


class ResNet18(ResNet):
  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  block: str = "basic"


class ResNet50(ResNet):
  stage_sizes: Sequence[int] = (3, 4, 6, 3)
  block: str = "bottleneck"


class EncoderBlock(nn.Module):
  dim: int
  heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  layers: LayerSet | None = None

  @nn.compact
  def __call__(self, x, mask=None, train: bool = True):
    L = _layers(self.layers)
    drop = (
      (lambda y, name: L.Dropout(self.dropout_rate, deterministic=not train, name=name)(y))
      if self.dropout_rate > 0
      else (lambda y, name: y)
    )
    y = L.LayerNorm(name="ln1")(x)
    y = L.MultiHeadDotProductAttention(
      num_heads=self.heads,
      qkv_features=self.dim,
      dropout_rate=self.dropout_rate,
      deterministic=not train,
      name="attn",
    )(y, mask=mask)
    x = x + drop(y, "drop1")
    y = L.LayerNorm(name="ln2")(x)
    y = L.Dense(self.mlp_dim, name="mlp_in")(y)
    y = L.GELU(name="gelu")(y)
    y = L.Dense(self.dim, name="mlp_out")(y)
    return x + drop(y, "drop2")


class TransformerEncoder(nn.Module):
  """Pre-LN transformer encoder: blocks of LayerNorm -> self-attention -> residual,
  LayerNorm -> Dense-GELU-Dense -> residual, and a final LayerNorm.

  Inputs are float [batch, length, dim], or int tokens [batch, length] when
  `vocab_size` is set (token + learned position embeddings). With `num_classes`
  the mean over positions feeds a dense classifier.
  """

  num_layers: int
  dim: int
  heads: int
  mlp_dim: int
  dropout_rate: float = 0.0
  vocab_size: int | None = None
  max_len: int = 512
  num_classes: int | None = None
  layers: LayerSet | None = None

  @nn.compact
  def __call__(self, x, mask=None, train: bool = True):
    L = _layers(self.layers)
    if self.vocab_size is not None:
      if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError("with vocab_size set, inputs must be integer token ids")
      x = L.Embed(self.vocab_size, self.dim, name="embed")(x)
      pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, self.max_len, self.dim))
      x = x + pos[:, : x.shape[1]]
    if x.shape[-1] != self.dim:
      raise ValueError(f"inputs have {x.shape[-1]} features, the encoder expects dim={self.dim}")
    for i in range(self.num_layers):
      x = EncoderBlock(
        self.dim, self.heads, self.mlp_dim, self.dropout_rate, self.layers, name=f"block{i}"
      )(x, mask, train)
    x = L.LayerNorm(name="ln_out")(x)
    if self.num_classes is not None:
      x = L.Dense(self.num_classes, name="head")(jnp.mean(x, axis=1))
    return x
