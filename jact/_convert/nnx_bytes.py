"""The bytes an nnx layer call keeps for the backward pass, plain and converted,
for `conversion_report` (the nnx counterpart of the linen engine's `measure`),
and the rows of the layers `convert` left plain, noted when they are called.

Each measure traces the call abstractly on a copy of the layer (`nnx.split` /
`nnx.merge`), so neither the layer's streams nor the report's rows change.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from flax import nnx

from jact._flax.context import NNX_MEASURE, bound
from jact._flax.conversion import rounds
from jact._convert.generic import saved_bytes
from jact._flax.record import record, recording


def call_bytes(module, call: Callable[..., Any], args, kwargs) -> int:
  """Bytes `call(copy of module, *args, **kwargs)` keeps for the backward pass,
  the layer's own parameters not counted."""
  graphdef, state = nnx.split(module)

  def run(state, *args):
    return call(nnx.merge(graphdef, state), *args, **kwargs)

  with recording(), bound(NNX_MEASURE, None):  # the layers inside: neither noted nor measured
    return saved_bytes(run, (state, *args), kept={0})


def _flax_call(module) -> Callable[..., Any]:
  """The `__call__` of the Flax layer class a twin derives from."""
  base = next(c for c in type(module).__mro__ if c.__module__.startswith("flax."))
  return base.__call__


def _plain(call: Callable[..., Any]) -> Callable[..., Any]:
  """A twin's call computing what its Flax layer does: the path it runs without
  a key (Flax's forward, the plain ops behind its hooks), differentiable; Flax's
  own call for the twins that never round (Embed, Dropout)."""

  def plain(module, *args, **kwargs):
    if not rounds(type(module)):
      return _flax_call(module)(module, *args, **kwargs)
    module._jact_plain = True
    return call(module, *args, **kwargs)

  return plain


def measure(module, call: Callable[..., Any], args, kwargs, *, plain=None) -> tuple[int, int]:
  """(plain bytes, saved bytes) of `call(module, *args, **kwargs)`, a converted
  layer's call; `plain` the plain layer's call (default: `call` with rounding off,
  a twin's Flax computation)."""
  plain = _plain(call) if plain is None else plain
  return call_bytes(module, plain, args, kwargs), call_bytes(module, call, args, kwargs)


def measuring():
  """The block of a `conversion_report`'s trace: layer calls note their bytes."""
  return bound(NNX_MEASURE, measure)


_NOTING: dict[type, type] = {}


def _noting_class(base: type) -> type:
  """A subclass of `base` (a plain layer's class) whose calls note a report row
  with the bytes the plain call keeps (`_jact_note`: name, reason, in_model)."""
  if base not in _NOTING:

    def __call__(self, *args, **kwargs):
      name, reason, in_model = self._jact_note
      size = None if NNX_MEASURE.get() is None else call_bytes(self, base.__call__, args, kwargs)
      how = "model" if in_model else "plain"  # in_model: compressed by the model's call
      record(name, base.__name__, how, reason, size, None if in_model else size)
      return base.__call__(self, *args, **kwargs)

    attrs = {"__call__": __call__, "__module__": base.__module__, "__qualname__": base.__qualname__}
    _NOTING[base] = type(base.__name__, (base,), attrs)
  return _NOTING[base]


@contextlib.contextmanager
def noting_plain(layers):
  """Inside: the plain layers `layers` ((name, reason, in_model, layer) each)
  note their calls, with their bytes; their classes come back on exit."""
  changed = []
  try:
    for name, reason, in_model, layer in layers:
      if "_jact_note" in vars(layer):  # the same layer reached twice
        continue
      cls = type(layer)
      layer.__class__ = _noting_class(cls)
      layer._jact_note = (name, reason, in_model)
      changed.append((layer, cls))
    yield
  finally:
    for layer, cls in changed:
      vars(layer).pop("_jact_note", None)
      layer.__class__ = cls
