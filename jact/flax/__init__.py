"""Flax integration: compressed twins of the common layers.

`jact.flax.linen` mirrors `flax.linen` layers (rounding noise from the 'jact'
RNG stream of `apply`), `jact.flax.nnx` mirrors `flax.nnx` layers (a 'jact'
stream forked from `rngs` at construction). Both keep Flax's variables, so
plain checkpoints load unchanged.
"""

from jact.flax import linen, nnx
from jact.flax import compressed_module  # noqa: F401  (imported to register the Flax route of jact.compressed)

__all__ = ["linen", "nnx"]
