"""A zoo of Flax models written the way Flax example code writes them.

The models are deliberately *not* written for jact: activations and pooling
are called as functions (`nn.relu`, `nn.max_pool`, `nnx.gelu`), BatchNorm
names a cross-device axis as data-parallel examples do, attention is either a
Flax layer with a `mask=` or written by hand with `jax.nn.softmax`, recurrent
models use `nn.RNN` / `nn.Bidirectional`, and a stack of nnx blocks is built
with `nnx.vmap` and run with `nnx.scan`. They measure what `jact.convert` and
`jact.compressed` do to unmodified code (`experiments/bench/bench_models.py`,
`experiments/bench/train_zoo.py`, `tests/test_zoo.py`). No dropout anywhere, so a
plain and a converted forward pass can be compared value for value.

Sizes are small (CPU). Each model comes as a `Case`: how to build it, a
batch of inputs of the right kind, and its loss.

>>> case = CASES["mnist_cnn"]
>>> batch = case.batch(0)
>>> model = case.build()
>>> case.logits_plain(model, batch).shape
(16, 10)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = [
  "ResNet",
  "ResNet18",
  "SST2Classifier",
  "TransformerLM",
  "GemmaLike",
  "Seq2Seq",
  "ScanMLP",
  "MnistCNN",
  "Case",
  "CASES",
]

ModuleDef = Any


# ----------------------------------------------------------------------------- ResNet-18 (linen)


class ResNetBlock(nn.Module):
  """Two 3x3 convolutions with a projection shortcut when the shape changes."""

  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple[int, int] = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.norm()(y)
    y = self.act(y)
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  """ImageNet-style ResNet: 7x7 stem, max pool, four stages, global mean."""

  stage_sizes: Sequence[int]
  num_classes: int = 10
  num_filters: int = 64
  act: Callable = nn.relu

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False)
    norm = functools.partial(
      nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name="batch"
    )
    x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
    x = norm(name="bn_init")(x)
    x = nn.relu(x)
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = ResNetBlock(
          self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act
        )(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2))


# ----------------------------------------------------------------------------- SST-2 BiLSTM (linen)


class SST2Classifier(nn.Module):
  """Embedding, a bidirectional LSTM, a masked mean over time, an MLP head."""

  vocab_size: int
  embedding_size: int = 64
  hidden_size: int = 64
  num_classes: int = 2

  @nn.compact
  def __call__(self, tokens, lengths):
    x = nn.Embed(self.vocab_size, self.embedding_size)(tokens)
    x = nn.Bidirectional(
      nn.RNN(nn.OptimizedLSTMCell(self.hidden_size)), nn.RNN(nn.OptimizedLSTMCell(self.hidden_size))
    )(x, seq_lengths=lengths)
    mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    x = jnp.sum(x * mask[..., None], axis=1) / lengths[:, None]
    x = nn.tanh(nn.Dense(self.hidden_size)(x))
    return nn.Dense(self.num_classes)(x)


# ---------------------------------------------------------------------- LM1B-style decoder (linen)


@dataclasses.dataclass(frozen=True)
class LMConfig:
  vocab_size: int = 65
  emb_dim: int = 128
  num_heads: int = 4
  num_layers: int = 2
  mlp_dim: int = 512
  max_len: int = 256


class DecoderBlock(nn.Module):
  """Pre-LayerNorm block: causal self-attention, then a gelu MLP."""

  config: LMConfig

  @nn.compact
  def __call__(self, x, decoder_mask):
    cfg = self.config
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(
      num_heads=cfg.num_heads, qkv_features=cfg.emb_dim, use_bias=False, deterministic=True
    )(y, mask=decoder_mask)
    x = x + y
    y = nn.LayerNorm()(x)
    y = nn.Dense(cfg.mlp_dim)(y)
    y = nn.gelu(y)
    y = nn.Dense(cfg.emb_dim)(y)
    return x + y


class TransformerLM(nn.Module):
  """Token + learned position embeddings, decoder blocks, final norm, logits."""

  config: LMConfig

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
      x = DecoderBlock(cfg, name=f"decoderblock_{i}")(x, decoder_mask)
    x = nn.LayerNorm(name="encoderdecoder_norm")(x)
    return nn.Dense(cfg.vocab_size, name="logitdense")(x)


# ----------------------------------------------------------------------------- Gemma-like (nnx)


class GemmaAttention(nnx.Module):
  """Einsum projections and softmax attention written out by hand."""

  def __init__(self, dim: int, num_heads: int, head_dim: int, *, rngs: nnx.Rngs):
    self.q_einsum = nnx.Einsum("BTD,DNH->BTNH", (dim, num_heads, head_dim), rngs=rngs)
    self.kv_einsum = nnx.Einsum("BSD,CDNH->CBSNH", (2, dim, num_heads, head_dim), rngs=rngs)
    self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (num_heads, head_dim, dim), rngs=rngs)
    self.head_dim = head_dim

  def __call__(self, x, mask):
    q = self.q_einsum(x) * self.head_dim**-0.5
    k, v = self.kv_einsum(x)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k)
    logits = jnp.where(mask[:, None], logits, -2.3819763e38)
    probs = jax.nn.softmax(logits, axis=-1)
    encoded = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
    return self.attn_vec_einsum(encoded)


class GemmaMLP(nnx.Module):
  """Gated feed-forward: gelu(x W_gate) * (x W_up), then W_down."""

  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.gate_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(nnx.gelu(self.gate_proj(x)) * self.up_proj(x))


class GemmaBlock(nnx.Module):
  def __init__(self, dim, num_heads, head_dim, hidden, *, rngs):
    self.pre_attention_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.attn = GemmaAttention(dim, num_heads, head_dim, rngs=rngs)
    self.pre_ffw_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.mlp = GemmaMLP(dim, hidden, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.pre_attention_norm(x), mask)
    return x + self.mlp(self.pre_ffw_norm(x))


class GemmaLike(nnx.Module):
  """A small Gemma-shaped decoder (no rotary embedding, tied embedding)."""

  def __init__(
    self,
    vocab_size=65,
    dim=128,
    num_layers=2,
    num_heads=4,
    head_dim=32,
    hidden=256,
    *,
    rngs: nnx.Rngs,
  ):
    self.embedder = nnx.Embed(vocab_size, dim, rngs=rngs)
    self.layers = nnx.List(
      [GemmaBlock(dim, num_heads, head_dim, hidden, rngs=rngs) for _ in range(num_layers)]
    )
    self.final_norm = nnx.RMSNorm(dim, rngs=rngs)
    self.dim = dim

  def __call__(self, tokens):
    x = self.embedder(tokens) * jnp.sqrt(self.dim).astype(jnp.float32)
    length = tokens.shape[1]
    mask = jnp.tril(jnp.ones((length, length), bool))[None]
    for layer in self.layers:
      x = layer(x, mask)
    x = self.final_norm(x)
    return self.embedder.attend(x)


# ----------------------------------------------------------------------------- Seq2seq (linen)


class Seq2Seq(nn.Module):
  """LSTM encoder-decoder on one-hot characters, teacher forced."""

  vocab_size: int
  hidden_size: int = 64

  @nn.compact
  def __call__(self, encoder_inputs, decoder_inputs):
    encoder = nn.RNN(nn.LSTMCell(self.hidden_size), return_carry=True, name="encoder")
    carry, _ = encoder(encoder_inputs)
    decoder = nn.RNN(nn.LSTMCell(self.hidden_size), name="decoder")
    y = decoder(decoder_inputs, initial_carry=carry)
    return nn.Dense(self.vocab_size, name="logits")(y)


# ----------------------------------------------------------------------------- nnx scan over layers


class MLPBlock(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.linear1 = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.linear2 = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + self.linear2(nnx.gelu(self.linear1(self.norm(x))))


class ScanMLP(nnx.Module):
  """A stack of residual MLP blocks, created with nnx.vmap, run with nnx.scan."""

  def __init__(self, dim: int, num_layers: int, num_classes: int, *, rngs: nnx.Rngs):

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_block(rngs: nnx.Rngs):
      return MLPBlock(dim, rngs=rngs)

    self.blocks = create_block(rngs)
    self.head = nnx.Linear(dim, num_classes, rngs=rngs)

  def __call__(self, x):

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    x = forward(x, self.blocks)
    return self.head(jnp.mean(x, axis=1))


# ----------------------------------------------------------------------------- MNIST CNN (nnx)


class MnistCNN(nnx.Module):
  """The nnx MNIST tutorial's CNN: two conv + avg-pool stages, two linears."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.conv1(x)))
    x = self.avg_pool(nnx.relu(self.conv2(x)))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.linear1(x))
    return self.linear2(x)


