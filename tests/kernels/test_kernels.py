"""The kernel registry and the Pallas per-group and ReLU-mask kernels.

The Pallas kernels run in interpret mode on CPU (slow: small inputs, few grid
steps) and must be bit-exact with the XLA reference for the same seed; their
GPU lowering is checked from CPU (Triton IR is generated, nothing runs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact import kernels
from jact import _compat
from jact.compressors import PerGroup
from jact.kernels._quantize import pallas_triton as pergroup
from jact.kernels._relu_mask import pallas_triton as relu
from jact.kernels._relu_mask.reference import relu_mask_reference
from jact.ops._linear import dense
from jact._core.quantize import effective_group_size
from jact.kernels._quantize.reference import dequantize_reference, quantize_reference
from kernel_checks import (
  assert_lowers_for_cuda,
  assert_same_bits,
  assert_same_packed,
  poisoned_call,
)


def _activation(shape, dtype, seed=0, specials=True):
  x = 3 * jax.random.normal(jax.random.key(seed), shape)
  if specials and x.size >= 8:
    flat = x.reshape(-1)
    flat = flat.at[jnp.array([1, 5, 7])].set(jnp.array([jnp.inf, jnp.nan, -jnp.inf]))
    flat = flat.at[jnp.array([2, 3])].set(jnp.array([0.0, -0.0]))
    x = flat.reshape(shape)
  return x.astype(dtype)


FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""XLA:CPU options for `jitted` (kernels and references compiled alike):
unoptimized, the interpret-mode kernels compile a third faster. (They compute in
float32 and integers; tests/kernels/test_kernel_contract.py checks their unoptimized bits
against the reference compiled as users compile it.)"""


def jitted(fn, *args, **kwargs):
  """`fn(*args, **kwargs)` compiled as one program (static keyword arguments):
  run op by op, the references dispatch many small computations, and the
  interpreted kernels compile faster as one module."""
  return jax.jit(functools.partial(fn, **kwargs), compiler_options=FAST_COMPILE)(*args)


# ----------------------------------------------------------------------------- registry


def _gpu_kernel(op: str) -> str:
  """The kernel a GPU runs for `op`: jax-triton's where it has one and jax-triton is
  installed (above Pallas' deprecated Triton backend), else Pallas'."""
  jax_triton_ops = {o for o, _, _ in kernels.JAX_TRITON_KERNELS}
  return "jax_triton" if op in jax_triton_ops and _compat.has_jax_triton() else "pallas_triton"


def _launch_name(op: str) -> str:
  """The launch name of the kernel `_gpu_kernel(op)` stages."""
  return {"quantize": "jact_quantize", "relu_mask": "jact_relu_mask"}[op] + (
    "_jax_triton" if _gpu_kernel(op) == "jax_triton" else ""
  )


def test_reference_on_cpu_pallas_on_gpu():
  for op in (
    "quantize",
    "dequantize",
    "relu_mask",
    "quantize_per_sample",
    "dequantize_per_sample",
    "division_compress",
    "float8_compress",
  ):
    assert kernels.select(op, platform="cpu").name == "xla"
    assert kernels.select(op, platform="gpu").name == _gpu_kernel(op)
  assert kernels.select("quantize", platform="cpu") is kernels.select("quantize")  # CI is CPU


def test_empty_and_oversized_inputs_use_the_reference():
  assert kernels.select("quantize", platform="gpu", size=0).name == "xla"
  assert kernels.select("quantize", platform="gpu", size=2**31).name == "xla"
  assert kernels.select("quantize", platform="gpu", size=2**20).name == _gpu_kernel("quantize")


def test_registered_kernel_wins_by_priority_on_its_platform_only():
  impl = kernels.Implementation(
    "quantize", "test_fast", quantize_reference, platforms=("tpu",), priority=20
  )
  table = kernels.REGISTRY.extended(impl)
  assert table.select("quantize", platform="tpu").name == "test_fast"
  assert table.select("quantize", platform="cpu").name == "xla"
  with table.use(quantize="xla"):
    assert table.select("quantize", platform="tpu").name == "xla"
  assert table.select("quantize", implementation="xla", platform="tpu").name == "xla"
  assert "test_fast" not in kernels.available("quantize")  # the shared table is unchanged
  with pytest.raises(TypeError):
    kernels.available("quantize")["test_fast"] = impl


