"""Compressed rematerialization and `jax.checkpoint` policies for jact residuals.

`checkpoint(fn, compress_argnums=...)` is `jax.checkpoint` whose saved values
are compressed (GACT's CB1): the forward pass keeps a quantized copy of the
segment inputs listed in `compress_argnums` (its activations; parameters stay
exact, the rule of `jact.compressed`) and of whatever `policy` saves; the
backward pass recomputes the segment from the reconstructed inputs, with
`fn`'s own residuals compressed by `jact.compressed`, and runs its VJP.

The policies select jact's compressed residuals by name for `jax.checkpoint`
(or `jact.checkpoint`): save them, or offload them to host memory (ActNN
L4 / GACT L2 swapping, the JAX way), and recompute everything else.

>>> import jax, jax.numpy as jnp, jact
>>> def block(w, x):
...   return x + jnp.tanh(x @ w)
>>> w, x = jnp.eye(256) / 16, jnp.ones((64, 256))
>>> ckpt = jact.checkpoint(block, bits=4, compress_argnums=(1,))
>>> loss = lambda w, x: ckpt(w, x, key=jax.random.key(0)).sum()
>>> jax.jit(jax.grad(loss, argnums=1))(w, x).shape
(64, 256)
>>> plain = jact.residual_report(lambda w, x: jax.checkpoint(block)(w, x).sum(), w, x)
>>> plain.total_bytes + plain.argument_bytes - w.nbytes   # plain remat keeps x: 64 KiB
65536
>>> jact.residual_report(loss, w, x).total_bytes   # a 4-bit copy of x + its 8-byte rounding key
8456
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax

from jact.compressors import Compressor
from jact import _compat
from jact._core import rng
from jact._engine.names import JACT_NAME_PREFIX, is_jact_name
from jact._engine.rounding import compressor_keywords, resolve_compressor
from jact._transforms._arguments import (
  check_argnums,
  check_policy,
  input_flags,
  reserved_key_check,
  returning_arrays,
)
from jact._transforms._modules import (
  CompressedModule,
  is_callable_pytree,
  module_argnums,
  module_call,
)
from jact._transforms.compressed import (
  DEFAULT_MIN_SIZE,
  ResidualConfig,
  call_compressed,
  compressed,
  over_array_leaves,
)

__all__ = [
  "checkpoint",
  "save_compressed",
  "offload_compressed",
  "save_inputs_only",
  "CompressedNamesPolicy",
]


@functools.lru_cache(maxsize=1024)
def _jax_policy(name: str | None, src: str | None, dst: str | None):
  """jax's own policy selecting the one checkpoint name `name` (none when None):
  saved on the device when `dst` is None, else offloaded from `src` to `dst`."""
  names = () if name is None else (name,)
  if dst is None:
    return jax.checkpoint_policies.save_only_these_names(*names)
  return jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=(),
    names_which_can_be_offloaded=names,
    offload_src=src,
    offload_dst=dst,
  )


@dataclasses.dataclass(frozen=True)
class CompressedNamesPolicy:
  """A `jax.checkpoint` policy that saves (or offloads) jact's compressed residuals.

  A value is selected when its `checkpoint_name` is in jact's reserved
  namespace (`jact._engine.names.tag` names every residual piece
  `JACT_NAME_PREFIX + name`) and `name` starts with one of `prefixes` (all
  jact residuals when `prefixes` is empty). Every other value, a user's own
  `checkpoint_name`s included, is recomputed. Like jax's policies, a
  decision depends on the named value alone, not on what else the process
  traced; it is delegated to `jax.checkpoint_policies.save_only_these_names`
  or `save_and_offload_only_these_names` for that one name.

  Attributes:
    prefixes: residual-name prefixes to select (empty: all).
    offload_to: None to keep selected values on the device, or a memory
      kind such as 'pinned_host' to offload them there.
    offload_from: the memory kind they are offloaded from.
  """

  prefixes: tuple[str, ...] = ()
  offload_to: str | None = None
  offload_from: str = "device"

  def selects(self, name: Any) -> bool:
    """Whether the `checkpoint_name` `name` is selected."""
    if not is_jact_name(name):
      return False
    residual = name[len(JACT_NAME_PREFIX) :]
    return not self.prefixes or any(residual.startswith(p) for p in self.prefixes)

  def __call__(self, prim, *avals, **params):
    name = _compat.policy_checkpoint_name(prim, params)
    chosen = name if self.selects(name) else None
    if self.offload_to is None:
      return _jax_policy(chosen, None, None)(prim, *avals, **params)
    return _jax_policy(chosen, self.offload_from, self.offload_to)(prim, *avals, **params)


def _check_prefixes(prefixes) -> tuple[str, ...]:
  for p in prefixes:
    if not isinstance(p, str) or not p:
      raise ValueError(f"residual-name prefixes must be non-empty strings, got {p!r}")
  return tuple(prefixes)


def save_compressed(*prefixes: str) -> CompressedNamesPolicy:
  """A `jax.checkpoint` policy that saves jact's compressed residuals by name.

  Under `jax.checkpoint(f, policy=jact.save_compressed(...))` (or as the
  `policy` of `jact.checkpoint`), the values kept for the backward pass are
  the residuals the jact ops and `jact.compressed` inside `f` stored
  compressed, selected by residual name (those starting with one of
  `prefixes`; all when none is given); every other value is recomputed. It
  compresses nothing itself and transforms no function: it is the
  name-selecting counterpart of `jax.checkpoint_policies.save_only_these_names`
  for jact's reserved residual names.

  Args:
    *prefixes: residual-name prefixes, e.g. "block" or "Dense_0".

  Returns:
    A policy for `jax.checkpoint(..., policy=...)` or `jact.checkpoint`.

  Example: `jax.checkpoint(jact.compressed(block, name="block"),
  policy=jact.save_compressed("block"))` stores only the compressed copies
  (the same memory as `jact.compressed` alone, but the block's output and other
  uncompressed values are recomputed instead of kept).
  """
  return CompressedNamesPolicy(_check_prefixes(prefixes))


def offload_compressed(
  *prefixes: str, src: str = "device", dst: str = "pinned_host"
) -> CompressedNamesPolicy:
  """Policy: offload jact's compressed residuals from `src` to `dst` memory
  (ActNN L4 / GACT L2 swapping), recompute everything else.

  On CPU the offload is a no-op; on GPU/TPU the compressed bytes live in
  pinned host memory between the forward and the backward pass.

  Args:
    *prefixes: residual-name prefixes (all jact residuals when none).
    src, dst: memory kinds, as in `jax.checkpoint_policies.save_and_offload_only_these_names`.
  """
  for kind, value in (("src", src), ("dst", dst)):
    if not isinstance(value, str) or not value:
      raise ValueError(
        f"{kind} must be a memory kind such as 'device' or 'pinned_host', got {value!r}"
      )
  return CompressedNamesPolicy(_check_prefixes(prefixes), offload_to=dst, offload_from=src)


def save_inputs_only():
  """Policy for `jact.checkpoint`: keep nothing but the compressed segment
  inputs (`jax.checkpoint_policies.nothing_saveable`)."""
  return jax.checkpoint_policies.nothing_saveable


def _plain_checkpoint(fn, policy, prevent_cse, check_key, config):
  """`fn` under plain `jax.checkpoint` (non-array leaves held fixed, `key=`
  accepted and unused): nothing is compressed, so nothing is rounded."""
  checked = returning_arrays(fn, "jact.checkpoint")

  @functools.wraps(fn)
  def wrapped(*args, key=None, **kwargs):
    check_key(args)
    call, values, _ = over_array_leaves(checked, args, kwargs)
    return jax.checkpoint(call, policy=policy, prevent_cse=prevent_cse)(*values)

  wrapped.residual_config = config
  return wrapped


def checkpoint(
  fn: Callable[..., Any] | None = None,
  *,
  policy: Callable[..., Any] | None = None,
  bits: int | None = 4,
  compressor: Compressor | None = None,
  min_size: int = DEFAULT_MIN_SIZE,
  name: str = "checkpoint",
  compress_argnums: Sequence[int] = (),
  prevent_cse: bool = True,
):
  """`jax.checkpoint` whose saved values are compressed (GACT CB1).

  The forward pass runs `fn` exactly and keeps compressed copies of the
  floating inputs in `compress_argnums` (the segment's activations) and of
  whatever `policy` saves; other inputs (parameters) are kept by reference,
  exact, as in `jact.compressed`.
  The backward pass recomputes `fn` from the reconstructed inputs, with its
  residuals compressed by `jact.compressed` (named `f"{name}.body.{i}"`),
  and runs its VJP. Recomputing from reconstructed inputs adds rounding
  noise to the whole segment's backward pass (GACT §5: negligible).

  Args:
    fn: the segment, a function of pytrees of arrays (non-array leaves are
      held fixed, as in `jact.compressed`), or a callable pytree such as an
      `eqx.Module` (see `jact.compressed`: the result is a pytree holding it).
    policy: a `jax.checkpoint` policy for the recomputation (default: save
      nothing, i.e. `save_inputs_only()`); values it saves are compressed.
      `save_compressed()` keeps the body's compressed residuals instead of
      recomputing them.
    bits, compressor, min_size: compression settings (see `jact.compressed`).
    name: residual-name prefix: inputs are `f"{name}.{i}"`, the body's
      residuals `f"{name}.body.{i}"`.
    compress_argnums: positions of the arguments that are the segment's
      activations (e.g. `(1,)` for `block(params, x)`): the forward pass keeps
      a compressed copy of their floating leaves instead of the argument.
      Every other argument, keyword arguments included, is kept by reference
      and exact (parameters are alive anyway): the rule and the default `()`
      of `jact.compressed`. With none listed and a policy that saves nothing
      (None, `save_inputs_only()`), nothing is stored compressed and the
      segment is plain `jax.checkpoint`, its recomputation exact too (`bits`
      and `key` unused): a UserWarning says so.
    prevent_cse: as in `jax.checkpoint`.

  Returns:
    `wrapped(*args, key=None, **kwargs)`.
  """
  resolved = resolve_compressor(bits, compressor, "jact.checkpoint")
  check_policy(policy, "jact.checkpoint")
  if fn is None:
    return functools.partial(
      checkpoint,
      policy=policy,
      **compressor_keywords(resolved),
      min_size=min_size,
      name=name,
      compress_argnums=compress_argnums,
      prevent_cse=prevent_cse,
    )
  if not callable(fn):
    raise TypeError(f"jact.checkpoint takes a function, got {type(fn).__name__}")
  if is_callable_pytree(fn):  # an Equinox module: its parameters stay leaves of the wrapper
    return CompressedModule(
      fn,
      checkpoint(
        module_call(fn),
        policy=policy,
        **compressor_keywords(resolved),
        min_size=min_size,
        name=name,
        compress_argnums=module_argnums(check_argnums(compress_argnums)),
        prevent_cse=prevent_cse,
      ),
    )
  check_key = reserved_key_check(fn, "jact.checkpoint")
  compress_argnums = check_argnums(compress_argnums)
  config = ResidualConfig(resolved, min_size, name)
  if not compress_argnums and (
    policy is None or policy is jax.checkpoint_policies.nothing_saveable
  ):
    name_of_fn = getattr(fn, "__name__", type(fn).__name__)
    warnings.warn(
      f"jact.checkpoint({name_of_fn}) stores nothing compressed: no argument is listed in "
      f"compress_argnums and the policy saves nothing, so it is plain jax.checkpoint (inputs "
      f"kept by reference, the recomputation exact). List the segment's activation "
      f"arguments, e.g. compress_argnums=(1,) for block(params, x) or (0,) for a module "
      f"called as module(x), to keep a compressed "
      f"copy of them instead (GACT CB1); parameters stay exact either way.",
      UserWarning,
      stacklevel=2,
    )
    return _plain_checkpoint(fn, policy, prevent_cse, check_key, config)
  body = compressed(
    returning_arrays(fn, "jact.checkpoint"),
    **compressor_keywords(resolved),
    min_size=min_size,
    name=f"{name}.body",
  )

  def rematted(key, args, kwargs):
    # Non-array leaves (flags, functions, strings) are held fixed, as in
    # jact.compressed: jax.checkpoint traces only the arrays.
    call, values, _ = over_array_leaves(body, args, {**kwargs, "key": key})
    return jax.checkpoint(call, policy=policy, prevent_cse=prevent_cse)(*values)

  @functools.wraps(fn)
  def wrapped(*args, key=None, **kwargs):
    check_key(args)
    body_key = None if key is None else jax.random.fold_in(rng.single_key(key), 1)
    flags = input_flags(fn, args, kwargs, compress_argnums)
    # The incoming cotangent of a segment in a residual stream is an elementwise
    # sum over all later segments' backward passes; unless it is materialized,
    # XLA re-fuses that chain into every earlier segment's backward and keeps
    # each segment's input cotangents alive to the end (measured: 1.2 MiB per
    # transformer block at small size, 9 MiB at 16x256x256).
    return call_compressed(
      lambda *a, **k: rematted(body_key, a, k),
      args,
      kwargs,
      key=key,
      config=config,
      compress_inputs=flags,
      materialize_cotangent=True,
    )

  wrapped.residual_config = config
  return wrapped