# ----------------------------------------------------------------------------- cases


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@dataclasses.dataclass(frozen=True)
class Case:
  """One zoo model and how to drive it.

  Attributes:
    name: key in `CASES`.
    framework: "linen" or "nnx".
    build: () -> a linen Module (unbound) or a fresh nnx Module.
    batch: (seed) -> {"inputs": tuple of model arguments, "labels": array}
      of synthetic data of the right kind (`experiments/bench/train_zoo.py` feeds
      real data).
    train_kwargs: extra keyword arguments of a training call (linen).
    mutable: linen collections a training call updates.
    axis_name: the axis a training step binds (BatchNorm's `axis_name`):
      the step runs under `jax.shard_map` over one device naming it.
  """

  name: str
  framework: str
  build: Callable[[], Any]
  batch: Callable[[int], dict]
  loss: Callable[[Any, Any], Any] = _xent
  train_kwargs: dict = dataclasses.field(default_factory=dict)
  mutable: tuple[str, ...] = ()
  axis_name: str | None = None

  def init(self, seed: int = 0):
    """linen: the variables; nnx: a fresh model (its own init)."""
    model = self.build()
    if self.framework == "nnx":
      return model
    batch = self.batch(seed)
    return model.init(jax.random.key(seed), *batch["inputs"], **self.train_kwargs)

  def logits_plain(self, model_or_variables, batch):
    """The plain model's output (inference: no statistics update, no axis)."""
    if self.framework == "nnx":
      return model_or_variables(*batch["inputs"])
    kwargs = {k: False if k == "train" else v for k, v in self.train_kwargs.items()}
    return self.build().apply(model_or_variables, *batch["inputs"], **kwargs)