def test_unknown_names_raise_with_the_choices():
  with pytest.raises(ValueError, match="available: \\['jax_triton', 'pallas_triton', 'xla'\\]"):
    kernels.select("quantize", implementation="cuda_magic")
  with pytest.raises(KeyError, match="known ops"):
    kernels.available("no_such_op")
  with pytest.raises(ValueError, match="available"):
    with kernels.use(quantize="nope"):
      pass
  with pytest.raises(ValueError, match="use one of \\['jax_triton', 'pallas_triton', 'xla'\\]"):
    PerGroup(2, implementation="triton")
  with pytest.raises(ValueError, match="available"):
    jact.quantize(jnp.ones((2, 8)), jax.random.key(0), bits=2, implementation="cuda")


# ----------------------------------------------------------------------------- per-group kernels


# 1 bit on (4, 1000) float32 (groups of 200, not a power of two) is
# tests/kernels/test_kernel_contract.py's quantize case "b1-f32-group200" and dequantize
# case "b1-f32" (same shape, dtype, width, group size and rows; there with the
# outputs pre-filled), so it is not repeated here (interpret mode compiles
# each kernel for seconds).
@pytest.mark.parametrize(
  "shape,dtype,bits,group_size,stochastic",
  [
    ((3, 7, 13), jnp.bfloat16, 2, 64, True),  # 91 values: a partial, NaN-padded group
    ((5, 784), jnp.float16, 4, 256, True),  # group 112
    ((2, 1024), jnp.float32, 8, 256, False),  # round to nearest, 4 groups a sample
    ((6, 520), jnp.float32, 4, 128, True),  # 520 = 5 groups of 104
    ((16, 256), jnp.bfloat16, 8, 256, True),
  ],
)
@pytest.mark.slow
def test_quantize_and_dequantize_kernels_are_bit_exact(shape, dtype, bits, group_size, stochastic):
  x = _activation(shape, dtype, seed=bits)
  g = effective_group_size(int(np.prod(shape[1:])), group_size)
  seed = jnp.uint32(0xC0FFEE + bits)
  kernel = jitted(
    pergroup.quantize,
    x,
    seed,
    bits=bits,
    group_size=g,
    stochastic=stochastic,
    interpret=True,
    rows=4,
  )
  reference = jitted(quantize_reference, x, seed, bits=bits, group_size=g, stochastic=stochastic)
  assert_same_packed(kernel, reference)
  for out in (None, jnp.float32) if dtype != jnp.float32 else (None,):  # None: float32 already
    assert_same_bits(
      jitted(pergroup.dequantize, reference, dtype=out, interpret=True, rows=4),
      jitted(dequantize_reference, reference, dtype=out),
    )


@pytest.mark.slow
def test_every_group_and_value_is_written(monkeypatch):
  """Outputs start as garbage: any unwritten or misplaced byte shows as a mismatch."""
  monkeypatch.setattr(pergroup.T, "call", poisoned_call)
  for i, n in enumerate([1, 9]):
    x = _activation((n, 328), jnp.float32, seed=10 + i, specials=False)
    seed = jnp.uint32(i)
    k = jitted(
      pergroup.quantize,
      x,
      seed,
      bits=2,
      group_size=effective_group_size(328, 256),
      interpret=True,
      rows=2,
    )
    assert_same_packed(k, jitted(quantize_reference, x, seed, bits=2, group_size=k.group_size))
    assert_same_bits(
      jitted(pergroup.dequantize, k, interpret=True, rows=2), jitted(dequantize_reference, k)
    )


