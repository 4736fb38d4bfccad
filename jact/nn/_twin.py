"""What every linen twin shares: the 'jact' stream, the rounding settings, the
residual name and the hooks through which Flax's forward calls jact's ops."""

from __future__ import annotations

from typing import Any, Callable

from jact._engine.rounding import compressor_keywords, resolve_compressor
from jact._flax import hooks as _hooks
from jact._flax.hooks import Hook
from jact._compat import flax as _compat


class _Twin:
  """Mixin: RNG stream, settings and residual name of a linen twin. A rounding
  twin (one with `bits` / `compressor` fields) resolves them once, when it is
  built, to the one value the ops get (`_stored`)."""

  def __post_init__(self):
    if "compressor" in type(self).__dataclass_fields__:
      stored = resolve_compressor(self.bits, self.compressor, self._api())
      object.__setattr__(self, "_jact_stored", stored)
    super().__post_init__()

  def _api(self) -> str:
    return f"jact.nn.{type(self).__name__}"

  def _stored(self):
    """How the twin stores its residuals: a `Compressor`, or None (kept exact)."""
    return self.__dict__.get("_jact_stored")

  def _rounding(self) -> dict:
    """The ops' keywords for `_stored()`."""
    return compressor_keywords(self._stored())

  def _residual_name(self) -> str:
    path = self.path
    return "/".join(path) if path else type(self).__name__

  def _key(self) -> tuple[bool, Any]:
    """(compress?, key): the 'jact' key when rounding needs one; without the
    stream, (False, None): run the plain computation through `_keyless`."""
    if not _hooks.needs_key(self._stored()):
      return True, None
    if self.has_rng("jact"):
      return True, self.make_rng("jact")
    return False, None

  def _keyless(self, fn: Callable) -> Callable:
    """`fn`, the layer's plain computation run without a key: differentiating it raises."""
    what = f"{self._api()} {self._residual_name()!r}"
    return _hooks.keyless(fn, _hooks.linen_keyless_message(what))

  def _check_hook(self, field: str) -> None:
    if not isinstance(getattr(self, field), Hook) or getattr(self, f"{field}_cls") is not None:
      raise TypeError(
        f"jact.nn.{type(self).__name__} installs its own {field!r}; do not pass "
        f"{field} or {field}_cls."
      )

  def _provide(self, slot: str, op: Callable, plain: Callable, **static):
    self._check_hook(slot)
    compress, key = self._key()
    if not compress:
      return _hooks.provide(**{slot: self._keyless(plain)})
    calls = _hooks.Calls(
      op, key, (self._residual_name(),), slot, plain=plain, **self._rounding(), **static
    )
    return _hooks.provide(**{slot: calls})


def _custom(module, *fields: str) -> str | None:
  """A `Conversion.check` reason: a layer given its own hook (`dot_general`, ...)."""
  for f in fields:
    if getattr(module, f) is not None:
      return f"a custom {f!r} (the twin installs its own)"
  return None


def _norm_options_supported(module, mask, layer: str, cross_device: bool = False) -> None:
  if mask is not None:
    raise ValueError(f"jact.nn.{layer} does not support mask=; use flax.linen.{layer}.")
  if not cross_device and (module.axis_name is not None or module.axis_index_groups is not None):
    raise ValueError(
      f"jact.nn.{layer} does not support axis_name/axis_index_groups (pmap statistics); "
      f"use flax.linen.{layer}, or jit with sharded inputs."
    )
  if not module.force_float32_reductions:
    raise ValueError(f"jact.nn.{layer} needs force_float32_reductions=True.")


def _output_dtype(x, params, dtype):
  return _compat.canonicalize_dtype(x, *[p for p in params if p is not None], dtype=dtype)
