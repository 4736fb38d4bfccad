"""Every private or internal Flax access jact makes (written for flax 0.12.8).

jact's Flax integration reaches past Flax's public API for the lifted call
behind `jact.compressed(LinenModule)`, linen's method dispatcher and capture
stack behind `jact.convert`, binding a twin to a layer's scope, building an nnx
twin around a layer's own Variables, an RNG stream's key derivation, and which
Variables an nnx call replaced. Same convention as the JAX accessors: one small
function each (`linen`, `nnx`), naming the public replacement or what to watch,
its probe beside it; `check()` raises a `CompatError` naming each broken access.
Imported by jact's Flax modules only: `jact._compat` itself never imports Flax.
"""

from jact._compat._probes import CHECKS, CompatError, check
from jact._compat.flax.linen import (
  bind_to_scope,
  canonicalize_dtype,
  lift_method_call,
  lifted_target,
  pack_all,
  relift,
  remat_body,
  run_methods_within,
  state_restored,
  suppress_capture,
)
from jact._compat.flax.nnx import (
  attention_defaults,
  attention_signature,
  nnx_twin_of,
  peek_stream_key,
  replaced_variables,
  stream_key_shape,
  draw_first_of_stacked,
  trace_context_error,
  variable_values,
)

__all__ = [
  "CompatError",
  "CHECKS",
  "check",
  "pack_all",
  "lift_method_call",
  "state_restored",
  "run_methods_within",
  "suppress_capture",
  "bind_to_scope",
  "canonicalize_dtype",
  "lifted_target",
  "relift",
  "remat_body",
  "nnx_twin_of",
  "peek_stream_key",
  "stream_key_shape",
  "draw_first_of_stacked",
  "trace_context_error",
  "variable_values",
  "replaced_variables",
  "attention_signature",
  "attention_defaults",
]
