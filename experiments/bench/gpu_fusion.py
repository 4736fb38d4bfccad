"""Where jact's compression lands in XLA:GPU's program, and what it costs to compile (deviceless).

For models of `experiments.lib.frontier_models` (real sizes by default, `--small` for a check),
the gradient step `jax.value_and_grad(loss)` with `jact.compressed` per block (as in
`experiments.bench.frontier`) is compiled by XLA:GPU for an H200 on this machine
(`jact.compile_for`), plain and at each width in two ways:

* "xla": every kernel op forced to its XLA reference (`jact.kernels.use(op="xla", ...)`), which
  XLA may fuse with the op that produces the residual;
* "kernel": the automatic choice for a program lowered for cuda (`jact.compile_for` stages the
  highest-priority kernel under `jact.kernels.lowering_for("cuda")`: jax-triton where it has the
  op and is installed, else Pallas' Triton backend): opaque custom calls.

Each kernel op call is traced inside a named scope of its own (`jfz<n>_<op>`; metadata only, the
program is the same), so the optimized HLO (`compiled.as_text()`) says which launched ops (fusions
and custom calls) compute each compression. For every compressed residual (a forward compress op's
input x) a row records:

* `compress_ops`, `compress_ops_bytes`: the launched ops holding some of its compression, and
  their bytes accessed (operands + outputs, as `jact._step_time` counts them; a fusion that also
  computes x's producer counts whole);
* `placement`, where the compression starts: "one pass" -- in a fusion that computes x and
  writes it for x's other consumers (a multi-output fusion: the producer's own pass over memory
  also starts the compression); "recomputed" -- in a fusion that computes x from its producer's
  inputs without writing it (XLA moved or duplicated the producer's elementwise tail into it;
  x itself, where another op needs it, is written by another fusion this cannot identify);
  "read back" -- x is read from HBM (always so for a kernel: a custom call is opaque to XLA);
* `x_reads`: how many times the compression's launched ops read x (or a same-size float copy
  of it) back from HBM: 1 for a kernel, 0 for the ideal "one pass"; a "recomputed" compression
  reads its producer's inputs instead, which this does not count;
* `x_readers`, `x_readers_bytes`: every launched op reading the buffers of x identified above
  (read back by the compression, or written by its one-pass fusion; none for "recomputed"),
  the forward's own consumers included, and their bytes accessed.

Per program: launched ops and bytes accessed (`jact._step_time.predict_step_time`; a loop body
counted once per trip), those holding any compression or decompression (`compress_launches`,
`decompress_launches`), jact's Triton calls -- call sites, and distinct kernels (different
code: Pallas' Triton IR, jax-triton's PTX) -- and the compile seconds, trace + lower apart from
XLA:GPU's compile (CPU seconds of this process and wall seconds). No GPU runs: no timing, so
the "xla" vs "kernel" evidence here is bytes and launches only; the registry's choice on a GPU
must be made by measurement there.

Rows are written to the JSON as measured (a run cut short keeps them; a rerun skips rows already
there unless `--fresh`).

    python -m experiments.bench.gpu_fusion [--models lm_6x512 resnet50_224 ...] [--bits 2 4]
        [--modes xla kernel] [--json experiments/results/gpu_fusion.json] [--fresh]
    python -m experiments.bench.gpu_fusion --small --json /tmp/gpu_fusion.json   # a quick check
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import dataclasses
import hashlib
import json
import math
import pathlib
import re
import time
import zlib
from typing import Iterator

import jax
import numpy as np

import jact
import jact.kernels
from jact import _compat
from jact._step_time import _launched, parse_module, predict_step_time, shapes
from experiments.bench import frontier
from experiments.bench.compile_anatomy import patched
from experiments.lib import frontier_models, metadata, paths

__all__ = [
  "COMPRESS_OPS",
  "KernelCall",
  "tagged_kernels",
  "residuals",
  "triton_calls",
  "compile_timed",
  "measure",
  "main",
]

COMPRESS_OPS = ("quantize", "relu_mask", "quantize_per_sample", "division_compress")
COMPRESS_OPS += ("float8_compress",)
"""The kernel ops that write a residual's compressed form in the forward pass."""
DECOMPRESS_OPS = ("dequantize", "dequantize_per_sample")
PLACEMENTS = ("one pass", "recomputed", "read back", "?")
"""Where a residual's compression starts (see `residuals`)."""
DEFAULT_MODELS = ("lm_6x512", "resnet50_224")
_TAG = re.compile(r"\bjfz(\d+)_")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PARAMETER = re.compile(r"^\s*%?([^\s=]+) = \S+ parameter\((\d+)\)", re.M)
_FLOAT = ("f32", "bf16", "f16", "f64")


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """One kernel op call as traced: its tag, the implementation chosen and its input."""

  tag: int
  op: str
  implementation: str
  shape: tuple[int, ...]
  dtype: str
  static: tuple  # (name, value) of its int / bool / str keyword arguments (bits, group_size...)

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def _implementation(fn) -> str:
  """The implementation a dispatched callable runs: "xla", "pallas_triton", "jax_triton"."""
  name = getattr(fn, "__name__", "")
  staged = re.fullmatch(r"[a-z0-9_]+?_(pallas_triton|jax_triton|[a-z0-9]+)_or_xla", name)
  if staged:
    return staged.group(1)
  if "jax_triton" in name or "jax_triton" in getattr(fn, "__module__", ""):
    return "jax_triton"
  if "pallas" in getattr(fn, "__module__", ""):
    return "pallas_triton"
  return "xla"


