"""Shared checks for the Pallas kernel tests."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jact import _compat
from jact.kernels import _triton as T

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


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
    r.shape,
    r.dtype,
    r.bits,
    r.group_size,
    r.view_shape,
  )


class Poisoned:
  """A stand-in for `jact.kernels._triton.call` whose outputs start as garbage
  instead of what interpret mode starts them as (NaN for floats, and for
  integers their minimum: 0 for the uint8 codes, a value a kernel writes
  often). Each output is aliased to an input filled with `fills()`'s
  (integer, float) value, so a kernel must write every output element
  itself. `fills` is read when the call is traced: it may return tracers, so
  one compiled function runs with several fills. `calls` counts the calls made.
  """

  def __init__(self, fills):
    self.fills = fills
    self.calls = 0

  def __call__(self, kernel, *, grid, out_shape, name, interpret, num_warps=4, num_stages=1):
    outs = out_shape if isinstance(out_shape, tuple) else (out_shape,)

    def run(*args):
      self.calls += 1
      int_fill, float_fill = self.fills()
      garbage = [
        jnp.full(
          o.shape,
          jnp.asarray(int_fill if jnp.issubdtype(o.dtype, jnp.integer) else float_fill).astype(
            o.dtype
          ),
        )
        for o in outs
      ]

      def body(*refs):  # drop the aliased inputs
        kernel(*refs[: len(args)], *refs[len(args) + len(outs) :])

      return pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=grid if isinstance(grid, tuple) else (grid,),
        interpret=interpret,
        name=name,
        compiler_params=T.compiler_params(num_warps, num_stages),
        input_output_aliases={len(args) + i: i for i in range(len(outs))},
      )(*args, *garbage)

    return run


class PoisonedTriton:
  """A stand-in for `jact.kernels._jax_triton.call` (the jax-triton kernels'
  launcher) that passes it `initial` outputs of garbage: `fills()`'s integer
  value for integer outputs, its float value for float outputs. `calls` counts
  the calls made."""

  def __init__(self, call, fills):
    self.call, self.fills = call, fills
    self.calls = 0

  def __call__(self, kernel, *args, out_shape, **kwargs):
    self.calls += 1
    int_fill, float_fill = self.fills()
    initial = [
      jnp.asarray(int_fill if jnp.issubdtype(o.dtype, jnp.integer) else float_fill)
      for o in out_shape
    ]
    return self.call(kernel, *args, out_shape=out_shape, **{**kwargs, "initial": initial})


def poisoned_call(kernel, **kwargs):
  """`_triton.call` with outputs that start as 0xA5 (integers) or 1.5 (floats)."""
  return Poisoned(lambda: (0xA5, 1.5))(kernel, **kwargs)


def assert_same_tree(got, want, what="output"):
  """`got` and `want` are the same pytree (static fields included) whose array
  leaves have the same shapes, dtypes and bits (-0.0 != 0.0, NaN payloads count)."""
  assert jax.tree.structure(got) == jax.tree.structure(want), (
    f"{what}: structure or static fields differ:\n{jax.tree.structure(got)}\n"
    f"{jax.tree.structure(want)}"
  )
  for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
    a, b = np.asarray(a), np.asarray(b)
    assert (a.shape, a.dtype) == (b.shape, b.dtype), (
      f"{what} leaf {i}: shape/dtype {a.shape} {a.dtype}, reference {b.shape} {b.dtype}"
    )
    wrong = bits_of(a) != bits_of(b)
    if wrong.any():
      first = tuple(int(k) for k in np.argwhere(wrong)[0])
      raise AssertionError(
        f"{what} leaf {i} ({a.dtype}{list(a.shape)}): {int(wrong.sum())} of {a.size} elements "
        f"differ from the reference; first at {first}: {a[first]!r} != {b[first]!r}"
      )


def cuda_kernels(fn, reference, *args):
  """The names of the Triton kernels `fn` lowers to for CUDA (from any host),
  checking that they are its only custom calls and that its outputs have the
  structure, shapes and dtypes of `reference` (the XLA twin) at `args`."""
  lowered = _compat.lower_for_cuda(fn, *args)
  calls = [line for line in lowered.as_text().splitlines() if "stablehlo.custom_call" in line]
  assert all("@__gpu$xla.gpu.triton" in c for c in calls), calls
  names = [m for c in calls for m in re.findall(r'\bname = "(jact_[a-z0-9_]+)"', c)]
  assert len(names) == len(calls), calls
  want = jax.eval_shape(reference, *args)
  assert jax.tree.structure(lowered.out_info) == jax.tree.structure(want)
  got = [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(lowered.out_info)]
  assert got == [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(want)]
  return names


def assert_lowers_for_cuda(fn, reference, *args, kernels):
  """`fn` lowered for CUDA (from any host) is Triton custom calls named
  `kernels`, in that order and nothing else, and its outputs have the
  structure, shapes and dtypes of `reference` (the XLA twin) at `args`."""
  names = cuda_kernels(fn, reference, *args)
  assert names == list(kernels), names


_REG = r"(%[a-z]+\d+)"


def ptx_facts(ptx: str) -> dict:
  """Global access widths, fused (or fusable) multiply-adds and approximate divisions of PTX.

  >>> ptx = ("mul.f32 %f3, %f1, %f2;\\nadd.f32 %f4, %f3, %f1;\\n"
  ...        "mul.rn.f32 %f5, %f1, %f2;\\nadd.rn.f32 %f6, %f5, %f1;\\nfma.rn.f32 %f7, %f1, %f2, %f6;")
  >>> ptx_facts(ptx)["fused_multiply_adds"]
  2
  """  # noqa: E501 (the example's PTX)
  loads = Counter(re.findall(r"\bld\.global[\w.]*", ptx))
  stores = Counter(re.findall(r"\bst\.global[\w.]*", ptx))
  products = set(re.findall(rf"\bmul(?:\.ftz)?\.f32\s+{_REG}", ptx))  # unrounded multiplies
  pairs = 0
  for _, a, b in re.findall(rf"\b(?:add|sub)(?:\.ftz)?\.f32\s+{_REG},\s*{_REG},\s*{_REG}", ptx):
    pairs += a in products or b in products
  pairs += len(re.findall(r"\bfma\.[\w.]*f32", ptx))
  approximate = len(re.findall(r"\bdiv\.(?:approx|full)[\w.]*f32", ptx))
  return {
    "loads": dict(loads),
    "stores": dict(stores),
    "fused_multiply_adds": pairs,
    "approximate_divisions": approximate,
  }
