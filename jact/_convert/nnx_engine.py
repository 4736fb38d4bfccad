"""nnx `convert`: layers with no twin, the model's outermost call, and stacked
streams.

* A layer with no twin (`GENERIC`) becomes an instance of a cached subclass of
  its class holding the very same Variables, whose `__call__` runs the
  layer's own through `nnx_call` (every residual compressed, its positional
  arguments -- activations -- too).
* The model itself gets, in place, a subclass of its class whose `__call__`
  runs the original through `nnx_call`, so the functions between its layers
  (activations, pooling, softmax) keep compressed residuals too.
* A layer built inside `nnx.vmap` (a stack of blocks run by `nnx.scan`) holds
  parameters with leading stack axes; its rounding stream gets the same axes
  (one key per stacked layer), so that the scan can slice it like the rest. So
  does the model's own stream when the model is such a stack itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from jact._compat import flax as _compat
from jact._flax import hooks as _hooks
from jact._flax.context import NNX_IN_MODEL, NNX_MEASURE, bound
from jact._convert.settings import Settings
from jact._convert.generic import layout_recomputed, residual_config
from jact._flax.record import record
from jact._flax.compressed import nnx_call

CELLS = (nnx.LSTMCell, nnx.OptimizedLSTMCell, nnx.GRUCell, nnx.SimpleCell)
GENERIC = (nnx.LinearGeneral, nnx.Einsum, nnx.ConvTranspose, nnx.GroupNorm) + CELLS


@dataclasses.dataclass(frozen=True, eq=False)
class EngineSetup:
  """Static settings of a converted call (compared by identity, as nnx static
  attributes must hash): the engine's config and which arguments it compresses."""

  config: Any
  inputs: bool
  cell: bool = False


class _FirstKey:
  """Draws from a stacked stream called whole (a model holding only stacked
  layers, whose own call `nnx.scan` does not slice): one key, from the first
  layer's key and count, the whole count advancing as `RngStream` does."""

  def __init__(self, stream: nnx.RngStream):
    self.stream = stream

  def __call__(self):
    return _compat.draw_first_of_stacked(self.stream)


def _draw(module, stream_attr: str, config) -> tuple[bool, Any]:
  """(compress?, key): the module's own stream, else `jact.nnx.use_key`'s key."""
  if not config.needs_key:
    return True, None
  stream = getattr(module, stream_attr, None)
  if stream is not None:
    if _compat.stream_key_shape(stream):  # stacked, called whole
      stream = _FirstKey(stream)
    return True, _hooks.draw(stream, f"jact.convert's {type(module).__name__} {config.name!r}")
  key = _hooks.context_key(config.name)
  return key is not None, key


def _run(module, base: type, setup: EngineSetup, stream_attr: str, args, kwargs):
  measure = NNX_MEASURE.get() if setup.inputs else None  # a model's row: no bytes (as linen's)
  sizes = (None, None)
  if measure is not None:
    sizes = measure(module, type(module).__call__, args, kwargs, plain=base.__call__)
  record(setup.config.name, base.__name__, "engine" if setup.inputs else "model", "", *sizes)
  compress, key = _draw(module, stream_attr, setup.config)
  if not compress:
    message = _hooks.nnx_keyless_message(
      f"jact.convert's {type(module).__name__} {setup.config.name!r}",
      "give it its own stream: jact.convert(model, rngs=nnx.Rngs(jact=0))",
    )
    return _hooks.keyless(lambda: base.__call__(module, *args, **kwargs), message)()
  argnums = tuple(range(len(args))) if setup.inputs else ()
  return nnx_call(
    module,
    base.__call__,
    args,
    kwargs,
    key=key,
    config=setup.config,
    policy=layout_recomputed if setup.cell else None,
    compress_argnums=argnums,
  )


_LAYER_CLASSES: dict[type, type] = {}
_MODEL_CLASSES: dict[type, type] = {}


