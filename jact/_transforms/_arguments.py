"""Argument checks shared by `jact.compressed`, `jact.checkpoint` and the levels: each gives a
clear error naming the argument and the fix."""

from __future__ import annotations

import inspect
from typing import Callable

import jax

from jact._transforms._vjp_residuals import is_array


def check_policy(policy, api: str) -> None:
  """A clear error unless `policy` is None or a `jax.checkpoint` policy (a callable)."""
  if policy is None or callable(policy):
    return
  hint = ""
  if isinstance(policy, str):
    import difflib  # pylint: disable=import-outside-toplevel

    known = [n for n in dir(jax.checkpoint_policies) if not n.startswith("_")]
    close = difflib.get_close_matches(policy, known, n=1, cutoff=0.3) or ["dots_saveable"]
    hint = f", e.g. policy=jax.checkpoint_policies.{close[0]}"
  raise TypeError(
    f"{api}: policy must be a jax.checkpoint policy -- a function such as "
    f"jax.checkpoint_policies.dots_saveable or jact.save_compressed() -- or None, got "
    f"{type(policy).__name__} {policy!r:.60}; pass the policy object itself{hint}"
  )


def check_argnums(argnums) -> tuple[int, ...]:
  if isinstance(argnums, int) and not isinstance(argnums, bool):
    argnums = (argnums,)
  try:
    argnums = tuple(argnums)
  except TypeError:
    argnums = (argnums,)
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in argnums):
    raise ValueError(
      f"compress_argnums must be non-negative ints (positions of the activation "
      f"arguments, e.g. compress_argnums=(1,) for block(params, x)), got "
      f"{argnums!r}"
    )
  return argnums


def input_flags(fn, args, kwargs, argnums) -> tuple[bool, ...]:
  """One flag per leaf of (args, kwargs): store a compressed copy of it? Only
  the leaves of the positional arguments in `argnums` are; keyword arguments
  never are (the rule of `compressed` and `jact.checkpoint`)."""
  if any(i >= len(args) for i in argnums):
    raise ValueError(
      f"compress_argnums={argnums} but {getattr(fn, '__name__', 'fn')} got "
      f"{len(args)} positional arguments: list positions below {len(args)}, "
      f"and pass the activations positionally"
    )
  flags = []
  for i, a in enumerate(args):
    flags += [i in argnums] * len(jax.tree.leaves(a))
  flags += [False] * len(jax.tree.leaves(kwargs))
  return tuple(flags)


def _fn_name(fn) -> str:
  return getattr(fn, "__name__", type(fn).__name__)


def reserved_key_check(fn, api: str) -> Callable[[tuple], None]:
  """A call-time check for a required parameter `key` of `fn` that a call
  leaves unfilled: the wrapper takes `key=` as its own rounding key."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):  # no signature to read (some builtins)
    params = {}
  param = params.get("key")
  if (
    param is None
    or param.default is not param.empty
    or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
  ):
    return lambda args: None
  positional = param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
  index = list(params).index("key")

  def check(args):
    if positional and len(args) > index:
      return  # fn's own key passed positionally
    raise TypeError(
      f"{api}: {_fn_name(fn)} needs its own parameter `key`, but the keyword `key=` is "
      f"reserved by jact.compressed / jact.checkpoint for the PRNG key of stochastic "
      f"rounding and is not passed on. Rename the parameter (e.g. `rng`), pass it "
      f"positionally, or bind it before wrapping: "
      f"{api}(functools.partial({_fn_name(fn)}, key=k))."
    )

  return check


def returning_arrays(fn, api: str):
  """`fn` whose outputs are checked by `check_outputs` when it is traced."""

  def checked(*args, **kwargs):
    return check_outputs(fn(*args, **kwargs), fn, api)

  checked.__name__ = _fn_name(fn)
  return checked


def check_outputs(out, fn, api: str):
  """`out` when it is a non-empty pytree of arrays, else a TypeError naming the fix."""
  leaves = jax.tree_util.tree_leaves_with_path(out)
  bad = next(((path, leaf) for path, leaf in leaves if not is_array(leaf)), None)
  if leaves and bad is None:
    return out
  if bad is not None:
    where = f" at output{jax.tree_util.keystr(bad[0])}" if bad[0] else ""
    what = f"{type(bad[1]).__name__} {bad[1]!r:.40}{where}"
  else:
    what = f"{out!r:.40}, which holds no array"
  raise TypeError(
    f"{api}: {_fn_name(fn)} returned {what}; a wrapped function must return an array or a "
    f"pytree of arrays (what the backward pass differentiates). Return numbers as arrays "
    f"(jnp.asarray(...)), and return strings, None or other Python values from outside "
    f"the wrapped function."
  )
