"""How `jact.compressed` and `jact.checkpoint` treat stateful objects: routes that frameworks
register (Flax's, added by `jact._flax`, so this package never imports Flax) and
`CompressedModule`, the wrapper that keeps a callable pytree's parameters as leaves."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax

from jact._core import rng
from jact._transforms._arguments import check_argnums
from jact._transforms._vjp_residuals import ResidualConfig

__all__ = [
  "ModuleRoute",
  "add_module_route",
  "CompressedModule",
  "is_callable_pytree",
  "module_call",
  "module_argnums",
]


@dataclasses.dataclass(frozen=True)
class ModuleRoute:
  """How `compressed` treats a framework's stateful objects (`jact._flax` adds
  the Flax route when it is imported, so this module never imports Flax).

  Attributes:
    handles: true for a module object `compressed` should wrap itself.
    wrap: (module, config, policy, compress_argnums) -> the compressed module.
    takes_arguments: true when a function's (args, kwargs) hold such objects.
    call: runs the function on them: (fn, args, kwargs, *, key, config,
      policy, compress_argnums) -> its outputs.
  """

  handles: Callable[[Any], bool]
  wrap: Callable[..., Any]
  takes_arguments: Callable[[tuple, dict], bool]
  call: Callable[..., Any]


_MODULE_ROUTES: list[ModuleRoute] = []


def add_module_route(route: ModuleRoute) -> None:
  """Makes `compressed` hand the objects `route` recognises to it."""
  if route not in _MODULE_ROUTES:
    _MODULE_ROUTES.append(route)


def is_callable_pytree(fn) -> bool:
  """Whether `fn` is a callable pytree node (an `equinox.Module`, a
  `jax.tree_util.Partial`): its leaves are parameters a gradient must reach."""
  return not jax.tree_util.treedef_is_leaf(jax.tree.structure(fn))


def _key_parameter(fn):
  """`fn`'s parameter `key` (Equinox's convention for a module's randomness), or None."""
  try:
    param = inspect.signature(fn).parameters.get("key")
  except (TypeError, ValueError):
    return None
  if param is None or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
    return None
  return param


def _positional_key_index(fn) -> int | None:
  """The position of `fn`'s parameter `key` when a call may fill it positionally."""
  param = _key_parameter(fn)
  if param is None or param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
    return None
  return list(inspect.signature(fn).parameters).index("key")


_MODULE = "_jact_module"  # the wrapped module, passed to `module_call` by keyword
_MODULE_KEY = "_jact_module_key"  # carries a module's own `key=` past the wrapper's


def module_call(module) -> Callable[..., Any]:
  """`call(*args, _jact_module=module, **kwargs) = module(*args, **kwargs)`, named
  after the module. The module goes by keyword, so the positions of `args` --
  what `compress_argnums` and jact's errors count -- are the module call's own;
  a keyword `_MODULE_KEY` reaches the module as its `key`."""

  def call(*args, **kwargs):
    module = kwargs.pop(_MODULE)
    if _MODULE_KEY in kwargs:
      kwargs["key"] = kwargs.pop(_MODULE_KEY)
    return module(*args, **kwargs)

  call.__name__ = call.__qualname__ = type(module).__name__
  return call


def module_argnums(argnums) -> tuple[int, ...]:
  """`compress_argnums` of a module's call (validated): positions of its own
  arguments, as `module_call` receives them."""
  return check_argnums(argnums)


@jax.tree_util.register_pytree_node_class
class CompressedModule:
  """`jact.compressed(module)` (or `jact.checkpoint(module)`) for a callable
  pytree, such as an `eqx.Module`.

  A pytree whose one child is `module`, so its parameters stay leaves of the
  model that holds it: `eqx.filter_grad`, `eqx.partition` and optimizers see
  them, where a closure would hide them (and get no gradient). Calling it
  runs `module(*args, **kwargs)` with compressed residuals; the module is
  an argument kept by reference (parameters are exact), passed by keyword:
  `compress_argnums` counts the module call's own arguments (0: its first).
  When the module's call takes a `key` (Equinox's convention for dropout),
  the key goes to it as well, so its randomness is the plain model's for the
  same key; rounding then draws from `jax.random.fold_in(key,
  ROUNDING_STREAM)`. The key may be passed as `key=` or in its position of
  the module's call, not both.

  The same holds for any callable pytree, e.g. `jax.tree_util.Partial`:

  >>> import jax, jax.numpy as jnp, jact
  >>> layer = jax.tree_util.Partial(lambda w, x: jnp.tanh(x @ w), jnp.ones((64, 256)) / 64)
  >>> fast = jact.compressed(layer, bits=2)
  >>> loss = lambda f, x: jnp.sum(f(x, key=jax.random.key(0)) ** 2)
  >>> grads = jax.grad(loss)(fast, jnp.ones((32, 64)))   # same structure as `fast`
  >>> grads.module.args[0].shape
  (64, 256)

  Attributes:
    module: the wrapped callable pytree.
    call: `call(module, *args, key=..., **kwargs)`, the module's call through
      `jact.compressed` or `jact.checkpoint` (static).
  """

  ROUNDING_STREAM = 0x6A616374  # folded into a key shared with the module's own randomness

  def __init__(self, module, call: Callable[..., Any]):
    self.module = module
    self.call = call

  def tree_flatten(self):
    return (self.module,), self.call

  @classmethod
  def tree_unflatten(cls, call, children):
    return cls(children[0], call)

  @property
  def residual_config(self) -> ResidualConfig:
    return self.call.residual_config

  def __call__(self, *args, key=None, **kwargs):
    name = type(self.module).__name__
    param, module_key = _key_parameter(self.module), None
    index = _positional_key_index(self.module)
    if index is not None and len(args) > index:  # the module's `key` given positionally
      if key is not None:
        raise TypeError(
          f"jact's wrapped {name} got its `key` twice: positionally (argument {index} of "
          f"{name}'s call) and as key=. Pass it once: {name}'s key also seeds jact's "
          f"stochastic rounding (jax.random.fold_in(key, CompressedModule.ROUNDING_STREAM)), "
          f"so drop key= and keep the positional one, or pass it only as key=."
        )
      key = args[index]  # it stays in `args`: the module's positions are unchanged
    elif param is not None and key is not None:
      module_key = key
    elif param is not None and param.default is param.empty:
      where = "" if index is None else f" (or as argument {index} of {name}'s call)"
      raise TypeError(
        f"jact's wrapped {name}: {name}'s call needs its `key` and got none. Pass it as "
        f"key={where}: it reaches {name}'s `key` (its own randomness as in the plain model) "
        f"and jact's stochastic rounding draws from jax.random.fold_in(key, "
        f"CompressedModule.ROUNDING_STREAM)."
      )
    call = {_MODULE: self.module, **kwargs}
    if module_key is not None:
      call[_MODULE_KEY] = module_key
    if param is not None and key is not None:
      key = jax.random.fold_in(rng.single_key(key), self.ROUNDING_STREAM)
    return self.call(*args, key=key, **call)

  def __repr__(self) -> str:
    return f"CompressedModule({self.module!r}, name={self.residual_config.name!r})"
