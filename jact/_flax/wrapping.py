"""Helpers the linen and nnx wrappers of `jact.compressed` share: the call check, the default
residual name and the message of a key-less call."""

from __future__ import annotations

import dataclasses

from jact._flax import hooks as _hooks
from jact._transforms.compressed import ResidualConfig

_DEFAULT_NAME = "compressed"  # `compressed`'s default name: replaced by the module's path


def check_call(module_class) -> None:
  if not any("__call__" in vars(c) for c in module_class.__mro__ if c is not object):
    raise TypeError(
      f"jact.compressed compresses a module's __call__; {module_class.__name__} has none."
    )


def named(config: ResidualConfig, name: str) -> ResidualConfig:
  if config.name != _DEFAULT_NAME or not name:
    return config
  return dataclasses.replace(config, name=name)


def keyless_message(what: str, nnx_module: bool) -> str:
  what = f"jact.compressed({what})"
  if nnx_module:
    return _hooks.nnx_keyless_message(
      what,
      "give it a stream: build the decorated class with rngs=nnx.Rngs(params=0, "
      "jact=1), or wrap an instance as CompressedModule(module, rngs=nnx.Rngs(jact=1), ...); "
      "or call it with key=<a fresh PRNG key or an nnx.Rngs with a 'jact' stream>",
    )
  return _hooks.linen_keyless_message(what, " or call it with key=<a fresh PRNG key>")
