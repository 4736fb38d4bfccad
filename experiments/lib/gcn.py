"""A two-layer graph convolutional network (Kipf & Welling 2017) in plain JAX.

    logits = A_hat . dropout(relu(A_hat . dropout(X) W1 + b1)) W2 + b2,
    A_hat  = D^-1/2 (A + I) D^-1/2,

trained with softmax cross-entropy on the labelled training nodes. The
sparse product `A_hat . h` is a gather of `h` along the edge list and a
`jax.ops.segment_sum` onto the receiving nodes (`propagate`). Every function
takes arrays only (and static Python numbers), so it can be wrapped as it is
by `jact.compressed`:

>>> import jax, jax.numpy as jnp, jact
>>> from experiments.lib.planetoid import load_cora
>>> cora = load_cora()
>>> graph, x = graph_arrays(cora), jnp.asarray(cora.x)
>>> params = init_gcn(jax.random.key(0), cora.num_features, 16, cora.num_classes)
>>> layer = jact.compressed(gcn_layer, bits=2, name="gcn1")
>>> h = layer(params["layer1"], x, graph, jax.random.key(1), key=jax.random.key(2))
>>> bool((h == gcn_layer(params["layer1"], x, graph, jax.random.key(1))).all()), h.shape
(True, (2708, 16))

What each piece saves for the backward pass (`jact.residual_report`):
  * `propagate` saves nothing new: its VJP is `A_hat^T g`, computed from the
    edge list and the weights, which are the layer's own inputs. (Without the
    custom VJP, JAX would keep the edge weights broadcast to [E, H] floats.)
    The adjacency is a constant: its weights get a zero gradient.
  * `x @ w` keeps the (dropped-out) input, float [N, F]: compressed.
  * ReLU keeps the bool mask `z > 0`, dropout its bool keep-mask, and
    nothing else (small custom VJPs): both packed to 1 bit by `compressed`.
  * with `grad_input=False` (the first layer, whose input is data) the input
    is not differentiated, so the input dropout mask is not kept at all.

Run `python -m experiments.lib.gcn` for a training run (plain vs compressed).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jact._core import rng as jact_rng
from jact.ops._dropout import keep_mask

__all__ = [
  "Graph",
  "graph_arrays",
  "propagate",
  "relu",
  "dropout",
  "gcn_layer",
  "init_gcn",
  "gcn_apply",
  "cross_entropy",
  "gcn_loss",
  "l2_penalty",
  "accuracy",
  "train_gcn",
]


class Graph(NamedTuple):
  """The propagation matrix A_hat as an edge list (a pytree of arrays).

  `(A_hat @ h)[receivers[k]] += weights[k] * h[senders[k]]`.
  """

  senders: jax.Array  # int32 [E + N]
  receivers: jax.Array  # int32 [E + N]
  weights: jax.Array  # float32 [E + N]


def graph_arrays(data) -> Graph:
  """The `Graph` of a `experiments.lib.planetoid.Planetoid` (rows receive, columns send)."""
  return Graph(
    senders=jnp.asarray(data.adj_index[1], jnp.int32),
    receivers=jnp.asarray(data.adj_index[0], jnp.int32),
    weights=jnp.asarray(data.adj_weight, jnp.float32),
  )


def _spmm(senders, receivers, weights, h):
  messages = jnp.take(h, senders, axis=0) * weights[:, None].astype(h.dtype)
  return jax.ops.segment_sum(messages, receivers, num_segments=h.shape[0])


@jax.custom_vjp
def _propagate(senders, receivers, weights, h):
  return _spmm(senders, receivers, weights, h)


def _propagate_fwd(senders, receivers, weights, h):
  return _spmm(senders, receivers, weights, h), (senders, receivers, weights)


def _propagate_bwd(saved, g):
  senders, receivers, weights = saved
  # d/dh of A_hat h is A_hat^T g: swap senders and receivers. The adjacency
  # is treated as a constant (zero gradient for its weights).
  return None, None, jnp.zeros_like(weights), _spmm(receivers, senders, weights, g)


_propagate.defvjp(_propagate_fwd, _propagate_bwd)


def propagate(graph: Graph, h: jax.Array) -> jax.Array:
  """`A_hat @ h` for node features h [N, H]: gather along edges, segment_sum.

  Its backward pass needs only the edge list and weights (no activation).
  """
  return _propagate(graph.senders, graph.receivers, graph.weights, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _masked(x, keep, scale):
  """`where(keep, x * scale, 0)`; the VJP keeps only the bool `keep`."""
  return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))


def _masked_fwd(x, keep, scale):
  return _masked(x, keep, scale), keep


def _masked_bwd(scale, keep, g):
  return jnp.where(keep, g * scale, jnp.zeros((), g.dtype)), None


_masked.defvjp(_masked_fwd, _masked_bwd)


def relu(z: jax.Array) -> jax.Array:
  """ReLU whose backward pass keeps only the bool mask `z > 0`.

  (`jax.nn.relu` under `jax.vjp` also keeps a broadcast array of zeros,
  float [N, H], besides the mask.)
  """
  return _masked(z, z > 0, 1.0)


def dropout(x: jax.Array, key, rate: float) -> jax.Array:
  """Inverted dropout through a bool keep-mask; the backward pass keeps only
  that mask (1 bit per value under `jact.compressed`).

  The mask is `jact.ops._dropout.keep_mask` (a counter hash of the element
  index, P(keep) = 1 - rate): `jax.random.bernoulli` over Cora's 2708 x 1433
  features costs ~50x the rest of a training step on CPU. (`jact.ops.dropout`
  itself would keep only a 4-byte seed and regenerate the mask; this model
  keeps the mask, to exercise bit-packing of bool residuals.)
  """
  if key is None or rate == 0.0:
    return x
  keep = keep_mask(jact_rng.seed_from_key(key), x.shape, rate)
  return _masked(x, keep, 1.0 / (1.0 - rate))


def gcn_layer(
  params: dict,
  x: jax.Array,
  graph: Graph,
  dropout_key=None,
  *,
  rate: float = 0.5,
  relu: bool = True,
  grad_input: bool = True,
) -> jax.Array:
  """One GCN layer: `act(A_hat . dropout(x) @ w + b)`.

  Args:
    params: {"w": [F, H], "b": [H]}.
    x: node features [N, F].
    graph: the `Graph` of A_hat.
    dropout_key: PRNG key of the dropout mask; None: no dropout (evaluation).
    rate: dropout rate (static).
    relu: apply ReLU (hidden layer) or not (output layer).
    grad_input: whether x is differentiated. False for the first layer, whose
      input is data: then neither its dropout mask is kept nor d/dx computed
      (`jact.compressed` differentiates every float argument otherwise).
  """
  if not grad_input:
    x = jax.lax.stop_gradient(x)
  h = dropout(x, dropout_key, rate) @ params["w"]
  z = propagate(graph, h) + params["b"]
  return _masked(z, z > 0, 1.0) if relu else z


def _glorot(key, shape):
  limit = np.sqrt(6.0 / (shape[0] + shape[1]))
  return jax.random.uniform(key, shape, jnp.float32, -limit, limit)


def init_gcn(key, in_features: int, hidden: int, classes: int) -> dict:
  """Glorot-uniform weights and zero biases, as in Kipf & Welling."""
  k1, k2 = jax.random.split(key)
  return {
    "layer1": {"w": _glorot(k1, (in_features, hidden)), "b": jnp.zeros((hidden,))},
    "layer2": {"w": _glorot(k2, (hidden, classes)), "b": jnp.zeros((classes,))},
  }


def gcn_apply(
  params: dict,
  x: jax.Array,
  graph: Graph,
  dropout_key=None,
  *,
  rate: float = 0.5,
  layer: Callable[..., Any] | None = None,
  key=None,
) -> jax.Array:
  """Logits [N, C] of the two-layer GCN.

  `layer` replaces `gcn_layer` (e.g. `jact.compressed(gcn_layer, bits=2)`);
  when `key` is given it is split and passed as `key=` to each layer call.
  """
  layer = gcn_layer if layer is None else layer
  d1 = d2 = k1 = k2 = None
  if dropout_key is not None:
    d1, d2 = jax.random.split(dropout_key)
  extra = [{}, {}]
  if key is not None:
    k1, k2 = jax.random.split(key)
    extra = [{"key": k1}, {"key": k2}]
  h = layer(params["layer1"], x, graph, d1, rate=rate, relu=True, grad_input=False, **extra[0])
  return layer(params["layer2"], h, graph, d2, rate=rate, relu=False, **extra[1])


def cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of the nodes in `mask` (bool [N])."""
  logp = jax.nn.log_softmax(logits)
  picked = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[:, None], axis=1)[:, 0]
  return -jnp.sum(jnp.where(mask, picked, 0.0)) / jnp.sum(mask)