def layer_class(base: type) -> type:
  """The cached engine subclass of a layer class with no twin."""
  if base not in _LAYER_CLASSES:

    def __call__(self, *args, **kwargs):
      return _run(self, base, self.jact_engine, "jact_rngs", args, kwargs)

    _LAYER_CLASSES[base] = type(
      base.__name__,
      (base,),
      {
        "__call__": __call__,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "_jact_base": base,
      },
    )
  return _LAYER_CLASSES[base]


def model_class(base: type) -> type:
  """The cached subclass a converted model's class becomes: its `__call__`
  through the engine (once: inner converted models run their own call)."""
  if base not in _MODEL_CLASSES:

    def __call__(self, *args, **kwargs):
      if NNX_IN_MODEL.get():
        return base.__call__(self, *args, **kwargs)
      with bound(NNX_IN_MODEL, True):
        return _run(self, base, self.jact_model, "jact_model_rngs", args, kwargs)

    _MODEL_CLASSES[base] = type(
      base.__name__,
      (base,),
      {
        "__call__": __call__,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "_jact_model_base": base,
      },
    )
  return _MODEL_CLASSES[base]


def is_engine_layer(module) -> bool:
  return type(module) in _LAYER_CLASSES.values()


def base_type(module) -> type:
  cls = type(module)
  return cls.__dict__.get("_jact_base", cls.__dict__.get("_jact_model_base", cls))


def setup_for(settings: Settings, name: str, *, cell: bool, inputs: bool) -> EngineSetup:
  return EngineSetup(residual_config(settings, name, scanned=cell), inputs, cell)


# ----------------------------------------------------------------------------- stacks


def _expected(module) -> tuple[str, tuple] | None:
  """(parameter, its shape in one unstacked layer), from the layer's settings."""
  if isinstance(module, (nnx.Conv, nnx.ConvTranspose, nnx.Einsum)):
    return "kernel", tuple(module.kernel_shape)
  if isinstance(module, nnx.Linear):
    return "kernel", (module.in_features, module.out_features)
  if isinstance(module, nnx.LinearGeneral) and not module.batch_axis:
    return "kernel", tuple(module.in_features) + tuple(module.out_features)
  if isinstance(module, nnx.Embed):
    return "embedding", (module.num_embeddings, module.features)
  if isinstance(module, (nnx.LayerNorm, nnx.RMSNorm, nnx.BatchNorm)):
    for attr in ("scale", "mean"):
      if getattr(module, attr, None) is not None:
        return attr, (module.num_features,)
  return None


def stack_shape(module) -> tuple[int, ...] | None:
  """The leading axes `nnx.vmap` added to the parameters of `module` (or of a
  layer inside it), () when there are none, None when nothing tells."""
  for _, sub in nnx.iter_modules(module):
    expected = _expected(sub)
    if expected is None:
      continue
    attr, shape = expected
    value = getattr(sub, attr)
    actual = tuple(getattr(value, "shape", ()))
    if len(actual) >= len(shape) and actual[len(actual) - len(shape) :] == shape:
      return actual[: len(actual) - len(shape)]
  return None


def stacked_stream(stream: nnx.RngStream | None, shape: tuple[int, ...]):
  """`stream` with one key per stacked layer (leading axes `shape`)."""
  if stream is None or not shape or _compat.stream_key_shape(stream) == shape:
    return stream
  return nnx.RngStream(jax.random.split(stream(), shape), tag=stream.tag)


def model_stack_shape(model) -> tuple[int, ...]:
  """The leading axes shared by the parameters of every layer of `model`: those
  of a model built by `nnx.vmap` itself (run by `nnx.scan`, which slices its
  stream with its parameters); () when some layer is unstacked."""
  shapes = [stack_shape(sub) for _, sub in nnx.iter_modules(model) if _expected(sub)]
  shapes = [s for s in shapes if s is not None]
  if not shapes:
    return ()
  common = shapes[0]
  for s in shapes[1:]:
    n = 0
    while n < min(len(common), len(s)) and common[n] == s[n]:
      n += 1
    common = common[:n]
  return common


def fork(rngs, shape: tuple[int, ...]):
  """A new 'jact' stream forked from `rngs` (None without rngs), stacked to `shape`."""
  if rngs is None:
    return None
  stream = rngs["jact"].fork() if isinstance(rngs, nnx.Rngs) else rngs.fork()
  return stacked_stream(stream, shape)


