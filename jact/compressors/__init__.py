"""Compressors: how a residual is stored for the backward pass.

Every method is a `Compressor` (compress, decompress, stored bytes, unbiased?)
and plugs in as `compressor=` wherever jact takes `bits=`: the compressed
ops, the Flax layers, `jact.compressed`, `jact.checkpoint` and
`jact.convert`; it can also be a `jact.BitPlan` entry. An integer `bits=`
width is shorthand for ActNN's per-group quantizer, `PerGroup(bits)`; a
plan's per-sample budget stores with `PerSample` (ActNN's per-sample widths).

>>> import jax, jax.numpy as jnp, jact
>>> from jact import compressors
>>> x, w = jnp.ones((4, 256)), jnp.ones((256, 3))
>>> y = jact.ops.dense(x, w, key=jax.random.key(0), compressor=compressors.PerGroup(2))
>>> y.shape
(4, 3)
"""

from jact.compressors._base import Compressed, Compressor, Stored, from_dict, registered
from jact.compressors._blpa import BLPA
from jact.compressors._division import Division
from jact.compressors._fixed_point import Fixpoint
from jact.compressors._float8 import Float8
from jact.compressors._pergroup import PerGroup
from jact.compressors._per_sample import PerSample
from jact.compressors._zero_value import ZeroValue

__all__ = [
  "Compressor",
  "Stored",
  "Compressed",
  "from_dict",
  "registered",
  "PerGroup",
  "PerSample",
  "Division",
  "BLPA",
  "Fixpoint",
  "Float8",
  "ZeroValue",
]
