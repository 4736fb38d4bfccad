"""The models, batches and train steps of `experiments.bench.memory_batch` (and
`experiments.gpu.gpu_lm`): the pre-activation ResNet-20 and the zoo's decoder LM, each residual
block trained one of six ways."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jact
from experiments.lib import data, preact, zoo

__all__ = [
  "Config",
  "FULL",
  "SMALL",
  "block_method",
  "resnet_blockwise_logits",
  "lm_blockwise_logits",
  "init_params",
  "real_batch",
  "loss_fn",
  "train_step",
  "optimizer",
  "on_device",
]

MODELS = ("resnet20", "transformer_lm")
METHODS = ("plain", "remat", "jact4", "jact2", "jact_checkpoint", "offload")
CHECKPOINT_BITS = 4  # width of jact_checkpoint's and offload's compressed copies
LEARNING_RATE = 1e-3  # the same batch is stepped on repeatedly: keep values finite


@dataclasses.dataclass(frozen=True)
class Config:
  """Model sizes and search settings of a run (`FULL`, `SMALL`)."""

  widths: tuple[int, ...]  # ResNet stage widths
  blocks: int  # ResNet residual blocks per stage
  lm: zoo.LMConfig  # the LM; its max_len is the sequence length trained on
  cap_mib: float  # the memory cap
  start: int  # first batch of the doubling
  granularity: int  # the search's resolution: batches are its multiples
  upper: int  # largest batch tried
  time_batch: int  # largest batch the timing uses
  time_steps: int  # timed rounds (one step per method each)
  measure: str = "step_mib"  # what the cap limits: one of MEASURES
  fast_compile: bool = False  # compile every step with FAST_COMPILE_FLAGS


FULL = Config(
  widths=(16, 32, 64),
  blocks=3,
  lm=zoo.LMConfig(max_len=128),
  cap_mib=512,
  start=64,
  granularity=16,
  upper=4096,
  time_batch=64,
  time_steps=20,
)
SMALL = Config(
  widths=(8, 16),
  blocks=1,
  lm=zoo.LMConfig(emb_dim=32, num_heads=2, num_layers=2, mlp_dim=64, max_len=32),
  cap_mib=40,
  start=32,
  granularity=32,
  upper=64,
  time_batch=32,
  time_steps=10,
  fast_compile=True,
)
SMALL_MODELS = ("resnet20",)
SMALL_METHODS = ("plain", "jact2")


# ----------------------------------------------------------------------------- methods


def block_method(method: str, plain_block: Callable, jact_block: Callable, name: str) -> Callable:
  """One residual block `(params, x, key) -> y` trained the way `method` says.

  `plain_block(params, x)` is the block as written; `jact_block(params, x, key)`
  the same block keeping 4-bit residuals (offload's policy selects them).
  """
  if method == "plain":
    return lambda p, x, key: plain_block(p, x)
  if method == "remat":
    remat = jax.checkpoint(plain_block)
    return lambda p, x, key: remat(p, x)
  if method == "jact_checkpoint":
    ckpt = jact.checkpoint(plain_block, bits=CHECKPOINT_BITS, compress_argnums=(1,), name=name)
    return lambda p, x, key: ckpt(p, x, key=key)
  if method == "offload":
    return jax.checkpoint(jact_block, policy=jact.offload_compressed())
  raise ValueError(f"no block form for method {method!r}")


# ----------------------------------------------------------------------------- ResNet-20


def _resnet_block(pair, h, key, *, stride, form, name):
  """Two preact units and the parameter-free shortcut: one residual block."""
  rounding = {} if form == "plain" else dict(bits=CHECKPOINT_BITS)
  k1, k2 = jax.random.split(key)
  width = pair[1]["kernel"].shape[-1]
  r = preact._unit(h, pair[0], stride, f"{name}.a", form, rounding, k1)
  r = preact._unit(r, pair[1], 1, f"{name}.b", form, rounding, k2)
  return preact._shortcut(h, width, stride) + r


def resnet_blockwise_logits(params, x, key, method: str = "plain"):
  """preact.apply's network with each residual block trained by `method`."""
  units, width = params["units"], params["stem"].shape[-1]
  h = preact._conv(x, params["stem"], 1)
  for i in range(0, len(units), 2):
    pair, name = (units[i], units[i + 1]), f"block{i // 2}"
    stride = 2 if pair[1]["kernel"].shape[-1] > width else 1
    plain = functools.partial(
      _resnet_block, key=jax.random.key(0), stride=stride, form="plain", name=name
    )
    compressed = functools.partial(_resnet_block, stride=stride, form="layers", name=name)
    block = block_method(
      method,
      lambda p, h, plain=plain: plain(p, h),
      lambda p, h, k, compressed=compressed: compressed(p, h, key=k),
      name,
    )
    h = block(pair, h, jax.random.fold_in(key, i))
    width = pair[1]["kernel"].shape[-1]
  head = params["head"]
  h = jnp.mean(jax.nn.relu(preact._plain_bn(h, head["scale"], head["bias"])), axis=(1, 2))
  return h @ head["kernel"]


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def resnet_loss(method: str) -> Callable:
  """`loss(params, (images, labels), key)` of the ResNet trained by `method`."""
  if method == "plain":
    return functools.partial(preact.loss, form="plain")
  if method in ("jact4", "jact2"):
    return functools.partial(preact.loss, form="layers", bits=int(method[-1]))
  return lambda params, batch, key: _xent(
    resnet_blockwise_logits(params, batch[0], key, method), batch[1]
  )


@functools.lru_cache(maxsize=1)
def cifar_pool() -> tuple[np.ndarray, np.ndarray]:
  """256 standardized CIFAR-10 training images and their labels (numpy)."""
  _, pool_x, pool_y = data.load_pool("cifar10", 32, jnp.float32)
  return np.asarray(pool_x), np.asarray(pool_y)


def cifar_batch(batch: int) -> tuple[np.ndarray, np.ndarray]:
  """`batch` training images (the pool repeated) and their labels (numpy)."""
  pool_x, pool_y = cifar_pool()
  idx = np.arange(batch) % len(pool_x)
  return pool_x[idx], pool_y[idx]


# ----------------------------------------------------------------------------- decoder LM


def lm_blockwise_logits(params, tokens, key, cfg: zoo.LMConfig, method: str = "plain"):
  """zoo.TransformerLM's forward pass with each decoder block trained by `method`."""
  x = nn.Embed(cfg.vocab_size, cfg.emb_dim).apply({"params": params["Embed_0"]}, tokens)
  x = x + params["pos_embedding"][:, : tokens.shape[1]]
  mask = nn.make_causal_mask(tokens)
  block = zoo.DecoderBlock(cfg)
  jact_block = jact.convert(block, bits=CHECKPOINT_BITS)
  for i in range(cfg.num_layers):
    fn = block_method(
      method,
      lambda p, x: block.apply({"params": p}, x, mask),
      lambda p, x, k: jact_block.apply({"params": p}, x, mask, rngs={"jact": k}),
      f"block{i}",
    )
    x = fn(params[f"decoderblock_{i}"], x, jax.random.fold_in(key, i))
  x = nn.LayerNorm().apply({"params": params["encoderdecoder_norm"]}, x)
  return nn.Dense(cfg.vocab_size).apply({"params": params["logitdense"]}, x)


def lm_loss(method: str, cfg: zoo.LMConfig) -> Callable:
  """`loss(params, (tokens, next tokens), key)` of the LM trained by `method`."""
  if method == "plain":
    model = zoo.TransformerLM(cfg)
    return lambda params, batch, key: _xent(model.apply({"params": params}, batch[0]), batch[1])
  if method.removeprefix("jact").isdigit():  # jact4, jact2, ... (gpu_lm adds jact8)
    model = jact.convert(zoo.TransformerLM(cfg), bits=int(method.removeprefix("jact")))
    return lambda params, batch, key: _xent(
      model.apply({"params": params}, batch[0], rngs={"jact": key}), batch[1]
    )
  return lambda params, batch, key: _xent(
    lm_blockwise_logits(params, batch[0], key, cfg, method), batch[1]
  )


@functools.lru_cache(maxsize=1)
def shakespeare_ids() -> np.ndarray:
  """Tiny Shakespeare as character ids (the sorted characters: 65, the LM's vocabulary)."""
  text = data._data_file("tinyshakespeare/input.txt").read_text(encoding="utf-8")
  vocab = np.array(sorted(set(text)))
  return np.searchsorted(vocab, np.array(list(text))).astype(np.int32)


def shakespeare_batch(batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
  """`batch` random windows of tiny Shakespeare character ids and their next characters."""
  ids = shakespeare_ids()
  starts = np.random.default_rng(0).integers(0, len(ids) - length - 1, batch)
  windows = ids[starts[:, None] + np.arange(length + 1)]
  return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------- train step


@functools.lru_cache(maxsize=4)
def init_params(model: str, config: Config):
  """The model's initial parameters (numpy; the same for every method and batch)."""
  if model == "resnet20":
    params = preact.init(jax.random.key(0), widths=config.widths, blocks=config.blocks)
  elif model == "transformer_lm":
    tokens = jnp.zeros((1, config.lm.max_len), jnp.int32)
    key = jax.random.key(0, impl="unsafe_rbg")  # compiles in 2 s, threefry in 10
    params = jax.jit(zoo.TransformerLM(config.lm).init)(key, tokens)["params"]
  else:
    raise ValueError(f"model must be one of {MODELS}, got {model!r}")
  return jax.device_get(params)


def real_batch(model: str, batch: int, config: Config) -> tuple[np.ndarray, np.ndarray]:
  """`batch` real training examples of `model`'s data set (numpy)."""
  if model == "resnet20":
    return cifar_batch(batch)
  return shakespeare_batch(batch, config.lm.max_len)


def loss_fn(model: str, method: str, config: Config) -> Callable:
  """`loss(params, batch, key)` of `model` trained by `method`."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if model == "resnet20":
    return resnet_loss(method)
  if model == "transformer_lm":
    return lm_loss(method, config.lm)
  raise ValueError(f"model must be one of {MODELS}, got {model!r}")


def train_step(loss: Callable, tx) -> Callable:
  """`(params, opt_state, batch, key) -> (params, opt_state, loss)`: gradient and update."""

  def step(params, opt_state, batch, key):
    value, grads = jax.value_and_grad(loss)(params, batch, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def optimizer():
  return optax.sgd(LEARNING_RATE, momentum=0.9)


def on_device(params, batch):
  """(params, optimizer state, batch) on the device, ready."""
  tx = optimizer()
  params, batch = jax.device_put(params), jax.device_put(tuple(batch))
  opt_state = tx.init(params)
  return jax.block_until_ready((params, opt_state, batch))
