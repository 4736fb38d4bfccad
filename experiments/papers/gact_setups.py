"""GACT's four tasks as `TaskSetup`s (data, model, losses, controllers, metric) for
`experiments.papers.gact_tasks`: SST-2, tiny Shakespeare, Cora with a GCN and with a GAT."""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jact
from experiments.lib import data as data_lib
from experiments.lib import planetoid, zoo, zoo_data
from experiments.lib.gact_models import (
  GAT,
  GCN,
  BlockFieldLM,
  EncoderBlock,
  SST2Transformer,
  checkpointed_block,
  cross_entropy,
)
from experiments.lib.gcn import graph_arrays

__all__ = ["TASKS", "SMALL", "VARIANTS", "TaskSetup", "setup_task"]

LM_VARIANTS = ("fp", "gact_l1", "fixed2", "gact_cb1", "fixed4", "adaptive2")
GRAPH_VARIANTS = ("fp", "fixed4", "adaptive2")
VARIANTS = {
  "sst2": LM_VARIANTS,
  "shakespeare": LM_VARIANTS,
  "cora_gcn": GRAPH_VARIANTS,
  "cora_gat": GRAPH_VARIANTS,
}

# Sizes of each task: the full run, and `--small` (tiny models, a few steps).
TASKS = {
  "sst2": dict(
    steps=216,
    batch=64,
    length=64,
    vocab=8000,
    dim=128,
    heads=4,
    mlp=512,
    blocks=2,
    lr=1e-3,
    adapt_interval=100,
    log_every=12,
    eval_every=54,
  ),
  "shakespeare": dict(
    steps=300,
    batch=32,
    length=128,
    config=zoo.LMConfig(),
    lr=1e-3,
    adapt_interval=100,
    log_every=10,
    eval_every=50,
    eval_batches=16,
  ),
  "cora_gcn": dict(
    steps=200, hidden=16, dropout=0.5, lr=0.01, adapt_interval=50, log_every=5, eval_every=1
  ),
  "cora_gat": dict(
    steps=200,
    hidden=8,
    heads=8,
    dropout=0.6,
    lr=0.005,
    adapt_interval=50,
    log_every=5,
    eval_every=1,
  ),
}
SMALL = {
  "sst2": dict(
    TASKS["sst2"],
    steps=4,
    batch=16,
    length=32,
    vocab=2000,
    dim=32,
    heads=2,
    mlp=64,
    blocks=1,
    adapt_interval=100,
    log_every=2,
    eval_every=4,
    eval_size=128,
  ),
  "shakespeare": dict(
    TASKS["shakespeare"],
    steps=4,
    batch=8,
    length=32,
    config=zoo.LMConfig(emb_dim=32, num_heads=2, num_layers=1, mlp_dim=64, max_len=32),
    adapt_interval=100,
    log_every=2,
    eval_every=4,
    eval_batches=2,
  ),
  "cora_gcn": dict(TASKS["cora_gcn"], steps=4, adapt_interval=100, log_every=2, eval_every=2),
  "cora_gat": dict(TASKS["cora_gat"], steps=4, adapt_interval=100, log_every=2, eval_every=2),
}
WEIGHT_DECAY = 5e-4  # Cora (Kipf & Welling; Velickovic et al.)


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
  cb1_params = jax.eval_shape(lambda: checkpointed.init(jax.random.key(seed), example)["params"])
  if jax.tree.map(jnp.shape, cb1_params) != jax.tree.map(jnp.shape, params):
    raise AssertionError("the checkpointed model's parameters differ from the plain model's")
  bits = int(jact.levels.get("gact:L1").bits)
  converted = _linen_loss(jact.convert(plain, bits=bits), True)
  return {
    "fp": _linen_loss(plain, False),
    "gact_l1": converted,
    "fixed2": _linen_loss(jact.convert(plain, bits=2), True),
    "gact_cb1": _linen_loss(jact.convert(checkpointed, bits=bits), True),
    "fixed4": _linen_loss(jact.convert(plain, bits=4), True),
    "adaptive2": converted,
  }


def _linen_loss(model, with_key: bool):
  def loss(params, batch, key):
    inputs, labels = batch
    rngs = {"jact": key} if with_key else {}
    return cross_entropy(model.apply({"params": params}, inputs, rngs=rngs), labels)

  return loss


def _init(model, seed: int, *inputs):
  """The model's initial parameters (jitted: Flax's init op by op compiles every op)."""
  return jax.jit(lambda key, *inputs: model.init(key, *inputs)["params"])(
    jax.random.key(seed), *inputs
  )


def _sst2_encode(sentences, ids, length):
  tokens = np.zeros((len(sentences), length), np.int32)
  for i, words in enumerate(sentences):
    row = [ids.get(w, 1) for w in words][:length] or [1]
    tokens[i, : len(row)] = row
  return tokens


def _predict_in_chunks(logits_fn, params, x, chunk: int = 256) -> np.ndarray:
  """Arg-max predictions of `logits_fn(params, x[i:i+chunk])`, the last chunk padded
  (one compiled shape)."""
  out = []
  for start in range(0, len(x), chunk):
    part = x[start : start + chunk]
    padded = np.concatenate([part, np.zeros((chunk - len(part), *part.shape[1:]), part.dtype)])
    out.append(np.asarray(jnp.argmax(logits_fn(params, jnp.asarray(padded)), -1))[: len(part)])
  return np.concatenate(out)