def gcn_loss(
  params: dict,
  x: jax.Array,
  graph: Graph,
  labels: jax.Array,
  mask: jax.Array,
  dropout_key=None,
  *,
  rate: float = 0.5,
  **apply_kwargs,
) -> jax.Array:
  """`cross_entropy` of `gcn_apply` (keywords such as `layer`, `key` go to it).

  Wrap the model (`gcn_apply` or `gcn_layer`) in `jact.compressed`, not this
  loss: JAX's log-softmax backward divides by the saved normalizer
  sum(exp(z)), [N, 1] (2708 floats, above `min_size`, so `compressed` would
  quantize it), and 1 / (a stochastically rounded value) is biased.
  """
  logits = gcn_apply(params, x, graph, dropout_key, rate=rate, **apply_kwargs)
  return cross_entropy(logits, labels, mask)


def l2_penalty(params: dict, weight_decay: float = 5e-4) -> jax.Array:
  """Kipf & Welling's weight decay: on the first layer's weights only."""
  return weight_decay * 0.5 * jnp.sum(params["layer1"]["w"] ** 2)


def accuracy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> float:
  """Fraction of the nodes in `mask` whose arg-max logit is their label."""
  hit = (jnp.argmax(logits, -1) == labels) & mask
  return float(jnp.sum(hit) / jnp.sum(mask))


