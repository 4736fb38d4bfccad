"""`convert` for flax.linen models: method interception (see `jact._convert`)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import flax.linen as nn

from jact._compat import flax as _compat
from jact._flax.conversion import rounds, table as conversion_table
from jact.compressors import Compressor, PerGroup
from jact import nn as jnn
from jact._convert import linen_engine as _engine
from jact._convert.settings import Settings, unsupported
from jact._flax.context import LINEN_IN_MODEL, LINEN_SETTINGS, bound
from jact._flax.record import is_recording


@contextlib.contextmanager
def _converting(settings: Settings):
  """Makes `settings` current and, once per thread of calls, installs the interceptor."""
  outer = LINEN_SETTINGS.get()
  with bound(LINEN_SETTINGS, settings):
    if outer is not None:  # our interceptor is already on Flax's stack
      yield
    else:
      with nn.intercept_methods(_intercept):
        yield


_CLASSES: dict[type, type] = {}


def _converted_class(cls: type) -> type:
  """A cached subclass of `cls` whose every wrapped method runs under interception."""
  base = getattr(cls, "_jact_base", cls)
  if base in _CLASSES:
    return _CLASSES[base]
  target = _compat.lifted_target(base)
  if target is not None:
    # a lifted class (`nn.vmap(Block, ...)`): its methods clone `Block` with the
    # instance's fields, the jact fields too; lift the converted `Block` instead
    return _named(_compat.relift(base, _converted_class(target)), base)

  class Converted(base):  # type: ignore[misc, valid-type]
    jact_compressor: Compressor | None = PerGroup(4)
    jact_strict: bool = False
    jact_functions: bool = True

    @nn.nowrap
    def _jact_settings(self) -> Settings:
      return Settings(self.jact_compressor, self.jact_strict, self.jact_functions)

    # Besides every method of the model's classes (below), `init_with_output`
    # (behind `init`) and `apply` run under interception, for `method=`
    # callables that are not module methods. `nowrap`: Flax must not wrap these.
    @nn.nowrap
    def init_with_output(self, *args, **kwargs):
      with _converting(self._jact_settings()):
        return super().init_with_output(*args, **kwargs)

    @nn.nowrap
    def apply(self, *args, **kwargs):
      with _converting(self._jact_settings()), _engine.outer_key(kwargs.get("rngs")):
        return super().apply(*args, **kwargs)

  # Every method of a linen module (those of the model's classes, wrapped by
  # Flax), also as a child of an unconverted model, runs with the interceptor.
  _compat.run_methods_within(Converted, lambda module: _converting(module._jact_settings()))
  return _named(Converted, base)


def _named(converted: type, base: type) -> type:
  """`converted`, cached as `base`'s converted class and named like it (a converted
  model used as a child is auto-named like the plain one)."""
  for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
    setattr(converted, attr, getattr(base, attr))
  converted._jact_base = base
  _CLASSES[base] = converted
  return converted


def convert_linen(model: nn.Module, settings: Settings) -> nn.Module:
  if model.scope is not None or isinstance(model.parent, nn.Module):
    raise ValueError(
      f"jact.convert needs a top-level, unbound linen module, got a bound or child "
      f"{type(model).__name__}. Convert the whole model, e.g. convert(Model(...)); the "
      f"layers inside it are converted when it runs."
    )
  cls = _converted_class(type(model))
  attrs = {
    f.name: getattr(model, f.name)
    for f in dataclasses.fields(model)
    if f.init and f.name != "parent" and not f.name.startswith("jact_")
  }
  return cls(
    **attrs,
    jact_compressor=settings.compressor,
    jact_strict=settings.strict,
    jact_functions=settings.functions,
    parent=None,
  )


# Flax class -> twin, as the twins of `jact.nn` declare it (`conversion`)
_LINEN_TWINS: dict[type, type] = conversion_table(jnn)
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


def _own_params(module) -> bool:
  """Whether `module` holds parameters of its own (not only through child layers)."""
  params = module.variables.get("params", {}) if module.scope is not None else {}
  return any(not hasattr(v, "items") for v in params.values())


def _outside_call(next_fun, args, kwargs, context, settings: Settings, base: type):
  """A call that is no supported layer's `__call__`: the converted model's
  outermost call through the engine, a warning for a layer with parameters of
  its own that nothing compresses, else the call itself."""
  module = context.module
  is_model = "_jact_base" in type(module).__dict__ and base not in _engine.GENERIC
  # Flax also runs wrapped callables that are no method of the class (the
  # abstract check of a lifted class's setup, `apply(method=function)`)
  if (
    is_model
    and settings.functions
    and callable(getattr(type(module), context.method_name, None))
    and not LINEN_IN_MODEL.get()
    and context.method_name != "setup"
    and not module.is_initializing()
  ):
    method = getattr(type(module), context.method_name)  # a lifted class's: relifted
    _engine.note(module, "model", "", None, None, args, kwargs, descendants=False)
    with bound(LINEN_IN_MODEL, True):
      return _engine.engine_call(
        module, method, args, kwargs, settings, descendants=False, inputs=False
      )
  in_model = LINEN_IN_MODEL.get()
  if (
    in_model
    and settings.functions
    and not module.is_initializing()
    and context.method_name != "setup"
    and _compat.remat_body(module)
  ):
    return _remat_body(module, context, args, kwargs, settings)
  if (
    context.method_name == "__call__"
    and (not in_model or is_recording())
    and not type(module).__module__.startswith("jact.")  # a twin's own Flax code
    and not module.is_initializing()
    and _own_params(module)
  ):
    if in_model:  # compressed by the model's call: reported as such
      _engine.note(
        module, "plain", _no_twin(base), base.__call__, None, args, kwargs, descendants=True
      )
    else:
      reason = (
        f"{_no_twin(base)}, and its own parameters are used outside any converted "
        f"layer (convert with functions=True to compress them through the model's "
        f"call)"
      )
      unsupported(settings, _where(module), reason)
      _engine.note(module, "plain", reason, base.__call__, None, args, kwargs, descendants=True)
  return next_fun(*args, **kwargs)


def _remat_body(module, context, args, kwargs, settings: Settings):
  """The body of a model's own `nn.remat(Block)` call, through the engine.

  The model's call (the engine) keeps a compressed copy of the remat's inputs,
  as of any activation it saves; the body's own residuals (the functions
  between its layers) are compressed here, so the recomputation in the backward
  stores them compressed too. Left to the model's call, they were recomputed
  uncompressed (and where XLA merges the recomputation with the forward, as
  XLA:CPU does, kept exact from the forward on): a model's remat cost memory."""
  method = getattr(type(module), context.method_name)
  return _engine.engine_call(
    module,
    method,
    args,
    kwargs,
    settings,
    descendants=False,
    inputs=False,
    name=f"{_engine.name_of(module)}.body",
  )