def _images(seed, shape, batch_size, num_classes=10):
  rng = np.random.default_rng(seed)
  return {
    "inputs": (jnp.asarray(rng.standard_normal((batch_size, *shape)), jnp.float32),),
    "labels": jnp.asarray(rng.integers(0, num_classes, batch_size), jnp.int32),
  }


def _tokens(seed, batch_size, length, vocab):
  rng = np.random.default_rng(seed)
  seq = rng.integers(0, vocab, (batch_size, length + 1))
  return {
    "inputs": (jnp.asarray(seq[:, :-1], jnp.int32),),
    "labels": jnp.asarray(seq[:, 1:], jnp.int32),
  }


def _sentences(seed, batch_size=32, length=40, vocab=4000):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(5, length + 1, batch_size)
  tokens = rng.integers(1, vocab, (batch_size, length)) * (np.arange(length) < lengths[:, None])
  return {
    "inputs": (jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)),
    "labels": jnp.asarray(rng.integers(0, 2, batch_size), jnp.int32),
  }


def _addition(seed, batch_size=32, vocab=14, in_len=9, out_len=5):
  rng = np.random.default_rng(seed)
  enc = rng.integers(0, vocab, (batch_size, in_len))
  dec = rng.integers(0, vocab, (batch_size, out_len + 1))
  one_hot = lambda a: jax.nn.one_hot(jnp.asarray(a), vocab)
  return {
    "inputs": (one_hot(enc), one_hot(dec[:, :-1])),
    "labels": jnp.asarray(dec[:, 1:], jnp.int32),
  }


LM_CONFIG = LMConfig()

CASES: dict[str, Case] = {
  c.name: c
  for c in [
    Case(
      "resnet18",
      "linen",
      lambda: ResNet18(num_filters=16),
      lambda s: _images(s, (32, 32, 3), 32),
      train_kwargs={"train": True},
      mutable=("batch_stats",),
      axis_name="batch",
    ),
    Case("bilstm_sst2", "linen", lambda: SST2Classifier(vocab_size=4000), _sentences),
    Case(
      "transformer_lm",
      "linen",
      lambda: TransformerLM(LM_CONFIG),
      lambda s: _tokens(s, 16, 64, LM_CONFIG.vocab_size),
    ),
    Case("gemma_nnx", "nnx", lambda: GemmaLike(rngs=nnx.Rngs(0)), lambda s: _tokens(s, 16, 64, 65)),
    Case("seq2seq", "linen", lambda: Seq2Seq(vocab_size=14), _addition),
    Case(
      "scan_mlp_nnx",
      "nnx",
      lambda: ScanMLP(128, 4, 10, rngs=nnx.Rngs(0)),
      lambda s: {**_images(s, (64, 128), 16)},
    ),
    Case(
      "mnist_cnn", "nnx", lambda: MnistCNN(rngs=nnx.Rngs(0)), lambda s: _images(s, (28, 28, 1), 16)
    ),
  ]
}
