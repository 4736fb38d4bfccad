"""`convert`: make an existing, unmodified Flax model save compressed activations.

ActNN's model converter in the Flax idiom. The model's code is not touched and
its variables are kept (same tree, same values: a plain checkpoint loads);
what changes is that its Dense/Conv/norm/embedding/dropout/attention layers
run the jact twins' logic (`jact.nn.*`, `jact.nnx.*`), which keep a
stochastically rounded low-bit copy of what the backward pass needs. The
forward values are unchanged.

* **linen** -- method interception. `convert(Model(...))` returns a copy of the
  module whose class is a subclass of the model's class (same name, same
  fields plus `jact_bits`, `jact_group_size`, `jact_stochastic`, `jact_strict`).
  While any of its methods runs (`init`, `apply`, `method=...`, a bound
  module, or as a submodule of a bigger model), `flax.linen.intercept_methods`
  redirects every `__call__` of a supported Flax layer to the twin built from
  that layer's own settings and bound to the layer's own scope, so parameters
  keep their paths. Rounding noise comes from the 'jact' RNG stream of
  `apply` -- in every apply that runs a converted layer, inference included
  (for inference, apply the plain model to the same variables); `init`
  needs none. Inside `nn.scan`, list 'jact' in `split_rngs` for fresh noise
  per iteration. Options known only at call time (`mask=`,
  `sow_weights=True`) fall back per call.
* **nnx** -- module surgery. `convert(model, rngs=nnx.Rngs(jact=0))` replaces,
  in place, every supported layer inside `model` by its twin holding the
  very same `nnx.Param` / `nnx.BatchStat` objects, and returns `model` (or
  the twin when `model` itself is a supported layer; use the returned
  value). Each converted layer forks its own 'jact' stream from `rngs` (as
  the twins do); `nnx.state(model, nnx.Param)` and the batch statistics are
  unchanged, the new RNG state sits under `<layer>/jact_rngs`. Residuals
  are named after attribute paths ("blocks/0/attn"). Settings are checked
  at conversion; options passed at call time that a twin lacks (`mask=`,
  `sow_weights=True`) raise the twin's ValueError.

Converting again applies the new settings: a converted linen model is
rebuilt with them, and in an nnx model every rounding twin already there
(from an earlier `convert`, or built as `jact.nnx.*`) takes the new `bits`,
`group_size` and `stochastic` and re-forks its stream from `rngs` (from its
own stream when `rngs` is not given). In linen, a converted submodule inside
a converted model keeps its own settings while its methods run.

Supported (exact types; subclasses are left alone, their `super().__call__`
included): Dense/Linear, Conv, BatchNorm, LayerNorm, RMSNorm, Embed, Dropout,
MultiHeadDotProductAttention/MultiHeadAttention/SelfAttention (linen) and
MultiHeadAttention (nnx). Layers or options a twin does not support (a custom
`dot_general`/`attention_fn`, `mask=`, `axis_name`, normalization over
non-last axes, `sow_weights=True`, ...) run plain and emit a
`ConversionWarning` (or raise with `strict=True`); other layer types
(DenseGeneral, ConvTranspose, GroupNorm, ...) run plain silently. Activation
*functions* (`nn.relu`, `jax.nn.gelu`, ...) are plain functions, not module
methods, so they cannot be intercepted and keep Flax's residuals; for
compressed activations use the modules `jact.nn.GELU()` / `jact.nnx.GELU()`
or `jact.ops.gelu` in the model code. Converted Dropout draws its masks from
jact's hash PRNG: same rate and statistics, different masks than Flax's for
the same key.

>>> import jax, jax.numpy as jnp
>>> import flax.linen as nn
>>> from jact.flax.convert import convert
>>> class MLP(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(2)(nn.relu(nn.Dense(8)(x)))
>>> x = jnp.ones((4, 3))
>>> variables = MLP().init(jax.random.key(0), x)        # a plain model's variables
>>> model = convert(MLP(), bits=4)
>>> y = model.apply(variables, x, rngs={'jact': jax.random.key(1)})
>>> bool(jnp.allclose(y, MLP().apply(variables, x)))
True
>>> from flax import nnx
>>> net = nnx.Sequential(nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.relu,
...                      nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
>>> net = convert(net, rngs=nnx.Rngs(jact=2))
>>> type(net.layers[0]).__module__, net.layers[0].residual_name
('jact.flax.nnx', 'layers/0')
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import warnings
from typing import Any, Callable

import flax.linen as nn
from flax import nnx
from flax.linen import attention as linen_attention
from flax.linen import module as nn_module
from flax.nnx import rnglib
from flax.nnx.nn import attention as nnx_attention
from jax import lax

from jact.flax import _hooks
from jact.flax import linen as jnn
from jact.flax import nnx as jnnx
from jact.flax._hooks import Hook

__all__ = ["convert", "ConversionWarning"]


class ConversionWarning(UserWarning):
  """A supported layer runs uncompressed because of an option its twin lacks."""


@dataclasses.dataclass(frozen=True)
class _Settings:
  bits: int | None
  group_size: int
  stochastic: bool
  strict: bool

  @property
  def needs_key(self) -> bool:
    return _hooks.needs_key(self.bits, self.group_size, self.stochastic)

  @property
  def rounding(self) -> dict:
    return dict(bits=self.bits, group_size=self.group_size, stochastic=self.stochastic)


def convert(model, *, bits: int | None = 4, group_size: int = 256, stochastic: bool = True,
            strict: bool = False, rngs: rnglib.Rngs | rnglib.RngStream | None = None):
  """Makes a plain Flax model store compressed activations; keeps its variables.

  Args:
    model: an unbound `flax.linen.Module` (a converted copy is returned; the
      argument is not modified) or a `flax.nnx.Module` (converted in place;
      the model is returned, or the twin when `model` itself is a supported
      layer).
    bits: 1, 2, 4 or 8 bits per saved value, or None (no compression).
    group_size: values per quantization group (a multiple of 8).
    stochastic: stochastic (unbiased) rounding, which needs a 'jact' RNG
      stream; False rounds to nearest and needs none.
    strict: raise a ValueError, instead of warning and running the plain
      layer, when a supported layer uses an option its twin lacks.
    rngs: nnx only: the `nnx.Rngs` (with a 'jact' or 'default' stream) or
      `nnx.RngStream` each converted layer forks its rounding stream from.
      Needed when rounding is stochastic. linen models take the 'jact'
      stream in `apply(..., rngs={'jact': key})` instead.

  Returns:
    The converted model.

  Raises:
    TypeError: `model` is not a linen or nnx module, or `rngs` is given for a
      linen model.
    ValueError: bad `bits` / `group_size`; a bound linen module; an nnx model
      that needs a 'jact' stream and got none; with `strict=True`, an
      unsupported option.
  """
  _hooks.rounding_kwargs(bits, group_size, stochastic)  # the twins' checks and messages
  if not isinstance(strict, bool):
    raise TypeError(f"strict must be True or False, got {strict!r}")
  settings = _Settings(bits, group_size, bool(stochastic), strict)
  if isinstance(model, nn.Module):
    if rngs is not None:
      raise TypeError(
          "convert(linen_model, rngs=...): a linen model draws its rounding noise from the "
          "'jact' stream of apply: model.apply(variables, x, rngs={'jact': key}). Drop rngs=.")
    return _convert_linen(model, settings)
  if isinstance(model, nnx.Module):
    return _convert_nnx(model, settings, rngs)
  raise TypeError(
      f"jact.convert accepts a flax.linen.Module (returns a converted copy) or a "
      f"flax.nnx.Module (converted in place), got {type(model).__module__}."
      f"{type(model).__qualname__}.")


def _unsupported(settings: _Settings, where: str, reason: str) -> None:
  message = f"jact.convert: {where} runs uncompressed: {reason}"
  if settings.strict:
    raise ValueError(message + " (strict=True)")
  warnings.warn(message, ConversionWarning, stacklevel=4)


# ============================================================================ linen

_ACTIVE: contextvars.ContextVar[_Settings | None] = contextvars.ContextVar(
    "jact_convert_settings", default=None)


@contextlib.contextmanager
def _converting(settings: _Settings):
  """Makes `settings` current and, once per thread of calls, installs the interceptor."""
  outer = _ACTIVE.get()
  token = _ACTIVE.set(settings)
  try:
    if outer is not None:  # our interceptor is already on Flax's stack
      yield
    else:
      with nn.intercept_methods(_intercept):
        yield
  finally:
    _ACTIVE.reset(token)


_CLASSES: dict[type, type] = {}


def _converted_class(cls: type) -> type:
  """A cached subclass of `cls` whose every wrapped method runs under interception."""
  base = getattr(cls, "_jact_base", cls)
  if base in _CLASSES:
    return _CLASSES[base]

  class Converted(base):  # type: ignore[misc, valid-type]
    jact_bits: int | None = 4
    jact_group_size: int = 256
    jact_stochastic: bool = True
    jact_strict: bool = False

    @nn.nowrap
    def _jact_settings(self) -> _Settings:
      return _Settings(self.jact_bits, self.jact_group_size, self.jact_stochastic,
                       self.jact_strict)

    # Every method of a linen module (those of the model's classes, wrapped by
    # Flax) goes through `_call_wrapped_method` (Flax-internal, but the one
    # place all of them pass; unchanged since 2021); `init_with_output`
    # (behind `init`) and `apply` are covered too, for `method=` callables
    # that are not module methods. `nowrap`: Flax must not wrap these.
    @nn.nowrap
    def _call_wrapped_method(self, fun, args, kwargs):
      with _converting(self._jact_settings()):
        return super()._call_wrapped_method(fun, args, kwargs)

    @nn.nowrap
    def init_with_output(self, *args, **kwargs):
      with _converting(self._jact_settings()):
        return super().init_with_output(*args, **kwargs)

    @nn.nowrap
    def apply(self, *args, **kwargs):
      with _converting(self._jact_settings()):
        return super().apply(*args, **kwargs)

  # Same name: a converted model used as a child is auto-named like the plain one.
  for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
    setattr(Converted, attr, getattr(base, attr))
  Converted._jact_base = base
  _CLASSES[base] = Converted
  return Converted


def _convert_linen(model: nn.Module, settings: _Settings) -> nn.Module:
  if model.scope is not None or isinstance(model.parent, nn.Module):
    raise ValueError(
        f"jact.convert needs a top-level, unbound linen module, got a bound or child "
        f"{type(model).__name__}. Convert the whole model, e.g. convert(Model(...)); the "
        f"layers inside it are converted when it runs.")
  cls = _converted_class(type(model))
  attrs = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
           if f.init and f.name != "parent" and not f.name.startswith("jact_")}
  return cls(**attrs, jact_bits=settings.bits, jact_group_size=settings.group_size,
             jact_stochastic=settings.stochastic, jact_strict=settings.strict, parent=None)


@dataclasses.dataclass(frozen=True)
class _LinenRule:
  """How one Flax layer type is converted.

  twin: the jact twin class; drop: the layer's hook fields the twin replaces;
  check(module, call arguments) -> reason it cannot be converted, or None;
  needs_key(module, call arguments) -> whether this call draws rounding noise.
  """
  twin: type
  drop: tuple[str, ...] = ()
  check: Callable[..., str | None] = lambda m, a: None
  needs_key: Callable[..., bool] = lambda m, a: True


def _custom(module, *fields: str) -> str | None:
  for f in fields:
    if getattr(module, f) is not None:
      return f"a custom {f!r} (the twin installs its own)"
  return None


def _last_axis(axes, ndim: int) -> bool:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return len(axes) == 1 and axes[0] % ndim == ndim - 1


def _norm_check(module, a, *, axes: bool) -> str | None:
  if a.get("mask") is not None:
    return "mask= is not supported"
  if module.axis_name is not None or module.axis_index_groups is not None:
    return "axis_name/axis_index_groups (cross-device statistics) are not supported"
  if not module.force_float32_reductions:
    return "force_float32_reductions=False is not supported"
  if axes:
    ndim = getattr(a.get("x"), "ndim", 0)
    if not (ndim and _last_axis(module.reduction_axes, ndim)
            and _last_axis(module.feature_axes, ndim)):
      return "only normalization over the last axis is supported"
  return None


def _batch_norm_training(module, a) -> bool:
  call = a.get("use_running_average")
  use_ra = module.use_running_average if call is None else call
  return use_ra is not None and not use_ra  # None: the twin raises Flax's own error


def _batch_norm_check(module, a) -> str | None:
  if not _batch_norm_training(module, a):
    return None  # the twin runs Flax's inference path
  axes = (module.axis,) if isinstance(module.axis, int) else tuple(module.axis)
  if len(axes) != 1:
    return "only a single feature axis is supported"
  return _norm_check(module, a, axes=False)


def _attention_check(module, a) -> str | None:
  if module.attention_fn is not linen_attention.dot_product_attention:
    return "a custom 'attention_fn'"
  reason = _custom(module, "qkv_dot_general", "out_dot_general", "qkv_dot_general_cls",
                   "out_dot_general_cls", "qk_attn_weights_einsum_cls",
                   "attn_weights_value_einsum_cls")
  if reason is not None:
    return reason
  if a.get("sow_weights"):
    return "sow_weights=True (jact attention does not return the weights)"
  return None


_ATTENTION = _LinenRule(jnn.MultiHeadDotProductAttention,
                        ("attention_fn", "qkv_dot_general", "out_dot_general"),
                        _attention_check)

_LINEN_RULES: dict[type, _LinenRule] = {
    nn.Dense: _LinenRule(jnn.Dense, ("dot_general",),
                         lambda m, a: _custom(m, "dot_general", "dot_general_cls")),
    nn.Conv: _LinenRule(jnn.Conv, ("conv_general_dilated",),
                        lambda m, a: _custom(m, "conv_general_dilated",
                                             "conv_general_dilated_cls")),
    nn.BatchNorm: _LinenRule(jnn.BatchNorm, check=_batch_norm_check,
                             needs_key=_batch_norm_training),
    nn.LayerNorm: _LinenRule(jnn.LayerNorm, check=lambda m, a: _norm_check(m, a, axes=True)),
    nn.RMSNorm: _LinenRule(jnn.RMSNorm, check=lambda m, a: _norm_check(m, a, axes=True)),
    nn.Embed: _LinenRule(jnn.Embed, needs_key=lambda m, a: False),
    nn.Dropout: _LinenRule(jnn.Dropout, needs_key=lambda m, a: False),
    nn.MultiHeadDotProductAttention: _ATTENTION,
    nn.MultiHeadAttention: _ATTENTION,
    nn.SelfAttention: dataclasses.replace(_ATTENTION, twin=jnn.SelfAttention),
}
_SIGNATURES: dict[type, inspect.Signature] = {}


def _call_arguments(module, args, kwargs) -> dict | None:
  """The call's arguments by parameter name, or None when they do not bind."""
  cls = type(module).__dict__.get("_jact_base", type(module))
  if cls not in _SIGNATURES:
    _SIGNATURES[cls] = inspect.signature(cls.__call__)
  try:
    bound = _SIGNATURES[cls].bind(module, *args, **kwargs)
  except TypeError:
    return None
  return dict(bound.arguments)


