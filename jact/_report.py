"""Memory reports: the residuals a backward pass keeps, and compiled memory.

Two views of the memory a training step needs (they can disagree: XLA may
fuse, duplicate or reschedule and keep a full-precision tensor alive that the
residual list no longer names):

* `residual_report(fn, *args)` lists every value `fn`'s VJP saves for the
  backward pass (traced with `jax.vjp`, nothing runs), with its
  `checkpoint_name` if it has one. Values that *are* `fn`'s arguments (weights,
  inputs) are alive anyway and are counted apart from `total_bytes`.
* `compiled_memory(fn, *args)` (`jact._compiled_memory`) compiles `jax.jit(fn)`
  and reads XLA's buffer sizes.

>>> import jax, jax.numpy as jnp
>>> x = jnp.ones((4, 256))
>>> r = residual_report(lambda x: jnp.sin(x).sum(), x)  # keeps cos(x)
>>> r.total_bytes == x.nbytes, r.argument_bytes
(True, 0)
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Callable

import jax
import numpy as np

from jact import _compat, kernels
from jact._engine.names import JACT_NAME_PREFIX
from jact._transforms.compressed import over_array_leaves

__all__ = [
  "Residual",
  "ResidualGroup",
  "ResidualReport",
  "residual_report",
  "format_bytes",
]

_PATH = re.compile(r"(?:[^\s(]*/)([^/\s:]+:\d+)")


def format_bytes(n: int) -> str:
  """Human-readable binary byte count.

  >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**30)
  ('512 B', '1.50 KiB', '3.00 GiB')
  """
  n = int(n)
  if abs(n) < 1024:
    return f"{n} B"
  value = float(n)
  for unit in ("KiB", "MiB", "GiB", "TiB"):
    value /= 1024.0
    if abs(value) < 1024 or unit == "TiB":
      break
  return f"{value:.2f} {unit}"


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
  size = int(np.prod(shape, dtype=np.int64)) if shape else 1
  return size * int(dtype.itemsize)


def _count(n: int, word: str) -> str:
  return f"{n} {word}{'' if n == 1 else 's'}"


def _short_source(source: str) -> str:
  """Drops directories from file paths in a residual description."""
  return _PATH.sub(r"\1", source)


# ----------------------------------------------------------------------------- residuals


@dataclasses.dataclass(frozen=True)
class Residual:
  """One value saved for the backward pass.

  Attributes:
    name: its `checkpoint_name`, or None when unnamed.
    shape: array shape.
    dtype: array dtype.
    bytes: size in bytes (elements x itemsize).
    source: where it comes from, worded like jax's `saved_residuals`:
      "from the argument x", "named 'dense.lhs' from file:line (fn)",
      "output of cos from file:line (fn)", ...
    is_argument: the value is one of fn's (flattened) arguments, alive anyway
      (possibly under a name: an uncompressed input saved as `dense.lhs`).
    kernel: the Pallas kernel that wrote it ("jact_quantize", ... -- see
      `jact.kernels`), or "xla" for values XLA computes.
  """

  name: str | None
  shape: tuple[int, ...]
  dtype: Any
  bytes: int
  source: str
  is_argument: bool
  kernel: str = "xla"


@dataclasses.dataclass(frozen=True)
class ResidualGroup:
  """The pieces saved under one name (a `Packed` is codes + minimum + scale).

  `name` is None for the group of all unnamed, non-argument residuals.
  """

  name: str | None
  pieces: tuple[Residual, ...]

  @property
  def bytes(self) -> int:
    return sum(p.bytes for p in self.pieces)


@dataclasses.dataclass(frozen=True)
class ResidualReport:
  """Every residual of a function's VJP; see `residual_report`.

  Attributes:
    residuals: one row per saved value, in the order the VJP keeps them.
  """

  residuals: tuple[Residual, ...]

  @property
  def total_bytes(self) -> int:
    """Bytes saved for the backward pass, EXCLUDING fn's own arguments."""
    return sum(r.bytes for r in self.residuals if not r.is_argument)

  @property
  def argument_bytes(self) -> int:
    """Bytes of residuals that are fn's arguments (alive anyway)."""
    return sum(r.bytes for r in self.residuals if r.is_argument)

  def by_name(self) -> dict[str | None, ResidualGroup]:
    """Non-argument residuals grouped by name (None: the unnamed ones).

    Keys are in order of first appearance; the bytes of all groups add up
    to `total_bytes`.
    """
    groups: dict[str | None, list[Residual]] = {}
    for r in self.residuals:
      if not r.is_argument:
        groups.setdefault(r.name, []).append(r)
    return {k: ResidualGroup(k, tuple(v)) for k, v in groups.items()}

  def kernels(self) -> dict[str | None, str]:
    """Residual name -> the kernel(s) that wrote its pieces ("xla" or a Pallas
    kernel's name, comma-separated when they differ); shows which
    implementation `jact.kernels` selected."""
    found: dict[str | None, list[str]] = {}
    for r in self.residuals:
      if not r.is_argument:
        kinds = found.setdefault(r.name, [])
        if r.kernel not in kinds:
          kinds.append(r.kernel)
    return {k: ",".join(v) for k, v in found.items()}

  def __str__(self) -> str:
    with_kernel = any(r.kernel != "xla" for r in self.residuals)
    rows = [
      ("name", "shape", "dtype", "bytes") + (("kernel",) if with_kernel else ()) + ("source",)
    ]
    for r in self.residuals:
      rows.append(
        (
          r.name or ("(argument)" if r.is_argument else "-"),
          "[" + ",".join(map(str, r.shape)) + "]",
          str(r.dtype),
          format_bytes(r.bytes),
        )
        + ((r.kernel,) if with_kernel else ())
        + (_short_source(r.source),)
      )
    cols = len(rows[0]) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(cols)]
    lines = [
      "  ".join(
        [c.ljust(w) if i != 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row[:cols], widths))]
        + [row[cols]]
      )
      for row in rows
    ]
    lines.append(
      f"saved for backward: {format_bytes(self.total_bytes)} "
      f"in {_count(sum(not r.is_argument for r in self.residuals), 'array')} "
      f"(+ {format_bytes(self.argument_bytes)} of fn's own arguments)"
    )
    groups = self.by_name()
    if any(k is not None for k in groups):
      lines.append("by name:")
      width = max(len(k or "(unnamed)") for k in groups)
      for k, g in groups.items():
        lines.append(
          f"  {(k or '(unnamed)').ljust(width)}  {format_bytes(g.bytes):>10}"
          f"  ({_count(len(g.pieces), 'piece')})"
        )
    return "\n".join(lines)

  def print(self) -> None:
    """Prints the table (`print(str(report))`)."""
    print(str(self))


