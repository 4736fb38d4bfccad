"""GACT's claims at CPU scale: jact applied from outside to ordinary Flax models.

Every model here is ordinary Flax code (flax.linen layers, `nn.gelu`,
`jax.ops.segment_sum`); jact is applied from outside: `jact.convert` for the
transformers, `jact.compressed` around the graph networks, `jact.Controller`
(GACT's numeric sensitivity, Algorithm 1) for the adaptive bit plans, with the
plan a static argument of `jax.jit(jact.planned(step), static_argnames="plan")`.

| task | model, data | variants |
|---|---|---|
| sst2 | embedding + 2 pre-LN encoder blocks (`nn.MultiHeadDotProductAttention`, gelu MLP), masked mean pool, Dense head; SST-2 sentences | fp, gact_l1, fixed2, gact_cb1, fixed4, adaptive2 |
| shakespeare | `experiments.lib.zoo.TransformerLM` (`LMConfig()`: 2 causal blocks, width 128); tiny Shakespeare characters | fp, gact_l1, fixed2, gact_cb1, fixed4, adaptive2 |
| cora_gcn, cora_gat | 2-layer GCN (16 hidden) and GAT (8 heads x 8, then 1 head) on Cora, standard Planetoid split, full batch | fp, fixed4, adaptive2 |

Variants:

* fp -- the plain model.
* fixed2 / fixed4 -- every residual at 2 / 4 bits (`jact.convert(model, bits=2)`,
  `jact.compressed(model, bits=4)`).
* gact_l1 -- GACT L1: `jact.levels.get("gact:L1").controller(loss)`, i.e.
  `jact.Controller(loss, estimator="numeric", avg_bits=4)` on the 4-bit converted model.
* gact_cb1 -- GACT CB1: L1 with every block a compressed checkpoint segment: the
  block class wrapped as `jact.compressed(Block, bits=4, policy=jact.save_inputs_only(),
  compress_argnums=(0,))` (`checkpointed_block`). The forward pass keeps only a
  4-bit copy of each block's input; the backward pass recomputes the block from
  it with the converted layers' residuals compressed, as `jact.checkpoint` does
  for functions (`jact.checkpoint` takes functions, not linen classes). This is
  the one model-side change: the model must take its block class as a field
  (the `nn.remat(Block)` idiom of Flax examples). The SST-2 model has it; the
  zoo's `TransformerLM` builds `DecoderBlock` itself, so CB1 runs `BlockFieldLM`,
  a subclass that only makes the block class a field (same parameters).
* adaptive2 -- `jact.Controller(loss, estimator="numeric", avg_bits=2)` on the
  compressed model (GACT's "adaptive 2 bits"; on the transformers the 4-bit
  converted model of gact_l1, so fixed4 / gact_l1 and fixed2 / adaptive2 are the
  fixed-vs-adaptive pairs at equal average bits).

All variants of a task start from the same parameters and see the same batches
(and dropout masks) in the same order; only the stored residuals differ, so
evaluation runs the plain model's forward. Per variant the task's JSON records
the loss curve (mean of every `log_every` steps), held-out metrics (accuracy
for classification, loss for the LM; best and final), the bytes saved for the
backward pass (`jact.residual_report(loss, ...).total_bytes`) and the compiled
temp of the train step (XLA's memory analysis of the compiled step, the figure
`jact.compiled_memory(step, ...).temp_bytes` gives, read off the executable
the training used instead of compiling it a second time), the adaptive plans
(average bits, GACT's variance ratio at each adaptation), the median step
seconds (steps that compiled excluded) and the controller's seconds.

Full-run scale (`TASKS`): SST-2 2 epochs (216 steps of 64 sentences of at most
64 words, width 128, 4 heads, MLP 512, 8000-word vocabulary; Adam 1e-3 with
10% warm-up and cosine decay); Shakespeare 300 steps of 32 windows of 128
characters (`LMConfig()`, same optimizer); Cora 200 full-graph epochs per model
(Adam 0.01 / 0.005, weight decay 5e-4, dropout 0.5 / 0.6). Adaptive variants
re-plan at steps 0, 100, 200 (Cora: every 50 epochs). Estimated from probes
(CPU seconds per step and per compile / adaptation): about 45-50 minutes for
everything on two free CPU cores -- SST-2 ~18, Shakespeare ~21, Cora ~10; the
adaptive variants take 2-3x their fixed twins (the controller's estimator is
1 + L gradients per adaptation, L ~ 32 residuals, plus a compile per new plan).

    python -m experiments.papers.gact_tasks                      # writes experiments/results/gact/<task>.json
    python -m experiments.papers.gact_tasks --small --results /tmp/gact   # every task and variant, tiny

`--small` runs tiny models (one block, width 32; Cora as it is) for 4 steps
with one adaptation. Its cost is compiling, not training: a jact train step
compiles in ~10-25 s of CPU, the controller's first adaptation (the estimator's
and the sampling-variance check's compiles) in ~20-70 s, so the whole
small run takes 5-8 minutes of CPU (500 s measured on a busy 2-core machine),
80% of it in the six adaptive variants; `--tasks cora_gcn --variants fp fixed4`
takes ~15 s.

>>> [name for name in TASKS], VARIANTS["cora_gat"]
(['sst2', 'shakespeare', 'cora_gcn', 'cora_gat'], ('fp', 'fixed4', 'adaptive2'))
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jact
from experiments.lib import data as data_lib
from experiments.lib import memory, metadata, paths, resumable, zoo, zoo_data
from experiments.lib.gcn import Graph, graph_arrays

__all__ = ["TASKS", "SMALL", "VARIANTS", "EncoderBlock", "SST2Transformer", "BlockFieldLM",
           "checkpointed_block", "GCN", "GAT", "propagate", "TaskSetup", "setup_task",
           "train_variant", "run_task", "main"]

RESULTS = paths.RESULTS / "gact"
LM_VARIANTS = ("fp", "gact_l1", "fixed2", "gact_cb1", "fixed4", "adaptive2")
GRAPH_VARIANTS = ("fp", "fixed4", "adaptive2")
VARIANTS = {"sst2": LM_VARIANTS, "shakespeare": LM_VARIANTS, "cora_gcn": GRAPH_VARIANTS,
            "cora_gat": GRAPH_VARIANTS}

# Sizes of each task: the full run, and `--small` (tiny models, a few steps).
TASKS = {
    "sst2": dict(steps=216, batch=64, length=64, vocab=8000, dim=128, heads=4, mlp=512,
                 blocks=2, lr=1e-3, adapt_interval=100, log_every=12, eval_every=54),
    "shakespeare": dict(steps=300, batch=32, length=128, config=zoo.LMConfig(), lr=1e-3,
                        adapt_interval=100, log_every=10, eval_every=50, eval_batches=16),
    "cora_gcn": dict(steps=200, hidden=16, dropout=0.5, lr=0.01, adapt_interval=50,
                     log_every=5, eval_every=1),
    "cora_gat": dict(steps=200, hidden=8, heads=8, dropout=0.6, lr=0.005, adapt_interval=50,
                     log_every=5, eval_every=1),
}
SMALL = {
    "sst2": dict(TASKS["sst2"], steps=4, batch=16, length=32, vocab=2000, dim=32, heads=2,
                 mlp=64, blocks=1, adapt_interval=100, log_every=2, eval_every=4,
                 eval_size=128),
    "shakespeare": dict(TASKS["shakespeare"], steps=4, batch=8, length=32,
                        config=zoo.LMConfig(emb_dim=32, num_heads=2, num_layers=1, mlp_dim=64,
                                            max_len=32),
                        adapt_interval=100, log_every=2, eval_every=4, eval_batches=2),
    "cora_gcn": dict(TASKS["cora_gcn"], steps=4, adapt_interval=100, log_every=2, eval_every=2),
    "cora_gat": dict(TASKS["cora_gat"], steps=4, adapt_interval=100, log_every=2, eval_every=2),
}
WEIGHT_DECAY = 5e-4  # Cora (Kipf & Welling; Velickovic et al.)


# ----------------------------------------------------------------------------- models


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
    pos = self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                     (1, self.max_len, self.dim))
    x = x + pos[:, :tokens.shape[1]]
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
    x = nn.Embed(cfg.vocab_size, cfg.emb_dim,
                 embedding_init=nn.initializers.normal(stddev=1.0))(tokens)
    pos = self.param("pos_embedding", nn.initializers.normal(stddev=0.02),
                     (1, cfg.max_len, cfg.emb_dim))
    x = x + pos[:, :tokens.shape[1]]
    decoder_mask = nn.make_causal_mask(tokens)
    for i in range(cfg.num_layers):
      x = self.block(cfg, name=f"decoderblock_{i}")(x, decoder_mask)
    x = nn.LayerNorm(name="encoderdecoder_norm")(x)
    return nn.Dense(cfg.vocab_size, name="logitdense")(x)


def checkpointed_block(block_class, bits: int = 4):
  """`block_class` as a GACT CB1 segment: a compressed copy of its input (the first
  argument of `__call__`) is all the forward pass keeps; the backward pass
  recomputes the block from it (`jact.save_inputs_only()`: nothing else saved)."""
  return jact.compressed(block_class, bits=bits, policy=jact.save_inputs_only(),
                         compress_argnums=(0,))


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


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# ----------------------------------------------------------------------------- tasks


@dataclasses.dataclass
class TaskSetup:
  """What training one variant of a task needs.

  Attributes:
    params: initial parameters (the same for every variant).
    losses: variant -> `loss(params, batch, key, *extra)` (the model as the variant runs it).
    controllers: variant -> `jact.Controller` settings (the adaptive variants).
    batch: step -> the step's batch (the same for every variant).
    evaluate: params -> held-out metrics (the plain model's forward pass).
    optimizer: the optax transformation.
    metric: the metric of `evaluate` that picks the best evaluation.
    higher_is_better: whether a higher `metric` is better (accuracy) or not (loss).
    description: facts about the data, stored with the results.
    extra: step arguments after the key (data every step reads: Cora's features, graph).
  """
  params: Any
  losses: dict[str, Callable[..., Any]]
  controllers: dict[str, dict]
  batch: Callable[[int], Any]
  evaluate: Callable[[Any], dict]
  optimizer: Any
  metric: str
  higher_is_better: bool
  description: dict
  extra: tuple = ()


def _gact_l1(adapt_interval: int) -> dict:
  level = jact.levels.get("gact:L1")
  return dict(estimator=level.estimator, avg_bits=level.avg_bits, adapt_interval=adapt_interval)


def _transformer_controllers(adapt_interval: int) -> dict:
  """The adaptive transformer variants: GACT L1 (4 bits) for gact_l1 / gact_cb1, 2 bits
  for adaptive2."""
  l1 = _gact_l1(adapt_interval)
  return {"gact_l1": l1, "gact_cb1": l1, "adaptive2": dict(l1, avg_bits=2.0)}


def _adam_warmup_cosine(lr: float, steps: int):
  """Adam with a linear warm-up over the first 10% of the steps, then cosine decay."""
  return optax.adam(optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps))


def _transformer_losses(plain, checkpointed, params, example, seed: int) -> dict:
  """fp / gact_l1 / fixed2 / gact_cb1 losses of a linen model, `checkpointed` the same
  model with `checkpointed_block` blocks (checked: the very same parameters)."""
  cb1_params = jax.eval_shape(
      lambda: checkpointed.init(jax.random.key(seed), example)["params"])
  if jax.tree.map(jnp.shape, cb1_params) != jax.tree.map(jnp.shape, params):
    raise AssertionError("the checkpointed model's parameters differ from the plain model's")
  bits = int(jact.levels.get("gact:L1").bits)
  converted = _linen_loss(jact.convert(plain, bits=bits), True)
  return {"fp": _linen_loss(plain, False), "gact_l1": converted,
          "fixed2": _linen_loss(jact.convert(plain, bits=2), True),
          "gact_cb1": _linen_loss(jact.convert(checkpointed, bits=bits), True),
          "fixed4": _linen_loss(jact.convert(plain, bits=4), True), "adaptive2": converted}


def _linen_loss(model, with_key: bool):
  def loss(params, batch, key):
    inputs, labels = batch
    rngs = {"jact": key} if with_key else {}
    return _xent(model.apply({"params": params}, inputs, rngs=rngs), labels)
  return loss


def _init(model, seed: int, *inputs):
  """The model's initial parameters (jitted: Flax's init op by op compiles every op)."""
  return jax.jit(lambda key, *inputs: model.init(key, *inputs)["params"])(
      jax.random.key(seed), *inputs)


def _sst2_encode(sentences, ids, length):
  tokens = np.zeros((len(sentences), length), np.int32)
  for i, words in enumerate(sentences):
    row = [ids.get(w, 1) for w in words][:length] or [1]
    tokens[i, :len(row)] = row
  return tokens


def _predict_in_chunks(logits_fn, params, x, chunk: int = 256) -> np.ndarray:
  """Arg-max predictions of `logits_fn(params, x[i:i+chunk])`, the last chunk padded
  (one compiled shape)."""
  out = []
  for start in range(0, len(x), chunk):
    part = x[start:start + chunk]
    padded = np.concatenate([part, np.zeros((chunk - len(part), *part.shape[1:]), part.dtype)])
    out.append(np.asarray(jnp.argmax(logits_fn(params, jnp.asarray(padded)), -1))[:len(part)])
  return np.concatenate(out)


def _sst2(cfg: dict, seed: int, steps: int) -> TaskSetup:
  """Word ids (0 padding, 1 unknown, the rest the most frequent training words),
  sentences clipped to `length` words; dev and test accuracy."""
  train, y_train = zoo_data.sst2_split("train")
  splits = {name: zoo_data.sst2_split(name) for name in ("dev", "test")}
  counts = collections.Counter(w for s in train for w in s)
  ids = {w: i + 2 for i, (w, _) in enumerate(counts.most_common(cfg["vocab"] - 2))}
  x_train = _sst2_encode(train, ids, cfg["length"])
  held = {name: (_sst2_encode(s, ids, cfg["length"])[:cfg.get("eval_size")],
                 y[:cfg.get("eval_size")]) for name, (s, y) in splits.items()}
  build = functools.partial(SST2Transformer, vocab_size=cfg["vocab"], dim=cfg["dim"],
                            num_heads=cfg["heads"], mlp_dim=cfg["mlp"], num_blocks=cfg["blocks"],
                            max_len=cfg["length"])
  plain = build()
  params = _init(plain, seed, jnp.asarray(x_train[:2]))
  losses = _transformer_losses(plain, build(block=checkpointed_block(EncoderBlock)), params,
                               jnp.asarray(x_train[:2]), seed)
  per_epoch = len(x_train) // cfg["batch"]
  logits = jax.jit(lambda p, x: plain.apply({"params": p}, x))

  def batch(step):
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng((seed, epoch)).permutation(len(x_train))
    idx = order[index * cfg["batch"]:(index + 1) * cfg["batch"]]
    return jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx])

  def evaluate(p):
    return {f"{name}_accuracy": float(np.mean(_predict_in_chunks(logits, p, x) == y))
            for name, (x, y) in held.items()}

  return TaskSetup(params, losses, _transformer_controllers(cfg["adapt_interval"]), batch, evaluate,
                   _adam_warmup_cosine(cfg["lr"], steps), "dev_accuracy", True,
                   dict(train_size=len(x_train), steps_per_epoch=per_epoch,
                        eval_sizes={k: len(v[1]) for k, v in held.items()}))


def _shakespeare(cfg: dict, seed: int, steps: int) -> TaskSetup:
  """Random windows of the first 90% of the text; held-out loss on fixed windows of
  the last 10% (`experiments.bench.train_zoo.shakespeare_batches`)."""
  path = data_lib._data_file("tinyshakespeare/input.txt")  # pylint: disable=protected-access
  text = path.read_text()
  vocab = sorted(set(text))
  config = cfg["config"]
  if len(vocab) != config.vocab_size:
    raise ValueError(f"tiny Shakespeare has {len(vocab)} symbols, the LM {config.vocab_size}")
  lookup = np.zeros(max(map(ord, vocab)) + 1, np.int32)
  lookup[[ord(c) for c in vocab]] = np.arange(len(vocab))
  ids = lookup[np.frombuffer(text.encode("ascii"), np.uint8)]
  split, length = int(0.9 * len(ids)), cfg["length"]

  def windows(starts, source):
    seq = np.stack([source[s:s + length + 1] for s in starts])
    return jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:])

  def batch(step):
    rng = np.random.default_rng((seed, step))
    return windows(rng.integers(0, split - length - 1, cfg["batch"]), ids)

  held_ids = ids[split:]
  held = [windows(np.arange(i, i + cfg["batch"]) * (length + 1), held_ids)
          for i in range(0, cfg["eval_batches"] * cfg["batch"], cfg["batch"])]
  plain = zoo.TransformerLM(config)
  params = _init(plain, seed, held[0][0])
  losses = _transformer_losses(
      plain, BlockFieldLM(config, block=checkpointed_block(zoo.DecoderBlock)), params,
      held[0][0], seed)
  held_loss = jax.jit(lambda p, x, y: _xent(plain.apply({"params": p}, x), y))

  def evaluate(p):
    return {"held_out_loss": float(np.mean([held_loss(p, x, y) for x, y in held]))}

  return TaskSetup(params, losses, _transformer_controllers(cfg["adapt_interval"]), batch, evaluate,
                   _adam_warmup_cosine(cfg["lr"], steps), "held_out_loss", False,
                   dict(train_chars=split, held_out_windows=cfg["eval_batches"] * cfg["batch"],
                        config=dataclasses.asdict(config)))


def _cora(cfg: dict, seed: int, kind: str) -> TaskSetup:
  """Full-graph training on the 140 labelled nodes; the batch is (training node ids,
  their labels), so the controller's sampling variance compares two halves of them.
  The features and graph are arguments of the step (`extra`)."""
  cora = data_lib.load_cora()
  graph = graph_arrays(cora)
  x = jnp.asarray(cora.x)
  if kind == "gcn":
    model = GCN(cora.num_classes, cfg["hidden"], cfg["dropout"])
  else:
    model = GAT(cora.num_classes, cfg["hidden"], cfg["heads"], cfg["dropout"])
  params = _init(model, seed, x, graph)
  fixed = jact.compressed(model, bits=4, name=kind)
  nodes = np.flatnonzero(cora.train_mask).astype(np.int32)
  train = (jnp.asarray(nodes), jnp.asarray(cora.y[nodes]))

  def loss_of(module, compressed: bool):
    def loss(params, batch, key, x, graph):
      dropout_key, jact_key = jax.random.split(key)
      rngs = {"dropout": dropout_key}
      if compressed:
        rngs["jact"] = jact_key
      logits = module.apply({"params": params}, x, graph, train=True, rngs=rngs)
      node_ids, labels = batch
      return _xent(logits[node_ids], labels)
    return loss

  logits = jax.jit(lambda p, x, g: model.apply({"params": p}, x, g))
  labels = np.asarray(cora.y)

  def evaluate(p):
    predicted = np.asarray(jnp.argmax(logits(p, x, graph), -1))
    return {f"{split}_accuracy": float(np.mean(predicted[mask] == labels[mask]))
            for split, mask in (("train", cora.train_mask), ("val", cora.val_mask),
                                ("test", cora.test_mask))}

  optimizer = optax.chain(optax.add_decayed_weights(WEIGHT_DECAY), optax.adam(cfg["lr"]))
  losses = {"fp": loss_of(model, False), "fixed4": loss_of(fixed, True),
            "adaptive2": loss_of(fixed, True)}
  adaptive = dict(estimator="numeric", avg_bits=2.0, adapt_interval=cfg["adapt_interval"])
  return TaskSetup(params, losses, {"adaptive2": adaptive}, lambda step: train, evaluate,
                   optimizer, "val_accuracy", True,
                   dict(nodes=cora.num_nodes, edges=int(cora.edges.shape[1]),
                        split=[int(cora.train_mask.sum()), int(cora.val_mask.sum()),
                               int(cora.test_mask.sum())], weight_decay=WEIGHT_DECAY),
                   extra=(x, graph))


def setup_task(task: str, cfg: dict, seed: int = 0, steps: int | None = None) -> TaskSetup:
  """The `TaskSetup` of `task` ("sst2", "shakespeare", "cora_gcn", "cora_gat") for a
  run of `steps` steps (default `cfg["steps"]`; the transformers' schedule needs it)."""
  steps = cfg["steps"] if steps is None else steps
  if task == "sst2":
    return _sst2(cfg, seed, steps)
  if task == "shakespeare":
    return _shakespeare(cfg, seed, steps)
  if task in ("cora_gcn", "cora_gat"):
    return _cora(cfg, seed, task.split("_")[1])
  raise ValueError(f"unknown task {task!r}; choose from {list(TASKS)}")


# ----------------------------------------------------------------------------- training


def _step_memory(step_fn, loss_fn, args, plan) -> dict:
  """Bytes saved for the backward pass at `plan`, and the compiled temp of the train
  step (its executable, which the training already compiled, is looked up, not rebuilt)."""
  params, _, batch, key, *extra = args
  with jact.use_plan(plan):
    saved = jact.residual_report(lambda p: loss_fn(p, batch, key, *extra), params)
  compiled = step_fn.lower(*args, plan=plan).compile()
  return dict(saved_bytes=int(saved.total_bytes),
              temp_bytes=memory.compiled_memory_of(compiled).temp_bytes)


def _mean_windows(losses: list[float], every: int) -> list[dict]:
  return [dict(step=min(i + every, len(losses)), loss=float(np.mean(losses[i:i + every])))
          for i in range(0, len(losses), every)]


def train_variant(setup: TaskSetup, variant: str, *, steps: int, log_every: int,
                  eval_every: int, seed: int = 0, verbose: bool = True) -> dict:
  """Trains one variant from the task's initial parameters; returns its record."""
  loss_fn = setup.losses[variant]
  tx = setup.optimizer

  def train_step(params, opt_state, batch, key, *extra):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, key, *extra)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step_fn = jax.jit(jact.planned(train_step), static_argnames="plan")
  params, opt_state = setup.params, tx.init(setup.params)
  base_key = jax.random.key(seed + 1)
  controller = cstate = None
  if variant in setup.controllers:
    settings = dict(setup.controllers[variant])
    controller_loss = lambda p, b, k: loss_fn(p, b, k, *setup.extra)
    controller = jact.Controller(controller_loss, **settings)
    cstate = controller.init(params, setup.batch(0), base_key)
  losses, seconds, compiled_steps, plans, history = [], [], [], [], []
  controller_seconds, alerts, plan, best = 0.0, 0, None, None
  for step in range(steps):
    batch, key = setup.batch(step), jax.random.fold_in(base_key, step)
    if controller is not None:
      started = time.perf_counter()
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", jact.CompressionVarianceWarning)
        cstate = controller.update(cstate, params, batch, key)
      alerts += sum(issubclass(w.category, jact.CompressionVarianceWarning) for w in caught)
      controller_seconds += time.perf_counter() - started
      if cstate.plan != plan:
        compiled_steps.append(step)
      if controller.due(step):
        plans.append(dict(cstate.report, plan=cstate.plan.to_dict()))
      plan = cstate.plan
    elif step == 0:
      compiled_steps.append(0)
    started = time.perf_counter()
    params, opt_state, loss = step_fn(params, opt_state, batch, key, *setup.extra, plan=plan)
    losses.append(float(loss))
    seconds.append(time.perf_counter() - started)
    if not np.isfinite(losses[-1]):
      if verbose:
        print(f"  [{variant}] loss {losses[-1]} at step {step}: stopped", flush=True)
      break
    if (step + 1) % eval_every == 0 or step + 1 == steps:
      metrics = dict(step=step + 1, **setup.evaluate(params))
      history.append(metrics)
      score = metrics[setup.metric]
      if best is None or (score > best[setup.metric] if setup.higher_is_better
                          else score < best[setup.metric]):
        best = metrics
    if verbose and ((step + 1) % log_every == 0 or step + 1 == steps):
      print(f"  [{variant}] step {step + 1}/{steps} loss {np.mean(losses[-log_every:]):.4f} "
            f"({seconds[-1]:.3f} s/step)" + (f" {history[-1]}" if history and
                                              history[-1]["step"] == step + 1 else ""), flush=True)
  timed = [s for i, s in enumerate(seconds) if i not in compiled_steps]
  step_memory = _step_memory(step_fn, loss_fn, (params, opt_state, setup.batch(0), base_key,
                                           *setup.extra), plan)
  return dict(
      variant=variant, steps=len(losses), finite=bool(np.all(np.isfinite(losses))),
      first_loss=losses[0], final_loss=float(np.mean(losses[-log_every:])),
      losses=_mean_windows(losses, log_every), history=history, final=history[-1] if history
      else None, best=best, best_by=setup.metric, **step_memory,
      average_bits=None if plan is None else float(plan.average_bits()),
      plans=plans, variance_alerts=alerts,
      controller=setup.controllers.get(variant), controller_seconds=controller_seconds,
      median_step_s=float(np.median(timed if timed else seconds)), compiled_at=compiled_steps)


def _earlier_variants(path: Path, config: dict, seed: int, rerun) -> dict:
  """The variants an earlier run of the same task, settings and seed wrote to `path` (those
  not run again), each with the run's metadata: a run of some variants keeps the others."""
  if not path.exists():
    return {}
  earlier = json.loads(path.read_text())
  if json.loads(json.dumps(config)) != earlier.get("config") or earlier.get("seed") != seed:
    return {}
  return {name: dict(record, meta=record.get("meta", earlier.get("meta", {})))
          for name, record in earlier["variants"].items() if name not in rerun}


def run_task(task: str, cfg: dict, *, variants=None, steps: int | None = None,
             results: Path = RESULTS, meta: dict | None = None, seed: int = 0,
             verbose: bool = True) -> dict:
  """Trains every variant of `task`; writes `<results>/<task>.json` after each one."""
  variants = list(variants or VARIANTS[task])
  steps = cfg["steps"] if steps is None else steps
  started = time.perf_counter()
  setup = setup_task(task, cfg, seed, steps)
  config = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
            for k, v in cfg.items()}
  out = dict(meta=meta or {}, task=task, config=dict(config, steps=steps), seed=seed,
             data=setup.description, variants=_earlier_variants(
                 Path(results) / f"{task}.json", dict(config, steps=steps), seed, variants))
  for variant in variants:
    if verbose:
      print(f"[{task}] {variant}", flush=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    record = train_variant(setup, variant, steps=steps, log_every=cfg["log_every"],
                           eval_every=cfg["eval_every"], seed=seed, verbose=verbose)
    record["seconds"] = time.perf_counter() - t0
    record["cpu_seconds"] = time.process_time() - cpu0
    record["meta"] = meta or {}
    out["variants"][variant] = record
    out["seconds"] = time.perf_counter() - started
    resumable.write_json(Path(results) / f"{task}.json", out)
    if verbose:
      best = record["best"][record["best_by"]] if record["best"] else float("nan")
      print(f"[{task}] {variant}: {record['best_by']} best {best:.4f}, saved "
            f"{record['saved_bytes'] / 2**20:.2f} MiB, temp {record['temp_bytes'] / 2**20:.2f} MiB, "
            f"bits {record['average_bits']}, {record['median_step_s']:.3f} s/step, "
            f"{record['seconds']:.0f} s", flush=True)
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m experiments.papers.gact_tasks",
                              description=__doc__.split("\n")[0])
  p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
  p.add_argument("--variants", nargs="+", default=None,
                 help="only these variants (of those each task has)")
  p.add_argument("--steps", type=int, default=None,
                 help="training steps (Cora: epochs) per variant")
  p.add_argument("--small", action="store_true", help="tiny models, a few steps (CI)")
  p.add_argument("--results", type=Path, default=RESULTS)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--quiet", action="store_true")
  a = p.parse_args(argv)
  meta = metadata.run_metadata("experiments.papers.gact_tasks", argv)
  sizes = SMALL if a.small else TASKS
  out = {}
  for task in a.tasks:
    variants = [v for v in VARIANTS[task] if a.variants is None or v in a.variants]
    out[task] = run_task(task, sizes[task], variants=variants, steps=a.steps, results=a.results,
                         meta=dict(meta, small=a.small), seed=a.seed, verbose=not a.quiet)
  return out


if __name__ == "__main__":
  main()