# ----------------------------------------------------------------------------- convert


def path_name(path, module) -> str:
  return "/".join(str(p) for p in path) or type(module).__name__


def generic_layers(model, twin_types) -> list[tuple[tuple, Any]]:
  """(path, layer) of the outermost layers the engine converts (exact types), or
  converted before; none inside a layer of `twin_types` (attention's projections)."""
  found, twins = [], []
  for path, module in sorted(nnx.iter_modules(model), key=lambda pm: len(pm[0])):
    path = tuple(path)
    if any(path[: len(p)] == p for p in [p for p, _ in found] + twins):
      continue
    if type(module) in twin_types:
      twins.append(path)
    elif type(module) in GENERIC or is_engine_layer(module):
      found.append((path, module))
  return found


def inside(path, layers) -> bool:
  """Whether `path` lies strictly inside one of `layers` (their sublayers are not
  converted themselves: the engine compresses all of the layer's residuals)."""
  path = tuple(path)
  return any(len(path) > len(p) and path[: len(p)] == p for p, _ in layers)


def _shape_of(model, path, module) -> tuple[int, ...]:
  shape = stack_shape(module)
  if shape is None and path:  # no parameter tells: a sibling in the same block
    parent = model
    for p in path[:-1]:
      parent = (
        parent[p] if isinstance(parent, (list, dict, nnx.List, nnx.Dict)) else getattr(parent, p)
      )
    shape = stack_shape(parent)
  return shape or ()


def convert_layer(model, path, module, settings: Settings, rngs):
  """The engine layer for `module` (a new object holding its Variables), or
  `module` itself, updated, when it is one already."""
  name = path_name(path, module)
  base = base_type(module)
  layer = module if is_engine_layer(module) else _compat.nnx_twin_of(module, layer_class(base))
  layer.jact_engine = setup_for(settings, name, cell=issubclass(base, CELLS), inputs=True)
  old = getattr(layer, "jact_rngs", None) if layer is module else None
  source = rngs if rngs is not None else old
  stream = fork(source, _shape_of(model, path, module)) if settings.needs_key else None
  layer.jact_rngs = stream if stream is not None else nnx.data(None)
  return layer


def restack(model, path, twin) -> None:
  """Gives a rounding twin built from a stacked layer a stream stacked like it."""
  stream = getattr(twin, "jact_rngs", None)  # just forked by the twin: one key
  if stream is None:
    return
  shape = _shape_of(model, path, twin)
  if shape:
    twin.jact_rngs = stacked_stream(stream, shape)


def convert_model(model, settings: Settings, rngs, layer_streams=()) -> None:
  """Runs `model`'s `__call__` through the engine (in place: its class becomes a
  subclass), or back to plain with `functions=False`.

  Its stream is forked from `rngs`, else from its own stream (converted
  before), else from the first unstacked stream among `layer_streams` (the
  converted layers' streams, after their conversion): a model whose layers
  draw their own keys draws its own too. With none of these it has no stream
  (keys from `jact.nnx.use_key`). It is stacked to `model_stack_shape(model)`:
  a model built by `nnx.vmap` is sliced, stream included, by `nnx.scan`."""
  cls = type(model)
  base = cls.__dict__.get("_jact_model_base", cls)
  if not settings.functions:
    if base is not cls:
      model.__class__ = base
    return
  if "__call__" not in {n for c in base.__mro__ if c is not object for n in vars(c)}:
    return
  old = getattr(model, "jact_model_rngs", None) if base is not cls else None
  model.__class__ = model_class(base)
  model.jact_model = setup_for(settings, type(model).__name__, cell=False, inputs=False)
  source = rngs if rngs is not None else old
  if source is None:
    source = next((s for s in layer_streams if not _compat.stream_key_shape(s)), None)
  stream = fork(source, model_stack_shape(model)) if settings.needs_key else None
  model.jact_model_rngs = stream if stream is not None else nnx.data(None)
