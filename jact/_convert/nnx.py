"""`convert` for flax.nnx models: module surgery (see `jact._convert`)."""

from __future__ import annotations

from typing import Any, Callable

from flax import nnx
from jax import lax

from jact._compat import flax as _compat
from jact._flax import hooks as _hooks
from jact import nnx as jnnx
from jact._convert import nnx_engine as _engine
from jact._convert.settings import Settings, unsupported
from jact._flax.hooks import Hook


def _nnx_norm_check(module, *, axes: bool = True, cross_device: bool = False) -> str | None:
  if not cross_device and (module.axis_name is not None or module.axis_index_groups is not None):
    return "axis_name/axis_index_groups (cross-device statistics) are not supported"
  if axes and not (module.reduction_axes in (-1, (-1,)) and module.feature_axes in (-1, (-1,))):
    return "only reduction_axes=-1 and feature_axes=-1 are supported"
  return None


def _nnx_attention_check(module) -> str | None:
  if module.attention_fn is not nnx.dot_product_attention:
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
  nnx.Linear: (
    jnnx.Linear,
    lambda m: (
      None
      if m.dot_general is lax.dot_general
      else "a custom 'dot_general' (the twin installs its own)"
    ),
    _set("dot_general", Hook("dot_general")),
    True,
  ),
  nnx.Conv: (
    jnnx.Conv,
    lambda m: (
      None
      if m.conv_general_dilated is lax.conv_general_dilated
      else "a custom 'conv_general_dilated' (the twin installs its own)"
    ),
    _set("conv_general_dilated", Hook("conv_general_dilated")),
    True,
  ),
  nnx.BatchNorm: (
    jnnx.BatchNorm,
    lambda m: (
      _nnx_norm_check(m, axes=False, cross_device=True)
      if isinstance(m.axis, int)
      else "only a single feature axis is supported"
    ),
    lambda m: None,
    True,
  ),
  nnx.LayerNorm: (jnnx.LayerNorm, _nnx_norm_check, lambda m: None, True),
  nnx.RMSNorm: (jnnx.RMSNorm, _nnx_norm_check, lambda m: None, True),
  nnx.Embed: (jnnx.Embed, lambda m: None, lambda m: None, False),
  nnx.Dropout: (jnnx.Dropout, lambda m: None, lambda m: None, False),
  nnx.MultiHeadAttention: (
    jnnx.MultiHeadAttention,
    _nnx_attention_check,
    _nnx_attention_patch,
    True,
  ),
}


def _nnx_twin(plain, twin_cls: type, patch: Callable, rngs, settings: Settings | None, name: str):
  """A `twin_cls` instance holding `plain`'s attributes (its very Variable objects)."""
  twin = _compat.nnx_twin_of(plain, twin_cls)
  patch(twin)
  if settings is None:  # Embed, Dropout: no rounding
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
_ROUNDING_TWINS = (
  jnnx.Linear,
  jnnx.Conv,
  jnnx.BatchNorm,
  jnnx.LayerNorm,
  jnnx.RMSNorm,
  jnnx.MultiHeadAttention,
)


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
  generic = _engine.generic_layers(model, (*_NNX_RULES, *_ROUNDING_TWINS))
  for path, module in list(nnx.iter_modules(model)):
    rule = _NNX_RULES.get(type(module))
    if rule is None or _engine.inside(path, generic):
      continue
    twin_cls, check, patch, rounds = rule
    name = "/".join(str(p) for p in path) or type(module).__name__
    reason = check(module)
    if reason is not None:
      unsupported(settings, f"{name} (nnx.{type(module).__name__})", reason)
      continue
    plan.append((module, twin_cls, patch, rounds, name))
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
    id(module): _nnx_twin(module, twin_cls, patch, rngs, settings if rounds else None, name)
    for module, twin_cls, patch, rounds, name in plan
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
    rule = _NNX_RULES.get(type(module))
    reason = None if rule is None else rule[1](module)
    if reason is not None:
      name = "/".join(str(p) for p in path) or type(module).__name__
      in_model = any(path[: len(p)] == p for p in models)
      found.append((name, type(module).__name__, reason, in_model, module))
  return found