@contextlib.contextmanager
def tagged_kernels() -> Iterator[list[KernelCall]]:
  """Context in which every kernel op call (`jact.kernels.dispatch`) is traced inside the named
  scope `jfz<n>_<op>`, and recorded (the yielded list) as a `KernelCall`."""
  dispatch = jact.kernels.dispatch
  calls: list[KernelCall] = []

  def tagging(op, implementation=None, **kwargs):
    fn = dispatch(op, implementation, **kwargs)

    def run(first, *args, **kw):
      logical = getattr(first, "shape", ())
      dtype = getattr(first, "dtype", None)
      static = tuple(
        sorted((k, v) for k, v in kw.items() if isinstance(v, (int, bool, str)) and v is not None)
      )
      call = KernelCall(
        len(calls), op, _implementation(fn), tuple(logical), str(np.dtype(dtype)), static
      )
      calls.append(call)
      with jax.named_scope(f"jfz{call.tag}_{op}"):
        return fn(first, *args, **kw)

    return run

  with patched(jact.kernels, "dispatch", tagging):
    yield calls


def _xla_everywhere():
  """`jact.kernels.use(...)` forcing every op's XLA reference."""
  return jact.kernels.use(**{op: "xla" for op in jact.kernels.REGISTRY.ops})


# ----------------------------------------------------------------------------- the HLO


def _tags(instr) -> set[int]:
  m = _OP_NAME.search(instr.attrs)
  return {int(t) for t in _TAG.findall(m.group(1))} if m else set()


def _fused_tags(comps, name: str, seen=()) -> dict[str, set[int]]:
  """instruction name -> tags, over a fused computation and the fusions nested in it.

  Only instructions that depend on the fusion's data count: XLA merges identical
  constant-derived values (iotas, hash constants, shift amounts) of all calls into one,
  keeping the metadata of the first, which would tag every fusion using it. Reducers
  (`to_apply`) are not followed: XLA shares one among same-typed reductions too."""
  out: dict[str, set[int]] = {}
  data: set[str] = set()
  for instr in comps.get(name, []):
    if instr.opcode == "parameter" or any(o in data for o in instr.operands):
      data.add(instr.name)
    out[instr.name] = _tags(instr) if instr.name in data else set()
    for callee in re.findall(r"\bcalls=%?([^\s,]+)", instr.attrs):
      if callee not in seen and callee != name and instr.name in data:
        for tags in _fused_tags(comps, callee, seen + (name,)).values():
          out[instr.name] = out[instr.name] | tags
  return out


