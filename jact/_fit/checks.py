"""The argument checks of `jact.fit` and `jact.largest_batch`: each error names the
argument, the value given and what to give instead."""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Mapping

import jax
import numpy as np

__all__ = [
  "check_budget",
  "leaves_finite",
  "check_argnums",
  "check_calibration",
  "check_sensitivity",
  "check_key_parameter",
  "check_sharded",
  "check_batch_bounds",
  "batch_args",
]


def check_budget(budget_bytes, what: str = "budget_bytes") -> int:
  """`budget_bytes` as an int; a clear error for strings, floats, NaN and non-positive values."""
  if isinstance(budget_bytes, str):
    raise TypeError(
      f"{what} must be an int number of bytes, got the string {budget_bytes!r}: "
      f"write the number, e.g. {what}=2 * 2**30 for 2 GiB"
    )
  if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
    hint = (
      "" if not isinstance(budget_bytes, float) or math.isfinite(budget_bytes) else " (not finite)"
    )
    raise TypeError(
      f"{what} must be an int number of bytes, got {budget_bytes!r}{hint}: "
      f"e.g. {what}=int(0.5 * peak) or 2 * 2**30 for 2 GiB"
    )
  if budget_bytes <= 0:
    raise ValueError(f"{what} must be a positive number of bytes, got {budget_bytes}")
  return int(budget_bytes)


def check_argnums(argnums, n_args: int | None = None) -> tuple[int, ...]:
  """`argnums` as a tuple of argument positions, each below `n_args` when it is known."""
  one = isinstance(argnums, (int, np.integer)) and not isinstance(argnums, bool)
  try:
    out = (argnums,) if one else tuple(argnums)
  except TypeError:
    out = ()
  if (
    isinstance(argnums, str)
    or not out
    or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0 for i in out)
  ):
    raise ValueError(
      f"argnums must be a non-negative int or a non-empty tuple of them (the positions of "
      f"the differentiated arguments, e.g. argnums=0 for loss(params, batch)), got {argnums!r}"
    )
  out = tuple(int(i) for i in out)
  if n_args is not None and max(out) >= n_args:
    raise ValueError(
      f"argnums={argnums!r} names argument {max(out)}, but the loss is given {n_args} "
      f"example argument(s): use positions below {n_args}"
    )
  return out


def leaves_finite(tree) -> bool:
  """Whether every floating leaf of `tree` is finite (keys and integers are not checked)."""
  return all(
    bool(np.isfinite(np.asarray(x)).all())
    for x in jax.tree.leaves(tree)
    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
  )


def check_calibration(calibration, example_args: tuple) -> tuple | None:
  """`calibration` as a tuple of arrays shaped like `example_args` (structure, and every
  axis but the batch sizes), all finite; None stays None."""
  if calibration is None:
    return None
  if not isinstance(calibration, (tuple, list)):
    raise TypeError(
      f"calibration must be a tuple of the loss's arguments (like the example arguments), "
      f"got {type(calibration).__name__}: e.g. calibration=(params, x[:64])"
    )
  calibration = tuple(calibration)
  if len(calibration) != len(example_args):
    raise ValueError(
      f"calibration has {len(calibration)} argument(s), the example arguments {len(example_args)}: "
      f"give every argument of the loss, e.g. calibration=(params, x[:64])"
    )
  if jax.tree.structure(calibration) != jax.tree.structure(tuple(example_args)):
    raise ValueError(
      "calibration's structure differs from the example arguments': give the same pytrees "
      "(a smaller batch is fine), e.g. calibration=(params, x[:64])"
    )
  bad = [
    type(x).__name__
    for x in jax.tree.leaves(calibration)
    if not isinstance(x, (jax.Array, np.ndarray, np.generic))
  ]
  if bad:
    raise TypeError(
      f"calibration must hold real arrays (the sensitivities are measured on them), got "
      f"{bad[0]}: give jax or numpy arrays, or drop calibration= to use sizes"
    )
  if not leaves_finite(calibration):
    raise ValueError(
      "calibration holds NaN or inf values: the sensitivities measured on them would be "
      "meaningless; give a finite batch"
    )
  return calibration


