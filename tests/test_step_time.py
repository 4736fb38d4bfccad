"""A predicted step time from XLA:GPU's scheduled HLO (`jact._step_time`).

The parsing and the roofline are checked on hand-written HLO (no plugin); the
rest compiles small programs for an H200 on this CPU machine (the CUDA PJRT
plugin of the installed jax; skipped with the install command without it).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import jax
import jax.numpy as jnp
import pytest

import jact
from jact import _gpu_target
from jact import _step_time as st

needs_plugin = pytest.mark.skipif(
  importlib.util.find_spec("jax_plugins.xla_cuda12") is None
  and importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
  reason=f"no CUDA PJRT plugin to compile for a GPU: {_gpu_target.install_hint()}",
)

H200 = _gpu_target.gpu_target("h200")
CAL = st.Calibration(
  matmul_efficiency=0.5, conv_efficiency=0.4, bandwidth_efficiency=0.8, launch_overhead_s=4e-6
)

# ENTRY: a loop fusion, a cuBLAS gemm (with its workspace), a copy, and an 8-trip while whose
# body holds one fusion and whose condition one; parameters, constants, tuples,
# get-tuple-elements and bitcasts launch nothing.
HAND = """HloModule hand

%fused_tanh (param_0: f32[256,512]) -> f32[256,512] {
  %param_0 = f32[256,512]{1,0} parameter(0)
  ROOT %tanh.1 = f32[256,512]{1,0} tanh(%param_0)
}

