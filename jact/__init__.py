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

from jact.planning import acgc, levels, sensitivity
from jact.core import allocate, rng
from jact import compressors, ops
from jact.planning.controller import CompressionVarianceWarning, Controller, ControllerState
from jact.flax import linen as nn
from jact.flax import nnx
from jact.flax.convert import convert
from jact.planning.plan import BitPlan, UnknownResidualWarning, planned, use_plan
from jact.core.quantize import Packed
from jact.core.packing import PackedBits, pack_codes, unpack_codes
from jact.kernels.api import dequantize, quantize
from jact.transforms.checkpoint import (checkpoint, offload_compressed, save_compressed,
                                        save_inputs_only)
from jact.report import CompiledMemory, ResidualReport, compiled_memory, residual_report
from jact.transforms.compressed import compressed

__version__ = "0.1.0"

__all__ = [
    "quantize", "dequantize", "Packed", "PackedBits", "pack_codes", "unpack_codes",
    "ops", "nn", "nnx", "rng", "compressors", "sensitivity", "acgc", "allocate", "levels",
    "Controller", "ControllerState", "CompressionVarianceWarning",
    "residual_report", "compiled_memory", "ResidualReport", "CompiledMemory",
    "compressed", "checkpoint", "convert", "save_compressed", "offload_compressed", "save_inputs_only",
    "BitPlan", "use_plan", "planned", "UnknownResidualWarning",
]
