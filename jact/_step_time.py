"""A predicted step time for an XLA:GPU program, read from its scheduled HLO.

`predict_step_time(compiled, target="h200")` walks the ENTRY computation of the
program XLA:GPU scheduled (and the computations its `while`, `call`,
`conditional` and `async-start` ops run; a `while` body counts `known_trip_count`
times) and times every launched op -- fusion, cuBLAS/cuDNN custom-call, jact's
Triton kernels, copy, collective -- as a roofline:

    max(flops / (peak * efficiency), bytes / (bandwidth * bandwidth_efficiency)) + launch overhead

with bytes what crosses HBM (the op's operands and results; a fusion's own
operands and outputs, a sliced operand by its slice, an in-place update by the
update) and flops those of its matmuls (2*M*N*K) and convolutions. bf16/f16
matmuls run at the target's tensor-core peak, float32 ones at its tf32 peak
(XLA's default precision on a GPU); elementwise work is taken as memory-bound.
The efficiencies and the overhead are the few global constants of `Calibration`,
fitted to step times measured on an H200 (`experiments.bench.time_model`). It is
a prediction, not a measurement: no overlap of ops, no caches, no autotuning.

>>> text = '''
... ENTRY %main (p: f32[1024,1024]) -> f32[1024,1024] {
...   %p = f32[1024,1024]{1,0} parameter(0)
...   ROOT %t = f32[1024,1024]{1,0} fusion(%p), kind=kLoop, calls=%fused
... }
... '''
>>> step = predict_step_time(text)
>>> step.kernels, step.bytes_accessed, step.by_kind["fusion"] == step.seconds
(1, 8388608.0, True)
>>> import jax, jax.numpy as jnp, jact
>>> compiled = jact.compile_for(lambda x: jnp.tanh(x).sum(),
...                             jax.ShapeDtypeStruct((1024,), jnp.float32))  # doctest: +SKIP
>>> print(predict_step_time(compiled))                                       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable, Sequence

import numpy as np

from jact._gpu_target import GpuTarget, gpu_target

__all__ = ["Calibration", "StepTime", "predict_step_time", "fit_calibration"]


@dataclasses.dataclass(frozen=True)
class Calibration:
  """The global constants of the roofline: achieved fractions of peak, and a per-launch cost.

  Attributes:
    matmul_efficiency: fraction of the tensor-core peak a gemm reaches.
    conv_efficiency: fraction of the tensor-core peak a cuDNN convolution reaches.
    bandwidth_efficiency: fraction of the HBM bandwidth a memory-bound op reaches.
    launch_overhead_s: seconds added to every launched op.
  """

  matmul_efficiency: float = 1.0
  conv_efficiency: float = 0.92
  bandwidth_efficiency: float = 1.0
  launch_overhead_s: float = 14.6e-6


# The defaults: fitted on log time to nine step times measured on an H200 (ResNet-50 and a
# transformer LM, plain and jact; jax 0.11.2's programs, predicted from jax 0.10.2's) by
# `python -m experiments.bench.time_model` (experiments/results/time_model.json). They fit the
# totals within ~2%, but the nine rows barely tell the constants apart: two efficiencies sit at
# their bound of 1 and the per-launch cost absorbs what the roofline misses (cache reuse,
# small kernels far from peak); a fixed 5 us launch cost with 0.82 / 0.99 / 0.67 fits almost as
# well. Read them as one fitted whole, not as achieved fractions of peak.
DEFAULT_CALIBRATION = Calibration()


@dataclasses.dataclass(frozen=True)
class Op:
  """One launched op: its kind, work, and how many times it runs (loop trip counts)."""

  name: str
  kind: str
  flops: float
  bytes: float
  peak_flops: float  # the FLOP/s its flops run at (0: none)
  count: int = 1

  def seconds(self, target: GpuTarget, cal: Calibration) -> float:
    """Roofline time of one run of this op."""
    efficiency = cal.conv_efficiency if self.kind == "conv" else cal.matmul_efficiency
    compute = self.flops / (self.peak_flops * efficiency) if self.flops else 0.0
    memory = self.bytes / (target.memory_bandwidth * cal.bandwidth_efficiency)
    return max(compute, memory) + cal.launch_overhead_s


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A predicted step time and what makes it up.

  Attributes:
    seconds: the predicted step time.
    flops: matmul and convolution FLOPs of one step.
    bytes_accessed: bytes the launched ops read and write in HBM.
    kernels: launched ops (a loop body's counted once per trip).
    by_kind: seconds by kind of op ("matmul", "conv", "fusion", "jact_kernel", "copy",
      "collective", "other").
    notes: what the prediction assumed (e.g. a loop of unknown trip count counted once).
    target: the GPU's name.
    calibration: the constants used.
    ops: every launched op (to re-time with another `Calibration`).
  """

  seconds: float
  flops: float
  bytes_accessed: float
  kernels: int
  by_kind: dict
  notes: tuple = ()
  target: str = "h200"
  calibration: Calibration = DEFAULT_CALIBRATION
  ops: tuple = dataclasses.field(default=(), repr=False, compare=False)

  def __str__(self) -> str:
    kinds = ", ".join(
      f"{k} {1e3 * v:.2f}" for k, v in sorted(self.by_kind.items(), key=lambda kv: -kv[1])
    )
    return (
      f"predicted {1e3 * self.seconds:.2f} ms/step on {self.target}: {self.flops / 1e12:.3g} "
      f"TFLOP, {self.bytes_accessed / 1e9:.3g} GB, {self.kernels} launches (ms: {kinds})"
    )

  def with_calibration(self, calibration: Calibration) -> StepTime:
    """The same program timed with other constants."""
    return _summarize(self.ops, gpu_target(self.target), calibration, self.notes)