def _launch_computations(comps, entry: str) -> list[str]:
  """The computations whose instructions launch (the ENTRY, loop bodies, called ones)."""
  out, todo = [], [entry]
  while todo:
    name = todo.pop()
    if name in out or name not in comps:
      continue
    out.append(name)
    for instr in comps[name]:
      if instr.opcode == "while":
        todo += [c for c in re.findall(r"\b(?:body|condition)=%?([^\s,]+)", instr.attrs)]
      elif instr.opcode in ("call", "async-start", "conditional"):
        todo += re.findall(
          r"\b(?:to_apply|calls|true_computation|false_computation)=%?([^\s,]+)", instr.attrs
        )
        m = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
        todo += [b.strip().lstrip("%") for b in m.group(1).split(",")] if m else []
  return out


def _elements(type_text: str) -> list[tuple[str, int]]:
  return [(dtype, math.prod(dims)) for dtype, dims in shapes(type_text)]


def _is_x(type_text: str, size: int) -> bool:
  """A single float array of `size` elements (a compress op's input, maybe reshaped)."""
  arrays = _elements(type_text)
  return len(arrays) == 1 and arrays[0][0] in _FLOAT and arrays[0][1] == size


def _is_x_bits(type_text: str, call: KernelCall) -> bool:
  """x as a kernel takes it: a float array of its size, or its bits (bfloat16 as uint16)."""
  arrays = _elements(type_text)
  if _is_x(type_text, call.size):
    return True
  bits = {2: "u16", 4: "u32"}.get(np.dtype(call.dtype).itemsize)
  return len(arrays) == 1 and arrays[0] == (bits, call.size)


@dataclasses.dataclass
class _Launch:
  name: str
  computation: str
  instr: object
  bytes: float
  tags: set[int]
  fused: dict  # instruction name -> tags (fusions; empty for custom calls)


def _launches(comps, entry, target) -> list[_Launch]:
  spec = jact.gpu_target(target)
  out = []
  for comp in _launch_computations(comps, entry):
    types = {i.name: i.type for i in comps[comp]}
    for instr in comps[comp]:
      op = _launched(instr, types, comps, spec)
      if op is None or instr.opcode in ("while", "call", "conditional", "async-start"):
        continue
      callee = re.search(r"\bcalls=%?([^\s,]+)", instr.attrs) if instr.opcode == "fusion" else None
      fused = _fused_tags(comps, callee.group(1)) if callee else {}
      tags = set().union(_tags(instr), *fused.values())
      out.append(_Launch(instr.name, comp, instr, op.bytes, tags, fused))
  return out


def _source(by_name: dict, name: str) -> tuple[str, int | None]:
  """(defining instruction, tuple index) of a value, through bitcasts and get-tuple-elements."""
  index = None
  instr = by_name.get(name)
  while instr is not None:
    if instr.opcode == "bitcast" and instr.operands:
      instr = by_name.get(instr.operands[0])
    elif instr.opcode == "get-tuple-element" and instr.operands and index is None:
      index = int(re.search(r"index=(\d+)", instr.attrs).group(1))
      instr = by_name.get(instr.operands[0])
    else:
      return instr.name, index
  return name, index


def _readers(comps, comp: str, launched: set[str]) -> dict:
  """(instruction, tuple index) of each value of `comp` -> the launched ops reading it."""
  by_name = {i.name: i for i in comps[comp]}
  out: dict = {}
  for instr in comps[comp]:
    if instr.name in launched:
      for o in set(instr.operands):
        out.setdefault(_source(by_name, o), set()).add(instr.name)
  return out


_LAYOUT = ("bitcast", "reshape", "transpose", "copy", "convert")


def _layout_chain(body: dict, name: str, tags: dict) -> list:
  """The untagged layout ops (bitcast, reshape, transpose, copy, convert) from `name` down to
  the value they rearrange: [name's instruction, ..., the source]."""
  chain = []
  instr = body.get(name)
  while instr is not None:
    chain.append(instr)
    if instr.opcode not in _LAYOUT or len(instr.operands) != 1 or tags.get(instr.name):
      break
    instr = body.get(instr.operands[0])
  return chain


