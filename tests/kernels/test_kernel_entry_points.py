"""One validated entry point per kernel op (`jact.kernels.<op>.api`), and no call site
that picks a kernel by op name: each function validates its arguments and runs the
implementation the table picks (`implementation=`, `jact.kernels.use`, the backend)."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest

from jact import kernels
from jact.kernels._division.api import division_compress
from jact.kernels._division.reference import division_compress_reference
from jact.kernels._float8.api import float8_compress
from jact.kernels._per_sample.api import dequantize_per_sample, quantize_per_sample
from jact.kernels._quantize.api import dequantize, quantize
from jact.kernels._relu_mask.api import relu_mask
from jact.kernels._relu_mask.reference import relu_mask_reference
from kernel_checks import assert_same_bits, assert_same_packed

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "jact"

ENTRY_POINTS = {
  "quantize": quantize,
  "dequantize": dequantize,
  "relu_mask": relu_mask,
  "quantize_per_sample": quantize_per_sample,
  "dequantize_per_sample": dequantize_per_sample,
  "division_compress": division_compress,
  "float8_compress": float8_compress,
}


def _x(shape=(2, 8, 8, 16), seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def test_every_registered_op_has_one_entry_point_in_its_package():
  assert set(ENTRY_POINTS) == set(kernels.REGISTRY.ops)
  for op, fn in ENTRY_POINTS.items():
    package = fn.__module__.split(".")
    assert package[:2] == ["jact", "kernels"] and package[-1] == "api", (op, fn.__module__)
    reference = kernels.available(op)["xla"].fn
    assert reference.__module__ == ".".join(package[:-1] + ["reference"]), (
      op,
      reference.__module__,
    )


def test_no_call_site_picks_a_kernel_by_op_name():
  """`dispatch` / `select` by op name only inside the entry points (`<op>/api.py`) and
  the registry itself; everything else calls an entry point."""
  allowed = {PACKAGE / "kernels" / "registry.py", PACKAGE / "kernels" / "__init__.py"}
  wrong = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if path in allowed or (path.parent.parent == PACKAGE / "kernels" and path.name == "api.py"):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, ast.Call):
        continue
      f = node.func
      if isinstance(f, ast.Name):
        picks = f.id == "dispatch"
      else:  # kernels.dispatch(...), REGISTRY.select(...); not jnp.select
        owner = (
          f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        )
        picks = isinstance(f, ast.Attribute) and (
          f.attr == "dispatch" or (f.attr == "select" and owner in ("kernels", "REGISTRY"))
        )
      if picks:
        wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
  assert not wrong, "call the op's entry point (jact.kernels.<op>.api) instead:\n" + "\n".join(
    wrong
  )


@pytest.mark.parametrize("slope", [None, 0.1])
def test_relu_mask_entry_point_runs_the_reference_on_cpu(slope):
  x = _x((3, 20)).at[0, 0].set(0.0)
  y, mask = jax.jit(lambda x: relu_mask(x, negative_slope=slope))(x)
  y_ref, mask_ref = relu_mask_reference(x, negative_slope=slope)
  assert_same_bits(y, y_ref)
  assert_same_bits(mask.data, mask_ref.data)
  assert mask.shape == mask_ref.shape == (3, 20)


@pytest.mark.slow  # runs the Pallas kernel in interpret mode (3-4 s of one core)
def test_entry_points_follow_the_kernel_chosen_by_use():
  x = _x((2, 16))
  with kernels.use(relu_mask="pallas_triton"):  # interpret mode on CPU, same bits
    y, mask = jax.jit(relu_mask)(x)
  y_ref, mask_ref = relu_mask_reference(x)
  assert_same_bits(y, y_ref)
  assert_same_bits(mask.data, mask_ref.data)
  with pytest.raises(ValueError, match="unknown implementation 'nope' for 'relu_mask'"):
    relu_mask(x, implementation="nope")
  with pytest.raises(ValueError, match="unknown implementation 'nope' for 'division_compress'"):
    division_compress(_x(), jnp.uint32(1), block=4, bits=2, implementation="nope")


def test_division_entry_point_matches_the_reference():
  x = _x((1, 5, 6, 8))  # partial blocks on both axes
  args = dict(block=4, bits=2, group_size=32, lfc_dtype=jnp.float16)
  both = lambda x, s: (division_compress(x, s, **args), division_compress_reference(x, s, **args))
  (lfc, hfc), (ref_lfc, ref_hfc) = jax.jit(both)(x, jnp.uint32(7))  # one program: one compile
  assert_same_bits(lfc, ref_lfc)
  assert_same_packed(hfc, ref_hfc)


@pytest.mark.parametrize(
  "call, error, message",
  [
    (lambda: relu_mask(jnp.arange(4)), TypeError, "float32, bfloat16 or float16 array, got int32"),
    (lambda: relu_mask(_x((2, 8)), negative_slope="0.1"), TypeError, "negative_slope .* got '0.1'"),
    (lambda: relu_mask(_x((2, 8)), negative_slope=True), TypeError, "negative_slope .* got True"),
    (
      lambda: division_compress(_x((2, 16)), jnp.uint32(1), block=4, bits=2),
      ValueError,
      r"rank 3 to 5 .* got shape \(2, 16\)",
    ),
    (
      lambda: division_compress(_x(), jnp.uint32(1), block=0, bits=2),
      ValueError,
      "block must be a positive int .* got 0",
    ),
    (
      lambda: division_compress(_x(), jnp.uint32(1), block=4, bits=9),
      ValueError,
      r"bits must be one of \(1, 2, 3, 4, 5, 6, 7, 8, 16\), got 9",
    ),
    (
      lambda: division_compress(_x(), jnp.uint32(1), block=4, bits=2, group_size=12),
      ValueError,
      "group_size must be a positive multiple of 8",
    ),
    (
      lambda: division_compress(_x(), jnp.uint32(1), block=4, bits=2, lfc_dtype=jnp.int8),
      ValueError,
      "lfc_dtype must be float32, bfloat16 or float16",
    ),
    (
      lambda: division_compress(_x(), None, block=4, bits=2),
      ValueError,
      "needs a uint32 seed.*seed_from_key",
    ),
    (
      lambda: division_compress(_x().astype(jnp.int32), jnp.uint32(1), block=4, bits=2),
      TypeError,
      "float32, bfloat16 or float16 array, got int32",
    ),
    (
      lambda: dequantize_per_sample(_x((2, 8))),
      TypeError,
      "takes the PackedPerSample that quantize_per_sample returns, got ArrayImpl",
    ),
    (lambda: float8_compress(_x(), None, format="e3m4"), ValueError, "format must be one of"),
    (lambda: float8_compress(_x(), None, scale="e8m0"), ValueError, "scale one of"),
    (lambda: float8_compress(_x(), None, block_size=0), ValueError, "block_size must be"),
    (lambda: float8_compress(_x(), None, stochastic=True), ValueError, "needs a uint32 seed"),
    (
      lambda: float8_compress(_x().astype(jnp.int32), None),
      TypeError,
      "float32, bfloat16 or float16 array, got int32",
    ),
  ],
)
def test_entry_points_reject_bad_arguments_naming_them(call, error, message):
  with pytest.raises(error, match=message):
    call()