def _where(module) -> str:
  path = "/".join(module.path)
  return f"{path or type(module).__name__} (flax.linen.{type(module).__name__})"


def _linen_missing_stream(module) -> ValueError:
  return ValueError(
      f"jact.convert: {_where(module)} rounds its saved activations stochastically and "
      f"needs an RNG stream named 'jact' in apply. Fixes: pass a fresh key per step, e.g. "
      f"model.apply(variables, x, rngs={{'jact': key}}) (init needs none); or convert with "
      f"stochastic=False (round-to-nearest) or bits=None (no compression).")


def _intercept(next_fun, args, kwargs, context):
  settings = _ACTIVE.get()
  module = context.module
  # a converted bare layer (convert(nn.Dense(3))) is looked up by its base class
  rule = _LINEN_RULES.get(type(module).__dict__.get("_jact_base", type(module)))
  if settings is None or rule is None or context.method_name != "__call__":
    return next_fun(*args, **kwargs)
  arguments = _call_arguments(module, args, kwargs)
  if arguments is None:  # let Flax report the bad call
    return next_fun(*args, **kwargs)
  reason = rule.check(module, arguments)
  if reason is not None:
    _unsupported(settings, _where(module), reason)
    return next_fun(*args, **kwargs)
  if (settings.needs_key and rule.needs_key(module, arguments)
      and not module.has_rng("jact") and not module.is_initializing()):
    raise _linen_missing_stream(module)
  fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
            if f.init and f.name not in ("parent", "name", *rule.drop)
            and not f.name.startswith("jact_")}
  if "bits" in {f.name for f in dataclasses.fields(rule.twin)}:
    fields.update(settings.rounding)
  # Bound to (a rewound view of) the layer's own scope: same variables, same
  # RNG counters, residuals named after the layer's path; rewound, so that
  # names the layer's own setup() reserved (Embed's table) can be reused. The
  # twin's own calls (and those of the Flax code it reuses through super())
  # pass through this interceptor.
  twin = rule.twin(**fields, parent=module.scope.rewound())
  with _no_capture(twin):
    return twin(*args, **kwargs)


