"""How a twin declares its conversion: which Flax layer it replaces, which hook
fields it installs itself, when it does not apply, whether it draws a key.

Each twin of `jact.nn` / `jact.nnx` that `jact.convert` routes to sets a
`conversion` class attribute; `jact._convert` builds its linen and nnx tables
from these declarations (`table`), so a new twin is added where it is written.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import ModuleType
from typing import Any, Callable


def _applies(*_) -> None:
  return None


def _nothing(_) -> None:
  return None


def _always(*_) -> bool:
  return True


@dataclasses.dataclass(frozen=True)
class Conversion:
  """How `jact.convert` replaces a Flax layer by the twin declaring this.

  Attributes:
    replaces: the Flax layer classes the twin replaces (exact types: a subclass
      may compute something else).
    drop: linen: the layer's hook fields the twin installs itself (not copied).
    check: why a layer cannot be converted, or None: linen `check(module,
      arguments)` (the call's arguments by name, checked at each call); nnx
      `check(module)` (checked once, when converting).
    patch: nnx: `patch(twin)` installs the twin's hooks on the converted copy.
    draws_key: linen: `draws_key(module, arguments)`, whether a call of a
      rounding twin draws a key (batch norm only in training); the twins
      without rounding settings (`rounds`) never do.
  """

  replaces: tuple[type, ...]
  drop: tuple[str, ...] = ()
  check: Callable[..., str | None] = _applies
  patch: Callable[[Any], None] = _nothing
  draws_key: Callable[..., bool] = _always


def rounds(twin: type) -> bool:
  """Whether `twin` takes rounding settings (`bits` / `compressor`): a linen
  twin's fields, an nnx twin's constructor keywords."""
  fields = getattr(twin, "__dataclass_fields__", None)
  if fields is not None:
    return "compressor" in fields
  return "compressor" in inspect.signature(twin.__init__).parameters


def table(namespace: ModuleType) -> dict[type, type]:
  """Flax class -> twin, from the `conversion` each class of `namespace.__all__`
  declares itself (an inherited declaration does not count)."""
  found: dict[type, type] = {}
  for name in namespace.__all__:
    twin = getattr(namespace, name)
    conversion = vars(twin).get("conversion") if isinstance(twin, type) else None
    if conversion is None:
      continue
    if not isinstance(conversion, Conversion):
      raise TypeError(
        f"{namespace.__name__}.{name}.conversion must be a jact._flax.conversion.Conversion, "
        f"got {type(conversion).__name__}."
      )
    for layer in conversion.replaces:
      if found.get(layer, twin) is not twin:
        raise TypeError(
          f"{layer.__qualname__} is replaced by both {namespace.__name__}."
          f"{found[layer].__name__} and {namespace.__name__}.{name}; declare it on one."
        )
      found[layer] = twin
  return found