def _root_outputs(comps, fused_comp: str) -> list[str]:
  """Names of a fused computation's outputs (through bitcasts)."""
  instrs = comps.get(fused_comp, [])
  if not instrs:
    return []
  by_name = {i.name: i for i in instrs}
  root = instrs[-1]
  outs = list(root.operands) if root.opcode == "tuple" else [root.name]
  resolved = []
  for o in outs:
    instr = by_name.get(o)
    while instr is not None and instr.opcode == "bitcast" and instr.operands:
      instr = by_name.get(instr.operands[0])
    resolved.append(instr.name if instr is not None else o)
  return resolved


def _callee(instr) -> str | None:
  """The fused computation a fusion calls (None for other ops)."""
  m = re.search(r"\bcalls=%?([^\s,]+)", instr.attrs) if instr.opcode == "fusion" else None
  return m.group(1) if m else None


def _entries(
  launch: _Launch, comps, call: KernelCall, numbers: dict[str, int]
) -> tuple[bool, list[int], list[int]]:
  """How the compress op's input x enters its tagged instructions in fusion `launch`:
  (computed there, the fusion outputs that are x, the fusion operands that are x read from HBM).
  x is a float array of the input's size reaching a tagged instruction through untagged layout
  ops (a copy of x the fusion reads counts as x). `numbers`: parameter name -> its number."""
  callee = _callee(launch.instr)
  if not callee:
    return False, [], []
  body = {i.name: i for i in comps[callee]}
  outputs = _root_outputs(comps, callee)
  computed, written, read = False, set(), set()
  for instr in body.values():
    if call.tag not in launch.fused.get(instr.name, set()):
      continue
    for o in instr.operands:
      chain = _layout_chain(body, o, launch.fused)
      if not chain or call.tag in launch.fused.get(o, set()) or not _is_x(chain[0].type, call.size):
        continue
      if chain[-1].opcode == "parameter":
        read.add(numbers[chain[-1].name])
      else:
        computed = True
        written |= {outputs.index(c.name) for c in chain if c.name in outputs}
  return computed, sorted(written), sorted(read)


def residuals(text: str, calls: list[KernelCall], target: str = "h200") -> list[dict]:
  """One row per forward compress call of `calls` found in the optimized HLO `text`
  (see the module docstring for the fields)."""
  comps, entry = parse_module(text)
  numbers = {name: int(n) for name, n in _PARAMETER.findall(text)}  # names are module-unique
  launches = _launches(comps, entry, target)
  launched = {l.name for l in launches}
  bytes_of = {l.name: l.bytes for l in launches}
  by_comp = {c: {i.name: i for i in comps[c]} for c in {l.computation for l in launches}}
  readers_of = {c: _readers(comps, c, launched) for c in by_comp}
  rows = []
  for call in calls:
    if call.op not in COMPRESS_OPS:
      continue
    ops = [l for l in launches if call.tag in l.tags]
    one_pass = recomputed = read_back = kernel = False
    x_reads, x_buffers = 0, set()
    for launch in ops:
      by_name = by_comp[launch.computation]
      if launch.instr.opcode == "fusion":
        computed, outputs, read = _entries(launch, comps, call, numbers)
        x_operands = [launch.instr.operands[i] for i in read]
        many = len(_root_outputs(comps, _callee(launch.instr))) > 1
        x_buffers |= {(launch.computation, (launch.name, i if many else None)) for i in outputs}
        one_pass |= computed and bool(outputs)
        recomputed |= computed and not outputs
      else:  # a kernel: its operands of x's size are x (or x's bits)
        x_operands = [o for o in launch.instr.operands if _is_x_bits(by_name[o].type, call)]
        kernel = True
      read_back |= bool(x_operands)
      x_reads += len(x_operands)
      x_buffers |= {(launch.computation, _source(by_name, o)) for o in x_operands}
    readers = set()
    for comp, source in x_buffers:
      readers.update(readers_of[comp].get(source, ()))
    placement = (  # a kernel reads x from HBM, whatever fusions its operand's bitcast joined
      "read back"
      if kernel or (read_back and not (one_pass or recomputed))
      else "one pass"
      if one_pass
      else "recomputed"
      if recomputed
      else "?"
    )
    rows.append(
      {
        "tag": call.tag,
        "op": call.op,
        "implementation": call.implementation,
        "shape": list(call.shape),
        "dtype": call.dtype,
        **dict(call.static),
        "x_bytes": call.size * _itemsize(call.dtype),
        "compress_ops": len(ops),
        "compress_ops_bytes": sum(l.bytes for l in ops),
        "compress_ops_shared": sum(len(l.tags) > 1 for l in ops),
        "placement": placement,
        "x_reads": x_reads,
        "x_readers": len(readers),
        "x_readers_bytes": sum(bytes_of[r] for r in readers),
      }
    )
  return rows


