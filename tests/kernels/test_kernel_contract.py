"""The contract every kernel in `jact.kernels.REGISTRY` keeps, checked per (op, implementation).

The table is read when the tests are collected, so a newly registered kernel
is tested here without editing this file; a new *op* needs a case generator
in `CASES` (its tests fail, naming the op, until it has one). For every
implementation other than the "xla" reference (the oracle) and every case:

* bit-exact: each output leaf equals the reference's in shape, dtype and
  bits, and the pytrees match including static fields (shape, dtype, bits,
  group size, view shape) -- as users call the kernel on one case an op, and
  with pre-filled outputs (below) on every case;
* every output element written: the Pallas calls run with their outputs
  pre-filled with garbage, twice with different garbage, and must still
  return the reference's bits. Pallas' Triton interpret mode cannot do this
  itself (it starts outputs as NaN and integer minima -- 0 for the uint8
  codes -- with no option; the TPU interpreter's `uninitialized_memory`
  rejects the masked loads these kernels use), so `_triton.call`, through
  which every kernel makes its Pallas calls, is swapped for
  `kernel_checks.Poisoned`;

and every implementation, the reference included, lowers for CUDA from this
host (Triton custom calls only; none for the reference) with the reference's
output structure, shapes and dtypes.

Off GPU the kernels run in Pallas interpret mode (their default there).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jact._core import rng
from jact._core.quantize import effective_group_size
from jact.kernels._per_sample.reference import quantize_per_sample_reference
from jact.kernels._quantize.reference import quantize_reference, quantize_rows_reference
from jact.kernels import REGISTRY
from jact.kernels import _jax_triton
from jact.kernels import _triton as T
from kernel_checks import (
  Poisoned,
  PoisonedTriton,
  assert_same_tree,
  bits_of,
  cuda_kernels,
  ptx_facts,
)

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
REFERENCE = "xla"


@dataclasses.dataclass(frozen=True)
class Case:
  """One argument set of an op, in the reference's signature.

  `make()` returns (positional array arguments, keyword arguments: static
  values, or arrays the functions close over); `options` adds keyword
  arguments per implementation name (the Pallas kernels' `rows` and `tile`,
  which bound the grid so small inputs still span several programs).
  Interpret mode compiles each kernel for seconds, so only one `quick` case an
  op is unmarked; the others are marked slow (`-m "not slow"` leaves them out).
  """

  name: str
  make: Callable[[], tuple[tuple, dict]]
  options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
  quick: bool = False


def activation(shape, dtype, seed, scale=3.0):
  """Normals of a per-sample range, with +-inf, NaN, +-0 in sample 0 and, when
  there are several samples, sample 1 entirely non-finite; made on the host."""
  rng = np.random.default_rng(seed)
  spread = np.arange(1, shape[0] + 1, dtype=np.float64).reshape((-1,) + (1,) * (len(shape) - 1))
  x = scale * rng.standard_normal(shape) * spread
  flat = x.reshape(shape[0], -1)
  if flat.shape[1] >= 8:
    flat[0, [1, 5, 7, 2, 3]] = np.inf, np.nan, -np.inf, 0.0, -0.0
  if shape[0] > 1:
    flat[1] = np.where(np.arange(flat.shape[1]) % 2, -np.inf, np.nan)
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def nonfinite_groups(dtype, seed, groups=3, group=16):
  """Samples of `groups` groups of `group` values, each group one pattern of
  non-finite values (+inf, -inf, NaN, both infinities, nothing finite, a
  constant, a wide range, +-0), in an order drawn from `seed`; made on the host."""
  rng = np.random.default_rng(seed)
  patterns = [
    {},
    {3: np.inf},
    {0: -np.inf},
    {7: np.nan},
    {1: np.inf, 2: -np.inf},
    "nan",
    "inf",
    ("const", 1.5, {4: np.inf}),
    ("const", 0.0, {5: np.nan}),
    ("wide", {6: np.inf}),
    ("const", -2.0, {group - 1: -np.inf}),
    ("zeros", {0: np.inf}),
  ]
  rows = []
  for pattern in [patterns[i] for i in rng.permutation(len(patterns))]:
    v = rng.standard_normal(group)
    if pattern == "nan" or pattern == "inf":
      v[:] = np.nan if pattern == "nan" else np.inf
    elif isinstance(pattern, dict):
      for i, value in pattern.items():
        v[i] = value
    else:
      kind, *rest = pattern
      v = {
        "const": np.full(group, rest[0] if kind == "const" else 0.0),
        "wide": rng.uniform(-3e38, 3e38, group),
        "zeros": np.array([0.0, -0.0] * (group // 2)),
      }[kind]
      for i, value in rest[-1].items():
        v[i] = value
    rows.append(v)
  x = np.stack(rows).reshape(-1, groups * group)
  if jnp.dtype(dtype) != jnp.float32:
    x = np.where(np.isfinite(x), np.clip(x, -60000, 60000), x)
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def jitted(fn, *args, **kwargs):
  """`fn(*args, **kwargs)` compiled as one program (static keyword arguments):
  op by op, the references take seconds to dispatch their many small operations."""
  return jax.jit(functools.partial(fn, **kwargs))(*args)


def at_code_boundaries(n, groups, group, bits, seed):
  """float32 (n, groups * group) values whose exact v + u lies just under a code boundary
  for `seed`'s noise (u), so a kernel that fuses the product v with the add of u into one
  multiply-add, or rounds it otherwise than the reference, gets other codes. Each group
  holds 0 and 3.9375: its step is the same and not a power of two."""
  levels = (1 << bits) - 1
  ends = np.zeros((n, groups, group), np.float32)
  ends[..., 1] = 3.9375
  step = np.asarray(
    jitted(
      quantize_reference, jnp.asarray(ends.reshape(n, -1)), seed, bits=bits, group_size=group
    ).scale,
    np.float32,
  )[..., None]
  u = np.asarray(
    jax.jit(lambda seed: rng.uniform_from_bits(rng.element_bits(seed, (n, groups, group))))(seed),
    np.float64,
  )
  k = np.random.default_rng(0).integers(1, levels, (n, groups, group))
  x = ((k - u - 2e-6) * step).astype(np.float32)
  x[..., :2] = ends[..., :2]
  return jnp.asarray(x.reshape(n, -1))


def random_bytes(shape, seed):
  """Every byte value: any code the dequantizers may meet."""
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8))


# ----------------------------------------------------------------------------- case generators


def quantize_cases():
  def case(name, shape, dtype, bits, group_size, rows, stochastic=True, quick=False):
    g = effective_group_size(int(np.prod(shape[1:])), group_size)

    def make():
      seed = jnp.uint32(0xC0FFEE + bits) if stochastic else None
      return (
        (activation(shape, dtype, seed=bits), seed),
        dict(bits=bits, group_size=g, stochastic=stochastic),
      )

    return Case(
      name, make, {"pallas_triton": dict(rows=rows), "jax_triton": dict(rows=rows)}, quick
    )

  return [
    case("b1-f32-group200", (4, 1000), F32, 1, 256, rows=4),  # groups of 200: not a power of two
    case("b2-bf16-partial-group", (3, 7, 13), BF16, 2, 64, rows=2, quick=True),  # 64 + 27
    case("b4-f16-below-one-group", (5, 20), F16, 4, 256, rows=2),  # one group of 24 > 20 values
    case("b8-f32-nearest", (2, 300), F32, 8, 256, rows=1, stochastic=False),  # 256 + 44
    boundary_case(8, rows=4),
    # the bit-plane widths (3, 5, 6, 7) and 16 bits (low and high byte planes)
    case("b3-f32-group200", (4, 1000), F32, 3, 256, rows=4),
    case("b5-bf16-partial-group", (3, 7, 13), BF16, 5, 64, rows=2),
    case("b6-f16-below-one-group", (5, 20), F16, 6, 256, rows=2),
    case("b7-f32-nearest", (2, 300), F32, 7, 256, rows=1, stochastic=False),
    case("b16-f32-partial-group", (3, 300), F32, 16, 64, rows=2),
    case("b16-bf16-nearest", (2, 100), BF16, 16, 64, rows=1, stochastic=False),
  ] + [
    nonfinite_case(bits, dtype, rows=2)
    for bits, dtype in ((1, F32), (2, F16), (4, BF16), (8, F32), (3, F16), (5, BF16), (16, F32))
  ]


def boundary_case(bits, rows):
  """Values just under code boundaries (`at_code_boundaries`): one rounding per operation."""

  def make():
    seed = jnp.uint32(0xB0B + bits)
    return (
      (at_code_boundaries(4, 8, 256, bits, seed), seed),
      dict(bits=bits, group_size=256, stochastic=True),
    )

  return Case(
    f"b{bits}-f32-at-code-boundaries",
    make,
    {"pallas_triton": dict(rows=rows), "jax_triton": dict(rows=rows)},
  )


def nonfinite_case(bits, dtype, rows):
  """Groups of 16 holding every pattern of `nonfinite_groups`."""

  def make():
    return (
      (nonfinite_groups(dtype, seed=bits), jnp.uint32(0xF1A6 + bits)),
      dict(bits=bits, group_size=16, stochastic=True),
    )

  return Case(
    f"b{bits}-{jnp.dtype(dtype).name}-nonfinite-kinds",
    make,
    {"pallas_triton": dict(rows=rows), "jax_triton": dict(rows=rows)},
  )


def dequantize_cases():
  def case(
    name, shape, dtype, bits, group_size, out, rows, scale=3.0, rows_view=False, quick=False
  ):
    def make():
      x = activation(shape, dtype, seed=10 + bits, scale=scale)
      if rows_view:  # samples of < 8 values: one row, the shape kept as `view_shape`
        packed = jitted(
          quantize_rows_reference, x, jnp.uint32(bits), bits=bits, group_size=group_size
        )
      else:
        packed = jitted(
          quantize_reference,
          x,
          jnp.uint32(bits),
          bits=bits,
          group_size=effective_group_size(int(np.prod(shape[1:])), group_size),
        )
      packed = dataclasses.replace(packed, data=random_bytes(packed.data.shape, seed=bits))
      return (packed,), dict(dtype=out)

    return Case(
      name, make, {"pallas_triton": dict(rows=rows), "jax_triton": dict(rows=rows)}, quick
    )

  return [
    case("b1-f32", (4, 1000), F32, 1, 256, None, rows=4),
    case("b2-bf16-to-f32-partial-group", (3, 7, 13), BF16, 2, 64, F32, rows=2),
    case("b4-f32-to-f16-clamped", (2, 300), F32, 4, 256, F16, rows=1, scale=1e6, quick=True),
    case("b8-f16-view-shape", (3, 2, 3), F16, 8, 256, None, rows=1, rows_view=True),
    case("b3-f32", (4, 1000), F32, 3, 256, None, rows=4),
    case("b5-bf16-to-f32-partial-group", (3, 7, 13), BF16, 5, 64, F32, rows=2),
    case("b7-f32-to-f16-clamped", (2, 300), F32, 7, 256, F16, rows=1, scale=1e6),
    case("b6-f16-view-shape", (3, 2, 3), F16, 6, 256, None, rows=1, rows_view=True),
    case("b16-f32-to-bf16", (2, 300), F32, 16, 64, BF16, rows=2),
  ] + [
    nonfinite_dequantize_case(bits, out)
    for bits, out in ((1, None), (2, F16), (4, None), (8, BF16), (3, None), (7, F16), (16, BF16))
  ]


def nonfinite_dequantize_case(bits, out):
  """Random codes in the flagged groups of `nonfinite_groups` (every code, the top one included)."""

  def make():
    packed = jitted(
      quantize_reference,
      nonfinite_groups(F32, seed=20 + bits),
      jnp.uint32(bits),
      bits=bits,
      group_size=16,
    )
    packed = dataclasses.replace(packed, data=random_bytes(packed.data.shape, seed=bits))
    return (packed,), dict(dtype=out)

  return Case(
    f"b{bits}-nonfinite-kinds", make, {"pallas_triton": dict(rows=2), "jax_triton": dict(rows=2)}
  )


def relu_mask_cases():
  def case(name, shape, dtype, slope, tile, quick=False):
    return Case(
      name,
      lambda: ((activation(shape, dtype, seed=len(shape)),), dict(negative_slope=slope)),
      {"pallas_triton": dict(tile=tile), "jax_triton": dict(tile=tile)},
      quick,
    )

  return [
    case("f32", (3, 50), F32, None, 4, quick=True),
    case("bf16-3d", (7, 13, 5), BF16, None, 16),
    case("f16-leaky", (1000,), F16, 0.1, 32),
    case("f32-leaky", (64, 33), F32, 0.01, 64),
    case("f32-below-one-byte", (5,), F32, None, 1),  # fewer values than mask planes
  ]


def _per_sample_args(shape, dtype, widths, per_value, group_size, seed):
  d = int(np.prod(shape[1:]))
  g = effective_group_size(d, group_size)
  dp = -(-d // g) * g
  bits = jnp.asarray(widths, jnp.int32)
  capacity = int(per_value * shape[0] * dp)
  assert sum(widths) * dp // 8 <= capacity
  x = (
    nonfinite_groups(dtype, seed=len(widths))
    if group_size == 16
    else activation(shape, dtype, seed=len(widths))
  )
  return x, bits, dict(capacity_bytes=capacity, group_size=g, seed=seed)


# (name, shape, dtype, widths, capacity in bytes per value, group size, stochastic, rows);
# the first is the quick one
PER_SAMPLE = [
  ("widths-1248-f32-partial-group", (4, 300), F32, [1, 2, 4, 8], 1.0, 256, True, 2),
  ("bf16-zero-only-programs", (5, 7, 13), BF16, [8, 1, 2, 4, 1], 64.0, 256, True, 1),
  ("f16-nearest-group112", (6, 784), F16, [2, 8, 1, 4, 4, 1], 0.5, 256, False, 4),
  ("f32-below-one-group", (3, 20), F32, [8, 2, 1], 1.0, 256, True, 1),
  ("f32-nonfinite-kinds", (4, 48), F32, [1, 2, 4, 8], 1.0, 16, True, 2),
  ("bf16-bit-planes-35671", (5, 300), BF16, [3, 5, 6, 7, 1], 1.0, 256, True, 2),
  ("f32-nearest-every-width", (8, 40), F32, [7, 1, 2, 3, 4, 5, 6, 8], 1.0, 256, False, 1),
]


PER_SAMPLE_OUTS = [None, F32, F16, None, F16, F32, None]
"""The dequantizers' output dtype per PER_SAMPLE case (None: the input's)."""


def quantize_per_sample_cases():
  def case(name, shape, dtype, widths, per_value, group_size, stochastic, rows):
    def make():
      seed = jnp.uint32(1234) if stochastic else None
      x, bits, kwargs = _per_sample_args(shape, dtype, widths, per_value, group_size, seed)
      return (x, bits), kwargs

    options = {"pallas_triton": dict(rows=rows), "jax_triton": dict(rows=rows)}
    return Case(name, make, options, quick=name == PER_SAMPLE[0][0])

  return [case(*c) for c in PER_SAMPLE]


def dequantize_per_sample_cases():
  def case(name, shape, dtype, widths, per_value, group_size, stochastic, rows, out):
    def make():
      x, bits, kwargs = _per_sample_args(
        shape, dtype, widths, per_value, group_size, jnp.uint32(77)
      )
      packed = jitted(quantize_per_sample_reference, x, bits, **kwargs)
      packed = dataclasses.replace(packed, data=random_bytes(packed.data.shape, seed=len(widths)))
      return (packed,), dict(dtype=out)

    options = {"pallas_triton": dict(rows=rows), "jax_triton": dict(rows=rows)}
    return Case(name, make, options, quick=name == PER_SAMPLE[0][0])

  return [case(*c, out=o) for c, o in zip(PER_SAMPLE, PER_SAMPLE_OUTS)]


def division_compress_cases():
  def case(name, shape, dtype, lfc_dtype, block, bits, group_size, rows, quick=False):
    return Case(
      name,
      lambda: (
        (activation(shape, dtype, seed=bits), jnp.uint32(0xD1 + bits)),
        dict(block=block, bits=bits, group_size=group_size, lfc_dtype=lfc_dtype),
      ),
      {"pallas_triton": dict(rows=rows), "jax_triton": dict(rows=rows, tile=32)},
      quick,
    )

  return [
    case("b2-f32-one-pass", (2, 8, 8, 16), F32, BF16, 4, 2, 256, None, quick=True),
    case("b1-f16-groups-straddle-bands", (2, 10, 10, 8), F16, BF16, 4, 1, 256, 2),
    case("b8-bf16-below-one-group", (4, 3, 3, 8), BF16, BF16, 4, 8, 256, 2),
    case("b4-f32-rank3-two-kernels", (3, 13, 24), F32, F16, 4, 4, 256, 2),
    case("b8-f32-rank5-one-pass", (1, 9, 4, 10, 8), F32, BF16, 4, 8, 64, None),
    case("b3-f32-one-pass", (2, 8, 8, 16), F32, BF16, 4, 3, 256, None),
    case("b16-f32-rank3-two-kernels", (3, 13, 24), F32, F16, 4, 16, 256, 2),
  ]


# (name, input shape or "nonfinite" (`nonfinite_groups`), dtype, format, block size, scale,
# stochastic, blocks a program); the first is the quick one
FLOAT8 = [
  ("e4m3-f32-pow2-nearest", (4, 1000), F32, "e4m3", 32, "pow2", False, 2),
  ("e5m2-bf16-pow2-stochastic", (3, 7, 13), BF16, "e5m2", 32, "pow2", True, 1),
  ("e4m3-f16-float-stochastic", (5, 20), F16, "e4m3", 16, "float", True, 2),
  ("e5m2-f32-float-block24", (2, 300), F32, "e5m2", 24, "float", False, 4),
  ("e4m3-f32-1d-stochastic", (100,), F32, "e4m3", 32, "pow2", True, 1),
  ("e4m3-f32-nonfinite-kinds", "nonfinite", F32, "e4m3", 16, "pow2", True, 2),
  ("e5m2-bf16-nonfinite-kinds", "nonfinite", BF16, "e5m2", 16, "float", False, 2),
]


def float8_compress_cases():
  def case(i, name, shape, dtype, fmt, block, scale, stochastic, rows):
    def make():
      x = nonfinite_groups(dtype, i) if shape == "nonfinite" else activation(shape, dtype, i)
      seed = jnp.uint32(0xF8 + i) if stochastic else None
      return (x, seed), dict(format=fmt, block_size=block, scale=scale, stochastic=stochastic)

    options = {"pallas_triton": dict(rows=rows), "jax_triton": dict(rows=rows)}
    return Case(name, make, options, quick=i == 0)

  return [case(i, *c) for i, c in enumerate(FLOAT8)]


CASES: dict[str, Callable[[], list[Case]]] = {
  "quantize": quantize_cases,
  "dequantize": dequantize_cases,
  "relu_mask": relu_mask_cases,
  "quantize_per_sample": quantize_per_sample_cases,
  "dequantize_per_sample": dequantize_per_sample_cases,
  "division_compress": division_compress_cases,
  "float8_compress": float8_compress_cases,
}
"""A case generator per op: a few representative argument sets (bits 1/2/4/8,
float32/bfloat16/float16, a partial last group, a sample smaller than one
group, non-finite values where the op takes them; fixed seeds)."""


# ----------------------------------------------------------------------------- parameters


def _params(implementations: Callable[[str], list[str]], per_case: bool):
  """pytest parameters (op, implementation, case) from the registry; an op
  without a case generator gets one parameter with case None, which fails."""
  params = []
  for op in REGISTRY.ops:
    for name in implementations(op):
      if op not in CASES:
        params.append(pytest.param(op, name, None, id=f"{op}-{name}-NO-CASE-GENERATOR"))
      elif per_case:
        params += [
          pytest.param(
            op, name, c, id=f"{op}-{name}-{c.name}", marks=() if c.quick else pytest.mark.slow
          )
          for c in CASES[op]()
        ]
      else:
        params.append(pytest.param(op, name, _quick(op), id=f"{op}-{name}"))
  return params


def _quick(op) -> Case:
  cases = CASES[op]()
  return next((c for c in cases if c.quick), cases[0])


def _kernels(op):
  return sorted(name for name in REGISTRY.available(op) if name != REFERENCE)


def _every(op):
  return sorted(REGISTRY.available(op))


def _require(op, case):
  if case is None:
    pytest.fail(
      f"op {op!r} is registered in jact.kernels.REGISTRY but has no case generator: "
      f"add one to CASES in tests/kernels/test_kernel_contract.py",
      pytrace=False,
    )


_REFERENCES: dict[tuple[str, str], tuple] = {}


def _reference(op: str, case: Case):
  """(array arguments, keyword arguments, the reference's outputs), made once a case."""
  key = (op, case.name)
  if key not in _REFERENCES:
    args, kwargs = case.make()
    fn = REGISTRY.available(op)[REFERENCE].fn
    _REFERENCES[key] = args, kwargs, jax.jit(functools.partial(fn, **kwargs))(*args)
  return _REFERENCES[key]


def _kernel(op, name, case, **extra):
  """The implementation's callable on the case's array arguments."""
  impl = REGISTRY.available(op)[name]
  _, kwargs, _ = _reference(op, case)
  return functools.partial(impl.fn, **kwargs, **case.options.get(name, {}), **extra)


# ----------------------------------------------------------------------------- the contract


def test_every_case_generator_names_a_registered_op_and_one_quick_case():
  stale = sorted(set(CASES) - set(REGISTRY.ops))
  assert not stale, f"case generators for ops not in jact.kernels.REGISTRY: {stale}; remove them"
  for op, generator in CASES.items():
    cases = generator()
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), f"{op}: case names repeat: {names}"
    quick = [c.name for c in cases if c.quick]
    assert len(quick) == 1, f"{op}: mark exactly one case quick (run by default), not {quick}"


