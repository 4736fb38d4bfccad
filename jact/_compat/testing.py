"""Accessors only jact's tests use; nothing in jact imports this module.

`saved_residuals` falls back to `jax._src.ad_checkpoint`, which the library
itself has no reason to reach.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.ad_checkpoint
import jax.numpy as jnp
from jax._src import ad_checkpoint as _private_ad_checkpoint

from jact._compat._probes import probes

__all__ = ["saved_residuals"]


def saved_residuals(fn: Callable, *args, **kwargs) -> list[tuple[Any, str]]:
  """`(aval, description)` of every value `jax.vjp(fn, ...)` saves, as JAX
  describes it (no looking through barriers, unlike `jact.residual_report`).

  Public in jax < 0.10 as `jax.ad_checkpoint.saved_residuals`; removed in
  0.10 (only `print_saved_residuals`, which prints the list, remains), so
  this falls back to `jax._src.ad_checkpoint.saved_residuals`."""
  public = getattr(jax.ad_checkpoint, "saved_residuals", None)
  return (public or _private_ad_checkpoint.saved_residuals)(fn, *args, **kwargs)


@probes(saved_residuals="jax.ad_checkpoint.saved_residuals, or jax._src.ad_checkpoint's")
def _check_saved_residuals():
  x = jnp.arange(3.0)
  saved = saved_residuals(lambda x: jnp.sin(x).sum(), x)
  assert len(saved) == 1 and tuple(saved[0][0].shape) == (3,) and isinstance(saved[0][1], str), (
    f"saved_residuals(sin) gave {saved}"
  )
