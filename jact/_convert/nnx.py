"""`convert` for flax.nnx models: module surgery (see `jact._convert`)."""

from __future__ import annotations

from typing import Any

from flax import nnx

from jact._compat import flax as _compat
from jact._flax.conversion import rounds, table as conversion_table
from jact import nnx as jnnx
from jact._convert import nnx_engine as _engine
from jact._convert.settings import Settings, unsupported


# Flax class -> twin, as the twins of `jact.nnx` declare it (`conversion`)
_NNX_TWINS: dict[type, type] = conversion_table(jnnx)


def _nnx_twin(plain, twin_cls: type, rngs, settings: Settings, name: str):
  """A `twin_cls` instance holding `plain`'s attributes (its very Variable objects)."""
  twin = _compat.nnx_twin_of(plain, twin_cls)
  twin_cls.conversion.patch(twin)
  if not rounds(twin_cls):  # Embed, Dropout: no rounding
    twin._init_jact(None, None, name)
  else:  # without rngs: no stream (keys from jact.nnx.use_key only)
    twin._init_jact(rngs, name=name, **settings.rounding)
  return twin


def _has_stream(rngs) -> bool:
  return isinstance(rngs, nnx.RngStream) or (
    isinstance(rngs, nnx.Rngs) and ("jact" in rngs or "default" in rngs)
  )


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


def _swap_in(node, twins: dict[int, Any]) -> None:
  """Replaces every reference `node` holds to a converted layer, through nnx's checks."""
  if isinstance(node, nnx.List):  # by index: how it stores its items is nnx's business
    for i, value in enumerate(list(node)):
      new, changed = _replace(value, twins)
      if changed and new is not value:
        node[i] = new
    return
  for attr, value in list(vars(node).items()):
    new, changed = _replace(value, twins)
    if changed and new is not value:
      setattr(node, attr, new)  # a module's attribute, an nnx.Dict's item


# twins that round (their settings are convert's); Embed and Dropout have none
_ROUNDING_TWINS = tuple(twin for twin in _NNX_TWINS.values() if rounds(twin))


# every layer class of jact.nnx (twins, activation and pooling layers, BLPABlock)
_TWIN_TYPES = tuple(
  obj for obj in map(lambda n: getattr(jnnx, n), jnnx.__all__) if isinstance(obj, type)
)


def _converted_twins(model: nnx.Module) -> list:
  """(name, twin) for the rounding twins already in `model` (exact types)."""
  return [
    ("/".join(str(p) for p in path) or type(module).__name__, module)
    for path, module in nnx.iter_modules(model)
    if type(module) in _ROUNDING_TWINS
  ]


def _layer_streams(model: nnx.Module) -> list:
  """The rounding streams of `model`'s converted layers (twins, engine layers),
  in `nnx.iter_modules` order."""
  return [
    stream
    for _, module in nnx.iter_modules(model)
    if module is not model
    for stream in [getattr(module, "jact_rngs", None)]
    if stream is not None
  ]


def convert_nnx(model: nnx.Module, settings: Settings, rngs):
  # Plan first (validation, clear errors), mutate after: no half-converted model.
  plan = []
  # layers with no twin: the generic engine
  generic = _engine.generic_layers(model, (*_NNX_TWINS, *_ROUNDING_TWINS))
  for path, module in list(nnx.iter_modules(model)):
    twin_cls = _NNX_TWINS.get(type(module))
    if twin_cls is None or _engine.inside(path, generic):
      continue
    name = "/".join(str(p) for p in path) or type(module).__name__
    reason = twin_cls.conversion.check(module)
    if reason is not None:
      unsupported(settings, f"{name} (nnx.{type(module).__name__})", reason)
      continue
    plan.append((module, twin_cls, name))
  if rngs is not None and not isinstance(rngs, (nnx.Rngs, nnx.RngStream)):
    raise TypeError(f"rngs must be an nnx.Rngs or nnx.RngStream, got {type(rngs).__name__}")
  if rngs is not None and not _has_stream(rngs):
    raise ValueError(
      f"jact.convert(model, rngs=...) forks each converted layer's rounding stream from "
      f"a stream named 'jact' (or 'default'); got an nnx.Rngs with only {list(rngs)}. Pass "
      f"rngs=nnx.Rngs(jact=0); or leave rngs out: the model's state then stays the plain "
      f"model's, and the keys come from jact.nnx.use_key."
    )
  converted = _converted_twins(model)
  for _, twin in converted:  # converted before (or built as twins): the new settings apply
    source = rngs if rngs is not None else twin.jact_rngs
    twin._init_jact(source, name=twin.residual_name, **settings.rounding)

  twins = {
    id(module): _nnx_twin(module, twin_cls, rngs, settings, name) for module, twin_cls, name in plan
  }
  paths = {id(module): path for path, module in nnx.iter_modules(model)}
  for module_id, twin in twins.items():  # built inside nnx.vmap: one stream per stacked layer
    _engine.restack(model, paths[module_id], twin)
  for path, module in generic:
    twins[id(module)] = _engine.convert_layer(model, path, module, settings, rngs)
  # A model that is itself a layer (a twin, an engine layer) has no functions
  # between layers: its own conversion covers its call.
  if id(model) not in twins and type(model) not in _TWIN_TYPES:
    _engine.convert_model(model, settings, rngs, _layer_streams(model))
  if not twins:
    return model
  # Swap the twins in wherever a converted layer is referenced: attributes of
  # every graph node (modules, nnx.List, nnx.Dict), through plain containers.
  # The twins are included: they hold copies of their plain layers' attributes
  # (an attention layer's qk-norms, for one).
  nodes = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Pytree)]
  for node in nodes + list(twins.values()):
    _swap_in(node, twins)
  return twins.get(id(model), model)


def plain_layers(model: nnx.Module) -> list[tuple[str, str, str, bool, nnx.Module]]:
  """(name, class, reason, in_model, layer) of each layer of `model` that
  `convert` left plain for an option its twin lacks (what it warned about);
  `in_model`: a converted model's call (`functions=True`) around it compresses
  its residuals. Layers inside twins and engine layers are theirs."""
  found, covered, models = [], [], []
  for path, module in sorted(nnx.iter_modules(model), key=lambda pm: len(pm[0])):
    path = tuple(path)
    if any(path[: len(p)] == p for p in covered):
      continue
    if type(module) in _TWIN_TYPES or _engine.is_engine_layer(module):
      covered.append(path)
      continue
    if "_jact_model_base" in type(module).__dict__:
      models.append(path)
    twin_cls = _NNX_TWINS.get(type(module))
    reason = None if twin_cls is None else twin_cls.conversion.check(module)
    if reason is not None:
      name = "/".join(str(p) for p in path) or type(module).__name__
      in_model = any(path[: len(p)] == p for p in models)
      found.append((name, type(module).__name__, reason, in_model, module))
  return found