@pytest.mark.parametrize("op,name,case", _params(_kernels, per_case=False))
def test_bit_exact_with_the_reference(op, name, case):
  """The kernel as users call it, on each op's quick case. Every case (this
  one too) is compared bit for bit again by `test_writes_every_output_element`,
  with outputs pre-filled: running each slow case twice more here would only
  add interpret-mode compilations."""
  _require(op, case)
  args, _, want = _reference(op, case)
  assert_same_tree(jax.jit(_kernel(op, name, case))(*args), want, f"{op}/{name}/{case.name}")


FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""XLA:CPU options for the pre-filled kernel runs: unoptimized, an interpret-mode
kernel compiles a third to a half faster. The reference stays compiled as users
compile it, so these runs also check that the kernel's bits do not depend on the
optimization level (the kernels compute in float32 and integers, converting
low-precision values once; a level that changed that arithmetic, as XLA:CPU's
level 0 does for chains of float16 operations, would show here as a mismatch).
`test_bit_exact_with_the_reference` runs the kernels as users do."""

FILLS = [(0xA5, 1.5), (0x5A, -3.25)]
"""Two garbage fills (integer outputs, float outputs) with different bits in
every dtype: an element a kernel leaves unwritten keeps a fill, which cannot
equal the reference's value under both."""


