"""Settings and warnings shared by `convert`'s linen and nnx paths."""

from __future__ import annotations

import dataclasses
import warnings

from jact.compressors import Compressor, PerGroup
from jact._engine.rounding import compressor_keywords
from jact._flax import hooks as _hooks


class ConversionWarning(UserWarning):
  """A layer of a converted model runs uncompressed (an option its twin lacks, or
  nothing converts it); says which layer and, in `conversion_report`, its share
  of the saved bytes."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """What `convert` was called with: how residuals are stored (`compressor`,
  resolved once from `bits=` / `compressor=`; None keeps them exact), `strict`
  and `functions`."""

  compressor: Compressor | None
  strict: bool = False
  functions: bool = True  # the model's outermost call through the generic engine

  @property
  def needs_key(self) -> bool:
    return _hooks.needs_key(self.compressor)

  @property
  def rounding(self) -> dict:
    """The rounding twins' keywords for `compressor`: `bits=` alone for the
    default per-group quantizer (so a re-converted twin's public `bits` says
    its width), else `compressor=`."""
    c = self.compressor
    if isinstance(c, PerGroup) and c == PerGroup(c.bits):
      return {"bits": c.bits}
    return compressor_keywords(c)


def unsupported(settings: Settings, where: str, reason: str) -> None:
  message = f"jact.convert: {where} runs uncompressed: {reason}"
  if settings.strict:
    raise ValueError(message + " (strict=True)")
  warnings.warn(message, ConversionWarning, stacklevel=4)
