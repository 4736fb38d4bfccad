"""Pure training-loss functions for the zoo's models, plain or made by jact.

`variant_fns(case, variant, bits)` returns the parameters, the rest of the
model's state and two pure functions of them, for one of three variants of
the *unmodified* model code (`experiments/lib/zoo.py`):

* "plain": the model as written;
* "convert": `jact.convert(model, bits=bits)` (linen: the 'jact' stream of
  `apply`; nnx: converted without `rngs=`, so the state is the plain model's,
  and run inside `jact.nnx.use_key(key)` -- the functional style, jax.grad
  over nnx.merge, cannot advance a stream's RngCount, as with nnx.Dropout);
* "compressed": `jact.compressed` around the whole model (linen: a function
  of the variables and inputs that calls `model.apply`; nnx: the module).

`forward(params, state, batch, key) -> (logits, new_state)` is a training
forward pass (`new_state` is the whole updated state: BatchNorm statistics),
under `jax.shard_map` over one device naming the case's `axis_name` when it
has one, as a data-parallel step binds it (older Flax examples: `jax.pmap`);
`loss(params, state, batch, key) -> (loss, new_state)` is differentiable in
`params`.

>>> from experiments.lib.zoo import CASES
>>> fns = variant_fns(CASES["mnist_cnn"], "plain")
>>> batch = CASES["mnist_cnn"].batch(0)
>>> float(fns.loss(fns.params, fns.state, batch, jax.random.key(0))[0]) > 0
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import jact

__all__ = ["VARIANTS", "VariantFns", "variant_fns", "flat"]

VARIANTS = ("plain", "convert", "compressed")


@dataclasses.dataclass
class VariantFns:
  params: Any
  state: Any
  forward: Callable[..., Any]
  loss: Callable[..., Any]


def flat(tree) -> jnp.ndarray:
  """All leaves of a pytree, raveled and concatenated (in leaf order)."""
  return jnp.concatenate([jnp.ravel(a).astype(jnp.float32) for a in jax.tree.leaves(tree)])


def _check(variant, bits):
  if variant not in VARIANTS:
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
  if variant != "plain" and bits is None:
    raise ValueError(f"variant {variant!r} needs bits= (1, 2, 4 or 8)")


def _linen(case, variant, bits, seed):
  variables = case.init(seed)
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}
  model = case.build()
  kwargs = dict(case.train_kwargs)
  if case.mutable:
    kwargs["mutable"] = list(case.mutable)

  def split(out):
    return out if case.mutable else (out, {})

  def updated(state, out):
    logits, updates = out
    return logits, {**state, **updates}

  if variant == "convert":
    model = jact.convert(model, bits=bits)
    apply = lambda variables, inputs, key: split(
      model.apply(variables, *inputs, rngs={"jact": key}, **kwargs)
    )
  elif variant == "compressed":
    whole = jact.compressed(
      lambda variables, *inputs: model.apply(variables, *inputs, **kwargs), bits=bits
    )
    apply = lambda variables, inputs, key: split(whole(variables, *inputs, key=key))
  else:
    apply = lambda variables, inputs, key: split(model.apply(variables, *inputs, **kwargs))

  def forward(params, state, batch, key):
    if case.axis_name is None:
      return updated(state, apply({"params": params, **state}, batch["inputs"], key))
    mesh = jax.make_mesh((1,), (case.axis_name,), devices=jax.devices()[:1])
    one_device = jax.shard_map(
      lambda variables, inputs, key: apply(variables, inputs, key),
      mesh=mesh,
      in_specs=P(),
      out_specs=P(),
    )
    return updated(state, one_device({"params": params, **state}, batch["inputs"], key))

  return params, state, forward


def _nnx(case, variant, bits, seed):
  model = case.build()
  if variant == "convert":
    model = jact.convert(model, bits=bits)
  elif variant == "compressed":
    model = jact.compressed(model, bits=bits)
  graphdef, params, state = nnx.split(model, nnx.Param, ...)

  def forward(params, state, batch, key):
    m = nnx.merge(graphdef, params, state)
    if variant == "compressed":
      logits = m(*batch["inputs"], key=key)
    elif variant == "convert":
      with jact.nnx.use_key(key):
        logits = m(*batch["inputs"])
    else:
      logits = m(*batch["inputs"])
    return logits, nnx.split(m, nnx.Param, ...)[2]

  return params, state, forward


def variant_fns(case, variant: str, bits: int | None = None, seed: int = 0) -> VariantFns:
  """Parameters, state, forward and loss of `case`'s model in `variant`."""
  _check(variant, bits)
  make = _nnx if case.framework == "nnx" else _linen
  params, state, forward = make(case, variant, bits, seed)

  def loss(params, state, batch, key):
    logits, new_state = forward(params, state, batch, key)
    return case.loss(logits, batch["labels"]), new_state

  return VariantFns(params, state, forward, loss)