def check_sensitivity(given, estimable: bool) -> dict[str, float]:
  """`sensitivity` (a mapping or a SensitivityState) as a dict of finite, non-negative
  floats; NaN entries are allowed only when they can be estimated (`estimable`)."""
  if given is None:
    return {}
  if hasattr(given, "as_dict"):
    given = given.as_dict()
  if not isinstance(given, Mapping):
    raise TypeError(
      f"sensitivity must be a mapping from residual names to c_l (or a "
      f"jact.sensitivity.SensitivityState), got {type(given).__name__}"
    )
  out = {}
  for name, c in given.items():
    if not isinstance(name, str):
      raise TypeError(f"sensitivity keys must be residual names (str), got {name!r}")
    try:
      c = float(c)
    except (TypeError, ValueError):
      raise TypeError(f"sensitivity[{name!r}] must be a number, got {c!r}") from None
    if math.isnan(c) and not estimable:
      raise ValueError(
        f"sensitivity[{name!r}] is NaN and there are no real arrays to estimate it on: give "
        f"a finite value, or calibration= arrays"
      )
    if c < 0 or math.isinf(c):
      raise ValueError(
        f"sensitivity[{name!r}] = {c} is not a sensitivity: give a finite value >= 0 "
        f"(or NaN to have it estimated on calibration arrays)"
      )
    out[name] = c
  return out


def check_key_parameter(loss_fn: Callable[..., Any], n_args: int) -> None:
  """A clear error when `loss_fn` takes a `key` the configured loss would swallow: the
  configured loss reserves the keyword `key` for its rounding noise."""
  try:
    params = inspect.signature(loss_fn).parameters
  except (TypeError, ValueError):
    return
  names = list(params)
  if "key" not in params:
    return
  p = params["key"]
  positional = (
    p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and names.index("key") < n_args
  )
  if not positional:
    raise ValueError(
      "loss_fn has its own parameter 'key', but the configured loss takes the keyword key= "
      "for its rounding noise: pass the loss's key positionally among the example arguments, "
      "or rename the parameter (e.g. rng)"
    )


def check_sharded(args: tuple) -> None:
  """Every sharded example argument divides evenly over its mesh axes."""
  for path, x in jax.tree_util.tree_leaves_with_path(args):
    sharding = getattr(x, "sharding", None)
    shape = getattr(x, "shape", None)
    if sharding is None or shape is None or not hasattr(sharding, "shard_shape"):
      continue
    try:
      sharding.shard_shape(tuple(shape))
    except ValueError as e:
      raise ValueError(
        f"example argument {jax.tree_util.keystr(path) or '(root)'} of shape {tuple(shape)} "
        f"does not divide over its sharding ({e}): make the sharded dimensions (the batch) "
        f"multiples of the mesh axes' sizes"
      ) from None


def check_batch_bounds(start, tolerance, max_batch) -> None:
  """`largest_batch`'s `start`, `tolerance` and `max_batch`."""
  for name, v in (("start", start), ("max_batch", max_batch)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{name} must be a positive int (a batch size), got {v!r}")
  if (
    isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1
  ):
    raise ValueError(f"tolerance must be in (0, 1) (e.g. 0.05), got {tolerance!r}")


def batch_args(args_for_batch: Callable[[int], Any], batch: int) -> tuple:
  """`args_for_batch(batch)` as a tuple, with a clear error when it is not one."""
  if not callable(args_for_batch):
    raise TypeError(
      f"args_for_batch must be a function batch -> example arguments, got "
      f"{type(args_for_batch).__name__}: e.g. lambda b: (params, jax.ShapeDtypeStruct((b, 64), "
      f"jnp.float32))"
    )
  args = args_for_batch(batch)
  if not isinstance(args, (tuple, list)):
    raise TypeError(
      f"args_for_batch({batch}) must return a tuple of the loss's arguments, got "
      f"{type(args).__name__}: e.g. return (params, x)"
    )
  return tuple(args)