@contextlib.contextmanager
def _no_capture(twin):
  """With `capture_intermediates`, the intercepted layer records its output
  itself: keep the twin (not its sublayers) from recording it again."""
  stack = getattr(getattr(nn_module, "_context", None), "capture_stack", None)
  if not stack or not stack[-1]:
    yield
    return
  outer = stack[-1]
  stack.append(lambda mdl, method: mdl is not twin and outer(mdl, method))
  try:
    yield
  finally:
    stack.pop()


# ============================================================================ nnx


def _nnx_norm_check(module, *, axes: bool = True) -> str | None:
  if module.axis_name is not None or module.axis_index_groups is not None:
    return "axis_name/axis_index_groups (cross-device statistics) are not supported"
  if axes and not (module.reduction_axes in (-1, (-1,)) and module.feature_axes in (-1, (-1,))):
    return "only reduction_axes=-1 and feature_axes=-1 are supported"
  return None


def _nnx_attention_check(module) -> str | None:
  if module.attention_fn is not nnx_attention.dot_product_attention:
    return "a custom 'attention_fn'"
  for f in ("qkv_dot_general", "out_dot_general", "qkv_dot_general_cls", "out_dot_general_cls"):
    if getattr(module, f, None) is not None:
      return f"a custom {f!r} (the twin installs its own)"
  for sub in ("query", "key", "value", "out"):
    layer = getattr(module, sub)
    if layer.dot_general is not None or layer.dot_general_cls is not None:
      return f"a custom dot_general in {sub!r}"
  return None


