"""linen `convert`: the calls that run through the generic engine.

Called from the interceptor of `convert.linen`: a layer with no twin
(`GENERIC`), a twin layer inside a scan that hides the 'jact' stream, and the
converted model's outermost method. Each runs as a lifted transform (the
module's variables and RNG streams passed in, its mutable collections passed
out, as `jact.compressed(LinenModule)` does) through `call_compressed`. The
module itself (and, for a layer, everything inside it) passes through the
interceptor unchanged while it runs there.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import flax.linen as nn

from jact._compat import flax as _compat
from jact._flax.context import LINEN_IN_MODEL, LINEN_OUTER_KEY, LINEN_PASS, bound
from jact._convert.settings import Settings
from jact._convert.generic import layout_recomputed, residual_config, saved_bytes, scan_key
from jact._flax.record import is_recording, record, recording
from jact._flax.compressed_linen import lift_compressed

# Flax layers with no twin whose calls run through the generic engine: all
# their residuals compressed, their inputs (activations) too. Cells are
# usually scanned over time (nn.RNN): their per-step residuals are small.
CELLS = (nn.LSTMCell, nn.OptimizedLSTMCell, nn.GRUCell, nn.SimpleCell, nn.MGUCell, nn.ConvLSTMCell)
GENERIC = (
  nn.DenseGeneral,
  nn.Einsum,
  nn.ConvTranspose,
  nn.ConvLocal,
  nn.GroupNorm,
  nn.InstanceNorm,
) + CELLS


def passes(module) -> bool:
  """Whether `module`'s call runs inside the engine call of itself or an ancestor."""
  current = LINEN_PASS.get()
  if current is None:
    return False
  path, descendants = current
  here = tuple(module.path)
  return here == path or (descendants and here[: len(path)] == path)


def _passing(module, descendants: bool):
  """Lets `module`'s call (and with `descendants`, its sublayers') through the interceptor."""
  return bound(LINEN_PASS, (tuple(module.path), descendants))


@contextlib.contextmanager
def outer_key(rngs) -> Iterator[None]:
  """Makes the 'jact' key of an `apply(..., rngs=)` the outer key (outermost apply only)."""
  key = rngs.get("jact") if isinstance(rngs, dict) else None
  if key is None or LINEN_OUTER_KEY.get() is not None:
    yield
    return
  with bound(LINEN_OUTER_KEY, key):
    yield


def name_of(module) -> str:
  return "/".join(module.path) or type(module).__name__


def key_for(module, settings: Settings, args, name: str | None = None) -> tuple[bool, Any]:
  """(compress?, key) of an engine call: the 'jact' stream's next key; inside a
  scan that hides the stream, `scan_key` of the outer apply's key (and of the
  call's `name`, default the module's path); no compression while initializing
  or without any key."""
  if module.is_initializing():
    return False, None
  if not settings.needs_key:
    return True, None
  if module.has_rng("jact"):
    return True, module.make_rng("jact")
  outer = LINEN_OUTER_KEY.get()
  if outer is not None:
    return True, scan_key(outer, name or name_of(module), args)
  return False, None


def hides_stream(module, settings: Settings) -> bool:
  """True inside a lifted transform (nn.scan, nn.RNN) that filtered out the 'jact'
  stream of a converted apply that has one: the twin cannot draw its key there."""
  return (
    settings.needs_key
    and not module.is_initializing()
    and not module.has_rng("jact")
    and LINEN_OUTER_KEY.get() is not None
  )


def _lifted(module, method: Callable, args, kwargs, transform) -> Any:
  return _compat.lift_method_call(module, type(module), method, transform, args, kwargs)


def engine_call(
  module,
  method: Callable,
  args,
  kwargs,
  settings: Settings,
  *,
  descendants: bool,
  scanned: bool = False,
  inputs: bool = True,
  policy: Callable | None = None,
  name: str | None = None,
) -> Any:
  """`method(module, *args, **kwargs)` with every residual compressed (the
  positional arguments too, when `inputs`: a layer's are activations); the plain
  call where `key_for` says so. `descendants`: the module's sublayers pass
  through the interceptor too (else they are converted as usual). `policy`: the
  call runs under `jax.checkpoint` with this policy (what it saves is
  compressed, the rest recomputed in the backward). `name`: the residuals'
  name (default: the module's path)."""
  name = name or name_of(module)
  compress, key = key_for(module, settings, args, name)
  with _passing(module, descendants):
    if not compress:
      return method(module, *args, **kwargs)

    def uncaptured(clone, *args, **kwargs):
      # with `capture_intermediates`, the intercepted module records its output itself
      with _compat.suppress_capture(clone):
        return method(clone, *args, **kwargs)

    config = residual_config(settings, name, scanned=scanned)
    if policy is None and scanned:
      policy = layout_recomputed
    transform = functools.partial(
      lift_compressed,
      key=key,
      compress=True,
      config=config,
      policy=policy,
      argnums=tuple(range(len(args))) if inputs else (),
      name_of=type(module),
    )
    return _lifted(module, uncaptured, args, kwargs, transform)


def measure(module, call: Callable, args, kwargs, *, descendants: bool) -> int:
  """Bytes `call(clone, *args, **kwargs)` keeps for the backward pass (parameters
  not counted), `clone` a copy of `module` bound to lifted scopes; traced
  abstractly, so nothing of it runs or stays."""
  result = {}

  def transform(core_fn):
    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
      def run(variable_groups, rng_groups, *args):
        return core_fn(scope_fn(variable_groups, rng_groups), *args, **kwargs)

      result["bytes"] = saved_bytes(run, (variable_groups, rng_groups, *args), kept={0, 1})
      return None, repack_fn(scope_fn(variable_groups, rng_groups))

    return _compat.pack_all(inner, name="jact_measure")

  with _passing(module, descendants), _compat.state_restored(module), recording():
    _lifted(module, call, args, kwargs, transform)  # layers inside: not recorded again
  return result["bytes"]


def note(
  module,
  how: str,
  reason: str,
  plain: Callable | None,
  converted: Callable | None,
  args,
  kwargs,
  *,
  descendants: bool,
) -> None:
  """Records this call (with measured bytes) when a conversion report is being taken."""
  if not is_recording():
    return
  if how == "plain" and LINEN_IN_MODEL.get():
    # inside the model's engine call: its residuals are compressed there
    how, converted = "model", None
  plain_bytes = saved = None
  if plain is not None:
    plain_bytes = measure(module, plain, args, kwargs, descendants=True)
  if converted is not None:
    saved = measure(module, converted, args, kwargs, descendants=descendants)
  record(
    name_of(module),
    type(module).__name__,
    how,
    reason,
    plain_bytes,
    plain_bytes if how == "plain" else saved,
  )