def _itemsize(dtype: str) -> int:
  return np.dtype(dtype).itemsize


# ----------------------------------------------------------------------------- Triton calls

_CONFIG = re.compile(r'backend_config="((?:[^"\\]|\\.)*)"')
_PALLAS_CONFIG = re.compile(r"backend_config=(\{.*\})\s*$")


def _kernel_identity(instr) -> tuple[str, str]:
  """(kernel name, a hash of its code) of a Triton custom call: Pallas' Triton IR with its
  launch parameters (the grid apart), or jax-triton's PTX (its launch grid and scalars apart)."""
  target = re.search(r'custom_call_target="([^"]*)"', instr.attrs).group(1)
  if target == "triton_kernel_call":
    m = _CONFIG.search(instr.attrs)
    config = zlib.decompress(codecs.escape_decode(m.group(1).encode("latin-1"))[0])
    names = re.findall(rb"jact_[a-z0-9_]+", config)
    start = config.find(b"//\n// Generated by LLVM NVPTX")
    end = config.rfind(b"// -- End function")
    code = config[start:end] if 0 <= start < end else config
    name = names[0].decode() if names else "?"
  else:
    config = instr.attrs[instr.attrs.find("backend_config=") :]
    m = re.search(r'\bname = "([^"]*)"', config)
    name = m.group(1) if m else "?"
    code = re.sub(r"grid_[xyz] = \d+ : i32", "", config).encode()
  return name, hashlib.sha1(code).hexdigest()[:12]


def triton_calls(text: str) -> dict:
  """jact's Triton kernel calls in an optimized HLO: call sites and distinct kernels (distinct
  code, i.e. Triton compiles), in all and per kernel name."""
  comps, _ = parse_module(text)
  by_name: dict[str, list[str]] = {}
  for instrs in comps.values():
    for instr in instrs:
      if instr.opcode != "custom-call":
        continue
      if not re.search(
        r'custom_call_target="(triton_kernel_call|__gpu\$xla\.gpu\.triton)"', instr.attrs
      ):
        continue
      name, code = _kernel_identity(instr)
      by_name.setdefault(name, []).append(code)
  return {
    "call_sites": sum(len(v) for v in by_name.values()),
    "distinct": sum(len(set(v)) for v in by_name.values()),
    "by_kernel": {
      k: {"call_sites": len(v), "distinct": len(set(v))} for k, v in sorted(by_name.items())
    },
  }


# ----------------------------------------------------------------------------- compiling


