"""Small Flax models the library tests borrow, written as ordinary Flax code.

`ViT` is a small Vision Transformer in the style of common Flax research code
(patch-embedding convolution, class token, learned position embedding,
pre-LayerNorm blocks with `nn.MultiHeadDotProductAttention` and a gelu MLP),
the same classes and parameter names as the experiments' zoo ViT.

>>> import jax, jax.numpy as jnp
>>> model = ViT(depth=1)
>>> x = jnp.zeros((2, 8, 8, 3))
>>> model.apply(model.init(jax.random.key(0), x), x).shape
(2, 10)
"""

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["MlpBlock", "Encoder1DBlock", "ViT"]


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
