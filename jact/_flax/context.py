"""The implicit state of jact's Flax integration, all in one place.

Each variable is a `contextvars.ContextVar` set by a `with` block (`bound`)
and read by the code traced inside it: what a twin's forward needs per call
(a traced op, a key) never ends up in a module attribute, and nested blocks
restore the outer value on exit. Modules import this one and never make their
own ContextVar.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

# The twins (jact._flax.hooks)
OPS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jact_flax_ops", default=None)
"""slot name -> the op (key and residual name bound) a `Hook` forwards to (`hooks.provide`)."""

USE_KEY: contextvars.ContextVar[Any] = contextvars.ContextVar("jact_nnx_key", default=None)
"""The key source of the enclosing `jact.nnx.use_key` block (a `hooks._KeySource`), or None."""

# conversion_report (jact._flax.record)
RECORDER: contextvars.ContextVar[list | None] = contextvars.ContextVar(
  "jact_convert_recorder", default=None
)
"""The `Row`s of the `conversion_report` being taken, or None outside one."""

# convert, linen (jact._convert.linen, .linen_engine)
LINEN_SETTINGS: contextvars.ContextVar[Any] = contextvars.ContextVar(
  "jact_convert_settings", default=None
)
"""The `Settings` of the converted linen model whose method is running."""

LINEN_PASS: contextvars.ContextVar[tuple[tuple[str, ...], bool] | None] = contextvars.ContextVar(
  "jact_convert_pass", default=None
)
"""(module path, descendants too) of a layer left plain, so that the interceptor lets it run."""

LINEN_OUTER_KEY: contextvars.ContextVar[Any] = contextvars.ContextVar(
  "jact_convert_outer_key", default=None
)
"""The 'jact' key drawn outside a linen scan, folded into keys of the layers inside it."""

LINEN_IN_MODEL: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "jact_convert_in_model", default=False
)
"""True inside a converted linen model's outermost call (the generic engine's model call)."""

# convert, nnx (jact._convert.nnx_engine)
NNX_IN_MODEL: contextvars.ContextVar[bool] = contextvars.ContextVar(
  "jact_nnx_in_model", default=False
)
"""True inside a converted nnx model's outermost call."""

NNX_MEASURE: contextvars.ContextVar[Any] = contextvars.ContextVar("jact_nnx_measure", default=None)
"""While an nnx `conversion_report` is taken: the function measuring a layer call's
(plain, saved) bytes (`jact._convert.nnx_bytes.measure`), else None."""


@contextlib.contextmanager
def bound(variable: contextvars.ContextVar, value) -> Iterator[Any]:
  """Sets `variable` to `value` inside the block; the outer value comes back on exit."""
  token = variable.set(value)
  try:
    yield value
  finally:
    variable.reset(token)