def _sst2(cfg: dict, seed: int, steps: int) -> TaskSetup:
  """Word ids (0 padding, 1 unknown, the rest the most frequent training words),
  sentences clipped to `length` words; dev and test accuracy."""
  train, y_train = zoo_data.sst2_split("train")
  splits = {name: zoo_data.sst2_split(name) for name in ("dev", "test")}
  counts = collections.Counter(w for s in train for w in s)
  ids = {w: i + 2 for i, (w, _) in enumerate(counts.most_common(cfg["vocab"] - 2))}
  x_train = _sst2_encode(train, ids, cfg["length"])
  held = {
    name: (_sst2_encode(s, ids, cfg["length"])[: cfg.get("eval_size")], y[: cfg.get("eval_size")])
    for name, (s, y) in splits.items()
  }
  build = functools.partial(
    SST2Transformer,
    vocab_size=cfg["vocab"],
    dim=cfg["dim"],
    num_heads=cfg["heads"],
    mlp_dim=cfg["mlp"],
    num_blocks=cfg["blocks"],
    max_len=cfg["length"],
  )
  plain = build()
  params = _init(plain, seed, jnp.asarray(x_train[:2]))
  losses = _transformer_losses(
    plain, build(block=checkpointed_block(EncoderBlock)), params, jnp.asarray(x_train[:2]), seed
  )
  per_epoch = len(x_train) // cfg["batch"]
  logits = jax.jit(lambda p, x: plain.apply({"params": p}, x))

  def batch(step):
    epoch, index = divmod(step, per_epoch)
    order = np.random.default_rng((seed, epoch)).permutation(len(x_train))
    idx = order[index * cfg["batch"] : (index + 1) * cfg["batch"]]
    return jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx])

  def evaluate(p):
    return {
      f"{name}_accuracy": float(np.mean(_predict_in_chunks(logits, p, x) == y))
      for name, (x, y) in held.items()
    }

  return TaskSetup(
    params,
    losses,
    _transformer_controllers(cfg["adapt_interval"]),
    batch,
    evaluate,
    _adam_warmup_cosine(cfg["lr"], steps),
    "dev_accuracy",
    True,
    dict(
      train_size=len(x_train),
      steps_per_epoch=per_epoch,
      eval_sizes={k: len(v[1]) for k, v in held.items()},
    ),
  )


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
    seq = np.stack([source[s : s + length + 1] for s in starts])
    return jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:])

  def batch(step):
    rng = np.random.default_rng((seed, step))
    return windows(rng.integers(0, split - length - 1, cfg["batch"]), ids)

  held_ids = ids[split:]
  held = [
    windows(np.arange(i, i + cfg["batch"]) * (length + 1), held_ids)
    for i in range(0, cfg["eval_batches"] * cfg["batch"], cfg["batch"])
  ]
  plain = zoo.TransformerLM(config)
  params = _init(plain, seed, held[0][0])
  losses = _transformer_losses(
    plain,
    BlockFieldLM(config, block=checkpointed_block(zoo.DecoderBlock)),
    params,
    held[0][0],
    seed,
  )
  held_loss = jax.jit(lambda p, x, y: cross_entropy(plain.apply({"params": p}, x), y))

  def evaluate(p):
    return {"held_out_loss": float(np.mean([held_loss(p, x, y) for x, y in held]))}

  return TaskSetup(
    params,
    losses,
    _transformer_controllers(cfg["adapt_interval"]),
    batch,
    evaluate,
    _adam_warmup_cosine(cfg["lr"], steps),
    "held_out_loss",
    False,
    dict(
      train_chars=split,
      held_out_windows=cfg["eval_batches"] * cfg["batch"],
      config=dataclasses.asdict(config),
    ),
  )


def _cora(cfg: dict, seed: int, kind: str) -> TaskSetup:
  """Full-graph training on the 140 labelled nodes; the batch is (training node ids,
  their labels), so the controller's sampling variance compares two halves of them.
  The features and graph are arguments of the step (`extra`)."""
  cora = planetoid.load_cora()
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
      return cross_entropy(logits[node_ids], labels)

    return loss

  logits = jax.jit(lambda p, x, g: model.apply({"params": p}, x, g))
  labels = np.asarray(cora.y)

  def evaluate(p):
    predicted = np.asarray(jnp.argmax(logits(p, x, graph), -1))
    return {
      f"{split}_accuracy": float(np.mean(predicted[mask] == labels[mask]))
      for split, mask in (
        ("train", cora.train_mask),
        ("val", cora.val_mask),
        ("test", cora.test_mask),
      )
    }

  optimizer = optax.chain(optax.add_decayed_weights(WEIGHT_DECAY), optax.adam(cfg["lr"]))
  losses = {
    "fp": loss_of(model, False),
    "fixed4": loss_of(fixed, True),
    "adaptive2": loss_of(fixed, True),
  }
  adaptive = dict(estimator="numeric", avg_bits=2.0, adapt_interval=cfg["adapt_interval"])
  return TaskSetup(
    params,
    losses,
    {"adaptive2": adaptive},
    lambda step: train,
    evaluate,
    optimizer,
    "val_accuracy",
    True,
    dict(
      nodes=cora.num_nodes,
      edges=int(cora.edges.shape[1]),
      split=[int(cora.train_mask.sum()), int(cora.val_mask.sum()), int(cora.test_mask.sum())],
      weight_decay=WEIGHT_DECAY,
    ),
    extra=(x, graph),
  )


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
