"""Shared checks for the Pallas kernel tests."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def bits_of(a):
  """The raw bits of an array (so -0.0 != 0.0 and NaN payloads count)."""
  a = np.asarray(a)
  return a.view(_UINT[a.dtype.itemsize])


def assert_same_bits(a, b):
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
  np.testing.assert_array_equal(bits_of(a), bits_of(b))


def assert_same_packed(p, r):
  """Two per-group `Packed` values hold the same bits and metadata."""
  for field in ("data", "minimum", "scale"):
    assert_same_bits(getattr(p, field), getattr(r, field))
  assert (p.shape, p.dtype, p.bits, p.group_size, p.view_shape) == (
      r.shape, r.dtype, r.bits, r.group_size, r.view_shape)


def poisoned_call(kernel, *, grid, out_shape, name, interpret, **_):
  """`_triton.call` whose outputs start as garbage instead of interpret mode's
  zeros (uint8) or NaN: the kernel must write every output element itself."""
  outs = out_shape if isinstance(out_shape, tuple) else (out_shape,)

  def run(*args):
    garbage = [jnp.full(o.shape, 0xA5 if jnp.issubdtype(o.dtype, jnp.integer) else 1.5, o.dtype)
               for o in outs]
    def body(*refs):  # drop the aliased inputs
      kernel(*refs[:len(args)], *refs[len(args) + len(outs):])
    return pl.pallas_call(body, out_shape=out_shape, grid=(grid,), interpret=interpret, name=name,
                          input_output_aliases={len(args) + i: i for i in range(len(outs))})(
                              *args, *garbage)
  return run


def assert_lowers_for_cuda(fn, reference, *args, kernels):
  """`fn` lowered for CUDA (from any host) is Triton custom calls named
  `kernels`, in that order and nothing else, and its outputs have the
  structure, shapes and dtypes of `reference` (the XLA twin) at `args`."""
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  calls = [line for line in lowered.as_text().splitlines() if "stablehlo.custom_call" in line]
  assert all("@__gpu$xla.gpu.triton" in c for c in calls), calls
  names = [m for c in calls for m in re.findall(r'\bname = "(jact_[a-z_]+)"', c)]
  assert names == list(kernels), names
  want = jax.eval_shape(reference, *args)
  assert jax.tree.structure(lowered.out_info) == jax.tree.structure(want)
  got = [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(lowered.out_info)]
  assert got == [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(want)]
