"""What `convert`'s linen and nnx paths share for calls with no twin: the generic
engine's settings, keys inside scans, and the saved-bytes measure.

Layers without a twin (recurrent cells, DenseGeneral, Einsum, ConvTranspose,
GroupNorm, ...) and the converted model's outermost call run through
`call_compressed`: every VJP residual of the call is stored compressed.
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
from jax import lax

from jact import _compat as _jax_compat
from jact._convert.settings import Settings
from jact._flax.compressed import config_of
from jact._transforms.compressed import ResidualConfig
from jact.compressors import PerGroup


def residual_config(settings: Settings, name: str, *, scanned: bool = False) -> ResidualConfig:
  """The generic engine's settings for one converted call named `name`.

  `scanned`: a call that usually runs inside a scan (a recurrent cell), whose
  per-step residuals are small (batch x hidden) but stacked over the steps:
  floats of at least one quantization group are compressed (the default is
  1024 values)."""
  extra = dict(min_size=_group_values(settings.compressor)) if scanned else {}
  return config_of(settings.compressor, name=name, **extra)


def _group_values(compressor) -> int:
  """Values per quantization group: the per-group quantizer's own; 256 (its
  default) for any other compressor."""
  if isinstance(compressor, PerGroup) and compressor.implementation is None:
    return compressor.group_size
  return PerGroup(4).group_size


def layout_recomputed(prim, *_, **__) -> bool:
  """`jax.checkpoint` policy for cells: save every value except layout ops'
  outputs (concatenate, reshape, ...), recomputed in the backward instead: their
  operands are parameters (kept by reference: a cell's concatenated gate
  kernels would otherwise be stored once per step of a scan) or values of the
  same size."""
  return not _jax_compat.is_layout_primitive(prim)


def _float_leaves(tree) -> list:
  return [
    leaf
    for leaf in jax.tree.leaves(tree)
    if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.size(leaf)
  ]


def name_salt(name: str) -> int:
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def scan_key(outer_key, name: str, args):
  """A rounding key for a call that cannot see the 'jact' stream (inside a linen
  `nn.scan` / `nn.RNN`, which pass only the streams listed in `split_rngs`).

  The outer key (drawn outside the scan, the same in every iteration) is
  folded with the layer's name and with a fingerprint of each float argument
  (the carry and the step's input), which differ from one iteration to the
  next. The fingerprint (`_fingerprint`) reads only each value's sign, so
  it is the same on one device and with the batch sharded over many, where
  the values themselves differ in their last bits (a matmul over a shard of
  the rows sums in another order); only a value within rounding error of
  zero can tell the two apart. Two iterations whose arguments have the same
  signs share their noise (a correlation, not an error)."""
  key = jax.random.fold_in(outer_key, name_salt(name))
  for leaf in _float_leaves(args):
    key = jax.random.fold_in(key, _fingerprint(lax.stop_gradient(leaf)))
  return key


def _fingerprint(x) -> jax.Array:
  """A uint32 of the signs of `x`'s values (negative, zero or NaN, positive)
  and their positions: the sum modulo 2**32 (integer addition, exact in any
  order and any device split) of each value's sign code mixed with its flat
  index. Signs, not bits: the same step computed on a shard of the batch
  rounds its values differently in the last bits, which would change every
  bit of a hash of them."""
  x = x.astype(jnp.float32)
  code = (x > 0).astype(jnp.uint32) + jnp.uint32(2) * (x < 0).astype(jnp.uint32)
  index = lax.broadcasted_iota(jnp.uint32, x.shape, 0) if x.ndim else jnp.uint32(0)
  for axis in range(1, x.ndim):
    index = index * jnp.uint32(x.shape[axis]) + lax.broadcasted_iota(jnp.uint32, x.shape, axis)
  mixed = ((code + jnp.uint32(1)) ^ (index * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B)
  return jnp.sum(mixed, dtype=jnp.uint32)  # integer sum mod 2**32: exact in any order


def saved_bytes(fn, inputs, kept) -> int:
  """Bytes `jax.vjp(fn, *inputs)` keeps for the backward pass, leaving out the
  leaves of `inputs[i]` for `i` in `kept` (parameters: alive anyway). Traced
  abstractly; an activation argument the VJP keeps counts."""
  flat, tree = jax.tree.flatten(inputs)
  owners = [i for i, a in enumerate(inputs) for _ in jax.tree.leaves(a)]
  diff = [
    k
    for k, leaf in enumerate(flat)
    if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)
  ]
  counted = {}

  def run(*diff_leaves):
    full = list(flat)
    for k, v in zip(diff, diff_leaves):
      full[k] = v
    out, vjp = jax.vjp(lambda *d: fn(*_replace(full, diff, d, tree)), *diff_leaves)
    leaves, _ = _jax_compat.vjp_residuals(vjp)
    excluded = {id(v) for k, v in zip(diff, diff_leaves) if owners[k] in kept}
    excluded |= {id(full[k]) for k in range(len(full)) if k not in diff}
    seen = set()
    for leaf in leaves:
      if id(leaf) in excluded or id(leaf) in seen:
        continue
      seen.add(id(leaf))
      # typed PRNG keys (a scan's per-layer dropout keys): an itemsize, no numpy dtype
      counted[id(leaf)] = math.prod(leaf.shape) * leaf.dtype.itemsize
    return out

  jax.eval_shape(run, *[flat[k] for k in diff])
  return sum(counted.values())


def _replace(full, diff, values, tree):
  full = list(full)
  for k, v in zip(diff, values):
    full[k] = v
  return jax.tree.unflatten(tree, full)
