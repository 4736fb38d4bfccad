"""`segment`: mark a part of a loss function that `jact.fit` may compress or rematerialize.

A segment is a function of pytrees of arrays (a block of a model) with a name
unique in the loss. Called outside `jact.fit`'s configured loss it is the
plain function: marking costs nothing. Inside it, the configuration decides:

* compress: `jact.compressed(fn, name=name, compress_argnums=...)`, its
  residuals named `f"{name}.{i}"`;
* remat (compressed rematerialization, GACT CB1: `jact.checkpoint`): only a
  compressed copy of the activation arguments (`compress_argnums`) is kept,
  named `f"{name}.remat.{i}"`; the backward pass recomputes the segment from
  their reconstructions, its residuals compressed for the segment's own
  backward only (`f"{name}.remat.body.{i}"`). Offered for segments with
  activation arguments only.

>>> import jax, jax.numpy as jnp, jact
>>> block = jact.segment(lambda w, x: jnp.tanh(x @ w), name="block0", compress_argnums=(1,))
>>> w, x = jnp.eye(4), jnp.ones((2, 4))
>>> bool(jnp.all(block(w, x) == jnp.tanh(x @ w)))   # outside fit: the plain function
True
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import zlib
from typing import Any, Callable, Iterator, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

from jact._engine import context as _context
from jact._transforms._arguments import check_argnums, returning_arrays
from jact._transforms.checkpoint import checkpoint
from jact._transforms.compressed import compressed

__all__ = ["segment", "Layout", "configured", "discovering", "SEGMENT_BITS", "JAX_POLICIES"]

SEGMENT_BITS = 4  # call-site width of a segment's residuals (fit's plans name every one)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Which segments are rematerialized (the rest are compressed); hashable. With `policy`
  (a name of `JAX_POLICIES`) every segment is instead JAX's own `jax.checkpoint` with that
  policy: nothing compressed, exact gradients."""

  remat: frozenset[str] = frozenset()
  policy: str | None = None
  every_residual: bool = False  # compress floating residuals of any size (calibration batches)


def _offload_inputs(names: Sequence[str]):
  return jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=list(names),
    offload_src="device",
    offload_dst="pinned_host",
  )


# JAX's rematerialization policies fit weighs against jact's configurations (per segment).
JAX_POLICIES = {
  "nothing_saveable": lambda name: jax.checkpoint_policies.nothing_saveable,
  "dots_saveable": lambda name: jax.checkpoint_policies.dots_saveable,
  "dots_with_no_batch_dims_saveable": (
    lambda name: jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  ),
  # the segment's activation arguments kept on the host, everything else recomputed
  "offload_inputs": lambda name: _offload_inputs([f"{name}.input"]),
}


@dataclasses.dataclass
class _Discovery:
  """What a discovery trace saw: segment names in call order and, per segment,
  the residual names recorded while it was traced."""

  order: list[str] = dataclasses.field(default_factory=list)
  rematerializable: set[str] = dataclasses.field(default_factory=set)
  members: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  owners: dict[str, Any] = dataclasses.field(default_factory=dict)

  def claim(self, name: str, owner: Any) -> None:
    """Records that `owner` (a segment) runs under `name`; two segments sharing one
    name would share their residuals' names, so that is an error."""
    if self.owners.setdefault(name, owner) is not owner:
      raise ValueError(
        f"jact.fit: two different jact.segment blocks are named {name!r}; a segment's name "
        f"must be unique in the loss (its residuals are named after it): give each its own, "
        f"e.g. name=f'block{{i}}'"
      )

  def attribute(self, names) -> None:
    """Gives each residual of `names` named after a segment (`f"{segment}.{i}"`,
    `.remat.{i}`, `.remat.body.{i}`) to that segment, wherever it was recorded: a
    transformation (`lax.scan`, `jax.vmap`) may compress a segment's residuals after its
    call returned. Others stay with the segment whose call recorded them."""
    for n in names:
      owner = max((s for s in self.members if n.startswith(s + ".")), key=len, default=None)
      if owner is None or n in self.members[owner]:
        continue
      for ns in self.members.values():
        if n in ns:
          ns.remove(n)
      self.members[owner].append(n)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jact_fit_active", default=None)
_DISCOVERY: contextvars.ContextVar = contextvars.ContextVar("jact_fit_discovery", default=None)
# Part of every jit / checkpoint cache key (a JAX user context): each configured trace gets a
# fresh value, so a segment behind an inner `jax.jit` or `jax.checkpoint` is traced again
# under the current layout, plan and recorder instead of replaying a trace cached for another.
_TRACE_CONTEXT = jax.make_user_context(None)
_TRACES = itertools.count()


