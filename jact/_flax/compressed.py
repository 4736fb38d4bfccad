"""`jact.compressed` for whole Flax modules: the module's forward through
`call_compressed`, its variables kept exactly as they are.

* linen: `jact.compressed(Module)` returns a module class, a lifted transform
  in the manner of `nn.remat` (same name, parameter paths and values); keys
  come from the 'jact' stream of `apply`.
* nnx, a class: a subclass with the same constructor that forks a 'jact'
  stream from its `rngs`; nnx, an instance: a `CompressedModule` wrapper.
  Without a stream, keys come from `jact.nnx.use_key`.

Without any key the plain module runs (a ValueError naming the fix if
differentiated). Only `__call__` is compressed. `call_function` is the
nnx-aware path for a plain function taking nnx modules.

>>> import jax, jax.numpy as jnp, flax.linen as nn, jact
>>> class MLP(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return nn.Dense(4)(nn.gelu(nn.Dense(512)(x)))
>>> CMLP = jact.compressed(MLP, bits=2)
>>> x = jnp.ones((16, 32))
>>> params = CMLP().init(jax.random.key(0), x)
>>> jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, MLP().init(jax.random.key(0), x))
True
>>> loss = lambda p, x: CMLP().apply(p, x, rngs={'jact': jax.random.key(1)}).sum()
>>> plain = lambda p, x: MLP().apply(p, x).sum()
>>> saved = lambda f: jact.residual_report(f, params, x).total_bytes
>>> saved(plain) > 30 * saved(loss)  # gelu's chain stores one derivative (_transforms._folding)
True
>>> from flax import nnx
>>> class Block(nnx.Module):
...   def __init__(self, rngs):
...     self.fc = nnx.Linear(32, 512, rngs=rngs)
...   def __call__(self, x):
...     return nnx.gelu(self.fc(x))
>>> model = jact.compressed(Block, bits=2)(nnx.Rngs(params=0, jact=1))
>>> model(x).shape
(16, 512)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
from flax import linen as nn
from flax import nnx

from jact._engine.derivatives import inference_only
from jact._engine.rounding import resolve_compressor
from jact._compat import flax as _compat
from jact._flax import hooks as _hooks
from jact._flax.compressed_linen import linen_class, linen_instance
from jact._flax.wrapping import check_call, keyless_message, named
from jact._transforms._modules import ModuleRoute, add_module_route
from jact._transforms.compressed import (
  ResidualConfig,
  call_compressed,
  check_argnums,
)

__all__ = ["is_flax", "wrap", "CompressedModule", "nnx_call", "call_function", "has_graph_nodes"]


def is_flax(obj) -> bool:
  """True for a linen or nnx Module class or instance (what `wrap` handles)."""
  if inspect.isclass(obj):
    return issubclass(obj, (nn.Module, nnx.Module))
  return isinstance(obj, (nn.Module, nnx.Module))


def wrap(obj, config: ResidualConfig, policy=None, compress_argnums=()):
  """`jact.compressed(obj, ...)` for a Flax module class or instance (see module docstring).

  `compress_argnums` are positions of `__call__`'s arguments (after `self`) that are
  activations: a compressed copy of them is stored instead of the argument itself.
  """
  argnums = check_argnums(compress_argnums)
  if inspect.isclass(obj) and issubclass(obj, nn.Module):
    return linen_class(obj, config, policy, argnums)
  if isinstance(obj, nn.Module):
    return linen_instance(obj, config, policy, argnums)
  if inspect.isclass(obj) and issubclass(obj, nnx.Module):
    return _nnx_class(obj, config, policy, argnums)
  if isinstance(obj, nnx.Module):
    return CompressedModule(obj, config=config, policy=policy, compress_argnums=argnums)
  raise TypeError(f"not a Flax module: {type(obj).__name__}")


# ----------------------------------------------------------------------------- nnx


class _Static:
  """A static attribute compared by identity (the config may hold unhashable overrides)."""

  def __init__(self, config: ResidualConfig, policy, argnums):
    self.config, self.policy, self.argnums = config, policy, argnums

  def __repr__(self):
    return f"{self.config!r}"


def _jact_stream(rngs) -> nnx.RngStream | None:
  """A private 'jact' stream from a constructor's `rngs`.

  Forked from an explicit 'jact' stream. With only a 'default' stream, derived
  from its key and count *without* consuming it, so that the parameters of
  modules built later from the same `rngs` stay those of the plain model.
  """
  if isinstance(rngs, nnx.RngStream):
    return rngs.fork()
  if not isinstance(rngs, nnx.Rngs):
    return None
  if "jact" in rngs:
    return rngs["jact"].fork()
  if "default" in rngs:
    key = _compat.peek_stream_key(rngs["default"])
    return nnx.RngStream(jax.random.fold_in(key, 0x6A616374), tag="jact")  # "jact"
  return None


def _key_from(key):
  """A PRNG key from what a caller passed as `key=` (key, nnx.Rngs or nnx.RngStream)."""
  if isinstance(key, nnx.Rngs):
    return key["jact"]()
  if isinstance(key, nnx.RngStream):
    return key()
  return key


def _draw_key(module, key, config: ResidualConfig, name: str):
  """(compress?, key): `key=` if given, else a `jact.nnx.use_key` block's key,
  else the module's stream; (False, None) where a key is needed and none is
  found (the plain call, see `_call`)."""
  if key is not None:
    return True, _key_from(key)
  if not config.needs_key:
    return True, None
  key = _hooks.context_key(name)
  if key is not None:
    return True, key
  stream = getattr(module, "jact_rngs", None)
  if stream is None:
    return False, None
  return True, stream()


def _call(
  module,
  target: nnx.Module,
  method,
  args,
  kwargs,
  key,
  config: ResidualConfig,
  policy,
  argnums,
  what: str,
):
  """`method(target, *args, **kwargs)` with compressed residuals, or plain
  (raising if differentiated) when no key can be found."""
  compress, key = _draw_key(module, key, config, config.name)
  if not compress:
    return inference_only(
      method(target, *args, **kwargs), keyless_message(f"{what} {config.name!r}", True)
    )
  return nnx_call(
    target, method, args, kwargs, key=key, config=config, policy=policy, compress_argnums=argnums
  )


def _is_graph_node(x) -> bool:
  return isinstance(x, (nnx.Pytree, nnx.Variable))  # modules, Rngs, optimizers, Variables


def has_graph_nodes(args, kwargs) -> bool:
  """True when `(args, kwargs)` holds nnx graph nodes: modules, Rngs, Variables (see
  `call_function`)."""
  return any(
    _is_graph_node(leaf) for leaf in jax.tree.leaves((args, kwargs), is_leaf=_is_graph_node)
  )


def call_function(
  fn,
  args,
  kwargs,
  *,
  key,
  config: ResidualConfig,
  policy=None,
  compress_argnums=(),
  name: str | None = None,
):
  """`fn(*args, **kwargs)` with compressed residuals, where the arguments may hold nnx
  modules, `nnx.Rngs` or Variables (graph nodes).

  The graph nodes are split into (graphdef, state); `call_compressed` runs a pure
  function of (state, other leaves) that merges them, calls `fn` and returns its
  output and the Variables whose value the call replaced (batch statistics, RNG
  counts, sown intermediates); those are written back with `nnx.update`, as nnx
  transforms do. (The function path of `jact.compressed` flattens an nnx module
  like any pytree, so what the call writes into it is lost; this is the call to
  route such arguments to.) `compress_argnums`: positional arguments whose array
  leaves are activations, stored compressed instead of by reference.
  """
  argnums = check_argnums(compress_argnums)
  if any(i >= len(args) for i in argnums):
    raise ValueError(
      f"compress_argnums={argnums} but {name or getattr(fn, '__name__', 'fn')} "
      f"got {len(args)} positional arguments"
    )
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_graph_node)
  arg_flags = [
    i in argnums for i, a in enumerate(args) for _ in jax.tree.leaves(a, is_leaf=_is_graph_node)
  ]
  arg_flags += [False] * (len(leaves) - len(arg_flags))
  is_node = [_is_graph_node(leaf) for leaf in leaves]
  nodes = [leaf for leaf, n in zip(leaves, is_node) if n]
  rest = [leaf for leaf, n in zip(leaves, is_node) if not n]
  rest_flags = [f for f, n in zip(arg_flags, is_node) if not n]
  graphdef, state = nnx.split(nodes)

  def pure(state, rest):
    # values, not Variables: merge reuses the state's Variable objects
    before = _compat.variable_values(state)
    merged = nnx.merge(graphdef, state)
    it_nodes, it_rest = iter(merged), iter(rest)
    a, k = jax.tree.unflatten(treedef, [next(it_nodes) if n else next(it_rest) for n in is_node])
    out = fn(*a, **k)
    return out, _compat.replaced_variables(before, nnx.state(merged))

  flags = [False] * len(jax.tree.leaves(state)) + [
    f for f, leaf in zip(rest_flags, rest) if jax.tree.leaves(leaf)
  ]
  out, updates = call_compressed(
    pure,
    (state, rest),
    {},
    key=key,
    config=config,
    policy=policy,
    compress_inputs=flags,
    state_output=True,
  )
  if jax.tree.leaves(updates):
    nnx.update(nodes, updates)
  return out


def nnx_call(
  module: nnx.Module,
  method: Callable[..., Any],
  args,
  kwargs,
  *,
  key,
  config: ResidualConfig,
  policy=None,
  compress_argnums=(),
):
  """`method(module, *args, **kwargs)` with compressed residuals and the state changes
  of `module` (and of graph nodes among the arguments, e.g. an `nnx.Rngs` passed
  for dropout) written back; see `call_function`."""
  return call_function(
    method,
    (module, *args),
    kwargs,
    key=key,
    config=config,
    policy=policy,
    compress_argnums=tuple(i + 1 for i in check_argnums(compress_argnums)),
    name=type(module).__name__,
  )


def _nnx_class(module_class, config: ResidualConfig, policy, argnums=()):
  check_call(module_class)
  base_call = module_class.__call__

  def __init__(self, *args, **kwargs):
    module_class.__init__(self, *args, **kwargs)
    rngs = kwargs.get("rngs")
    if rngs is None:
      rngs = next((a for a in args if isinstance(a, (nnx.Rngs, nnx.RngStream))), None)
    stream = _jact_stream(rngs) if config.needs_key else None
    self.jact_rngs = stream if stream is not None else nnx.data(None)
    self.residual_name = named(config, module_class.__name__).name

  @functools.wraps(base_call)
  def __call__(self, *args, key=None, **kwargs):
    cfg = dataclasses.replace(config, name=self.residual_name)
    return _call(
      self, self, base_call, args, kwargs, key, cfg, policy, argnums, module_class.__name__
    )

  functools.update_wrapper(__init__, module_class.__init__)
  return type(
    module_class.__name__,
    (module_class,),
    {
      "__init__": __init__,
      "__call__": __call__,
      "__module__": module_class.__module__,
      "__qualname__": module_class.__qualname__,
      "__doc__": module_class.__doc__,
      "residual_config": config,
    },
  )


def config_of(compressor, **settings) -> ResidualConfig:
  """The `ResidualConfig` storing residuals with `compressor` (resolved: a
  `Compressor`, or None: kept exact); `settings`: `min_size=`, `name=`,
  `overrides=`."""
  return ResidualConfig(compressor, **settings)


class CompressedModule(nnx.Module):
  """An nnx module whose calls store their residuals compressed.

  `CompressedModule(module, rngs=nnx.Rngs(jact=0), bits=2)` (settings as for
  `jact.compressed`: `bits=` or `compressor=`, `min_size=`, `name=`,
  `overrides=`; or `config=ResidualConfig(...)`); `jact.compressed(module)`
  builds one without a stream. Calling it calls `module` (state updates written
  back into `module`, which is kept as `.module`, shared, not copied); pass
  `key=` (a PRNG key, nnx.Rngs or nnx.RngStream) to override the stored stream.
  """

  def __init__(
    self,
    module: nnx.Module,
    *,
    rngs=None,
    config: ResidualConfig | None = None,
    policy=None,
    compress_argnums=(),
    **settings,
  ):
    if not isinstance(module, nnx.Module):
      raise TypeError(f"CompressedModule wraps an nnx.Module, got {type(module).__name__}")
    check_call(type(module))
    if config is None:
      bits, compressor = settings.pop("bits", 4), settings.pop("compressor", None)
      config = config_of(resolve_compressor(bits, compressor, "jact.compressed"), **settings)
    elif settings:
      raise TypeError("pass either config= or settings, not both")
    self.module = module
    self.residual_settings = _Static(config, policy, check_argnums(compress_argnums))
    self.residual_name = named(config, type(module).__name__).name
    stream = _jact_stream(rngs) if config.needs_key else None
    self.jact_rngs = stream if stream is not None else nnx.data(None)

  @property
  def residual_config(self) -> ResidualConfig:
    return self.residual_settings.config

  def __call__(self, *args, key=None, **kwargs):
    settings = self.residual_settings
    cfg = dataclasses.replace(settings.config, name=self.residual_name)
    return _call(
      self,
      self.module,
      type(self.module).__call__,
      args,
      kwargs,
      key,
      cfg,
      settings.policy,
      settings.argnums,
      type(self.module).__name__,
    )


add_module_route(
  ModuleRoute(handles=is_flax, wrap=wrap, takes_arguments=has_graph_nodes, call=call_function)
)