@pytest.mark.parametrize("op,name,case", _params(_kernels, per_case=True))
def test_writes_every_output_element(op, name, case, monkeypatch):
  _require(op, case)
  args, _, want = _reference(op, case)
  fills = {}
  poisoned = Poisoned(lambda: (fills["int"], fills["float"]))
  monkeypatch.setattr(T, "call", poisoned)
  poisoned_triton = PoisonedTriton(_jax_triton.call, lambda: (fills["int"], fills["float"]))
  monkeypatch.setattr(_jax_triton, "call", poisoned_triton)
  fn = _kernel(op, name, case)

  @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  def run(args, int_fill, float_fill):
    fills.update(int=int_fill, float=float_fill)
    return fn(*args)

  for int_fill, float_fill in FILLS:  # one trace: the fills are arguments
    got = run(args, jnp.int32(int_fill), jnp.float32(float_fill))
    assert poisoned.calls or poisoned_triton.calls, (
      f"{op}/{name} made no Pallas call through jact.kernels._triton.call nor Triton call "
      f"through jact.kernels._jax_triton.call, so its outputs could not be pre-filled"
    )
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
      a, b = np.asarray(a), np.asarray(b)
      stale = (bits_of(a) != bits_of(b)) & (
        bits_of(a)
        == bits_of(
          jnp.full((), int_fill if np.issubdtype(a.dtype, np.integer) else float_fill, a.dtype)
        )
      )
      assert not stale.any(), (
        f"{op}/{name}/{case.name}: output leaf {i} ({a.dtype}{list(a.shape)}) keeps the "
        f"garbage it started with at {int(stale.sum())} elements, first at "
        f"{tuple(int(k) for k in np.argwhere(stale)[0])}: the kernel does not write them"
      )
    assert_same_tree(
      got,
      want,
      f"{op}/{name}/{case.name} with outputs pre-filled with {int_fill:#x} / {float_fill}",
    )