def residual_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ResidualReport:
  """Lists what `jax.vjp(fn, *args, **kwargs)` saves for the backward pass.

  Traces `fn` abstractly (nothing is computed), so `args` may be arrays or
  `jax.ShapeDtypeStruct`s. `fn` must return an array (typically a scalar
  loss) or a pytree of arrays -- whatever `jax.vjp` accepts; all its array
  arguments, including keyword arguments, count as arguments. Residuals that
  are arguments are flagged `is_argument` and left out of `total_bytes`.

  The trace and the wording of `Residual.source` follow
  `jax.ad_checkpoint.saved_residuals`, but optimization barriers (which jact
  ops put around their residuals) and jitted functions are looked through,
  so names and arguments behind them are still recognised (a named residual
  that is just an argument is flagged `is_argument`); a buffer saved twice
  counts once. Names inside `scan`/`cond`/`jax.checkpoint` bodies are
  not looked into: such residuals read "output of <primitive>".

  Args:
    fn: the function to differentiate, e.g. a loss of (params, batch).
    args, kwargs: its positional and keyword arguments (pytrees of arrays).

  Inside `jact.kernels.lowering_for("cuda")` the report is that of the
  program lowered for cuda: its residuals name the GPU kernels that write them.

  Residuals a `jax.shard_map` inside `fn` saves are reported as one device
  keeps them (their shape inside the body), under their names, and a
  replicated argument the body keeps counts as that argument, once.

  Returns:
    A `ResidualReport`; `print(report)` shows a table.

  >>> import jax, jax.numpy as jnp
  >>> from jact.ops._linear import dense
  >>> x, w = jnp.ones((8, 512)), jnp.ones((512, 4))
  >>> r = residual_report(lambda x, w: dense(x, w, key=jax.random.key(0), bits=2).sum(), x, w)
  >>> g = r.by_name()["dense.lhs"]   # 2-bit codes + bf16 min and scale per group of 256
  >>> len(g.pieces), g.bytes == 8 * 512 * 2 // 8 + 8 * 2 * 4, r.argument_bytes == w.nbytes
  (3, True, True)
  """
  _check_callable(fn, "residual_report")
  rows, seen = [], set()
  for aval, name, source, var, is_argument, kernel in _saved_values(fn, args, kwargs):
    if var is not None:
      if var in seen:  # the same buffer saved twice (e.g. through a barrier) counts once
        continue
      seen.add(var)
    shape = tuple(int(d) for d in aval.shape)
    rows.append(
      Residual(
        name=name,
        shape=shape,
        dtype=aval.dtype,
        bytes=_nbytes(shape, aval.dtype),
        source=source,
        is_argument=is_argument,
        kernel=kernel,
      )
    )
  return ResidualReport(tuple(rows))