# ----------------------------------------------------------------------------- HLO text

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2}
_BYTES |= {"bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_BYTES |= {"c128": 16, "token": 0, "tf32": 4}
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_NO_LAUNCH = {
  "parameter",
  "constant",
  "tuple",
  "get-tuple-element",
  "bitcast",
  "opt-barrier",
  "after-all",
  "add-dependency",
  "domain",
  "partition-id",
  "replica-id",
}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-")


@dataclasses.dataclass(frozen=True)
class _Instr:
  name: str
  type: str  # "f32[2,3]{1,0}" or a tuple "(f32[2]{0}, u8[0]{0})"
  opcode: str
  operands: tuple  # operand names
  attrs: str  # the text after the operand list


def shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every array in an HLO type.

  >>> shapes("(f32[2,3]{1,0}, u8[0]{0}, s32[])")
  [('f32', (2, 3)), ('u8', (0,)), ('s32', ())]
  """
  return [
    (dtype, tuple(int(d) for d in dims.split(",") if d))
    for dtype, dims in _SHAPE.findall(type_text)
    if dtype in _BYTES or dtype.startswith("f8")
  ]


def _size(shape: tuple[str, tuple[int, ...]]) -> float:
  dtype, dims = shape
  return _BYTES.get(dtype, 1) * math.prod(dims)


def nbytes(type_text: str) -> float:
  """Bytes of all arrays in an HLO type.

  >>> nbytes("(f32[2,3]{1,0}, bf16[4]{0})")
  32.0
  """
  return float(sum(_size(s) for s in shapes(type_text)))


def _balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at `start`."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c in "({[":
      depth += 1
    elif c in ")}]":
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _parse_instr(line: str) -> _Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  name, rest = m.group(1), m.group(2)
  end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
  if end <= 0:
    return None
  type_text, rest = rest[:end], rest[end:].lstrip()
  m = re.match(r"([a-z][a-z0-9\-_]*)\(", rest)
  if not m:
    return None
  close = _balanced(rest, m.end() - 1)
  operands = tuple(re.findall(r"%([^\s,()]+)", rest[m.end() : close - 1]))
  return _Instr(name, type_text, m.group(1), operands, rest[close:])


def parse_module(text: str) -> tuple[dict[str, list[_Instr]], str]:
  """The computations of an HLO module's text (name -> instructions), and the ENTRY's name."""
  computations: dict[str, list[_Instr]] = {}
  entry, current = None, None
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = computations.setdefault(m.group(2), [])
        entry = m.group(2) if m.group(1) else entry
      continue
    if line.startswith("}"):
      current = None
      continue
    instr = _parse_instr(line)
    if instr is not None:
      current.append(instr)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return computations, entry


def _attr(attrs: str, key: str) -> str | None:
  m = re.search(rf"\b{key}=(%?[^\s,]+)", attrs)
  return m.group(1).lstrip("%") if m else None


def _called(attrs: str, key: str) -> list[str]:
  m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
  return [c.strip().lstrip("%") for c in m.group(1).split(",")] if m else []


def _trip_count(attrs: str) -> int | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
  return int(m.group(1)) if m else None


def _dims(attrs: str, key: str) -> list[int]:
  m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", attrs) or re.search(rf'"{key}":\[([^\]]*)\]', attrs)
  return [int(d.strip('" ')) for d in m.group(1).split(",") if d.strip('" ')] if m else []


# ----------------------------------------------------------------------------- FLOPs


def _matmul_peak(dtype: str, target: GpuTarget) -> float:
  if dtype in ("f32", "tf32"):
    return target.tf32_flops
  if dtype == "f64":
    return target.vector_flops
  return target.matmul_flops  # bf16, f16, f8, s8


def _dot_flops(instr: _Instr, types: dict[str, str], lhs_key: str) -> tuple[float, str]:
  """(2 * output elements * contracted size, operand dtype) of a dot or a gemm custom-call."""
  lhs = shapes(types.get(instr.operands[0], ""))
  out = shapes(instr.type)
  if not lhs or not out:
    return 0.0, "f32"
  k = math.prod(lhs[0][1][d] for d in _dims(instr.attrs, lhs_key) if d < len(lhs[0][1]))
  return 2.0 * math.prod(out[0][1]) * k, lhs[0][0]


def _conv_flops(instr: _Instr, types: dict[str, str], target_name: str) -> tuple[float, str]:
  """FLOPs of a convolution, from its forward shapes: 2 * output elements * (in features *
  window), the window divided by lhs dilation. cuDNN's custom-calls keep the forward labels:
  a backward-input call returns the input (its operand 0 is the output), a backward-filter call
  returns the kernel."""
  labels = re.search(r"dim_labels=([^_\s]+)_([^-\s]+)->([^\s,]+)", instr.attrs)
  ops = [shapes(types.get(o, "")) for o in instr.operands[:2]]
  result = shapes(instr.type)
  if not labels or len(ops) < 2 or not all(ops) or not result:
    return 0.0, "f32"
  if "BackwardInput" in target_name:
    out, kernel = ops[0][0], ops[1][0]
  elif "BackwardFilter" in target_name:
    out, kernel = ops[1][0], result[0]
  else:
    out, kernel = result[0], ops[1][0]
  kernel_labels = labels.group(2)
  per_output = math.prod(
    n for n, label in zip(kernel[1], kernel_labels) if label != "o"
  )  # in features * window
  dilation = re.search(r"lhs_dilate=([0-9x]+)", instr.attrs)
  if dilation:
    per_output /= math.prod(int(d) for d in dilation.group(1).split("x"))
  return 2.0 * math.prod(out[1]) * per_output, ops[0][0][0]


def _inner_flops(comps, name: str, target: GpuTarget, seen=()) -> tuple[float, float, str]:
  """(flops, FLOP/s they run at, kind) of the dots and convolutions in a fused computation."""
  flops, seconds_at_peak, kind = 0.0, 0.0, ""
  instrs = comps.get(name, [])
  types = {i.name: i.type for i in instrs}
  for instr in instrs:
    f, dtype, k = 0.0, "f32", ""
    if instr.opcode == "dot":
      (f, dtype), k = _dot_flops(instr, types, "lhs_contracting_dims"), "matmul"
    elif instr.opcode == "convolution":
      (f, dtype), k = _conv_flops(instr, types, "convForward"), "conv"
    elif instr.opcode == "custom-call":
      f, peak, k = _custom_call_flops(instr, types, target)
      if f:
        flops, seconds_at_peak, kind = flops + f, seconds_at_peak + f / peak, kind or k
      continue
    for callee in re.findall(r"(?:calls|to_apply)=%?([^\s,]+)", instr.attrs):
      if callee not in seen:
        f2, peak2, k2 = _inner_flops(comps, callee, target, seen + (name,))
        if f2:
          flops, seconds_at_peak, kind = flops + f2, seconds_at_peak + f2 / peak2, kind or k2
    if f:
      flops += f
      seconds_at_peak += f / _matmul_peak(dtype, target)
      kind = kind or k
  return flops, (flops / seconds_at_peak if seconds_at_peak else 0.0), kind


def _custom_call_flops(instr: _Instr, types, target: GpuTarget) -> tuple[float, float, str]:
  name = _attr(instr.attrs, "custom_call_target") or ""
  name = name.strip('"')
  if "cublas" in name or "gemm" in name.lower():
    f, dtype = _dot_flops(instr, types, "lhs_contracting_dimensions")
    return f, _matmul_peak(dtype, target), "matmul"
  if "cudnn$conv" in name:
    f, dtype = _conv_flops(instr, types, name)
    return f, _matmul_peak(dtype, target), "conv"
  if "cudnn$fmha" in name:
    f, dtype = _attention_flops(instr, types, name)
    return f, _matmul_peak(dtype, target), "attention"
  return 0.0, 0.0, ""


def _attention_flops(instr: _Instr, types: dict[str, str], name: str) -> tuple[float, str]:
  """cuDNN fused attention: QK^T and PV, 4*|Q|*Tk flops forward, 2.5x that backward
  (FlashAttention-2's count: S recomputed, dV, dP, dQ, dK), halved under a causal mask.
  Operands q, k, v first, in JAX's BTNH layout (key length: axis 1 of k)."""
  q, k = (shapes(types.get(o, "")) for o in instr.operands[:2])
  if not q or not k or len(k[0][1]) != 4:
    return 0.0, "f32"
  (dtype, q_shape), (_, k_shape) = q[0], k[0]
  flops = 4.0 * math.prod(q_shape) * k_shape[1]
  if "Backward" in name:
    flops *= 2.5
  if '"mask_type": "CAUSAL"' in instr.attrs or '"mask_type":"CAUSAL"' in instr.attrs:
    flops /= 2
  return flops, dtype


# ----------------------------------------------------------------------------- bytes


def _fusion_bytes(instr: _Instr, types: dict[str, str], fused: list[_Instr]) -> float:
  """HBM bytes of a fusion: operands read (a sliced one by its slices; the buffer a
  dynamic-update-slice updates in place not at all) and outputs written (an in-place update
  by the update)."""
  if not fused:
    return nbytes(instr.type) + sum(nbytes(types.get(o, "")) for o in instr.operands)
  by_name = {i.name: i for i in fused}
  params = {i.name: i for i in fused if i.opcode == "parameter"}
  users: dict[str, list[_Instr]] = {}
  for i in fused:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  read = 0.0
  for name, p in params.items():
    us = users.get(name, [])
    if us and all(u.opcode in ("dynamic-slice", "slice") for u in us):
      read += min(nbytes(p.type), sum(nbytes(u.type) for u in us))
    elif us and all(u.opcode == "dynamic-update-slice" and u.operands[0] == name for u in us):
      continue
    else:
      read += nbytes(p.type)
  root = next((i for i in reversed(fused) if i.opcode != "parameter"), None)
  outputs = [by_name.get(o) for o in root.operands] if root and root.opcode == "tuple" else [root]
  written = 0.0
  for out in outputs:
    while out is not None and out.opcode == "bitcast" and out.operands:
      out = by_name.get(out.operands[0])
    if out is not None and out.opcode == "dynamic-update-slice" and len(out.operands) > 1:
      update = by_name.get(out.operands[1])
      written += nbytes(update.type) if update else 0.0
    elif out is not None:
      written += nbytes(out.type)
  return read + written


def _custom_call_bytes(instr: _Instr, types: dict[str, str], target_name: str) -> float:
  results = shapes(instr.type)
  if ("cudnn" in target_name or "cublas" in target_name) and len(results) > 1:
    results = results[:-1]  # the scratch buffer
  return sum(_size(s) for s in results) + sum(nbytes(types.get(o, "")) for o in instr.operands)


# ----------------------------------------------------------------------------- the walk


def _launched(instr: _Instr, types, comps, target: GpuTarget) -> Op | None:
  """The op `instr` launches, or None."""
  op = instr.opcode
  if op in _NO_LAUNCH or op.endswith("-done") or op.endswith("-update"):
    return None
  if op == "fusion":
    callee = _attr(instr.attrs, "calls")
    fused = comps.get(callee, [])
    flops, peak, kind = _inner_flops(comps, callee, target) if callee else (0.0, 0.0, "")
    return Op(instr.name, kind or "fusion", flops, _fusion_bytes(instr, types, fused), peak)
  if op == "custom-call":
    name = (_attr(instr.attrs, "custom_call_target") or "").strip('"')
    flops, peak, kind = _custom_call_flops(instr, types, target)
    if "xla.gpu.triton" in name or name == "triton_kernel_call":  # Pallas', jax-triton's
      kind = "jact_kernel"
    return Op(instr.name, kind or "other", flops, _custom_call_bytes(instr, types, name), peak)
  nbytes_io = nbytes(instr.type) + sum(nbytes(types.get(o, "")) for o in instr.operands)
  if op in ("copy", "copy-start"):
    return Op(instr.name, "copy", 0.0, nbytes_io, 0.0)
  if op.startswith(_COLLECTIVES):
    return Op(instr.name, "collective", 0.0, nbytes_io, 0.0)
  if op == "dynamic-update-slice" and len(instr.operands) > 1:
    return Op(instr.name, "other", 0.0, 2 * nbytes(types.get(instr.operands[1], "")), 0.0)
  return Op(instr.name, "other", 0.0, nbytes_io, 0.0)


def _walk(comps, name: str, target: GpuTarget, times: int, notes: list, depth=0) -> list[Op]:
  """Launched ops of computation `name` run `times` times, called computations included."""
  if depth > 50:
    raise ValueError(f"HLO calls nested deeper than 50 at {name!r}")
  instrs = comps.get(name, [])
  types = {i.name: i.type for i in instrs}
  ops: list[Op] = []
  for instr in instrs:
    if instr.opcode == "while":
      trips = _trip_count(instr.attrs)
      if trips is None:
        notes.append(f"while {instr.name}: no known_trip_count, counted once")
        trips = 1
      body, cond = _attr(instr.attrs, "body"), _attr(instr.attrs, "condition")
      ops += _walk(comps, body, target, times * trips, notes, depth + 1)
      ops += _walk(comps, cond, target, times * (trips + 1), notes, depth + 1)
    elif instr.opcode in ("call", "async-start"):
      callee = _attr(instr.attrs, "to_apply") or _attr(instr.attrs, "calls")
      ops += _walk(comps, callee, target, times, notes, depth + 1)
    elif instr.opcode == "conditional":
      branches = _called(instr.attrs, "branch_computations") or [
        b for b in (_attr(instr.attrs, k) for k in ("true_computation", "false_computation")) if b
      ]
      costed = [_walk(comps, b, target, times, notes, depth + 1) for b in branches]
      seconds = [sum(o.count * o.seconds(target, DEFAULT_CALIBRATION) for o in c) for c in costed]
      if costed:
        ops += costed[int(np.argmax(seconds))]
        if len(costed) > 1:
          notes.append(f"conditional {instr.name}: its costliest of {len(costed)} branches")
    else:
      op = _launched(instr, types, comps, target)
      if op is not None:
        ops.append(dataclasses.replace(op, count=times))
  return ops


def _summarize(ops, target: GpuTarget, cal: Calibration, notes) -> StepTime:
  by_kind: dict[str, float] = {}
  for op in ops:
    by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op.count * op.seconds(target, cal)
  return StepTime(
    seconds=sum(by_kind.values()),
    flops=sum(op.count * op.flops for op in ops),
    bytes_accessed=sum(op.count * op.bytes for op in ops),
    kernels=sum(op.count for op in ops),
    by_kind=by_kind,
    notes=tuple(dict.fromkeys(notes)),
    target=target.name,
    calibration=cal,
    ops=tuple(ops),
  )


def predict_step_time(
  compiled_or_hlo_text: Any,
  target: str | GpuTarget = "h200",
  calibration: Calibration | None = None,
) -> StepTime:
  """The predicted time of one run of an XLA:GPU program.

  Args:
    compiled_or_hlo_text: a `jax.stages.Compiled` for the GPU (e.g. from `jact.compile_for`)
      or its scheduled HLO text (`compiled.as_text()`).
    target: the GPU ("h100", "h200" or a `GpuTarget`) whose peaks time the ops.
    calibration: efficiencies and launch overhead (default: fitted to H200 measurements).

  Returns:
    A `StepTime`: seconds, FLOPs, bytes, launched ops, seconds by kind of op.
  """
  text = compiled_or_hlo_text
  if not isinstance(text, str):
    text = compiled_or_hlo_text.as_text()
  spec = gpu_target(target)
  comps, entry = parse_module(text)
  notes: list[str] = []
  ops = _walk(comps, entry, spec, 1, notes)
  return _summarize(ops, spec, calibration or DEFAULT_CALIBRATION, notes)


def fit_calibration(
  steps: Sequence[StepTime],
  measured_seconds: Sequence[float],
  start: Calibration | None = None,
  fields: Iterable[str] | None = None,
) -> Calibration:
  """The `Calibration` minimizing the squared log error of `steps` against measured seconds.

  Efficiencies are kept in (0, 1], the overhead in [0, 1 ms]; `fields` names the constants
  to fit (default: all), the others stay at `start`'s.
  """
  from scipy import optimize  # only a fit needs it

  start = start or DEFAULT_CALIBRATION
  names = list(fields or [f.name for f in dataclasses.fields(Calibration)])
  measured = np.log(np.asarray(measured_seconds, float))
  lower = {n: (1e-9 if n == "launch_overhead_s" else 1e-3) for n in names}
  upper = {n: (1e-3 if n == "launch_overhead_s" else 1.0) for n in names}

  def calibration(x):
    return dataclasses.replace(start, **{n: float(np.exp(v)) for n, v in zip(names, x)})

  def residuals(x):
    cal = calibration(x)
    return np.log([s.with_calibration(cal).seconds for s in steps]) - measured

  x0 = np.log([min(max(getattr(start, n), 1.01 * lower[n]), 0.99 * upper[n]) for n in names])
  bounds = (np.log([lower[n] for n in names]), np.log([upper[n] for n in names]))
  return calibration(optimize.least_squares(residuals, x0, bounds=bounds).x)
