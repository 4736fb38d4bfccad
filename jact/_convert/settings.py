"""Settings and warnings shared by `convert`'s linen and nnx paths."""

from __future__ import annotations

import dataclasses
import warnings

from jact.compressors import Compressor
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
    """The rounding twins' keywords for `compressor`."""
    return compressor_keywords(self.compressor)


def unsupported(settings: Settings, where: str, reason: str) -> None:
  message = f"jact.convert: {where} runs uncompressed: {reason}"
  if settings.strict:
    raise ValueError(message + " (strict=True)")
  warnings.warn(message, ConversionWarning, stacklevel=4)