@contextlib.contextmanager
def _timing_compile(record: dict, fallback: dict | None):
  """Records the CPU and wall seconds spent in `jax.stages.Lowered.compile`. Where XLA:GPU's
  Triton gemm tiling fails without a GPU to autotune on ("Couldn't find output tile sizes"), the
  same lowered program is compiled again with `fallback` options (seconds of that compile)."""
  original = jax.stages.Lowered.compile

  def timed(self, options):
    cpu, wall = time.process_time(), time.perf_counter()
    try:
      return original(self, compiler_options=options)
    finally:
      record["compile_cpu_s"] = time.process_time() - cpu
      record["compile_wall_s"] = time.perf_counter() - wall

  def compile(self, compiler_options=None):
    try:
      return timed(self, compiler_options)
    except jax.errors.JaxRuntimeError as e:
      if fallback is None or "output tile sizes" not in str(e):
        raise
      record["compiler_options"] = fallback
      record["failed_compile_cpu_s"] = round(record["compile_cpu_s"], 2)
      return timed(self, {**(compiler_options or {}), **fallback})

  with patched(jax.stages.Lowered, "compile", compile):
    yield


def compile_timed(step, args, target: str, fallback: dict | None = frontier.CUBLAS_ONLY):
  """`jact.compile_for(step, *args)` traced once, and its seconds: trace + lower, XLA:GPU's
  compile (and the compiler options of a fallback compile, see `_timing_compile`)."""
  record: dict = {}
  cpu, wall = time.process_time(), time.perf_counter()
  with _timing_compile(record, fallback):
    compiled = jact.compile_for(step, *args, target=target)
  total_cpu, total_wall = time.process_time() - cpu, time.perf_counter() - wall
  failed = record.get("failed_compile_cpu_s", 0.0)
  seconds = {
    "trace_lower_cpu_s": round(total_cpu - record["compile_cpu_s"] - failed, 2),
    "compile_cpu_s": round(record["compile_cpu_s"], 2),
    "trace_lower_wall_s": round(total_wall - record["compile_wall_s"], 2),
    "compile_wall_s": round(record["compile_wall_s"], 2),
  }
  extra = {k: record[k] for k in ("compiler_options", "failed_compile_cpu_s") if k in record}
  return compiled, {**seconds, **extra}


def _config(bits: int | None) -> str:
  return "plain" if bits is None else f"jact{bits}"


def measure(model, bits: int | None, mode: str, target: str = "h200") -> dict:
  """One program's row: compile seconds, launches and bytes, Triton calls, residuals."""
  step = jax.value_and_grad(model.loss(frontier.wrap_for(_config(bits))))
  args = (model.params, model.batch, jax.random.key(0))
  with contextlib.ExitStack() as stack:
    if mode == "xla":
      stack.enter_context(_xla_everywhere())
    calls = stack.enter_context(tagged_kernels())
    compiled, seconds = compile_timed(step, args, target)
  text = compiled.as_text()
  predicted = predict_step_time(text, target)
  rows = residuals(text, calls, target)
  comps, entry = parse_module(text)
  launches = _launches(comps, entry, target)
  ops_of = lambda kind: [l for l in launches if any(calls[t].op in kind for t in l.tags)]
  compress, decompress = ops_of(COMPRESS_OPS), ops_of(DECOMPRESS_OPS)
  implementations: dict[str, dict[str, int]] = {}
  for c in calls:
    implementations.setdefault(c.op, {})
    implementations[c.op][c.implementation] = implementations[c.op].get(c.implementation, 0) + 1
  classes = {
    (c.op, c.implementation, c.dtype, c.static) for c in calls if c.implementation != "xla"
  }
  row = {
    **seconds,
    "launches": predicted.kernels,
    "bytes_accessed": predicted.bytes_accessed,
    "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
    "compress_launches": len(compress),
    "compress_launches_bytes": sum(l.bytes for l in compress),
    "decompress_launches": len(decompress),
    "decompress_launches_bytes": sum(l.bytes for l in decompress),
    "kernel_calls": len(calls),
    "implementations": implementations,
    "triton": {**triton_calls(text), "shape_classes": len(classes)},
    "residuals": residual_groups(rows),
    "summary": _summary(rows),
  }
  return row


