"""Optimization levels of ActNN (L0-L5) and GACT (L0, L1, L2, CB1, CB2) as presets.

Each level names the jact mechanism that realizes it (the table: docs/bit_plans.md,
"Presets").

>>> import jact
>>> level = jact.levels.get("gact:CB1")
>>> level.avg_bits, level.estimator, level.checkpoint
(4.0, 'numeric', True)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
from jax import lax

from jact import _compat
from jact.compressors import Compressor
from jact._engine.names import check_name
from jact._engine.rounding import compressor_keywords, resolve_compressor
from jact.ops._linear import conv_general_dilated
from jact._planning.controller import Controller
from jact._transforms import _interpreter as interpreter
from jact._transforms.checkpoint import checkpoint, offload_compressed
from jact._transforms._arguments import check_argnums, input_flags
from jact._transforms.compressed import DEFAULT_MIN_SIZE, compressed, over_array_leaves

__all__ = ["Level", "LEVELS", "get", "compress_convolutions"]


@dataclasses.dataclass(frozen=True)
class Level:
  """One optimization level, as settings of jact's mechanisms.

  Attributes:
    name: "actnn:L3", "gact:CB1", ...
    description: the paper's definition.
    bits: fixed width for compressed residuals (None: not compressed).
    conv_only: only convolutions are compressed (ActNN L1).
    estimator: None (fixed bits) or the `Controller` estimator.
    avg_bits: the controller's average-bit budget (adaptive levels).
    per_sample: per-sample widths inside each layer (ActNN L3+).
    offload: compressed residuals go to host memory (`jact.offload_compressed`).
    checkpoint: blocks are wrapped by `jact.checkpoint` (GACT CB1+).
    chunked_attention: attention via `jact.ops.chunked_attention` (GACT CB2).
  """

  name: str
  description: str
  bits: int | None = None
  conv_only: bool = False
  estimator: str | None = None
  avg_bits: float | None = None
  per_sample: bool = False
  offload: bool = False
  checkpoint: bool = False
  chunked_attention: bool = False

  def op_bits(self, kind: str) -> int | None:
    """Width for an op of `kind` ("conv", "dense", "norm", "activation", ...)."""
    if self.bits is None:
      return None
    return self.bits if (kind == "conv" or not self.conv_only) else None

  def policy(self):
    """The `jax.checkpoint` policy of the level (offloading), or None."""
    if not self.offload:
      return None
    return offload_compressed()

  def wrap(self, block: Callable[..., Any], *, name: str = "block", **kwargs):
    """`block` transformed as the level says: `jact.checkpoint` (CB levels),
    `jact.compressed` (with the offload policy when the level swaps), its
    convolutions only compressed (`conv_only`, see `compress_convolutions`),
    or unchanged when the level does not compress. `kwargs` go to that
    transform; pass `compress_argnums` (the block's activation arguments),
    which a CB level needs to store the block's input compressed."""
    if self.bits is None:
      return block
    if self.conv_only:
      return compress_convolutions(block, bits=self.bits, name=name, **kwargs)
    if self.checkpoint:
      return checkpoint(block, bits=self.bits, name=name, policy=self.policy(), **kwargs)
    wrapped = compressed(block, bits=self.bits, name=name, **kwargs)
    if self.offload:
      return jax.checkpoint(wrapped, policy=self.policy())
    return wrapped

  def controller(self, loss_fn: Callable[..., Any], **kwargs):
    """A `jact.Controller` for adaptive levels (ValueError for fixed ones)."""
    if self.estimator is None:
      raise ValueError(f"{self.name} uses fixed bits ({self.bits}); it has no controller")
    settings = dict(estimator=self.estimator, avg_bits=self.avg_bits, per_sample=self.per_sample)
    if self.per_sample:
      settings["allowed"] = _L3_WIDTHS  # ActNN's integer widths
    settings.update(kwargs)
    return Controller(loss_fn, **settings)


# ActNN L3: the joint layer x sample allocation at integer widths 1..8 (see Controller).
_L3 = dict(bits=2, estimator="analytic", avg_bits=2.0, per_sample=True)
_L3_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8)
_G1 = dict(bits=4, estimator="numeric", avg_bits=4.0)

#: The presets by name: ActNN's L0-L5 (`actnn:L3` ...) and GACT's L0/L1/L2/CB1/CB2 (`gact:L1` ...).
LEVELS = {
  level.name: level
  for level in (
    Level("actnn:L0", "do not compress"),
    Level(
      "actnn:L1",
      "per-group quantization for conv layers (4 bits), others full precision",
      bits=4,
      conv_only=True,
    ),
    Level("actnn:L2", "per-group quantization of every layer (4 bits)", bits=4),
    Level(
      "actnn:L3",
      "L2 + fine-grained (per-sample, per-layer) mixed precision, 2 bits on average, "
      "integer widths 1-8",
      **_L3,
    ),
    Level("actnn:L4", "L3 + swapping compressed activations to host memory", offload=True, **_L3),
    Level(
      "actnn:L5",
      "L4 + defragmentation (no-op under XLA's static buffer assignment)",
      offload=True,
      **_L3,
    ),
    Level("gact:L0", "do not compress"),
    Level("gact:L1", "per-group quantization with auto-precision, 4 bits average", **_G1),
    Level("gact:L2", "L1 + swapping/prefetching", offload=True, **_G1),
    Level("gact:CB1", "L1 + gradient checkpointing", checkpoint=True, **_G1),
    Level(
      "gact:CB2",
      "CB1 + memory-efficient self-attention",
      checkpoint=True,
      chunked_attention=True,
      **_G1,
    ),
  )
}


