"""`jact.compressed` for linen modules: the module's call as a lifted transform whose variables
and RNGs are explicit inputs of the compressed call (cf. `flax.core.lift.checkpoint`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import linen as nn

from jact._compat import flax as _compat
from jact._engine.derivatives import inference_only
from jact._flax.wrapping import check_call, keyless_message, named
from jact._transforms.compressed import ResidualConfig, call_compressed, input_flags

__all__ = ["lift_compressed", "linen_class", "linen_instance"]


def _flags(fn, prefix, args, kwargs, argnums) -> list[bool]:
  """`compress_inputs` for a call of `(*prefix, args..., kwargs)`: only the chosen args."""
  return [False] * len(jax.tree.leaves(prefix)) + list(input_flags(fn, args, kwargs, argnums))


def lift_compressed(
  fn,
  *,
  key,
  compress: bool,
  config: ResidualConfig,
  policy,
  argnums,
  name_of=None,
  keyless: str = "",
):
  """Lifted transform (cf. `flax.core.lift.checkpoint`): runs the scope function `fn`
  with variables and RNGs as explicit inputs of `call_compressed`, and returns the
  updated mutable collections as outputs, which `pack` publishes to the outer scope.
  With `compress=False` the plain function runs; its output raises `keyless`
  (the message) if differentiated."""

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):

    def pure(variable_groups, rng_groups, *args, **kwargs):
      scope = scope_fn(variable_groups, rng_groups)
      y = fn(scope, *args, **kwargs)
      return y, repack_fn(scope)

    if not compress:
      y, variables = pure(variable_groups, rng_groups, *args, **kwargs)
      return inference_only(y, keyless), variables
    flags = _flags(name_of, (variable_groups, rng_groups), args, kwargs, argnums)
    return call_compressed(
      pure,
      (variable_groups, rng_groups, *args),
      kwargs,
      key=key,
      config=config,
      policy=policy,
      compress_inputs=flags,
      state_output=True,
    )

  return _compat.pack_all(inner, name="compressed")


def linen_class(module_class, config: ResidualConfig, policy, argnums=()):
  check_call(module_class)
  fn = module_class.__call__

  @functools.wraps(fn)
  def __call__(self, *args, key=None, **kwargs):
    path = "/".join(self.path) if self.scope is not None else ""
    cfg = named(config, path or module_class.__name__)
    compress = True
    if key is None and cfg.needs_key:
      if self.has_rng("jact"):
        key = self.make_rng("jact")
      else:  # init, inference: the plain module (same parameters, same output)
        compress = False
    # `fn` runs on a `module_class` clone bound to the lifted scopes (as in linen's
    # own lifted transforms), so it sees the plain class.
    transform = functools.partial(
      lift_compressed,
      key=key,
      compress=compress,
      config=cfg,
      policy=policy,
      argnums=argnums,
      name_of=module_class,
      keyless=keyless_message(f"{module_class.__name__} {cfg.name!r}", False),
    )
    return _compat.lift_method_call(self, module_class, fn, transform, args, kwargs)

  # Same class name as the original, so that parents autoname it identically.
  return type(
    module_class.__name__,
    (module_class,),
    {
      "__call__": __call__,
      "__module__": module_class.__module__,
      "__qualname__": module_class.__qualname__,
      "__doc__": module_class.__doc__,
      "residual_config": config,
    },
  )


def linen_instance(module: nn.Module, config: ResidualConfig, policy, argnums=()):
  if module.scope is not None or isinstance(module.parent, nn.Module):
    raise TypeError(
      f"jact.compressed got a {type(module).__name__} instance that already belongs to a "
      f"parent module (created inside setup or @nn.compact); decorate the class instead, "
      f"e.g. jact.compressed({type(module).__name__}, bits=...)(...)(x)."
    )
  attrs = {
    f.name: getattr(module, f.name)
    for f in dataclasses.fields(module)
    if f.name != "parent" and f.init
  }
  return linen_class(type(module), config, policy, argnums)(**attrs)
