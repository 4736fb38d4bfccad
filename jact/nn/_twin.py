"""What every linen twin shares: the 'jact' stream, the rounding settings, the
residual name and the hooks through which Flax's forward calls jact's ops."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from jact._engine.op import REMOVED_KEYWORDS, reject_removed_keywords
from jact._flax import hooks as _hooks
from jact._flax.hooks import Hook
from jact._compat import flax as _compat


class _Twin:
  """Mixin: RNG stream, settings and residual name of a linen twin. A
  rounding twin (one with `bits` / `compressor` fields) built with the
  removed `group_size=` / `stochastic=` raises the ops' TypeError naming
  `compressor=jact.compressors.PerGroup(...)`."""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)  # Flax makes the dataclass (its __init__) here
    if "compressor" in getattr(cls, "__dataclass_fields__", {}):
      cls.__init__ = _rejecting_removed(cls.__init__)

  def _api(self) -> str:
    return f"jact.nn.{type(self).__name__}"

  def _rounding(self) -> dict:
    return _hooks.rounding_kwargs(self.bits, self.compressor, self._api())

  def _residual_name(self) -> str:
    path = self.path
    return "/".join(path) if path else type(self).__name__

  def _key(self) -> tuple[bool, Any]:
    """(compress?, key): the 'jact' key when rounding needs one; without the
    stream, (False, None): run the plain computation through `_keyless`."""
    if not _hooks.needs_key(self.bits, self.compressor, self._api()):
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


def _rejecting_removed(init: Callable) -> Callable:
  """A twin's dataclass `__init__` raising the TypeError of `takes_compressor`
  for `group_size=` / `stochastic=`."""
  if getattr(init, "_jact_rejects_removed", False):
    return init

  signature = inspect.signature(init)

  @functools.wraps(init)
  def checked(self, *args, **kwargs):
    api = f"jact.nn.{type(self).__name__}"
    if args and any(k in kwargs for k in REMOVED_KEYWORDS):  # bits= may be positional
      kwargs_given = {**signature.bind_partial(self, *args).arguments, **kwargs}
      reject_removed_keywords(api, kwargs_given)
    reject_removed_keywords(api, kwargs)
    init(self, *args, **kwargs)

  checked._jact_rejects_removed = True
  return checked


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
