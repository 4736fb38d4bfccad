"""Optimization levels of ActNN (L0-L5) and GACT (L0, L1, L2, CB1, CB2) as presets.

Each level says which jact mechanism realizes it:

| level | paper's meaning | jact |
|---|---|---|
| actnn:L0 | no compression | plain JAX (bits None) |
| actnn:L1 | 4-bit per-group quantization of conv layers only | `conv_bits=4`, other ops bits None |
| actnn:L2 | 4-bit per-group quantization of all layers | compressed ops / `jact.compressed`, bits 4 |
| actnn:L3 | L2 + per-sample and per-layer mixed precision, 2 bits avg | `Controller(estimator="analytic", per_sample=True, avg_bits=2)` |
| actnn:L4 | L3 + swapping to host | L3 + `jact.offload_compressed()` policy |
| actnn:L5 | L4 + allocator defragmentation | same as L4: XLA plans every buffer of a compiled step at compile time, so there is no run-time caching allocator to defragment |
| gact:L0 | no compression | plain JAX |
| gact:L1 | adaptive per-tensor bits, 4 avg | `Controller(estimator="numeric", avg_bits=4)` |
| gact:L2 | L1 + swapping | L1 + `jact.offload_compressed()` |
| gact:CB1 | L1 + gradient checkpointing | L1 with blocks wrapped by `jact.checkpoint` |
| gact:CB2 | CB1 + memory-efficient attention | CB1 + `jact.ops.chunked_attention` |

>>> import jact
>>> level = jact.levels.get("gact:CB1")
>>> level.avg_bits, level.estimator, level.checkpoint
(4.0, 'numeric', True)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["Level", "LEVELS", "get"]


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
    from jact.remat import offload_compressed  # pylint: disable=import-outside-toplevel
    return offload_compressed()

  def wrap(self, block: Callable[..., Any], *, name: str = "block", **kwargs):
    """`block` transformed as the level says: `jact.checkpoint` (CB levels),
    else `jact.compressed` (with the offload policy when the level swaps), or
    unchanged when the level does not compress."""
    if self.bits is None:
      return block
    from jact.remat import checkpoint  # pylint: disable=import-outside-toplevel
    from jact.residuals import compressed  # pylint: disable=import-outside-toplevel
    if self.checkpoint:
      return checkpoint(block, bits=self.bits, name=name, policy=self.policy(), **kwargs)
    wrapped = compressed(block, bits=self.bits, name=name, **kwargs)
    if self.offload:
      import jax  # pylint: disable=import-outside-toplevel
      return jax.checkpoint(wrapped, policy=self.policy())
    return wrapped

  def controller(self, loss_fn: Callable[..., Any], **kwargs):
    """A `jact.Controller` for adaptive levels (ValueError for fixed ones)."""
    if self.estimator is None:
      raise ValueError(f"{self.name} uses fixed bits ({self.bits}); it has no controller")
    from jact.controller import Controller  # pylint: disable=import-outside-toplevel
    settings = dict(estimator=self.estimator, avg_bits=self.avg_bits, per_sample=self.per_sample)
    settings.update(kwargs)
    return Controller(loss_fn, **settings)


_L3 = dict(bits=2, estimator="analytic", avg_bits=2.0, per_sample=True)
_G1 = dict(bits=4, estimator="numeric", avg_bits=4.0)

LEVELS = {level.name: level for level in (
    Level("actnn:L0", "do not compress"),
    Level("actnn:L1", "per-group quantization for conv layers (4 bits), others full precision",
          bits=4, conv_only=True),
    Level("actnn:L2", "per-group quantization of every layer (4 bits)", bits=4),
    Level("actnn:L3", "L2 + fine-grained (per-sample, per-layer) mixed precision, 2 bits", **_L3),
    Level("actnn:L4", "L3 + swapping compressed activations to host memory", offload=True, **_L3),
    Level("actnn:L5", "L4 + defragmentation (no-op under XLA's static buffer assignment)",
          offload=True, **_L3),
    Level("gact:L0", "do not compress"),
    Level("gact:L1", "per-group quantization with auto-precision, 4 bits average", **_G1),
    Level("gact:L2", "L1 + swapping/prefetching", offload=True, **_G1),
    Level("gact:CB1", "L1 + gradient checkpointing", checkpoint=True, **_G1),
    Level("gact:CB2", "CB1 + memory-efficient self-attention", checkpoint=True,
          chunked_attention=True, **_G1),
)}


def get(name: str) -> Level:
  """The level called `name` ("actnn:L0".."actnn:L5", "gact:L0", "gact:L1", "gact:L2",
  "gact:CB1", "gact:CB2")."""
  try:
    return LEVELS[name]
  except KeyError:
    raise ValueError(f"unknown optimization level {name!r}; choose one of {sorted(LEVELS)}") from None