def _arg_names(fn, args, kwargs) -> list[str]:
  """Names of the flattened arguments, like jax's ("x", "params['w']", "scale")."""
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    params = []
  positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  star = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
  names = []
  for path, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
    which, head, rest = path[0].idx, path[1], path[2:]
    if which == 1:
      base = str(head.key)
    elif head.idx < len(positional):
      base = positional[head.idx]
    else:
      base = f"{star or 'args'}[{head.idx - len(positional) if star else head.idx}]"
    names.append(base + jax.tree_util.keystr(tuple(rest)))
  return names


def _shown_name(name: str | None) -> str | None:
  """A residual name as reports show it: jact's reserved-namespace copy of a
  residual name (see `jact._engine.names.tag`) without its prefix."""
  if name is not None and name.startswith(JACT_NAME_PREFIX):
    return name[len(JACT_NAME_PREFIX) :]
  return name


def _lowering_platform() -> str:
  """The platform whose `lax.platform_dependent` branches reports follow: the one of an
  enclosing `jact.kernels.lowering_for`, else this machine's."""
  targets = kernels.REGISTRY.lowering_targets()
  return targets[0] if targets else _compat.lowering_platform()


def _inner_jaxpr(eqn, producer_map, jaxpr):
  """The body of a call-like eqn (jit, closed_call) whose ins/outs map 1:1, or the
  branch of a `lax.platform_dependent` cond that runs on this machine's platform
  (its operands follow the branch index); else None."""
  producer_of = lambda v: producer_map(jaxpr).get(v, (None,))[0]
  branch = _compat.platform_dependent_branch(eqn, producer_of, _lowering_platform())
  if branch is not None:
    return branch
  body = _compat.call_body(eqn)
  return _compat.shard_map_body(eqn) if body is None else body.jaxpr


def _kernel_of(eqn, jaxpr, producer_map) -> str:
  """The GPU kernel (Pallas or jax-triton) behind a value produced by `eqn` (through
  reshapes), or "xla"."""
  while _compat.is_view(eqn):
    found = producer_map(jaxpr).get(eqn.invars[0])
    if found is None:
      return "xla"
    eqn = found[0]
  return _compat.kernel_launch_name(eqn) or "xla"


def _check_callable(fn, api: str) -> None:
  if not callable(fn):
    raise TypeError(
      f"jact.{api}: fn must be the function to measure (e.g. a loss or a "
      f"training step), got {type(fn).__name__} {fn!r:.40}; pass it first: "
      f"jact.{api}(fn, *args)"
    )


def _is_traceable(leaf) -> bool:
  """Whether `leaf` is traced as an argument: an array or an abstract one.
  Other leaves (Python numbers and flags, functions) are static, as in
  `jact.compressed` and `equinox.filter_vjp`."""
  return _compat.is_jax_value(leaf) or isinstance(
    leaf, (np.ndarray, np.generic, jax.ShapeDtypeStruct)
  )


