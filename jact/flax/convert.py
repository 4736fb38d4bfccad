"""`convert`: make an existing, unmodified Flax model save compressed activations.

ActNN's model converter in the Flax idiom. The model's code is not touched and
its variables are kept (same tree, same values: a plain checkpoint loads);
what changes is that its Dense/Conv/norm/embedding/dropout/attention layers
run the jact twins' logic (`jact.nn.*`, `jact.nnx.*`), which keep a
stochastically rounded low-bit copy of what the backward pass needs, and that
the other layers (recurrent cells, DenseGeneral, ...) and the functions
between layers run through the generic engine (`jact.compressed`). The
forward values are unchanged.

* **linen** -- method interception. `convert(Model(...))` returns a copy of the
  module whose class is a subclass of the model's class (same name, same
  fields plus `jact_bits`, `jact_group_size`, `jact_stochastic`, `jact_strict`,
  `jact_compressor`).
  While any of its methods runs (`init`, `apply`, `method=...`, a bound
  module, or as a submodule of a bigger model), `flax.linen.intercept_methods`
  redirects every `__call__` of a supported Flax layer to the twin built from
  that layer's own settings and bound to the layer's own scope, so parameters
  keep their paths; layers with no twin run through the generic engine
  instead. Rounding noise comes from the 'jact' RNG stream of
  `apply` (`rngs={'jact': key}`, a fresh key per step) wherever the model is
  differentiated. Where nothing is saved -- `init`, inference, evaluation,
  decoding -- no key is needed: without the stream every converted layer
  runs its plain Flax computation (the plain model's output), and
  differentiating that raises a ValueError naming the fix, never a silent
  fixed key. Inside `nn.scan` / `nn.RNN` the key is derived as described
  below. Options known only at call time (`mask=`,
  `sow_weights=True`) fall back per call.
* **nnx** -- module surgery. `convert(model)` replaces, in place, every
  supported layer inside `model` by its twin holding the very same
  `nnx.Param` / `nnx.BatchStat` objects, and returns `model` (or the twin
  when `model` itself is a supported layer; use the returned value). Where
  the rounding keys come from is a choice:

  - without `rngs=`, nothing is added to the model's state: `nnx.state(model)`
    (all of it, RNG state included) is the plain model's, so full-state
    checkpoints, `nnx.update` and `nnx.merge` work both ways between the plain
    and the converted model. A differentiated call takes its keys from a
    `jact.nnx.use_key(key)` block around it (a fresh PRNG key, or an
    `nnx.Rngs` passed to the jitted step, per step); outside one the layers
    run plain: inference needs no key, and differentiating raises a
    ValueError naming the fixes.
  - with `rngs=nnx.Rngs(jact=0)`, each converted layer forks its own 'jact'
    stream (as the twins do) and draws a fresh key per call, so the training
    step needs no change, and layers inside an `nnx.scan` body get their own
    noise per iteration (under `use_key` they share the body's key). The
    full state then also holds these streams (`<layer>/jact_rngs`, tagged
    'jact'): a plain model loads the rest,
    `nnx.update(plain, nnx.state(model, nnx.Not(nnx.WithTag('jact'))))`,
    while a plain model's full state loads into the converted one as is.

  Residuals are named after attribute paths ("blocks/0/attn"). Settings are checked
  at conversion; options passed at call time that a twin lacks (`mask=`,
  `sow_weights=True`) raise the twin's ValueError.

Converting again applies the new settings: a converted linen model is
rebuilt with them, and in an nnx model every rounding twin already there
(from an earlier `convert`, or built as `jact.nnx.*`) takes the new `bits`,
`compressor`, `group_size` and `stochastic` and re-forks its stream from `rngs` (from its
own stream when `rngs` is not given). In linen, a converted submodule inside
a converted model keeps its own settings while its methods run.

What is converted, and how (exact types; subclasses are left alone, their
`super().__call__` included):

====================================================  ===============================
layers                                                converted by
====================================================  ===============================
Dense/Linear, Conv, BatchNorm (also with `axis_name`  their twin (`jact.nn.*`,
/ `axis_index_groups`), LayerNorm, RMSNorm, Embed,    `jact.nnx.*`)
Dropout, MultiHeadDotProductAttention /
MultiHeadAttention / SelfAttention
LSTMCell, OptimizedLSTMCell, GRUCell, SimpleCell,     the generic engine, per call
MGUCell, ConvLSTMCell (linen), DenseGeneral /         (`jact.compressed`: every
LinearGeneral, Einsum, ConvTranspose, GroupNorm,      residual and the call's inputs
ConvLocal, InstanceNorm (linen)                       compressed)
the functions between layers (`nn.relu`, gelu,        the generic engine on the
silu, softmax, `nn.max_pool`, `nn.avg_pool`, ...)     model's outermost call
and layers left plain inside the model                (`functions=True`, default)
====================================================  ===============================

Cells run per step inside `nn.RNN` / `nn.scan` / `nnx.RNN`, so their
residuals are compressed inside the scan body. linen scans pass only the
streams listed in `split_rngs`, so a layer there cannot see 'jact': its key is
the apply's 'jact' key folded with the layer's path and with an
order-independent fingerprint (an integer sum of the bits) of its float
arguments: they differ from step to step, and a batch sharded over devices
draws the same noise as on one device (bit-identical steps would share their
noise, a correlation, not an error) -- no need to edit `split_rngs`. In nnx, a layer built inside `nnx.vmap` (a scan over stacked
blocks) gets a stream with one key per stacked layer, which `nnx.scan` slices
like its parameters. With `functions=True` the model's outermost call (linen:
the method `apply` runs; nnx: `__call__`, the model's class becoming a
subclass in place) runs through the engine: its residual names are then those
of the model ("Model.12"), while the twins inside keep their stored pieces
(and the parameters they keep, by reference) as they are. A model that is
itself a layer (a twin, a layer the engine converts) has no functions between
layers and gets no model call. In nnx the model's call draws its keys like a
layer: its own stream forked from `rngs` (without `rngs`, from its first
converted layer's own stream where the layers have streams), else
`jact.nnx.use_key`. `functions=False` converts the layers only.

Options a twin does not support (a custom `dot_general`/`attention_fn`,
`mask=`, `axis_name` on LayerNorm/RMSNorm, normalization over non-last axes,
`sow_weights=True`, ...) run that layer plain and emit a `ConversionWarning`
(or raise with `strict=True`); with `functions=True` its residuals are still
compressed by the model's call. A module with parameters of its own used
outside any converted layer (a hand-written cell) is covered by the model's
call; with `functions=False` it is warned about. `jact.conversion_report(loss,
*args)` lists every layer call with how it was converted (and, for linen, the
bytes it saves plain and converted) and warns about what is left plain with
its share of the saved bytes. A Dense/Conv twin (and attention's
projections) called with complex operands runs Flax's own (lax) op, its
residuals exact; the engine keeps complex residuals exact too (the other
twins take real floats only and say so). Converted Dropout and
attention-weight dropout draw their masks exactly as Flax's do, from the
model's own 'dropout' stream (their backward keeps only the key): a converted
model's training forward is bit-identical to the plain model's for the same rngs.

>>> import jax, jax.numpy as jnp
>>> import flax.linen as nn
>>> from jact.flax.convert import convert
>>> class MLP(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))
>>> x = jnp.ones((4, 3))
>>> variables = MLP().init(jax.random.key(0), x)        # a plain model's variables
>>> model = convert(MLP(), bits=4)
>>> y = model.apply(variables, x, rngs={'jact': jax.random.key(1)})
>>> bool(jnp.allclose(y, MLP().apply(variables, x)))
True
>>> y = model.apply(variables, x)                       # inference: no key needed
>>> from flax import nnx
>>> net = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu,
...                      nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
>>> net = convert(net, rngs=nnx.Rngs(jact=2))
>>> type(net.layers[0]).__module__, net.layers[0].residual_name
('jact.flax.nnx', 'layers/0')
"""

