"""The `Compressor` interface, the `Stored` protocol and the generic stored form `Compressed`.

A compressor turns a floating residual into a `Stored` pytree of arrays to
keep for the backward pass, which `stored.decompress(dtype)` turns back into
an approximation of the residual. It is a
frozen, hashable dataclass of static settings, so it can be passed as
`compressor=` wherever jact takes `bits=` (ops, Flax layers,
`jact.compressed`) and stored in a `jact.BitPlan`; the ops call `compress` in
the forward pass and `decompress` in the backward pass.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp

from jact import kernels
from jact._core.quantize import FLOAT_DTYPES
from jact._core.stored import Stored

__all__ = [
  "Compressor",
  "Stored",
  "Compressed",
  "from_dict",
  "registered",
  "channels",
  "as_channel_rows",
  "check_implementation",
]

_REGISTRY: dict[str, type["Compressor"]] = {}


def channels(shape: tuple[int, ...]) -> int:
  """Channels of a residual: its last axis (one channel for a 0-D or 1-D tensor)."""
  return int(shape[-1]) if len(shape) >= 2 else 1


def as_channel_rows(x: jax.Array) -> jax.Array:
  """x as (values / C, C), C = `channels(x.shape)` (also for empty tensors, even C = 0)."""
  c = channels(tuple(x.shape))
  return x.reshape(x.size // c if c else 0, c)


def check_implementation(implementation: Any, op: str) -> None:
  """A clear error for a kernel name `jact.kernels` does not know for `op`."""
  if implementation is None:
    return
  known = sorted(kernels.available(op))
  if not isinstance(implementation, str) or implementation not in known:
    raise ValueError(
      f"unknown kernel implementation {implementation!r} for {op!r}; use one of "
      f"{known} or None (the best one for the backend)."
    )


class Compressor(abc.ABC):
  """How one floating residual is stored for the backward pass.

  Subclasses are frozen dataclasses (hashable, compared by value) that define:

  * `compress(x, seed)`: the stored form, a `Stored` (`Compressed`,
    `jact.Packed`, or a pytree of the compressor's own deriving from
    `Stored`); `seed` is a uint32 scalar when `needs_key`, else None.
  * `decompress(stored, dtype=None)`: the reconstruction, in x's shape
    (what `stored.decompress(dtype)` returns).
  * `stored_bytes(shape, dtype)`: bytes `compress` keeps for such an input
    (exactly what `jact.residual_report` counts).
  * `unbiased`: whether E[decompress(compress(x))] = x over the seed.
  * `with_bits(bits)`: the same method at another width (how a plan's integer
    entry applies to it); `bits` is the nominal width, `average_bits` the
    stored bits per value.
  * `with_budget(avg_bits)`: the method with per-sample widths averaging
    `avg_bits` (how a plan's per-sample budget applies to it); only the
    per-group quantizer has one (`PerSample`), others raise.
  * `method`: the registry name used by `to_dict` / `from_dict` (JSON plans).
  """

  method: ClassVar[str]

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    method = cls.__dict__.get("method")
    if isinstance(method, str):
      _REGISTRY[method] = cls

  @property
  @abc.abstractmethod
  def unbiased(self) -> bool:
    """E[decompress(compress(x, seed))] == x over random seeds."""

  @property
  def needs_key(self) -> bool:
    """Whether `compress` draws random numbers (then the op needs a PRNG key)."""
    return False

  @property
  @abc.abstractmethod
  def bits(self) -> int:
    """Nominal width of the stored codes."""

  @property
  def average_bits(self) -> float:
    """Stored bits per value, approximately (for plan summaries)."""
    return float(self.bits)

  @abc.abstractmethod
  def with_bits(self, bits: int) -> "Compressor":
    """The same compressor at another width."""

  def with_budget(self, avg_bits: float) -> "Compressor":
    """The per-sample form of this method at `avg_bits` average bits."""
    raise ValueError(
      f"{self!r} has no per-sample form: only the per-group quantizer (PerGroup) splits "
      "an average width among samples (jact.compressors.PerSample); drop the budget or "
      "give the residual an integer width."
    )

  @abc.abstractmethod
  def compress(self, x: jax.Array, seed: jax.Array | None) -> Stored:
    """The stored form of x."""

  @abc.abstractmethod
  def decompress(self, stored: Any, dtype=None) -> jax.Array:
    """The reconstruction of x (shape of x; dtype of x unless given)."""

  @abc.abstractmethod
  def stored_bytes(self, shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes `compress` stores for an input of this shape and dtype."""

  def to_dict(self) -> dict[str, Any]:
    """JSON-able description; `from_dict` inverts it."""
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    for k, v in fields.items():
      if isinstance(v, Compressor):
        fields[k] = v.to_dict()
      elif v is not None and not isinstance(v, (bool, int, float, str)):
        fields[k] = jnp.dtype(v).name
    return {"method": self.method, **fields}

  def check_input(self, x) -> None:
    """A clear error for inputs this compressor cannot take."""
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
      raise TypeError(
        f"{type(self).__name__} compresses float32, bfloat16 or float16 "
        f"residuals, got {x.dtype}; cast it first (x.astype(jnp.float32))."
      )


def registered() -> dict[str, type[Compressor]]:
  """Method name -> compressor class."""
  return dict(_REGISTRY)


def from_dict(d: Mapping[str, Any]) -> Compressor:
  """Inverse of `Compressor.to_dict`.

  >>> from jact import compressors
  >>> c = compressors.Division(block=4, bits=2)
  >>> compressors.from_dict(c.to_dict()) == c
  True
  """
  d = dict(d)
  method = d.pop("method", None)
  if method not in _REGISTRY:
    raise ValueError(f"unknown compressor method {method!r}; known: {sorted(_REGISTRY)}")
  cls = _REGISTRY[method]
  for k, v in list(d.items()):
    if isinstance(v, Mapping) and "method" in v:
      d[k] = from_dict(v)
  try:
    return cls(**d)
  except TypeError as e:
    raise ValueError(f"bad fields for compressor {method!r}: {e}") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Compressed(Stored):
  """A residual stored by a `Compressor` (the generic `Stored`).

  Attributes:
    arrays: the stored arrays (a dict of arrays or nested pytrees).
    compressor: the compressor that made it (static).
    shape, dtype: of the original residual (static).
  """

  arrays: dict
  compressor: Any = dataclasses.field(metadata=dict(static=True))
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    """Bytes actually stored."""
    return int(sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(self.arrays)))

  def decompress(self, dtype=None) -> jax.Array:
    """The compressor's reconstruction."""
    return self.compressor.decompress(self, dtype)
