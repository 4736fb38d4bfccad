"""A pre-activation CIFAR ResNet written with jact ops, for comparing compressors.

Every layer is a BN -> ReLU -> conv *unit* (the layout BLPA compresses), two
units per residual block, parameter-free shortcuts (strided subsampling and
zero-padded channels, He et al.'s CIFAR option A). The same parameters run in
three forms, so gradients can be compared with the exact ones:

* `"plain"`: plain JAX (what ordinary training keeps for the backward pass);
* `"layers"`: jact's batch_norm / relu / conv ops, every residual stored with
  the width `bits` or the `jact.compressors` object `compressor`;
* `"blpa"`: each unit is one fused `jact.ops.blpa_block` keeping a K-bit copy
  of the pre-ReLU value (K = `bits`, or a `compressor` that is a BLPA).

The head (final BN, ReLU, pooling, dense) is exact in every form, as in the
papers (the last layer is not compressed).

>>> import jax, jax.numpy as jnp
>>> params = init(jax.random.key(0), widths=(8, 16), blocks=1)
>>> x, y = jnp.ones((2, 8, 8, 3)), jnp.array([1, 2])
>>> float(loss(params, (x, y), jax.random.key(1), form="plain")) > 0
True
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jact

__all__ = ["init", "apply", "loss", "unit_names", "EPSILON"]

EPSILON = 1e-5


def init(
  key,
  *,
  widths: Sequence[int] = (16, 32, 64),
  blocks: int = 2,
  classes: int = 10,
  channels: int = 3,
) -> dict:
  """He-initialized parameters: stem conv, units (scale, bias, kernel), head.

  Drawn by numpy from a generator seeded with the key's data: jax.random's
  normal compiles once per kernel shape (20 s for a ResNet-20 on a CPU).
  """
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())

  def he(shape):
    return jnp.asarray(rng.standard_normal(shape, np.float32) * np.sqrt(2.0 / np.prod(shape[:-1])))

  params = {"stem": he((3, 3, channels, widths[0])), "units": []}
  c = widths[0]
  for w in widths:
    for _ in range(blocks):
      for cin in (c, w):
        params["units"].append(
          dict(scale=jnp.ones(cin), bias=jnp.zeros(cin), kernel=he((3, 3, cin, w)))
        )
      c = w
  params["head"] = dict(
    scale=jnp.ones(c),
    bias=jnp.zeros(c),
    kernel=jnp.asarray(rng.standard_normal((c, classes), np.float32) / np.sqrt(c)),
  )
  return params


def unit_names(params) -> list[str]:
  return [f"unit{i}" for i in range(len(params["units"]))]


def _plain_bn(x, scale, bias):
  mean = jnp.mean(x, axis=(0, 1, 2))
  var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))
  return (x - mean) * lax.rsqrt(var + EPSILON) * scale + bias


def _conv(x, kernel, stride):
  return lax.conv_general_dilated(
    x, kernel, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def _rounding(bits, compressor) -> dict:
  """The ops' keywords: the width, or the compressor alone (it sets its own width)."""
  if compressor is None:
    return dict(bits=bits)
  if bits is not None:
    raise ValueError(
      f"pass bits= or compressor=, not both (got bits={bits!r}, compressor={compressor!r})"
    )
  return dict(compressor=compressor)


def _unit(x, p, stride, name, form, rounding, key, densities=None):
  if form == "plain":
    a = jax.nn.relu(_plain_bn(x, p["scale"], p["bias"]))
    if densities is not None:
      densities[f"{name}.conv.lhs"] = jnp.mean((a != 0).astype(jnp.float32))
    return _conv(a, p["kernel"], stride)
  if form == "blpa":
    return jact.ops.blpa_block(
      x, p["scale"], p["bias"], p["kernel"], **rounding, strides=stride, epsilon=EPSILON, name=name
    )[0]
  k1, k2 = jax.random.split(key)
  h = jact.ops.batch_norm(
    x, p["scale"], p["bias"], epsilon=EPSILON, key=k1, **rounding, name=f"{name}.bn"
  )[0]
  return jact.ops.conv(
    jact.ops.relu(h, name=f"{name}.relu"),
    p["kernel"],
    strides=stride,
    key=k2,
    **rounding,
    name=f"{name}.conv",
  )


def _shortcut(x, width, stride):
  if stride > 1:
    x = x[:, ::stride, ::stride, :]
  if x.shape[-1] < width:
    x = jnp.pad(x, ((0, 0),) * 3 + ((0, width - x.shape[-1]),))
  return x


def apply(
  params,
  x,
  key=None,
  *,
  form: str = "layers",
  bits: int | None = None,
  compressor=None,
  densities: dict | None = None,
) -> jax.Array:
  """Logits. `form` is "plain", "layers" or "blpa"; `bits` the width or
  `compressor` the `jact.compressors` object of every unit; `key` the PRNG
  key for stochastic compressors.
  `densities` (plain form): filled with the fraction of non-zero values of each
  unit's ReLU output, under the name of the conv input it becomes."""
  if form not in ("plain", "layers", "blpa"):
    raise ValueError(f"form must be 'plain', 'layers' or 'blpa', got {form!r}")
  rounding = _rounding(bits, compressor)
  key = jax.random.key(0) if key is None else key
  keys = iter(jax.random.split(key, len(params["units"]) + 1))
  h = _conv(x, params["stem"], 1)
  units = iter(enumerate(params["units"]))
  width = h.shape[-1]
  while True:
    try:
      i, p1 = next(units)
    except StopIteration:
      break
    j, p2 = next(units)
    w = p2["kernel"].shape[-1]
    stride = 2 if w > width else 1
    r = _unit(h, p1, stride, f"unit{i}", form, rounding, next(keys), densities)
    r = _unit(r, p2, 1, f"unit{j}", form, rounding, next(keys), densities)
    h = _shortcut(h, w, stride) + r
    width = w
  head = params["head"]
  h = jnp.mean(jax.nn.relu(_plain_bn(h, head["scale"], head["bias"])), axis=(1, 2))
  return h @ head["kernel"]


def loss(
  params, batch, key=None, *, form: str = "layers", bits: int | None = None, compressor=None
) -> jax.Array:
  """Mean cross-entropy of `apply` on batch = (images NHWC, int labels)."""
  x, y = batch
  logits = apply(params, x, key, form=form, bits=bits, compressor=compressor)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
