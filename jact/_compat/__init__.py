"""Every private or undocumented JAX access jact makes, one package split by upstream area.

Each accessor is a small function in the module of its area (`jaxpr`,
`primitives`, `calls`, `vjp`, `sharding`, `pallas`, `gpu_aot`) whose docstring names the
public API that would replace it (or "none public" and what to watch), with
its probe beside it (`@probes(name="what it reads")`). `check()` runs the
probes and raises one `CompatError` naming each access the installed JAX
changed. Nothing else in jact touches `jax._src`, `jax.core`, `jax.extend`,
`jax.interpreters` or equation parameters (tests/compat/test_compat.py greps for it).

This package re-exports every JAX accessor and imports only JAX: it sits
below every other jact module. The Flax accessors live in `jact._compat.flax`
(imported by jact's Flax modules only), the tests' helpers in
`jact._compat.testing` (imported by tests only); both follow the same convention.
"""

from jact._compat._probes import CHECKS, CompatError, check
from jact._compat.jaxpr import (
  summarize_source,
  is_var,
  is_literal,
  literal_value,
  eval_jaxpr,
  prune_jaxpr,
  is_tracer,
  is_jax_value,
  on_device,
  barrier_operand,
  register_pass_through,
  passthrough_operand,
  is_view,
)
from jact._compat.primitives import (
  max_window_geometry,
  is_reduction,
  reduced_axes,
  is_row_link,
  elementwise_kind,
  is_layout_primitive,
  conv_kwargs,
  linear_identity_primitive,
  platform_lowered_primitive,
  lowering_is_partitioned,
)
from jact._compat.calls import (
  is_call,
  call_body,
  call_name,
  shard_map_body,
  nested_output,
  ScanParts,
  scan_parts,
  platform_dependent_branch,
  body_operand,
)
from jact._compat.vjp import (
  checkpoint_name,
  policy_checkpoint_name,
  vjp_residuals,
  rebuild_vjp,
  current_trace,
  jit_traces_since,
  abstract_evaluation,
  defvjp_batching_shared_outputs,
)
from jact._compat.sharding import (
  varying_axes,
  cast_varying,
  union_of_varying_axes,
  leading_axis_sharded,
  bind_eqn,
  is_static_shape,
  bound_axis_sizes,
  axes_bound,
)
from jact._compat.pallas import (
  lowering_platform,
  pallas_kernel_name,
  lower_for_cuda,
  gpu_mesh_context,
  has_pallas_triton,
  pallas_triton_deprecated,
  has_jax_triton,
  kernel_launch_name,
  import_jax_triton,
)
from jact._compat.gpu_aot import cuda_devices, cudnn_for_target

__all__ = [
  "CompatError",
  "CHECKS",
  "check",
  "summarize_source",
  "is_var",
  "is_literal",
  "literal_value",
  "eval_jaxpr",
  "prune_jaxpr",
  "is_tracer",
  "is_jax_value",
  "on_device",
  "barrier_operand",
  "register_pass_through",
  "passthrough_operand",
  "is_view",
  "max_window_geometry",
  "is_reduction",
  "reduced_axes",
  "is_row_link",
  "elementwise_kind",
  "is_layout_primitive",
  "conv_kwargs",
  "linear_identity_primitive",
  "platform_lowered_primitive",
  "lowering_is_partitioned",
  "is_call",
  "call_body",
  "call_name",
  "shard_map_body",
  "nested_output",
  "ScanParts",
  "scan_parts",
  "platform_dependent_branch",
  "body_operand",
  "checkpoint_name",
  "policy_checkpoint_name",
  "vjp_residuals",
  "rebuild_vjp",
  "current_trace",
  "jit_traces_since",
  "abstract_evaluation",
  "defvjp_batching_shared_outputs",
  "varying_axes",
  "cast_varying",
  "union_of_varying_axes",
  "leading_axis_sharded",
  "bind_eqn",
  "is_static_shape",
  "bound_axis_sizes",
  "axes_bound",
  "lowering_platform",
  "pallas_kernel_name",
  "gpu_mesh_context",
  "cuda_devices",
  "cudnn_for_target",
  "lower_for_cuda",
  "has_pallas_triton",
  "pallas_triton_deprecated",
  "has_jax_triton",
  "kernel_launch_name",
  "import_jax_triton",
]