def residual_groups(rows: list[dict]) -> list[dict]:
  """`residuals` rows grouped by op and input (shape, dtype, keyword arguments), in trace order:
  how many, their placements, their launches, reads of x and readers summed, and the fewest
  launches one of them takes."""
  groups: dict[tuple, dict] = {}
  fixed = ("tag", "placement", "compress_ops", "compress_ops_bytes", "compress_ops_shared")
  summed = ("compress_ops", "compress_ops_shared", "x_reads", "x_readers", "x_readers_bytes")
  for r in rows:
    head = {k: v for k, v in r.items() if k not in fixed + summed}
    g = groups.setdefault(
      json.dumps(head, sort_keys=True),
      {**head, "count": 0, "placements": {}, **{k: 0 for k in summed}},
    )
    g["count"] += 1
    g["compress_ops_min"] = min(g.get("compress_ops_min", r["compress_ops"]), r["compress_ops"])
    g["placements"][r["placement"]] = g["placements"].get(r["placement"], 0) + 1
    for k in summed:
      g[k] += r[k]
  return list(groups.values())


def _summary(rows: list[dict]) -> dict:
  """Totals over a program's compressed residuals."""
  total = lambda key: sum(r[key] for r in rows)
  return {
    "residuals": len(rows),
    **{p: sum(r["placement"] == p for r in rows) for p in PLACEMENTS},
    **{k: total(k) for k in ("x_bytes", "compress_ops", "x_reads", "x_readers")},
    "x_readers_bytes": total("x_readers_bytes"),
  }


# ----------------------------------------------------------------------------- the run


def _key(row: dict) -> tuple:
  return (row["model"], row["attention"], row["config"], row["mode"])


def _order(row: dict) -> tuple:
  """Rows by model (the frontier's order), then plain, then width and mode."""
  models = list(frontier_models.MODELS)
  model = models.index(row["model"]) if row["model"] in models else len(models)
  return (model, row["attention"], row["config"] != "plain", row["config"], row["mode"] or "")


def _with_ratios(rows: list[dict]) -> None:
  """Each jact row's figures over its model's plain row (`vs_plain`)."""
  plain = {(r["model"], r["attention"]): r for r in rows if r["config"] == "plain"}
  for r in rows:
    p = plain.get((r["model"], r["attention"]))
    if r["config"] == "plain" or p is None:
      continue
    total = lambda row, kind: row[f"trace_lower_{kind}_s"] + row[f"compile_{kind}_s"]
    r["vs_plain"] = {
      "compile_cpu": round(r["compile_cpu_s"] / max(p["compile_cpu_s"], 1e-9), 2),
      "trace_lower_cpu": round(r["trace_lower_cpu_s"] / max(p["trace_lower_cpu_s"], 1e-9), 2),
      "total_cpu": round(total(r, "cpu") / max(total(p, "cpu"), 1e-9), 2),
      "launches": round(r["launches"] / p["launches"], 3),
      "bytes_accessed": round(r["bytes_accessed"] / p["bytes_accessed"], 3),
    }


def _input(group: dict) -> str:
  """A residual group's op and input, whatever implementation took it."""
  skip = ("implementation", "count", "placements", "compress_ops", "compress_ops_shared")
  skip += ("x_reads", "x_readers", "x_readers_bytes", "compress_ops_min")
  return json.dumps({k: v for k, v in group.items() if k not in skip}, sort_keys=True)


def evidence(rows: list[dict]) -> list[dict]:
  """Per model, width, op and input (shape, dtype): the XLA quantizer's placements, launches
  and reads of x next to the kernel's -- what a deviceless compile can say about the
  registry's choice (no timing: on a GPU the choice must be measured)."""
  by = {_key(r): r for r in rows}
  out = []
  for (model, attention, config, mode), xla in sorted(by.items(), key=str):
    kernel = by.get((model, attention, config, "kernel"))
    if mode != "xla" or kernel is None:
      continue
    kernels: dict[str, dict] = {}
    for g in kernel["residuals"]:  # calls the kernel does not take keep the reference
      b = kernels.setdefault(_input(g), {"count": 0, "implementation": [], "placements": {}})
      b["implementation"].append(g["implementation"])
      for k in ("count", "compress_ops", "x_reads"):
        b[k] = b.get(k, 0) + g[k]
      for p, n in g["placements"].items():
        b["placements"][p] = b["placements"].get(p, 0) + n
    for a in xla["residuals"]:
      b = kernels.get(_input(a))
      if b is None or b["count"] != a["count"]:
        raise RuntimeError(f"{model} {config}: the two programs traced different calls")
      out.append(
        {
          "model": model,
          "attention": attention,
          "config": config,
          "op": a["op"],
          "shape": a["shape"],
          "dtype": a["dtype"],
          "bits": a.get("bits"),
          "residuals": a["count"],
          "x_bytes": a["x_bytes"],
          "kernel": "/".join(b["implementation"]),
          **{f"xla_{k}": a[k] for k in ("placements", "compress_ops", "x_reads")},
          **{f"kernel_{k}": b[k] for k in ("placements", "compress_ops", "x_reads")},
        }
      )
  return out