def get(name: str) -> Level:
  """The level called `name` ("actnn:L0".."actnn:L5", "gact:L0", "gact:L1", "gact:L2",
  "gact:CB1", "gact:CB2")."""
  try:
    return LEVELS[name]
  except KeyError:
    raise ValueError(
      f"unknown optimization level {name!r}; choose one of {sorted(LEVELS)}"
    ) from None


# ----------------------------------------------------------------------------- ActNN L1


def compress_convolutions(
  block: Callable[..., Any],
  *,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  min_size: int | None = None,
  name: str = "block",
  compress_argnums: Sequence[int] = (),
):
  """`block` with the inputs of its convolutions stored compressed and every
  other residual kept as plain JAX saves it (ActNN L1).

  `block` is traced and re-evaluated with each `lax.conv_general_dilated`
  (also inside `jax.jit` calls) run by `jact.ops.conv_general_dilated`, whose
  stored input is named f"{name}.conv{i}.lhs" (`i`: the convolution's position
  in the trace). The forward pass is exact. As in `jact.compressed`, a conv
  input that is one of `block`'s own arguments is kept by reference unless its
  position is in `compress_argnums`, and inputs of fewer than `min_size`
  values (default `jact._transforms.compressed.DEFAULT_MIN_SIZE`) are kept. Convolutions
  inside other higher-order primitives (`lax.scan`, `lax.cond`,
  `jax.checkpoint`, custom derivative rules) run plain. `bits` (or a
  `jact.compressors` object as `compressor`, e.g. `PerGroup(4, group_size=128,
  stochastic=False)`) says how the conv inputs are stored.

  Returns:
    `wrapped(*args, key=None, **kwargs)`; `key` is required when rounding is
    stochastic (a fresh key per step).
  """
  resolved = resolve_compressor(bits, compressor, "jact.levels.compress_convolutions")
  method = compressor_keywords(resolved)
  check_name(name)
  argnums = check_argnums(compress_argnums)
  min_size = DEFAULT_MIN_SIZE if min_size is None else min_size
  if not callable(block):
    raise TypeError(f"compress_convolutions takes a function, got {type(block).__name__}")

  @functools.wraps(block)
  def wrapped(*args, key=None, **kwargs):
    if key is None and resolved is not None and resolved.needs_key:
      raise ValueError(
        f"jact level {name!r}: the convolutions' inputs are stochastically rounded, which "
        f"needs a PRNG key: call it with key=jax.random.key(...) (a fresh key per step)."
      )
    call, values, dynamic = over_array_leaves(block, args, kwargs)
    closed, out_shape = jax.make_jaxpr(call, return_shape=True)(*values)
    flags = input_flags(block, args, kwargs, argnums)
    conv = _CompressedConv(key, method, min_size, name)
    outs = _evaluate(closed.jaxpr, closed.consts, values, [not flags[i] for i in dynamic], conv)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return wrapped


@dataclasses.dataclass
class _CompressedConv:
  """Runs one traced convolution, storing its input compressed unless `keep`."""

  key: Any
  method: dict  # the ops' bits= / compressor= keywords
  min_size: int
  name: str
  count: int = 0

  def __call__(self, params: dict, lhs, rhs, keep: bool):
    """`params`: the convolution's `lax.conv_general_dilated` keywords
    (`jact._compat.conv_kwargs`)."""
    i, self.count = self.count, self.count + 1
    params = dict(params)
    if keep or lhs.size < self.min_size:
      return lax.conv_general_dilated(lhs, rhs, **params)
    if all(d == 1 for d in params["lhs_dilation"]):
      params["lhs_dilation"] = None
    key = None if self.key is None else jax.random.fold_in(self.key, i)
    return conv_general_dilated(
      lhs, rhs, key=key, name=f"{self.name}.conv{i}", **self.method, **params
    )


def _evaluate(jaxpr, consts, args, by_reference, conv: _CompressedConv) -> list:
  """Evaluates `jaxpr` with its convolutions run by `conv` (also inside
  `jax.jit` bodies, entered in place); `by_reference` flags the inputs that
  are the block's own arguments (kept, not compressed)."""
  arguments = {v for v, ref in zip(jaxpr.invars, by_reference) if ref}

  def run_conv(frame, eqn):
    conv_kwargs = _compat.conv_kwargs(eqn)  # None for sharded convs: run plain
    if conv_kwargs is None:
      return None
    lhs = frame.origin(eqn.invars[0])
    return [
      conv(conv_kwargs, *frame.read_all(eqn.invars), keep=_compat.is_var(lhs) and lhs in arguments)
    ]

  return interpreter.evaluate(
    jaxpr, consts, args, {lax.conv_general_dilated_p: run_conv}, calls="jit"
  )
