"""`Stored`: the one protocol of a residual's stored form.

Whatever a compressor keeps for the backward pass (`jact.Packed`,
`PackedPerSample`, `PackedBits`, `jact.compressors.Compressed`, or a user
compressor's own pytree) derives from `Stored`: it says how many bytes it
holds (`nbytes`), rebuilds the value (`decompress(dtype)`), and names the
arrays the backward pass must read only after its cotangent arrives
(`map_ordered`). The engine stores with `compressor.compress(x, seed)`,
restores with `stored.decompress(dtype)`, and orders every `Stored` alike
(`jact._engine.scheduling`), so a user compressor's output is scheduled as
the built-in ones are. It lives here, below the kernels, because the kernels
build `Packed` and `PackedPerSample`; `jact.compressors` re-exports it.

The per-group and per-sample layouts are decoded by kernels, one layer up:
their entry points register the decoder here (`register_decoder`), so the
layout classes need not import the kernels.
"""

from __future__ import annotations

import abc
from typing import Callable

import jax

__all__ = ["Stored", "register_decoder", "decoder"]

_DECODERS: dict[type, Callable] = {}


class Stored(abc.ABC):
  """A residual's stored form: a JAX pytree that can rebuild the value.

  Subclasses (registered pytrees, e.g. `jax.tree_util.register_dataclass`
  dataclasses) define `decompress` and `nbytes` (a subclass missing either
  cannot be instantiated); `map_ordered` defaults to every array leaf.
  """

  @abc.abstractmethod
  def decompress(self, dtype=None) -> jax.Array:
    """The reconstruction (the original dtype unless `dtype` is given)."""

  @property
  @abc.abstractmethod
  def nbytes(self) -> int:
    """Bytes actually stored."""

  def map_ordered(self, fn: Callable[[jax.Array], jax.Array]) -> "Stored":
    """A copy with `fn` applied to the arrays the backward pass reads only
    after the cotangent arrives (`jact._engine.scheduling.barrier`): by
    default every array leaf, in flattening order."""
    return jax.tree.map(fn, self)


def register_decoder(cls: type, fn: Callable) -> None:
  """Makes `fn(stored, dtype)` the decoder of the stored layout `cls` (a
  kernel entry point registers the layout it decodes)."""
  _DECODERS[cls] = fn


def decoder(cls: type) -> Callable:
  """The decoder registered for `cls`; a clear error when none is."""
  try:
    return _DECODERS[cls]
  except KeyError:
    raise RuntimeError(
      f"no decoder is registered for {cls.__name__}: import jact (its kernels register "
      "one) before decompressing."
    ) from None
