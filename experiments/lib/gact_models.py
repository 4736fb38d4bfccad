"""GACT's models written as Flax users write them: a transformer classifier (SST-2), the zoo's
LM with block fields, GCN and GAT on a `Graph` (for `experiments.papers.gact_tasks`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jact
from experiments.lib import zoo
from experiments.lib.gcn import Graph

__all__ = [
  "EncoderBlock",
  "SST2Transformer",
  "BlockFieldLM",
  "checkpointed_block",
  "GCN",
  "GAT",
  "propagate",
  "cross_entropy",
]


class EncoderBlock(nn.Module):
  """Pre-LayerNorm encoder block: padded self-attention, then a gelu MLP."""

  num_heads: int
  mlp_dim: int

  @nn.compact
  def __call__(self, x, mask):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, deterministic=True)(y, mask=mask)
    x = x + y
    y = nn.LayerNorm()(x)
    y = nn.gelu(nn.Dense(self.mlp_dim)(y))
    return x + nn.Dense(x.shape[-1])(y)


class SST2Transformer(nn.Module):
  """Token + learned position embeddings, encoder blocks, final norm, masked mean
  pool over the words (token 0 is padding), a Dense head.

  >>> model = SST2Transformer(vocab_size=50, dim=16, num_heads=2, mlp_dim=32, num_blocks=1)
  >>> tokens = jnp.array([[3, 4, 0, 0], [5, 6, 7, 0]])
  >>> model.apply(model.init(jax.random.key(0), tokens), tokens).shape
  (2, 2)
  """

  vocab_size: int
  dim: int = 128
  num_heads: int = 4
  mlp_dim: int = 512
  num_blocks: int = 2
  max_len: int = 64
  num_classes: int = 2
  block: Any = EncoderBlock  # the block class (CB1 passes a checkpointed one)

  @nn.compact
  def __call__(self, tokens):
    words = tokens > 0
    x = nn.Embed(self.vocab_size, self.dim)(tokens)
    pos = self.param(
      "pos_embedding", nn.initializers.normal(stddev=0.02), (1, self.max_len, self.dim)
    )
    x = x + pos[:, : tokens.shape[1]]
    mask = nn.make_attention_mask(words, words)
    for i in range(self.num_blocks):
      x = self.block(self.num_heads, self.mlp_dim, name=f"block_{i}")(x, mask)
    x = nn.LayerNorm()(x)
    weight = words[..., None].astype(x.dtype)
    pooled = jnp.sum(x * weight, axis=1) / jnp.maximum(jnp.sum(weight, axis=1), 1.0)
    return nn.Dense(self.num_classes)(pooled)


class BlockFieldLM(zoo.TransformerLM):
  """`experiments.lib.zoo.TransformerLM` with its block class as a field (nothing else
  changes: same computation, same parameter names and values)."""

  block: Any = zoo.DecoderBlock

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.initializers.normal(stddev=1.0))(
      tokens
    )
    pos = self.param(
      "pos_embedding", nn.initializers.normal(stddev=0.02), (1, cfg.max_len, cfg.emb_dim)
    )
    x = x + pos[:, : tokens.shape[1]]
    decoder_mask = nn.make_causal_mask(tokens)
    for i in range(cfg.num_layers):
      x = self.block(cfg, name=f"decoderblock_{i}")(x, decoder_mask)
    x = nn.LayerNorm(name="encoderdecoder_norm")(x)
    return nn.Dense(cfg.vocab_size, name="logitdense")(x)


def checkpointed_block(block_class, bits: int = 4):
  """`block_class` as a GACT CB1 segment: a compressed copy of its input (the first
  argument of `__call__`) is all the forward pass keeps; the backward pass
  recomputes the block from it (`jact.save_inputs_only()`: nothing else saved)."""
  return jact.compressed(
    block_class, bits=bits, policy=jact.save_inputs_only(), compress_argnums=(0,)
  )


def propagate(graph: Graph, h):
  """`A @ h` over the edge list: gather the senders' rows, weight, segment-sum them
  onto the receivers (the adjacency is data: no gradient flows into it)."""
  weights = jax.lax.stop_gradient(graph.weights)
  messages = h[graph.senders] * weights.reshape(-1, *([1] * (h.ndim - 1)))
  return jax.ops.segment_sum(messages, graph.receivers, num_segments=h.shape[0])


class GCN(nn.Module):
  """Kipf & Welling's two-layer GCN, A drop(relu(A drop(x) W1 + b1)) W2 + b2, where
  A = D^-1/2 (A + I) D^-1/2 is the data kit's normalized adjacency."""

  num_classes: int
  hidden: int = 16
  dropout: float = 0.5

  @nn.compact
  def __call__(self, x, graph: Graph, train: bool = False):
    drop = lambda h: nn.Dropout(self.dropout, deterministic=not train)(h)
    h = propagate(graph, nn.Dense(self.hidden, use_bias=False)(drop(x)))
    h = nn.relu(h + self.param("bias1", nn.initializers.zeros, (self.hidden,)))
    out = propagate(graph, nn.Dense(self.num_classes, use_bias=False)(drop(h)))
    return out + self.param("bias2", nn.initializers.zeros, (self.num_classes,))


class GATLayer(nn.Module):
  """Graph attention (Velickovic et al.): per head, softmax over each node's incoming
  edges (self loop included) of leaky_relu(a_src . W h_j + a_dst . W h_i)."""

  features: int
  heads: int
  dropout: float

  @nn.compact
  def __call__(self, x, graph: Graph, train: bool = False):
    n = x.shape[0]
    h = nn.Dense(self.heads * self.features, use_bias=False)(x).reshape(n, self.heads, -1)
    init = nn.initializers.glorot_uniform()
    a_src = self.param("att_src", init, (self.heads, self.features))
    a_dst = self.param("att_dst", init, (self.heads, self.features))
    send, recv = graph.senders, graph.receivers
    scores = nn.leaky_relu((h * a_src).sum(-1)[send] + (h * a_dst).sum(-1)[recv], 0.2)
    scores = scores - jax.lax.stop_gradient(jax.ops.segment_max(scores, recv, n))[recv]
    weights = jnp.exp(scores)
    alpha = weights / jax.ops.segment_sum(weights, recv, n)[recv]
    alpha = nn.Dropout(self.dropout, deterministic=not train)(alpha)
    out = jax.ops.segment_sum(h[send] * alpha[..., None], recv, n)
    return out + self.param("bias", nn.initializers.zeros, (self.heads, self.features))


class GAT(nn.Module):
  """Two GAT layers: `heads` heads of `hidden` features (ELU), then one head of classes."""

  num_classes: int
  hidden: int = 8
  heads: int = 8
  dropout: float = 0.6

  @nn.compact
  def __call__(self, x, graph: Graph, train: bool = False):
    drop = lambda h: nn.Dropout(self.dropout, deterministic=not train)(h)
    h = GATLayer(self.hidden, self.heads, self.dropout)(drop(x), graph, train)
    h = nn.elu(h.reshape(x.shape[0], -1))
    return GATLayer(self.num_classes, 1, self.dropout)(drop(h), graph, train)[:, 0]


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