def _over_traceable_leaves(fn, args, kwargs):
  """`(call, values, {})`: `call(*values)` is `fn(*args, **kwargs)` with the
  traceable leaves passed in and every other leaf held fixed (unchanged
  when all leaves are traceable)."""
  if all(_is_traceable(leaf) for leaf in jax.tree_util.tree_leaves((args, kwargs))):
    return fn, args, kwargs
  call, values, _ = over_array_leaves(fn, args, kwargs, is_dynamic=_is_traceable)
  return call, values, {}


def _saved_values(fn, args, kwargs):
  """(aval, name, description, identity, is_argument, kernel) of every residual of jax.vjp(fn, ...).

  Like `jax.ad_checkpoint.saved_residuals` (same trace, same wording), but
  looks through identity-like producers -- optimization barriers, which jact
  ops put around their residuals, reduce_precision, checkpoint names -- and
  into jitted functions, so a residual keeps its `checkpoint_name` and an
  argument passed through a barrier or a name is still recognised as one.
  """
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))

  def unflattened(*leaves):
    a, k = jax.tree_util.tree_unflatten(treedef, leaves)
    return fn(*a, **k)

  # Leaves JAX cannot trace (an Equinox module's activation function, a
  # flag) are held fixed, as `jact.compressed` holds them.
  dynamic = [i for i, leaf in enumerate(leaves) if _is_traceable(leaf)]
  flat_fn, values, _ = _over_traceable_leaves(unflattened, tuple(leaves), {})
  closed, out_shape = jax.make_jaxpr(lambda *l: jax.vjp(flat_fn, *l), return_shape=True)(*values)
  top = closed.jaxpr
  num_res = len(_compat.vjp_residuals(out_shape[1])[0])
  all_names = _arg_names(fn, args, kwargs)
  arg_names = [all_names[i] for i in dynamic]
  producers: dict[int, dict] = {}

  def producer_map(jaxpr):
    if id(jaxpr) not in producers:
      producers[id(jaxpr)] = {v: (e, i) for e in jaxpr.eqns for i, v in enumerate(e.outvars)}
    return producers[id(jaxpr)]

  for v in top.outvars[len(top.outvars) - num_res :]:
    aval, name, named_src = v.aval, None, ""
    stack = []  # (call eqn, outer jaxpr) frames entered through jitted functions
    jaxpr = top
    while True:
      if _compat.is_literal(v):
        yield aval, name, "from a literal", None, False, "xla"
        break
      if v in jaxpr.invars:
        if stack:  # an input of a jitted function: continue with the caller's operand
          j = jaxpr.invars.index(v)
          eqn, jaxpr = stack.pop()
          v = _compat.body_operand(eqn, j)
          continue
        arg = f"the argument {arg_names[top.invars.index(v)]}"
        yield aval, name, f"{named_src}, {arg}" if name else f"from {arg}", v, True, "xla"
        break
      if v in jaxpr.constvars:
        yield aval, name, f"{named_src}, a constant" if name else "from a constant", v, False, "xla"
        break
      eqn, i = producer_map(jaxpr)[v]
      through = _compat.passthrough_operand(eqn, i)
      if through is not None:
        v = through
        continue
      inner = _inner_jaxpr(eqn, producer_map, jaxpr)
      if inner is not None:
        stack.append((eqn, jaxpr))
        jaxpr, v = inner, inner.outvars[i]
        if _compat.shard_map_body(eqn) is not None:
          aval = v.aval  # one device's value: shard_map's output stacks the devices' values
        continue
      eqn_name = _shown_name(_compat.checkpoint_name(eqn))
      if eqn_name is not None:  # an identity too: keep the outermost name, look further
        if name is None:
          name, named_src = eqn_name, f"named '{eqn_name}' from {_compat.summarize_source(eqn)}"
        v = eqn.invars[0]
        continue
      if name is not None:
        src = named_src
      elif _compat.is_call(eqn):
        src = (
          f"output of jitted function '{_compat.call_name(eqn)}' from "
          f"{_compat.summarize_source(eqn)}"
        )
      else:
        src = f"output of {eqn.primitive.name} from {_compat.summarize_source(eqn)}"
      yield aval, name, src, v, False, _kernel_of(eqn, jaxpr, producer_map)
      break