from __future__ import annotations

import flax.linen as nn
from flax import nnx

from jact.compressors import Compressor
from jact._engine.op import takes_compressor
from jact._engine.rounding import op_rounding
from jact.flax._conversion import ConversionWarning, Settings
from jact.flax._convert_linen import convert_linen
from jact.flax._convert_nnx import convert_nnx

__all__ = ["convert", "ConversionWarning"]


@takes_compressor(api="jact.convert")
def convert(model, *, bits: int | None = 4, compressor: Compressor | None = None,
            strict: bool = False,
            functions: bool = True, rngs: nnx.Rngs | nnx.RngStream | None = None):
  """Makes a plain Flax model store compressed activations; keeps its variables.

  Args:
    model: an unbound `flax.linen.Module` (a converted copy is returned; the
      argument is not modified) or a `flax.nnx.Module` (converted in place;
      the model is returned, or the twin when `model` itself is a supported
      layer).
    bits: 1, 2, 4 or 8 bits per saved value, or None (no compression).
    compressor: a `jact.compressors` object storing the saved values instead
      of `bits` (leave `bits` at its default). `bits` alone rounds
      stochastically (unbiased), which needs a key wherever the model is
      differentiated (linen: the 'jact' stream of `apply`; nnx: `rngs=` or
      `jact.nnx.use_key`); `PerGroup(bits, stochastic=False)` rounds to
      nearest and needs none; `PerGroup(bits, group_size=...)` sets the
      quantization groups (a multiple of 8). The twins get `bits=` for
      `PerGroup(bits)` (default group size, stochastic), else `compressor=`.
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
  rounding = op_rounding("jact.convert", bits, compressor)  # the twins' checks and messages
  if compressor is not None and not isinstance(rounding.bits, Compressor):
    bits, compressor = rounding.bits, None  # a plain PerGroup: the twins' own fields
  for flag, value in (("strict", strict), ("functions", functions)):
    if not isinstance(value, bool):
      raise TypeError(f"{flag} must be True or False, got {value!r}")
  settings = Settings(bits, rounding.group_size, bool(rounding.stochastic), strict, compressor,
                      functions)
  if isinstance(model, nn.Module):
    if rngs is not None:
      raise TypeError(
          "convert(linen_model, rngs=...): a linen model draws its rounding noise from the "
          "'jact' stream of apply: model.apply(variables, x, rngs={'jact': key}). Drop rngs=.")
    return convert_linen(model, settings)
  if isinstance(model, nnx.Module):
    return convert_nnx(model, settings, rngs)
  raise TypeError(
      f"jact.convert accepts a flax.linen.Module (returns a converted copy) or a "
      f"flax.nnx.Module (converted in place), got {type(model).__module__}."
      f"{type(model).__qualname__}. Wrap any other model (an Equinox module, a plain JAX "
      f"function) with jact.compressed(model_or_loss, bits=...) instead; pass a linen class "
      f"as an instance (Model(...)).")
