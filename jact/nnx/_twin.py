"""What every nnx twin shares: its settings, its own 'jact' stream (or keys from
`use_key`), its residual name, and the hooks through which Flax's forward calls
jact's ops."""

from __future__ import annotations

import functools
from typing import Any, Callable

from flax import nnx

from jact._engine.rounding import compressor_keywords, resolve_compressor
from jact._flax import hooks as _hooks
from jact._flax.context import NNX_MEASURE
from jact._flax.record import record
from jact.nnx._blpa import BLPABlock


class _Twin:
  """Mixin: settings, RNG stream and residual name of an nnx twin. Each call
  of a twin is recorded for `jact.conversion_report` (a 'twin' row)."""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    call = cls.__dict__.get("__call__")
    if call is not None:
      cls.__call__ = _recorded(call)

  @classmethod
  def _check_settings(cls, rngs, bits, compressor=None) -> None:
    """Fails fast (before any parameter is initialized) on bad settings."""
    resolve_compressor(bits, compressor, f"jact.nnx.{cls.__name__}")

  def _init_jact(self, rngs, bits=4, name=None, compressor=None):
    """Settings, residual name and the layer's own 'jact' stream, forked from
    `rngs` ('jact', else 'default') when rounding needs a key; without such a
    stream in `rngs` none (keys from `use_key` only). `bits` and `compressor`
    are resolved here, once, to the one value the ops get (`jact_stored`)."""
    stored = resolve_compressor(bits, compressor, f"jact.nnx.{type(self).__name__}")
    self.bits, self.compressor, self.jact_stored = bits, compressor, stored
    self.residual_name = name or type(self).__name__
    stream = None
    if self._needs_key() and isinstance(rngs, nnx.RngStream):
      stream = rngs.fork()
    elif self._needs_key() and isinstance(rngs, nnx.Rngs) and ("jact" in rngs or "default" in rngs):
      stream = rngs["jact"].fork()
    self.jact_rngs = stream if stream is not None else nnx.data(None)

  def _rounding(self) -> dict:
    """The ops' keywords for `jact_stored`."""
    return compressor_keywords(self.jact_stored)

  def _needs_key(self) -> bool:
    return _hooks.needs_key(self.jact_stored)

  def _key(self) -> tuple[bool, Any]:
    """(compress?, key): a `use_key` block's key, else the layer's stream; (False,
    None) where a key is needed and there is none: run plain through `_keyless`."""
    if self.__dict__.get("_jact_plain"):
      return False, None
    if not self._needs_key():
      return True, None
    key = _hooks.context_key(self.residual_name)
    if key is not None:
      return True, key
    if self.jact_rngs is None:
      return False, None
    return True, _hooks.draw(
      self.jact_rngs, f"jact.nnx.{type(self).__name__} {self.residual_name!r}"
    )

  def _keyless(self, fn):
    """`fn`, the layer's plain computation run without a key: differentiating it raises
    (except on a copy measured as plain by `conversion_report`)."""
    if self.__dict__.get("_jact_plain"):
      return fn
    return _hooks.keyless(
      fn,
      _hooks.nnx_keyless_message(
        f"jact.nnx.{type(self).__name__} {self.residual_name!r}",
        "give the layers their own streams: jact.convert(model, rngs=nnx.Rngs(jact=0)), or "
        "build the twins with rngs=nnx.Rngs(params=0, jact=1)",
      ),
    )

  def _provide(self, slot: str, op, plain, **static):
    compress, key = self._key()
    if not compress:
      return _hooks.provide(**{slot: self._keyless(plain)})
    calls = _hooks.Calls(
      op, key, (self.residual_name,), slot, plain=plain, **self._rounding(), **static
    )
    return _hooks.provide(**{slot: calls})


def _recorded(call):
  """`call` (a twin's `__call__`) noting the call, with its plain and saved bytes,
  in a conversion report being taken."""

  @functools.wraps(call)
  def recorded(self, *args, **kwargs):
    measure = NNX_MEASURE.get()
    sizes = (None, None) if measure is None else measure(self, call, args, kwargs)
    record(self.residual_name, type(self).__name__, "twin", "", *sizes)
    return call(self, *args, **kwargs)

  return recorded


def _install(field: str, value) -> Callable[[Any], None]:
  """A `Conversion.patch` setting the converted copy's `field` to `value` (its hook)."""
  return lambda twin: setattr(twin, field, value)


def _first_not_none(*values, error_msg: str):
  """The first value that is not None (a call-time option, then the constructor's)."""
  for value in values:
    if value is not None:
      return value
  raise ValueError(error_msg)


def _no_hook(kwargs: dict, *hooks: str) -> None:
  for h in hooks:
    if kwargs.get(h) is not None:
      raise TypeError(f"a jact twin installs its own {h!r}; do not pass one.")
    kwargs.pop(h, None)


def name_residuals(model: nnx.Module) -> nnx.Module:
  """Names every twin's residuals after its attribute path ("encoder/layers/0"); in place.

  >>> from flax import nnx
  >>> import jact
  >>> class Net(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.fc = jact.nnx.Linear(2, 2, rngs=rngs)
  >>> jact.nnx.name_residuals(Net(nnx.Rngs(0))).fc.residual_name
  'fc'
  """
  for path, module in nnx.iter_modules(model):
    if isinstance(module, (_Twin, BLPABlock)) and path:
      module.residual_name = "/".join(str(p) for p in path)
  return model
