"""Settings and warnings shared by `convert`'s linen and nnx paths."""

from __future__ import annotations

import dataclasses
import warnings

from jact.compressors import Compressor
from jact._engine.rounding import op_keywords
from jact._flax import hooks as _hooks


class ConversionWarning(UserWarning):
  """A layer of a converted model runs uncompressed (an option its twin lacks, or
  nothing converts it); says which layer and, in `conversion_report`, its share
  of the saved bytes."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """What `convert` was called with (the twins' rounding settings and `strict`)."""

  bits: int | None
  group_size: int
  stochastic: bool
  strict: bool
  compressor: Compressor | None = None
  functions: bool = True  # the model's outermost call through the generic engine

  @property
  def needs_key(self) -> bool:
    return _hooks.needs_key(api="jact.convert", **self.rounding)

  @property
  def rounding(self) -> dict:
    """The rounding twins' keywords: `bits=` alone for the default per-group
    quantizer, else `compressor=` (a plain `PerGroup` with other settings)."""
    return op_keywords(self.bits, self.group_size, self.stochastic, self.compressor)


def unsupported(settings: Settings, where: str, reason: str) -> None:
  message = f"jact.convert: {where} runs uncompressed: {reason}"
  if settings.strict:
    raise ValueError(message + " (strict=True)")
  warnings.warn(message, ConversionWarning, stacklevel=4)