def _no_twin(cls: type) -> str:
  """Why a layer with parameters of its own gets no twin: a subclass of a
  supported layer (twins replace exact types only: a subclass may change what
  the layer computes, e.g. a weight-standardized `StdConv(nn.Conv)`), or none."""
  parent = next((b for b in cls.__mro__[1:] if b in _LINEN_TWINS or b in _engine.GENERIC), None)
  if parent is None:
    return "no twin"
  return (
    f"no twin: a subclass of flax.linen.{parent.__name__} (twins and the engine "
    f"replace exact types only)"
  )


def _generic(next_fun, args, kwargs, module, settings: Settings, base: type, how: str):
  """A layer call with every residual (and its inputs) compressed by the engine."""
  method = base.__call__
  scanned = issubclass(base, _engine.CELLS) or how == "engine (in scan)"

  def converted(clone, *a, **k):
    return _engine.engine_call(clone, method, a, k, settings, descendants=True, scanned=scanned)

  _engine.note(module, how, "", method, converted, args, kwargs, descendants=True)
  return converted(module, *args, **kwargs)


def _intercept(next_fun, args, kwargs, context):
  settings = LINEN_SETTINGS.get()
  module = context.module
  if settings is None or _engine.passes(module):
    return next_fun(*args, **kwargs)
  # a converted bare layer (convert(nn.Dense(3))) is looked up by its base class
  base = type(module).__dict__.get("_jact_base", type(module))
  twin_cls = _LINEN_TWINS.get(base)
  if context.method_name != "__call__" or (twin_cls is None and base not in _engine.GENERIC):
    return _outside_call(next_fun, args, kwargs, context, settings, base)
  arguments = _call_arguments(module, args, kwargs)
  if arguments is None:  # let Flax report the bad call
    return next_fun(*args, **kwargs)
  if twin_cls is None:
    return _generic(next_fun, args, kwargs, module, settings, base, "engine")
  conversion, rounding = twin_cls.conversion, rounds(twin_cls)
  reason = conversion.check(module, arguments)
  if reason is not None:
    unsupported(settings, _where(module), reason)
    _engine.note(module, "plain", reason, base.__call__, None, args, kwargs, descendants=True)
    return next_fun(*args, **kwargs)
  draws_key = rounding and conversion.draws_key(module, arguments)
  if draws_key and _engine.hides_stream(module, settings):
    # inside nn.scan / nn.RNN without the 'jact' stream: the twin could draw no key
    return _generic(next_fun, args, kwargs, module, settings, base, "engine (in scan)")
  fields = {
    f.name: getattr(module, f.name)
    for f in dataclasses.fields(module)
    if f.init
    and f.name not in ("parent", "name", *conversion.drop)
    and not f.name.startswith("jact_")
  }
  if rounding:
    fields.update(settings.rounding)

  def twin_call(layer, *a, **k):
    # Bound to (a rewound view of) the layer's own scope: same variables, same
    # RNG counters, residuals named after the layer's path; rewound, so that
    # names the layer's own setup() reserved (Embed's table) can be reused. The
    # twin's own calls (and those of the Flax code it reuses through super())
    # pass through this interceptor.
    twin = _compat.bind_to_scope(layer, twin_cls, **fields)
    # With `capture_intermediates`, the intercepted layer records its output
    # itself: keep the twin (not its sublayers) from recording it again.
    with _compat.suppress_capture(twin):
      return twin(*a, **k)

  _engine.note(module, "twin", "", base.__call__, twin_call, args, kwargs, descendants=False)
  return twin_call(module, *args, **kwargs)