@pytest.mark.slow
def test_dispatch_through_ops_gives_the_same_gradient_and_reports_the_kernel():
  x = jax.random.normal(jax.random.key(1), (8, 512))
  w = jax.random.normal(jax.random.key(2), (512, 16)) / 20

  def loss(x, w):
    return jnp.sum(jact.ops.relu(dense(x, w, key=jax.random.key(3), bits=2)) ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  reference = grad(x, w)
  with kernels.use(quantize="pallas_triton", dequantize="pallas_triton", relu_mask="pallas_triton"):
    pallas = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    report = jact.residual_report(loss, x, w)
  for a, b in zip(pallas, reference):
    assert_same_bits(a, b)
  assert report.kernels()["dense.lhs"] == "jact_quantize"
  assert report.kernels()["relu.mask"] == "jact_relu_mask"
  assert "jact_quantize" in str(report)
  plain = jact.residual_report(loss, x, w)
  assert set(plain.kernels().values()) == {"xla"}
  assert "kernel" in str(report).splitlines()[0] and "kernel" not in str(plain).splitlines()[0]


def _cuda_text(fn, *args, platforms=("cuda",)):
  return _compat.lower_for_cuda(fn, *args, platforms=platforms).as_text()


@pytest.mark.slow
def test_automatic_gpu_choice_is_staged_by_lowering_platform(monkeypatch):
  """On a GPU machine ops stage the kernel for cuda and the reference for every
  other platform: running on the CPU gives the reference's bits, not a failed
  Triton lowering; lowering for cuda gives the Triton call."""
  monkeypatch.setattr(kernels._registry, "_backend", lambda: "gpu")
  x = jax.random.normal(jax.random.key(1), (8, 512))
  w = jax.random.normal(jax.random.key(2), (512, 16)) / 20

  def make_grad():  # a new function each time: the choice is made when it is traced
    def loss(x, w):
      return jnp.sum(jact.ops.relu(dense(x, w, key=jax.random.key(3), bits=2)) ** 2)

    return jax.grad(loss, argnums=(0, 1))

  grad = make_grad()
  jaxpr = str(jax.make_jaxpr(grad)(x, w))
  assert "platform_index" in jaxpr and ("pallas_call" in jaxpr or "triton_kernel_call" in jaxpr)
  staged = jax.jit(grad)(x, w)  # the CPU runs the reference branch
  monkeypatch.setattr(kernels._registry, "_backend", lambda: "cpu")
  reference_grad = make_grad()
  assert "platform_index" not in str(jax.make_jaxpr(reference_grad)(x, w))
  for a, b in zip(staged, jax.jit(reference_grad)(x, w)):
    assert_same_bits(a, b)
  monkeypatch.setattr(kernels._registry, "_backend", lambda: "gpu")
  assert kernels.kernel_launches(_cuda_text(grad, x, w, platforms=("cpu",))) == 0
  assert kernels.kernel_launches(_cuda_text(grad, x, w)) >= 3  # quantize, relu, dequantize


@pytest.mark.slow
def test_staged_arguments_keep_static_values_static(monkeypatch):
  monkeypatch.setattr(kernels._registry, "_backend", lambda: "gpu")
  x = jax.random.normal(jax.random.key(5), (4, 300)).astype(jnp.bfloat16)
  quantize = kernels.dispatch("quantize", size=x.size)
  assert quantize is not kernels.available("quantize")["pallas_triton"].fn
  for seed, stochastic in [(jnp.uint32(7), True), (None, False)]:
    # Under jit (one compile each, not op by op): a static value the staging
    # turned into a traced one would fail there.
    p = jitted(
      quantize, x, seed, bits=4, group_size=effective_group_size(300, 256), stochastic=stochastic
    )
    r = jitted(
      quantize_reference,
      x,
      seed,
      bits=4,
      group_size=effective_group_size(300, 256),
      stochastic=stochastic,
    )
    assert_same_packed(p, r)
    out = jitted(kernels.dispatch("dequantize", size=p.data.size), p, dtype=jnp.float32)
    assert out.dtype == jnp.float32
    assert_same_bits(out, jitted(dequantize_reference, r, dtype=jnp.float32))
  # a forced choice is never staged
  assert (
    kernels.dispatch("quantize", "pallas_triton")
    is kernels.available("quantize")["pallas_triton"].fn
  )
  with kernels.use(quantize="xla"):
    assert kernels.dispatch("quantize") is kernels.available("quantize")["xla"].fn


def test_report_names_the_kernel_of_the_platform_it_runs_on(monkeypatch):
  monkeypatch.setattr(kernels._registry, "_backend", lambda: "gpu")
  x = jax.random.normal(jax.random.key(1), (8, 512))
  w = jax.random.normal(jax.random.key(2), (512, 16)) / 20

  def loss(x, w):
    return jnp.sum(jact.ops.relu(dense(x, w, key=jax.random.key(3), bits=2)) ** 2)

  on_cpu = jact.residual_report(loss, x, w)
  assert set(on_cpu.kernels().values()) == {"xla"}
  monkeypatch.setattr(jact._report, "_lowering_platform", lambda: "cuda")
  on_cuda = jact.residual_report(loss, x, w)
  assert on_cuda.kernels()["dense.lhs"] == _launch_name("quantize")
  assert on_cuda.kernels()["relu.mask"] == _launch_name("relu_mask")
  assert on_cuda.total_bytes == on_cpu.total_bytes
  assert [r.name for r in on_cuda.residuals] == [r.name for r in on_cpu.residuals]


@pytest.mark.slow
def test_compressor_implementation_field_selects_the_kernel():
  x = jax.random.normal(jax.random.key(4), (4, 256))
  seed = jnp.uint32(9)
  for name in ("xla", "pallas_triton"):
    c = PerGroup(4, implementation=name)
    report = jact.residual_report(
      lambda x: jact.ops.gelu(x, key=jax.random.key(0), compressor=c).sum(), x
    )
    assert set(report.kernels().values()) == {"jact_quantize" if name != "xla" else "xla"}
    assert jact.compressors.from_dict(c.to_dict()) == c
  a = jitted(PerGroup(4, implementation="xla").compress, x, seed)  # one compile each
  b = jitted(PerGroup(4, implementation="pallas_triton").compress, x, seed)
  assert_same_packed(a, b)


# ----------------------------------------------------------------------------- ReLU mask


# The ReLU-mask kernel's bit-exactness, with its outputs pre-filled with
# garbage, is checked by tests/kernels/test_kernel_contract.py on the same five
# (shape, dtype, slope) cases this file ran (float32/bfloat16/float16, leaky
# and not, fewer values than mask planes) and more tile sizes.


# --------------------------------------------------------------------------- GPU lowering from CPU


@pytest.mark.slow
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pergroup_kernels_lower_for_cuda(bits):
  # One Triton call each, with the reference's output shapes and dtypes.
  for dtype, shape, group in [(jnp.float32, (64, 4096), 256), (jnp.bfloat16, (8, 784), 112)]:
    x = jax.ShapeDtypeStruct(shape, dtype)
    seed = jax.ShapeDtypeStruct((), jnp.uint32)
    kw = dict(bits=bits, group_size=group)
    assert_lowers_for_cuda(
      lambda x, s: pergroup.quantize(x, s, **kw, interpret=False),
      lambda x, s: quantize_reference(x, s, **kw),
      x,
      seed,
      kernels=["jact_quantize"],
    )
    assert_lowers_for_cuda(
      lambda x: pergroup.quantize(x, None, **kw, stochastic=False, interpret=False),
      lambda x: quantize_reference(x, None, **kw, stochastic=False),
      x,
      kernels=["jact_quantize"],
    )
    packed = jax.eval_shape(lambda x: quantize_reference(x, jnp.uint32(0), **kw), x)
    for out in (jnp.float32, dtype):
      assert_lowers_for_cuda(
        lambda p: pergroup.dequantize(p, out, interpret=False),
        lambda p: dequantize_reference(p, out),
        packed,
        kernels=["jact_dequantize"],
      )


def test_relu_mask_kernel_lowers_for_cuda():
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    x = jax.ShapeDtypeStruct((32, 56, 56, 64), dtype)
    for slope in (None, 0.2):
      assert_lowers_for_cuda(
        lambda x: relu.relu_mask(x, negative_slope=slope, interpret=False),
        lambda x: relu_mask_reference(x, negative_slope=slope),
        x,
        kernels=["jact_relu_mask"],
      )


@pytest.mark.slow
def test_staging_leaves_no_conditional_and_the_same_compiled_memory(monkeypatch):
  x = jax.random.normal(jax.random.key(1), (64, 1024))
  w = jax.random.normal(jax.random.key(2), (1024, 1024)) / 30

  def compiled():
    def loss(x, w):
      h = x
      for i in range(3):
        h = jact.ops.relu(dense(h, w, key=jax.random.fold_in(jax.random.key(3), i), bits=2))
      return jnp.sum(h**2)

    return jax.jit(jax.grad(loss, argnums=1)).lower(x, w).compile()

  plain = compiled()
  monkeypatch.setattr(kernels._registry, "_backend", lambda: "gpu")
  staged = compiled()
  assert " conditional(" not in staged.as_text() and " case(" not in staged.as_text()
  assert staged.memory_analysis().temp_size_in_bytes == plain.memory_analysis().temp_size_in_bytes


def test_the_jax_triton_kernel_is_chosen_by_the_registry_setting(monkeypatch):
  """`use(quantize="jax_triton")` routes jact's quantizer (and a layer's
  compressed residual) to the Triton-language kernel (Triton's interpreter off
  GPU), with the reference's bits."""
  from jact.kernels import _jax_triton

  launches = []
  launch = _jax_triton.call
  monkeypatch.setattr(
    _jax_triton, "call", lambda *a, **k: launches.append(k["name"]) or launch(*a, **k)
  )
  x = jax.random.normal(jax.random.key(3), (4, 300))
  w = jax.random.normal(jax.random.key(4), (300, 8)) / 20
  key = jax.random.key(5)
  loss = lambda x, w: jnp.sum(dense(x, w, key=key, bits=2) ** 2)
  with kernels.use(quantize="jax_triton"):
    assert kernels.select("quantize").name == "jax_triton"
    chosen = jact.quantize(x, key, bits=2, group_size=64)
    grads = jax.jit(jax.grad(loss, argnums=1))(x, w)
  assert launches == ["jact_quantize_jax_triton"] * 2, launches  # the quantizer, then the layer
  assert_same_packed(
    chosen, jitted(jact.quantize, x, key, bits=2, group_size=64, implementation="xla")
  )
  assert_same_bits(grads, jax.jit(jax.grad(loss, argnums=1))(x, w))


# ----------------------------------------------------------------- jax-triton shape classes


def _jax_triton_constants():
  """op -> a function of an input shape giving (runtime sizes, constexprs) of its
  jax-triton kernel: 4 bits, groups of 256, float32 (dequantize: to bfloat16)."""
  from jact.kernels._quantize import jax_triton as quantize
  from jact.kernels._relu_mask import jax_triton as relu_mask

  def dequantize(shape):
    packed = jax.eval_shape(
      functools.partial(quantize_reference, bits=4, group_size=256),
      jax.ShapeDtypeStruct(shape, jnp.float32),
      jax.ShapeDtypeStruct((), jnp.uint32),
    )
    return quantize.dequantize_constants(packed, jnp.bfloat16)[1:]

  return {
    "quantize": lambda shape: quantize.kernel_constants(
      shape, jnp.float32, bits=4, group_size=256, stochastic=True
    )[1:],
    "dequantize": dequantize,
    "relu_mask": lambda shape: relu_mask.kernel_constants(shape, jnp.float32)[1:],
  }


@pytest.mark.parametrize("op", ["quantize", "dequantize", "relu_mask"])
def test_jax_triton_sizes_are_runtime_arguments(op):
  """Inputs that differ only in their number of rows (and groups) give the kernel
  the same constexprs -- one Triton compile -- and their sizes at run time."""
  constants = _jax_triton_constants()[op]
  (sizes_a, a), (sizes_b, b) = constants((4, 512)), constants((6, 512))
  assert a == b, f"{op}: constexprs differ between call sites: {a} vs {b}"
  assert sizes_a != sizes_b, (sizes_a, sizes_b)


def test_call_sites_of_one_shape_class_share_one_jax_triton_compile():
  """A program lowered for cuda, with the quantize / dequantize / ReLU mask kernels
  of three tensors of different numbers of rows and groups (same width, group size,
  dtype): jax-triton compiles each kernel once -- every launch of an op carries the
  same PTX -- where per-call-site sizes as constexprs would compile it per tensor."""
  if not _compat.has_jax_triton():
    pytest.fail("jax-triton is not installed: pip install -e '.[test]'", pytrace=False)
  from jact.kernels import _jax_triton
  from jact.kernels._quantize import jax_triton as quantize
  from jact.kernels._relu_mask import jax_triton as relu_mask

  def program(xs, seed):
    out = []
    for x in xs:
      packed = quantize.quantize(x, seed, bits=4, group_size=256, interpret=False)
      y, mask = relu_mask.relu_mask(x, interpret=False)
      out.append((quantize.dequantize(packed, interpret=False), y, mask.data))
    return out

  xs = [jnp.zeros(shape) for shape in ((4, 512), (6, 512), (3, 768))]
  lowered = _compat.lower_for_cuda(program, xs, jnp.uint32(1))
  ptx = {}
  for name, code in _jax_triton.lowered_kernels(lowered.as_text()):
    ptx.setdefault(name, []).append(code)
  assert sorted(ptx) == [
    "jact_dequantize_jax_triton",
    "jact_quantize_jax_triton",
    "jact_relu_mask_jax_triton",
  ], sorted(ptx)
  for name, codes in ptx.items():
    assert len(codes) == 3 and all(codes), (name, len(codes))
    if name == "jact_relu_mask_jax_triton":
      codes = codes[:2]  # rows of 512 and of 768 values: mask tiles of 64 and 128 bytes
    assert len(set(codes)) == 1, f"{name}: {len(set(codes))} distinct compiles for one class"
