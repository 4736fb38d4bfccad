"""`jact.convert`: make an existing, unmodified Flax model save compressed activations.

ActNN's model converter in the Flax idiom: the model's code is not touched
and its variables are kept (a plain checkpoint loads); its supported layers
run the twins' logic (`jact.nn`, `jact.nnx`), the other layers and the
functions between layers run through the generic engine (`jact.compressed`).
linen models are converted by method interception (`linen.py`), nnx models by
module surgery in place (`nnx.py`); `report.py` is `conversion_report`.

>>> import jax, jax.numpy as jnp
>>> import flax.linen as nn
>>> import jact
>>> class MLP(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))
>>> x = jnp.ones((4, 3))
>>> variables = MLP().init(jax.random.key(0), x)        # a plain model's variables
>>> model = jact.convert(MLP(), bits=4)
>>> y = model.apply(variables, x, rngs={'jact': jax.random.key(1)})
>>> bool(jnp.allclose(y, MLP().apply(variables, x)))
True
>>> from flax import nnx
>>> net = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu,
...                      nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
>>> net = jact.convert(net, rngs=nnx.Rngs(jact=2))
>>> type(net.layers[0]) is jact.nnx.Linear, net.layers[0].residual_name
(True, 'layers/0')
"""

from __future__ import annotations

import flax.linen
import flax.nnx  # `nnx` here would be this package's submodule

from jact.compressors import Compressor
from jact._engine.rounding import resolve_compressor
from jact._convert.settings import ConversionWarning, Settings
from jact._convert.linen import convert_linen
from jact._convert.nnx import convert_nnx
from jact._convert.report import ConversionReport, conversion_report

__all__ = ["convert", "conversion_report", "ConversionReport", "ConversionWarning"]


def convert(
  model,
  *,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  strict: bool = False,
  functions: bool = True,
  rngs: flax.nnx.Rngs | flax.nnx.RngStream | None = None,
):
  """Makes a plain Flax model store compressed activations; keeps its variables.

  Args:
    model: an unbound `flax.linen.Module` (a converted copy is returned; the
      argument is not modified) or a `flax.nnx.Module` (converted in place;
      the model is returned, or the twin when `model` itself is a supported
      layer).
    bits: 1 to 8 or 16 bits per saved value, or None (no compression).
    compressor: a `jact.compressors` object storing the saved values instead
      of `bits` (leave `bits` at its default). `bits` alone rounds
      stochastically (unbiased), which needs a key wherever the model is
      differentiated (linen: the 'jact' stream of `apply`; nnx: `rngs=` or
      `jact.nnx.use_key`); `PerGroup(bits, stochastic=False)` rounds to
      nearest and needs none; `PerGroup(bits, group_size=...)` sets the
      quantization groups (a multiple of 8). The two are resolved once to the
      compressor every converted layer and call stores its residuals with.
    strict: raise a ValueError, instead of warning and running the plain
      layer, when a supported layer uses an option its twin lacks.
    functions: also run the model's outermost call through the generic
      engine (`jact.compressed`), so that what the functions between its
      layers save (`nn.relu`'s mask, gelu/silu inputs, softmax outputs,
      pooling) is compressed too. False: only the layers are converted.
    rngs: nnx only: the `nnx.Rngs` (with a 'jact' or 'default' stream) or
      `nnx.RngStream` each converted layer forks its own rounding stream
      from (RNG state added to the model). Without it the model's state is
      the plain model's and the keys come from `jact.nnx.use_key`. linen
      models take the 'jact' stream in `apply(..., rngs={'jact': key})`.

  Returns:
    The converted model.

  Raises:
    TypeError: `model` is not a linen or nnx module, or `rngs` is given for a
      linen model, or a compressor is passed as `bits` (pass it as `compressor=`).
    ValueError: bad `bits` / group size, or `bits` and `compressor` both
      given; a bound linen module; an `nnx.Rngs` with neither a 'jact' nor a
      'default' stream; with `strict=True`, an unsupported option.
  """
  stored = resolve_compressor(bits, compressor, "jact.convert")  # the twins' checks and messages
  for flag, value in (("strict", strict), ("functions", functions)):
    if not isinstance(value, bool):
      raise TypeError(f"{flag} must be True or False, got {value!r}")
  settings = Settings(stored, strict, functions)
  if isinstance(model, flax.linen.Module):
    if rngs is not None:
      raise TypeError(
        "convert(linen_model, rngs=...): a linen model draws its rounding noise from the "
        "'jact' stream of apply: model.apply(variables, x, rngs={'jact': key}). Drop rngs=."
      )
    return convert_linen(model, settings)
  if isinstance(model, flax.nnx.Module):
    return convert_nnx(model, settings, rngs)
  raise TypeError(
    f"jact.convert accepts a flax.linen.Module (returns a converted copy) or a "
    f"flax.nnx.Module (converted in place), got {type(model).__module__}."
    f"{type(model).__qualname__}. Wrap any other model (an Equinox module, a plain JAX "
    f"function) with jact.compressed(model_or_loss, bits=...) instead; pass a linen class "
    f"as an instance (Model(...))."
  )