def _jax_triton_ptx():
  """op -> its jax-triton kernel's `compile_for_cuda`, from each module's `PTX`."""
  import importlib

  from jact.kernels import JAX_TRITON_KERNELS

  ptx = {}
  for _, module, _ in JAX_TRITON_KERNELS:
    ptx.update(importlib.import_module(module).PTX)
  return ptx


def _lowers_jax_triton_kernel(op, case):
  """A jax-triton kernel's Triton source compiled for sm_90 here (a CPU jaxlib
  cannot load jax-triton, whose lowering builds a CUDA jaxlib object): PTX with
  no fused multiply-add and no approximate division, which would break
  bit-exactness on the device."""
  compile_for_cuda = _jax_triton_ptx().get(op)
  if compile_for_cuda is None:
    pytest.fail(f"{op}/jax_triton: add its compile_for_cuda to its module's PTX", pytrace=False)
  args, kwargs, _ = _reference(op, case)
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  facts = ptx_facts(compile_for_cuda(*shapes, **kwargs, **case.options.get("jax_triton", {})))
  assert facts["loads"] and facts["stores"], facts
  assert facts["fused_multiply_adds"] == 0 and facts["approximate_divisions"] == 0, facts


@pytest.mark.parametrize("op,name,case", _params(_every, per_case=False))
def test_lowers_for_cuda(op, name, case):
  """Lowered for CUDA from this host: Triton calls only (at least one for a
  kernel that lowers for cuda, none for one that lowers everywhere, like the
  reference), with the reference's output structure, shapes and dtypes."""
  _require(op, case)
  if name == "jax_triton":
    return _lowers_jax_triton_kernel(op, case)
  impl = REGISTRY.available(op)[name]
  if impl.lowering_platforms and "cuda" not in impl.lowering_platforms:
    pytest.fail(
      f"{op}/{name} lowers only for {impl.lowering_platforms}: extend this test to "
      f"check its lowering there",
      pytrace=False,
    )
  args, kwargs, _ = _reference(op, case)
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
  extra = dict(interpret=False) if impl.lowering_platforms else {}
  reference = functools.partial(REGISTRY.available(op)[REFERENCE].fn, **kwargs)
  names = cuda_kernels(_kernel(op, name, case, **extra), reference, *shapes)
  if impl.lowering_platforms:
    assert names and all(n.startswith("jact_") for n in names), names
  else:
    assert names == [], names