@contextlib.contextmanager
def configured(layout: Layout, key) -> Iterator[None]:
  """Segments traced inside the block follow `layout`, drawing rounding noise from `key`."""
  token = _ACTIVE.set((layout, key))
  try:
    with _TRACE_CONTEXT(("jact.fit", next(_TRACES))):
      yield
  finally:
    _ACTIVE.reset(token)


@contextlib.contextmanager
def discovering() -> Iterator[_Discovery]:
  """Records which segments run (in order) and which residuals each one records."""
  found = _Discovery()
  token = _DISCOVERY.set(found)
  try:
    yield found
  finally:
    _DISCOVERY.reset(token)


def _segment_key(key, name: str):
  if key is None:
    return None
  return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def segment(
  fn: Callable[..., Any] | None = None, *, name: str, compress_argnums: Sequence[int] = ()
):
  """Marks `fn` as a segment `jact.fit` may compress or rematerialize.

  Args:
    fn: the segment: a function of pytrees of arrays (non-array leaves are
      held fixed). Can be used as a decorator with keywords only.
    name: the segment's name, unique among the segments of one loss (e.g.
      `f"block{i}"`); its residuals are named after it.
    compress_argnums: positions of the arguments that are activations (e.g.
      `(1,)` for `block(params, x)`): rematerialization keeps a compressed copy
      of them; every other argument (parameters) is kept by reference.

  Returns:
    `wrapped(*args, **kwargs)`: `fn` itself outside `jact.fit`'s configured
    loss, the configured segment inside it.
  """
  if not isinstance(name, str) or not name or name.endswith(".") or ".remat" in name:
    raise ValueError(
      f"jact.segment needs a non-empty name without '.remat' and no trailing '.', got {name!r}"
    )
  argnums = check_argnums(compress_argnums)
  if fn is None:
    return functools.partial(segment, name=name, compress_argnums=argnums)
  if not callable(fn):
    raise TypeError(f"jact.segment takes a function, got {type(fn).__name__}")
  checked = returning_arrays(fn, "jact.segment")

  @functools.cache
  def modes(min_size: int | None):
    """(compressed, rematerialized) forms of the segment; `min_size=1` compresses every
    floating residual (the sensitivities of a smaller calibration batch)."""
    size = {} if min_size is None else dict(min_size=min_size)
    compress = compressed(checked, bits=SEGMENT_BITS, name=name, compress_argnums=argnums, **size)
    remat = (
      checkpoint(checked, bits=SEGMENT_BITS, name=f"{name}.remat", compress_argnums=argnums, **size)
      if argnums
      else None
    )
    return compress, remat

  modes(None)  # the settings are checked when the segment is made

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    active = _ACTIVE.get()
    if active is None:
      return fn(*args, **kwargs)
    layout, key = active
    found = _DISCOVERY.get()
    recorder = _context.current("recorder")
    before = set(recorder.sites) if (found is not None and recorder is not None) else None
    key = _segment_key(key, name)
    compress_mode, remat_mode = modes(1 if layout.every_residual else None)
    if layout.policy is not None:
      out = _with_policy(fn, name, argnums, layout.policy)(*args, **kwargs)
    elif name in layout.remat and remat_mode is not None:
      out = remat_mode(*args, key=key, **kwargs)
    else:
      out = compress_mode(*args, key=key, **kwargs)
    if found is not None:
      found.claim(name, wrapped)
    if before is not None and name not in found.members:  # (a retrace sees it again)
      found.order.append(name)
      if argnums:
        found.rematerializable.add(name)
      found.members[name] = [n for n in recorder.sites if n not in before]
    return out

  wrapped.segment_name = name
  return wrapped


def _with_policy(fn, name: str, argnums: tuple[int, ...], policy: str):
  """`fn` under `jax.checkpoint` with JAX's `policy`; its activation arguments named
  `f"{name}.input"` (what "offload_inputs" moves to the host)."""

  def named(*args, **kwargs):
    args = list(args)
    for i in argnums:
      if i < len(args):
        args[i] = jax.tree.map(lambda v: checkpoint_name(v, f"{name}.input"), args[i])
    return fn(*args, **kwargs)

  return jax.checkpoint(named, policy=JAX_POLICIES[policy](name))
