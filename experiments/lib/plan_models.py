"""Two models written with jact ops at the top level (as the analytic estimators need): a small
residual CNN and a 2-block character transformer, for `experiments.bench.bench_plans` and
`experiments.papers.bit_plans`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jact

__all__ = ["cnn_loss", "cnn_params", "transformer_loss", "transformer_params"]


def cnn_params(key, width=32):
  ks = jax.random.split(key, 6)
  he = lambda k, shape: jax.random.normal(k, shape) * np.sqrt(2.0 / np.prod(shape[:-1]))
  return dict(
    c0=he(ks[0], (3, 3, 3, width)),
    c1=he(ks[1], (3, 3, width, width)),
    c2=he(ks[2], (3, 3, width, width)),
    s1=jnp.ones(width),
    b1=jnp.zeros(width),
    s2=jnp.ones(width),
    b2=jnp.zeros(width),
    fc=jax.random.normal(ks[3], (width * 8 * 8, 10)) / np.sqrt(width * 64),
  )


def cnn_loss(p, batch, key):
  """conv -> [bn -> relu -> conv -> bn -> relu -> conv] + skip -> pool -> dense."""
  x, y = batch
  k = jax.random.split(key, 6)
  h = jact.ops.conv(x, p["c0"], key=k[0], name="conv0")
  r = jax.nn.relu(jact.ops.batch_norm(h, p["s1"], p["b1"], key=k[1], name="bn1")[0])
  r = jact.ops.conv(r, p["c1"], key=k[2], name="conv1")
  r = jax.nn.relu(jact.ops.batch_norm(r, p["s2"], p["b2"], key=k[3], name="bn2")[0])
  h = h + jact.ops.conv(r, p["c2"], key=k[4], name="conv2")
  h = jax.nn.relu(h).reshape(h.shape[0], 8, 4, 8, 4, -1).mean((2, 4)).reshape(h.shape[0], -1)
  logits = jact.ops.dense(h, p["fc"], key=k[5], name="fc")
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def transformer_params(key, vocab, d=64, blocks=2, length=64):
  ks = iter(jax.random.split(key, 4 + 6 * blocks))
  n = lambda shape, s: jax.random.normal(next(ks), shape) * s
  p = dict(embed=n((vocab, d), 0.1), pos=n((length, d), 0.1), out=n((d, vocab), d**-0.5))
  for b in range(blocks):
    p[f"b{b}"] = dict(
      qkv=n((d, 3 * d), d**-0.5),
      proj=n((d, d), d**-0.5),
      up=n((d, 4 * d), d**-0.5),
      down=n((4 * d, d), (4 * d) ** -0.5),
      ln1=jnp.ones(d),
      ln2=jnp.ones(d),
    )
  return p


def transformer_loss(p, batch, key, heads=4):
  tokens, targets = batch
  h = p["embed"][tokens] + p["pos"][None, : tokens.shape[1]]
  keys = iter(jax.random.split(key, 64))
  length = tokens.shape[1]
  causal = jnp.tril(jnp.ones((length, length), bool))[None, None]
  for b in sorted(k for k in p if k.startswith("b")):
    w = p[b]
    x = jact.ops.layer_norm(h, w["ln1"], key=next(keys), name=f"{b}.ln1")
    qkv = jact.ops.dense(x, w["qkv"], key=next(keys), name=f"{b}.qkv")
    q, k, v = (t.reshape(*t.shape[:2], heads, -1) for t in jnp.split(qkv, 3, axis=-1))
    a = jact.ops.dot_product_attention(q, k, v, mask=causal, key=next(keys), name=f"{b}.attn")
    h = h + jact.ops.dense(a.reshape(*a.shape[:2], -1), w["proj"], key=next(keys), name=f"{b}.proj")
    x = jact.ops.layer_norm(h, w["ln2"], key=next(keys), name=f"{b}.ln2")
    u = jact.ops.gelu(
      jact.ops.dense(x, w["up"], key=next(keys), name=f"{b}.up"), key=next(keys), name=f"{b}.gelu"
    )
    h = h + jact.ops.dense(u, w["down"], key=next(keys), name=f"{b}.down")
  logits = jact.ops.dense(h, p["out"], key=next(keys), name="head")
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
