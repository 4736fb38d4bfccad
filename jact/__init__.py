"""jact: activation compressed training for JAX and Flax.

Each layer keeps a compressed, stochastically rounded copy of what its
backward pass needs instead of the full-precision activation.

>>> import jax, jax.numpy as jnp, jact
>>> x = jnp.linspace(-1.0, 1.0, 512).reshape(2, 256)
>>> packed = jact.quantize(x, jax.random.key(0), bits=2)
>>> packed.nbytes, x.nbytes
(136, 2048)
>>> jact.dequantize(packed).shape
(2, 256)
"""

# The public API: one `from module import name as name` per name (the
# redundant alias marks an explicit re-export for type checkers), and
# `__all__` lists the same names.
from jact import acgc as acgc
from jact import allocate as allocate
from jact import levels as levels
from jact import rng as rng
from jact import sensitivity as sensitivity
from jact import compressors as compressors
from jact import kernels as kernels
from jact import ops as ops
from jact._planning.controller import CompressionVarianceWarning as CompressionVarianceWarning
from jact._planning.controller import Controller as Controller
from jact._planning.controller import ControllerState as ControllerState
from jact import nn as nn
from jact import nnx as nnx
from jact._convert import convert as convert
from jact._convert import conversion_report as conversion_report
from jact._planning.plan import BitPlan as BitPlan
from jact._planning.plan import UnknownResidualWarning as UnknownResidualWarning
from jact._planning.plan import planned as planned
from jact._planning.plan import use_plan as use_plan
from jact._core.quantize import Packed as Packed
from jact._core.packing import PackedBits as PackedBits
from jact._core.packing import pack_codes as pack_codes
from jact._core.packing import unpack_codes as unpack_codes
from jact.kernels._quantize.api import dequantize as dequantize
from jact.kernels._quantize.api import quantize as quantize
from jact._transforms.checkpoint import checkpoint as checkpoint
from jact._transforms.checkpoint import offload_compressed as offload_compressed
from jact._transforms.checkpoint import save_compressed as save_compressed
from jact._transforms.checkpoint import save_inputs_only as save_inputs_only
from jact._compiled_memory import CompiledMemory as CompiledMemory
from jact._report import ResidualReport as ResidualReport
from jact._compiled_memory import compiled_memory as compiled_memory
from jact._gpu_target import GpuTarget as GpuTarget
from jact._gpu_target import GpuCompilerMissing as GpuCompilerMissing
from jact._gpu_target import compile_for as compile_for
from jact._gpu_target import gpu_target as gpu_target
from jact._step_time import StepTime as StepTime
from jact._step_time import predict_step_time as predict_step_time
from jact._report import residual_report as residual_report
from jact._transforms.compressed import compressed as compressed
from jact._engine.sharding import sharded_batch as sharded_batch
from jact._fit.batch import LargestBatch as LargestBatch
from jact._fit.batch import largest_batch as largest_batch
from jact._fit.result import Fit as Fit
from jact._fit.result import FitError as FitError
from jact._fit.search import fit as fit
from jact._fit.segments import segment as segment

__version__ = "0.1.0"

__all__ = [
  "quantize",
  "dequantize",
  "Packed",
  "PackedBits",
  "pack_codes",
  "unpack_codes",
  "ops",
  "nn",
  "nnx",
  "rng",
  "compressors",
  "kernels",
  "sensitivity",
  "acgc",
  "allocate",
  "levels",
  "Controller",
  "ControllerState",
  "CompressionVarianceWarning",
  "residual_report",
  "compiled_memory",
  "ResidualReport",
  "CompiledMemory",
  "compile_for",
  "gpu_target",
  "GpuTarget",
  "GpuCompilerMissing",
  "predict_step_time",
  "StepTime",
  "compressed",
  "sharded_batch",
  "checkpoint",
  "convert",
  "conversion_report",
  "save_compressed",
  "offload_compressed",
  "save_inputs_only",
  "BitPlan",
  "use_plan",
  "planned",
  "UnknownResidualWarning",
  "fit",
  "Fit",
  "FitError",
  "segment",
  "largest_batch",
  "LargestBatch",
]