def _nnx_attention_patch(module) -> None:
  module.attention_fn = _hooks.attention_slot
  module.qkv_dot_general, module.out_dot_general = Hook("qkv"), Hook("out")
  for sub in ("query", "key", "value"):
    getattr(module, sub).dot_general = Hook("qkv")
  module.out.dot_general = Hook("out")


def _set(name: str, value) -> Callable[[Any], None]:
  return lambda module: setattr(module, name, value)


# type -> (twin, check(module) -> reason or None, patch(module) after the copy,
#          whether it rounds stochastically)
_NNX_RULES: dict[type, tuple[type, Callable, Callable, bool]] = {
    nnx.Linear: (jnnx.Linear,
                 lambda m: None if m.dot_general is lax.dot_general
                 else "a custom 'dot_general' (the twin installs its own)",
                 _set("dot_general", Hook("dot_general")), True),
    nnx.Conv: (jnnx.Conv,
               lambda m: None if m.conv_general_dilated is lax.conv_general_dilated
               else "a custom 'conv_general_dilated' (the twin installs its own)",
               _set("conv_general_dilated", Hook("conv_general_dilated")), True),
    nnx.BatchNorm: (jnnx.BatchNorm,
                    lambda m: (_nnx_norm_check(m, axes=False) if isinstance(m.axis, int)
                               else "only a single feature axis is supported"),
                    lambda m: None, True),
    nnx.LayerNorm: (jnnx.LayerNorm, _nnx_norm_check, lambda m: None, True),
    nnx.RMSNorm: (jnnx.RMSNorm, _nnx_norm_check, lambda m: None, True),
    nnx.Embed: (jnnx.Embed, lambda m: None, lambda m: None, False),
    nnx.Dropout: (jnnx.Dropout, lambda m: None, lambda m: None, False),
    nnx.MultiHeadAttention: (jnnx.MultiHeadAttention, _nnx_attention_check,
                             _nnx_attention_patch, True),
}