def _print(row: dict) -> None:
  s = row["summary"]
  t = row["triton"]
  ratio = row.get("vs_plain", {})
  print(
    f"{row['model']:13s} {row['config']:6s} {row['mode'] or '-':6s} "
    f"trace+lower {row['trace_lower_cpu_s']:6.1f} s  compile {row['compile_cpu_s']:6.1f} s "
    f"(x{ratio.get('compile_cpu', 1):.1f})  launches {row['launches']:5d}  "
    f"{row['bytes_accessed'] / 2**30:7.2f} GiB  residuals {s['residuals']:3d} "
    f"(one pass {s['one pass']}, recomputed {s['recomputed']}, read back {s['read back']}; "
    f"{s['x_reads']} reads of x)  triton {t['call_sites']} sites / "
    f"{t['distinct']} kernels",
    flush=True,
  )


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
  parser.add_argument("--bits", nargs="+", type=int, default=[2, 4])
  parser.add_argument("--modes", nargs="+", default=["xla", "kernel"], choices=["xla", "kernel"])
  parser.add_argument("--attention", default="xla", help="the models' attention (frontier's)")
  parser.add_argument("--target", default="h200")
  parser.add_argument("--small", action="store_true", help="tiny models: a quick check")
  parser.add_argument("--fresh", action="store_true", help="ignore rows already in the JSON")
  parser.add_argument("--json", default=str(paths.RESULTS / "gpu_fusion.json"))
  args = parser.parse_args(argv)
  path = pathlib.Path(args.json)
  payload = json.loads(path.read_text()) if path.exists() and not args.fresh else {"rows": []}
  runs = payload.get("meta", {}).get("runs", [])
  payload["meta"] = metadata.run_metadata(
    "experiments.bench.gpu_fusion",
    argv,
    target=args.target,
    compiler="XLA:GPU, deviceless (jact.compile_for), on this CPU machine: nothing ran on a GPU",
    step="jax.value_and_grad(loss), jact.compressed per block (experiments.bench.frontier)",
    jax_triton_kernels=[op for op, _, _ in jact.kernels.JAX_TRITON_KERNELS],
    note="no timing: launches and bytes accessed only; the XLA-vs-kernel choice on a GPU "
    "must be made by measurement there",
  )
  payload["meta"]["runs"] = [*runs, payload["meta"]["command"]]
  done = {_key(r) for r in payload["rows"]}
  for name in args.models:
    with _compat.cudnn_for_target(jact.gpu_target(args.target).cudnn_version):
      sizes = frontier.SMALL.get(name, {}) if args.small else {}
      model = frontier_models.build(name, attention=args.attention, **sizes)
    programs = [(None, None)] + [(b, m) for b in args.bits for m in args.modes]
    for bits, mode in programs:
      label = {"model": name, "attention": args.attention, "config": _config(bits), "mode": mode}
      if _key(label) in done:
        continue
      row = {**label, **measure(model, bits, mode, args.target)}
      payload["rows"].append(row)
      payload["rows"].sort(key=_order)
      _with_ratios(payload["rows"])
      payload["evidence"] = evidence(payload["rows"])
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(json.dumps(payload, indent=1) + "\n")
      _print(row)
  return payload


if __name__ == "__main__":
  main()