def train_gcn(
  data,
  *,
  steps: int = 50,
  bits: int | None = 2,
  hidden: int = 16,
  learning_rate: float = 0.01,
  rate: float = 0.5,
  weight_decay: float = 5e-4,
  seed: int = 0,
) -> dict:
  """Trains the GCN with optax Adam on the training nodes of a `Planetoid`.

  Args:
    data: an `experiments.lib.planetoid.Planetoid`.
    steps: full-graph gradient steps.
    bits: None trains the plain model; otherwise the whole loss is wrapped
      in `jact.compressed(bits=bits)` with a fresh key every step.

  Returns:
    {"losses": training loss per step (before the update), "train_acc",
     "val_acc", "test_acc" of the final parameters (no dropout), "seconds"}.
  """
  import optax

  import jact

  graph, x = graph_arrays(data), jnp.asarray(data.x)
  labels = jnp.asarray(data.y)
  masks = {k: jnp.asarray(getattr(data, f"{k}_mask")) for k in ("train", "val", "test")}
  model = gcn_apply if bits is None else jact.compressed(gcn_apply, bits=bits, name="gcn")

  def objective(params, x, graph, labels, mask, dropout_key, key):
    extra = {} if bits is None else {"key": key}
    logits = model(params, x, graph, dropout_key, rate=rate, **extra)
    value = cross_entropy(logits, labels, mask)
    return value + l2_penalty(params, weight_decay), value

  opt = optax.adam(learning_rate)
  params = init_gcn(jax.random.key(seed), data.num_features, hidden, data.num_classes)
  state = opt.init(params)

  @jax.jit  # the data are arguments: closed-over constants would slow XLA's compile ~2x
  def step(params, state, step_key, x, graph, labels, mask):
    dropout_key, key = jax.random.split(step_key)
    (_, value), grads = jax.value_and_grad(objective, has_aux=True)(
      params, x, graph, labels, mask, dropout_key, key
    )
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  start = time.perf_counter()
  losses = []
  keys = jax.random.split(jax.random.key(seed + 1), steps)
  for i in range(steps):
    params, state, value = step(params, state, keys[i], x, graph, labels, masks["train"])
    losses.append(float(value))
  logits = jax.jit(gcn_apply)(params, x, graph)
  out = {"losses": np.array(losses), "seconds": time.perf_counter() - start, "params": params}
  for k, m in masks.items():
    out[f"{k}_acc"] = accuracy(logits, labels, m)
  return out


if __name__ == "__main__":
  from experiments.lib.planetoid import load_cora

  cora = load_cora()
  for bits in (None, 8, 4, 2, 1):
    r = train_gcn(cora, steps=200, bits=bits)
    print(
      f"bits={bits}: loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, "
      f"train {r['train_acc']:.3f} val {r['val_acc']:.3f} test {r['test_acc']:.3f} "
      f"({r['seconds']:.1f} s)"
    )