def _nnx_twin(plain, twin_cls: type, patch: Callable, rngs, settings: _Settings | None,
              name: str):
  """A `twin_cls` instance holding `plain`'s attributes (its very Variable objects)."""
  twin = twin_cls.__new__(twin_cls)
  # what nnx's metaclass does before __init__, then the plain layer's attributes
  object.__setattr__(twin, "_pytree__state", type(plain._pytree__state)())
  for k, v in vars(plain).items():
    if k != "_pytree__state":
      object.__setattr__(twin, k, v)
  patch(twin)
  if settings is None:  # Embed, Dropout: no rounding
    twin._init_jact(None, None, 256, True, name)
  else:
    twin._init_jact(rngs, settings.bits, settings.group_size, settings.stochastic, name)
  return twin


def _has_stream(rngs) -> bool:
  return isinstance(rngs, rnglib.RngStream) or (
      isinstance(rngs, rnglib.Rngs) and ("jact" in rngs or "default" in rngs))


def _replace(value, twins: dict[int, Any]):
  """`value` with converted layers swapped in (lists/dicts in place); (value, changed)."""
  if id(value) in twins:
    return twins[id(value)], True
  if isinstance(value, list):
    changed = False
    for i, v in enumerate(value):
      new, c = _replace(v, twins)
      if c:
        value[i], changed = new, True
    return value, changed
  if isinstance(value, dict):
    changed = False
    for k, v in list(value.items()):
      new, c = _replace(v, twins)
      if c:
        value[k], changed = new, True
    return value, changed
  if isinstance(value, tuple):
    items = [_replace(v, twins) for v in value]
    if not any(c for _, c in items):
      return value, False
    new = [v for v, _ in items]
    return (type(value)(*new) if hasattr(value, "_fields") else type(value)(new)), True
  return value, False