%body (arg: (s32[], f32[256,512])) -> (s32[], f32[256,512]) {
  %arg = (s32[], f32[256,512]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[256,512]{1,0} get-tuple-element(%arg), index=1
  %loop_tanh = f32[256,512]{1,0} fusion(%x), kind=kLoop, calls=%fused_tanh
  ROOT %t = (s32[], f32[256,512]{1,0}) tuple(%i, %loop_tanh)
}

%fused_lt (param_0.1: s32[]) -> pred[] {
  %param_0.1 = s32[] parameter(0)
  %c8 = s32[] constant(8)
  ROOT %lt = pred[] compare(%param_0.1, %c8), direction=LT
}

%cond (arg.1: (s32[], f32[256,512])) -> pred[] {
  %arg.1 = (s32[], f32[256,512]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  ROOT %loop_lt = pred[] fusion(%i.1), kind=kLoop, calls=%fused_lt
}

ENTRY %main (a: f32[256,1024], b: f32[1024,512]) -> f32[256,512] {
  %a = f32[256,1024]{1,0} parameter(0)
  %b = f32[1024,512]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %gemm = (f32[256,512]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %out = f32[256,512]{1,0} get-tuple-element(%gemm), index=0
  %flat = f32[131072]{0} bitcast(%out)
  %back = f32[256,512]{1,0} bitcast(%flat)
  %first = f32[256,512]{1,0} fusion(%back), kind=kLoop, calls=%fused_tanh
  %copied = f32[256,512]{1,0} copy(%first)
  %init = (s32[], f32[256,512]{1,0}) tuple(%zero, %copied)
  %loop = (s32[], f32[256,512]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
  ROOT %res = f32[256,512]{1,0} get-tuple-element(%loop), index=1
}
"""  # noqa: E501 (HLO lines)

MIB_HALF = 256 * 512 * 4  # one f32[256,512]


def test_counts_the_launched_ops_of_a_hand_written_program():
  step = st.predict_step_time(HAND, calibration=CAL)
  # gemm + fusion + copy + 8 body fusions + 9 condition fusions
  assert step.kernels == 1 + 1 + 1 + 8 + 9
  assert step.flops == 2 * 256 * 512 * 1024
  kinds = {op.name: (op.kind, op.count) for op in step.ops}
  assert kinds == {
    "gemm": ("matmul", 1),
    "first": ("fusion", 1),
    "copied": ("copy", 1),
    "loop_tanh": ("fusion", 8),
    "loop_lt": ("fusion", 9),
  }
  gemm_bytes = 4 * (256 * 1024 + 1024 * 512) + MIB_HALF  # the workspace is not counted
  assert step.bytes_accessed == gemm_bytes + 2 * MIB_HALF * (1 + 1 + 8) + 9 * (4 + 1)
  assert step.notes == ()


def test_the_roofline_of_each_op():
  step = st.predict_step_time(HAND, calibration=CAL)
  gemm = next(op for op in step.ops if op.kind == "matmul")
  assert gemm.peak_flops == H200.tf32_flops  # float32 operands: tf32 tensor cores
  compute = gemm.flops / (H200.tf32_flops * CAL.matmul_efficiency)
  memory = gemm.bytes / (H200.memory_bandwidth * CAL.bandwidth_efficiency)
  assert gemm.seconds(H200, CAL) == pytest.approx(max(compute, memory) + 4e-6)
  assert sum(step.by_kind.values()) == pytest.approx(step.seconds)
  fusion = 2 * MIB_HALF / (H200.memory_bandwidth * 0.8) + 4e-6
  assert step.by_kind["fusion"] == pytest.approx(9 * fusion + 9 * (5 / (4.8e12 * 0.8) + 4e-6))
  assert "ms/step" in str(step) and "h200" in str(step)


def test_a_loop_of_unknown_trip_count_is_counted_once_and_said():
  text = HAND.replace(', backend_config={"known_trip_count":{"n":"8"}}', "")
  step = st.predict_step_time(text, calibration=CAL)
  assert step.kernels == 3 + 1 + 2
  assert any("known_trip_count" in n for n in step.notes)


def test_another_calibration_retimes_the_same_ops():
  step = st.predict_step_time(HAND, calibration=CAL)
  slower = dataclasses.replace(CAL, launch_overhead_s=1e-5)
  assert step.with_calibration(slower).seconds == pytest.approx(step.seconds + 20 * 6e-6)
  assert st.predict_step_time(HAND, calibration=slower).seconds == pytest.approx(
    step.with_calibration(slower).seconds
  )


def test_fit_recovers_the_constants_that_made_the_times():
  ops = [
    [st.Op("mm", "matmul", 2e12, 1e8, H200.matmul_flops)],
    [st.Op("mm", "matmul", 1e11, 1e7, H200.tf32_flops, count=3)],
    [st.Op("cv", "conv", 5e11, 1e8, H200.tf32_flops)],
    [st.Op("cv", "conv", 5e10, 1e7, H200.tf32_flops), st.Op("f", "fusion", 0, 1e6, 0, 2)],
    [st.Op("f", "fusion", 0.0, 4e9, 0.0)],
    [st.Op("f", "fusion", 0.0, 1e9, 0.0, count=10)],
    [st.Op("k", "jact_kernel", 0.0, 1e3, 0.0, count=3000)],
    [st.Op("k", "jact_kernel", 0.0, 1e4, 0.0, count=100)],
  ]
  steps = [st._summarize(o, H200, st.Calibration(), ()) for o in ops]
  measured = [s.with_calibration(CAL).seconds for s in steps]
  fitted = st.fit_calibration(steps, measured)
  for field in dataclasses.fields(st.Calibration):
    assert getattr(fitted, field.name) == pytest.approx(getattr(CAL, field.name), rel=1e-3)


def test_shapes_and_bytes_of_hlo_types():
  assert st.nbytes("(bf16[4,8]{1,0}, pred[3]{0}, s32[])") == 64 + 3 + 4
  assert st.nbytes("f32[2,2]{1,0:T(2,128)}") == 16


# ----------------------------------------------------------------------------- XLA:GPU programs


def _predict(fn, *shapes, dtype=jnp.bfloat16):
  args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
  return st.predict_step_time(jact.compile_for(fn, *args, target="h200"))


def _chain(k):
  def fn(x, w):
    for _ in range(k):
      x = jnp.tanh(x @ w)
    return x

  return fn


@needs_plugin
def test_k_times_the_matmul_work_is_predicted_k_times_slower():
  one = _predict(_chain(1), (4096, 4096), (4096, 4096))
  four = _predict(_chain(4), (4096, 4096), (4096, 4096))
  assert one.flops == 2 * 4096**3
  assert four.flops == 4 * one.flops
  assert four.seconds >= 0.9 * 4 * one.seconds
  assert four.by_kind["matmul"] > 0.8 * four.seconds  # compute-bound at this size


@needs_plugin
def test_a_memory_bound_elementwise_program_runs_at_the_calibrated_bandwidth():
  n = 1 << 26
  step = _predict(lambda x: jnp.tanh(x) * 3.0 + 1.0, (n,), dtype=jnp.float32)
  assert step.kernels == 1 and step.flops == 0
  assert step.bytes_accessed == 2 * 4 * n
  cal = st.DEFAULT_CALIBRATION
  expected = 8 * n / (H200.memory_bandwidth * cal.bandwidth_efficiency)
  assert step.seconds == pytest.approx(expected + cal.launch_overhead_s, rel=1e-6)


@needs_plugin
def test_a_scan_of_8_steps_costs_8_times_its_body():
  def body(c, w):
    return jnp.tanh(c @ w)

  def scan(length):
    return lambda c, w: jax.lax.scan(lambda c, _: (body(c, w), None), c, None, length=length)[0]

  shapes = (2048, 2048), (2048, 2048)
  once, eight, sixteen = (
    _predict(body, *shapes),
    _predict(scan(8), *shapes),
    _predict(scan(16), *shapes),
  )
  assert eight.flops == 8 * once.flops and sixteen.flops == 16 * once.flops
  once, eight, sixteen = (s.with_calibration(CAL).seconds for s in (once, eight, sixteen))
  per_trip = (sixteen - eight) / 8
  # a trip: the body, plus the loop's copy of its carry (bf16[2048,2048]), counter and condition
  carry_copy = 2 * 2 * 2048 * 2048 / (H200.memory_bandwidth * CAL.bandwidth_efficiency)
  assert once <= per_trip <= 1.05 * (once + carry_copy + 3 * CAL.launch_overhead_s)
  assert eight == pytest.approx(8 * per_trip, rel=0.1)


@needs_plugin
def test_jact_kernels_of_a_compressed_program_are_counted_as_jact_kernels():
  def block(x, w):
    return jnp.tanh(x @ w) + x

  def loss(x, w, key):
    return (jact.compressed(block, bits=2)(x, w, key=key) ** 2).mean()

  args = (
    jax.ShapeDtypeStruct((1024, 512), jnp.float32),
    jax.ShapeDtypeStruct((512, 512), jnp.float32),
    jax.random.key(0),
  )
  step = st.predict_step_time(jact.compile_for(jax.grad(loss), *args, target="h200"))
  kernels = [op for op in step.ops if op.kind == "jact_kernel"]
  assert len(kernels) >= 2  # a quantize in the forward, a dequantize in the backward
  assert all(op.flops == 0 and op.bytes > 0 for op in kernels)
  assert step.by_kind["jact_kernel"] > 0
  assert step.by_kind["matmul"] > 0


@needs_plugin
def test_cudnn_fused_attention_is_counted_by_its_flops():
  b, t, h, d = 4, 1024, 8, 64

  def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return out.astype(jnp.float32).sum()

  qkv = [jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)] * 3
  step = st.predict_step_time(jact.compile_for(jax.grad(loss, argnums=(0, 1, 2)), *qkv))
  # forward 4*B*T*H*D*T, backward 2.5x that, halved by the causal mask
  expected = 4.0 * b * t * h * d * t * (1 + 2.5) / 2
  assert step.by_kind["attention"] > 0
  assert step.flops == pytest.approx(expected, rel=0.05)