# twins that round (their settings are convert's); Embed and Dropout have none
_ROUNDING_TWINS = (jnnx.Linear, jnnx.Conv, jnnx.BatchNorm, jnnx.LayerNorm, jnnx.RMSNorm,
                   jnnx.MultiHeadAttention)


def _converted_twins(model: nnx.Module) -> list:
  """(name, twin) for the rounding twins already in `model` (exact types)."""
  return [("/".join(str(p) for p in path) or type(module).__name__, module)
          for path, module in nnx.iter_modules(model) if type(module) in _ROUNDING_TWINS]


def _convert_nnx(model: nnx.Module, settings: _Settings, rngs):
  # Plan first (validation, clear errors), mutate after: no half-converted model.
  plan = []
  for path, module in list(nnx.iter_modules(model)):
    rule = _NNX_RULES.get(type(module))
    if rule is None:
      continue
    twin_cls, check, patch, rounds = rule
    name = "/".join(str(p) for p in path) or type(module).__name__
    reason = check(module)
    if reason is not None:
      _unsupported(settings, f"{name} (nnx.{type(module).__name__})", reason)
      continue
    plan.append((module, twin_cls, patch, rounds, name))
  if rngs is not None and not isinstance(rngs, (rnglib.Rngs, rnglib.RngStream)):
    raise TypeError(f"rngs must be an nnx.Rngs or nnx.RngStream, got {type(rngs).__name__}")
  converted = _converted_twins(model)
  lacking = [name for *_, rounds, name in plan if rounds]
  lacking += [name for name, twin in converted if twin.jact_rngs is None]
  if settings.needs_key and lacking and not _has_stream(rngs):
    got = "no rngs" if rngs is None else f"rngs={rngs!r}"[:200]
    raise ValueError(
        f"jact.convert rounds the saved activations of an nnx model stochastically and "
        f"needs an RNG stream named 'jact' (or 'default') to fork each layer's stream from "
        f"({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}); "
        f"got {got}. Fixes: convert(model, rngs=nnx.Rngs(jact=0)); or convert with "
        f"stochastic=False (round-to-nearest) or bits=None (no compression).")
  for _, twin in converted:  # converted before (or built as twins): the new settings apply
    source = rngs if _has_stream(rngs) else twin.jact_rngs
    twin._init_jact(source, settings.bits, settings.group_size, settings.stochastic,
                    twin.residual_name)

  twins = {id(module): _nnx_twin(module, twin_cls, patch, rngs, settings if rounds else None,
                                 name)
           for module, twin_cls, patch, rounds, name in plan}
  if not twins:
    return model
  # Swap the twins in wherever a converted layer is referenced: attributes of
  # every graph node (modules, nnx.List, nnx.Dict), through plain containers.
  # The twins are included: they hold copies of their plain layers' attributes
  # (an attention layer's qk-norms, for one).
  nodes = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Pytree)]
  for node in nodes + list(twins.values()):
    for attr, value in list(vars(node).items()):
      new, changed = _replace(value, twins)
      if changed and new is not value:
        object.__setattr__(node, attr, new)  # same kind of value: nnx metadata unchanged
  return twins.get(id(model), model)
