"""Private or internal flax.nnx accesses, and the attention calling convention of both APIs.

nnx twins are built around a layer's own Variables, RNG streams are read
without being advanced, and the Variables a call wrote are found by identity;
attention twins take every keyword Flax's layers pass to an `attention_fn`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from jact._compat._probes import probes

__all__ = [
  "nnx_twin_of",
  "peek_stream_key",
  "stream_key_shape",
  "draw_first_of_stacked",
  "trace_context_error",
  "variable_values",
  "replaced_variables",
  "attention_signature",
  "attention_defaults",
]


def _expect(condition, what: str) -> None:
  if not condition:
    raise AssertionError(what)


# ----------------------------------------------------------------------------- nnx


def nnx_twin_of(plain: nnx.Module, cls: type) -> nnx.Module:
  """A new `cls` instance (`cls` a subclass of `type(plain)`) holding `plain`'s very
  attributes (its Variable objects, not copies), built without `cls.__init__`.

  Does what nnx's metaclass does before `__init__` (a fresh per-object state),
  then copies the attributes, nnx's own bookkeeping of which attributes are data
  included; every later assignment goes through nnx's checks.

  Public replacement: none public in flax 0.12.8 for "construct without
  __init__". `nnx.merge(*nnx.split(plain))` rebuilds sub-modules too (breaking
  sharing); `copy.copy` (nnx's pickle support) would share the per-object state
  between the two objects. Watch: `flax.nnx.pytreelib._graph_node_meta_call`
  (which attributes it sets: `_pytree__state`, `_pytree__nodes`).
  """
  twin = cls.__new__(cls)
  object.__setattr__(twin, "_pytree__state", type(plain._pytree__state)())
  for name, value in vars(plain).items():
    if name != "_pytree__state":
      object.__setattr__(twin, name, value)
  return twin


@probes(nnx_twin_of="nnx's per-object _pytree__state and attribute bookkeeping")
def _check_nnx_twin() -> None:
  class Twin(nnx.Linear):
    pass

  plain = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  twin = nnx_twin_of(plain, Twin)
  _expect(
    type(twin) is Twin and twin.kernel is plain.kernel and twin.bias is plain.bias,
    "the twin does not hold the plain layer's Variables",
  )
  twin.extra = nnx.data(jnp.zeros(()))  # an assignment through nnx's checks
  graphdef, state = nnx.split(twin)
  _expect(type(nnx.merge(graphdef, state)) is Twin, "split/merge does not round-trip the twin")
  x = jnp.ones((1, 2))
  _expect(
    bool(jnp.array_equal(nnx.jit(lambda m, x: m(x))(twin, x), plain(x))),
    "the twin computes a different output under nnx.jit",
  )


def peek_stream_key(stream: nnx.RngStream) -> jax.Array:
  """The key `stream()` would return next, without consuming it.

  Public replacement: partial. `RngStream.key`/`.count` are public Variables;
  that a draw is `fold_in(key, count)` is nnx's internal derivation. Watch:
  `flax.nnx.RngStream.__call__`.
  """
  return jax.random.fold_in(stream.key[...], stream.count[...])


@probes(peek_stream_key="an RngStream draws fold_in(key, count)")
def _check_stream() -> None:
  stream = nnx.Rngs(default=3)["default"]
  stream()
  peeked = peek_stream_key(stream)
  _expect(
    bool(jnp.array_equal(jax.random.key_data(peeked), jax.random.key_data(stream()))),
    "the peeked key is not the stream's next key",
  )


def stream_key_shape(stream: nnx.RngStream) -> tuple:
  """Shape of the key array behind `stream`: () for one stream, (n,) for the
  streams of n layers stacked by `nnx.vmap`. Public: `RngStream.key` is a
  public Variable; `[...]` reads its value."""
  return tuple(stream.key[...].shape)


@probes(stream_key_shape="RngStream.key's value, stacked by nnx.vmap")
def _check_stream_key_shape() -> None:
  _expect(stream_key_shape(nnx.Rngs(default=3)["default"]) == (), "a stream's key is not a scalar")

  @nnx.vmap(in_axes=0, out_axes=0)
  def stacked(key):
    return nnx.Rngs(default=key)

  rngs = stacked(jax.random.split(jax.random.key(0), 4))
  _expect(
    stream_key_shape(rngs["default"]) == (4,), "stacked streams do not hold one key per layer"
  )


def draw_first_of_stacked(stream: nnx.RngStream) -> jax.Array:
  """One key from streams stacked by `nnx.vmap` and called whole: the first
  layer's next key (`fold_in(key[0], count[0])`), every layer's count advanced
  by one, as each stream's own draw would.

  Public replacement: partial (`RngStream.key`/`.count` are public Variables;
  a draw being `fold_in(key, count)` is nnx's internal derivation). Watch:
  `flax.nnx.RngStream.__call__`.
  """
  count = stream.count[...]
  stream.count[...] = count + 1
  first = (0,) * count.ndim
  return jax.random.fold_in(stream.key[...][first], count[first])


@probes(draw_first_of_stacked="a stacked RngStream's first layer draws fold_in(key, count)")
def _check_draw_first_of_stacked() -> None:
  @nnx.vmap(in_axes=0, out_axes=0)
  def stacked(key):
    return nnx.Rngs(default=key)

  keys = jax.random.split(jax.random.key(0), 3)
  stream = stacked(keys)["default"]
  drawn = draw_first_of_stacked(stream)
  own = nnx.Rngs(default=keys[0])["default"]()
  _expect(
    bool(jnp.array_equal(jax.random.key_data(drawn), jax.random.key_data(own))),
    "the first stacked layer's draw is not its own stream's",
  )
  _expect(bool(jnp.all(stream.count[...] == 1)), "the stacked counts did not advance")


def trace_context_error() -> type:
  """The exception nnx raises when a Variable (an RNG stream's count) is updated
  inside a JAX transform that closes over its module (`jax.vmap(lambda x:
  model(x))`).

  Public replacement: partial. `flax.errors.TraceContextError` is listed in
  Flax's error reference; which update raises it is nnx's internal check.
  Watch: `flax.nnx.variablelib.Variable._check_can_update`.
  """
  return flax.errors.TraceContextError


@probes(trace_context_error="flax.errors.TraceContextError on a stream advanced inside jax.vmap")
def _check_trace_context_error() -> None:
  stream = nnx.Rngs(default=0)["default"]
  try:
    jax.vmap(lambda x: jax.random.normal(stream(), ()) * x)(jnp.ones(2))
  except trace_context_error():
    return
  raise AssertionError(
    "advancing a stream inside jax.vmap closing over it did not raise trace_context_error()"
  )


def _leaf(variable):
  leaves = jax.tree.leaves(variable)
  return leaves[0] if len(leaves) == 1 else tuple(leaves)


def _same(a, b) -> bool:
  if isinstance(a, tuple) and isinstance(b, tuple):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
  return a is b


def variable_values(state: nnx.State) -> dict:
  """path -> the value object(s) of each Variable in `state` (for `replaced_variables`)."""
  return {path: _leaf(var) for path, var in nnx.to_flat_state(state)}


def replaced_variables(before: dict, state: nnx.State) -> nnx.State:
  """The Variables of `state` whose value object is not the one in `before`
  (`variable_values` of the state the module was merged from): what a call wrote.

  Public replacement: none public in flax 0.12.8 (nnx's transforms track this
  internally). The calls are public; that `nnx.merge` reuses the state's arrays
  by identity, so an untouched Variable keeps its very array, is not documented.
  Watch: if merge copied, every Variable would count as written (still correct,
  but every parameter would pass through the output epilogue).
  """
  changed = [
    (path, var)
    for path, var in nnx.to_flat_state(state)
    if path not in before or not _same(_leaf(var), before[path])
  ]
  return nnx.from_flat_state(changed)


@probes(
  variable_values="nnx.to_flat_state: one value object per Variable",
  replaced_variables="nnx.merge reusing the state's arrays by identity",
)
def _check_replaced() -> None:
  for training in (True, False):
    model = nnx.BatchNorm(3, use_running_average=not training, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    before = variable_values(state)
    merged = nnx.merge(graphdef, state)
    merged(jnp.arange(6.0).reshape(2, 3))
    paths = {path for path, _ in nnx.to_flat_state(replaced_variables(before, nnx.state(merged)))}
    want = {("mean",), ("var",)} if training else set()
    _expect(paths == want, f"replaced Variables {sorted(paths)}, expected {sorted(want)}")


# ----------------------------------------------------------------------------- attention


def _attention_functions() -> tuple[Callable[..., Any], ...]:
  return (nn.dot_product_attention, nnx.dot_product_attention)


def attention_signature() -> inspect.Signature:
  """The parameters of Flax's `dot_product_attention` (linen's in order, then those only
  nnx's has, keyword-only), read from the installed Flax.

  An `attention_fn` with this signature receives every keyword Flax's attention
  layers pass: linen's MultiHeadDotProductAttention filters its keywords by the
  `attention_fn`'s signature (a keyword it does not declare is silently
  dropped); nnx's MultiHeadAttention passes a fixed list, all of them
  parameters of `nnx.dot_product_attention`. Public replacement: the functions
  and their signatures are public; that calling convention is not documented.
  Watch: the keyword lists in `MultiHeadDotProductAttention.__call__` and
  `nnx.MultiHeadAttention.__call__`.
  """
  linen_fn, nnx_fn = _attention_functions()
  params = {
    name: p.replace(annotation=p.empty)
    for name, p in inspect.signature(linen_fn).parameters.items()
  }
  for name, p in inspect.signature(nnx_fn).parameters.items():
    if name not in params:
      params[name] = p.replace(kind=p.KEYWORD_ONLY, annotation=p.empty)
  return inspect.Signature(list(params.values()))


def attention_defaults() -> dict[str, tuple]:
  """name -> the default value(s) the parameter has in Flax's attention functions."""
  defaults: dict[str, tuple] = {}
  for fn in _attention_functions():
    for name, p in inspect.signature(fn).parameters.items():
      if p.default is not p.empty:
        defaults[name] = defaults.get(name, ()) + (p.default,)
  return defaults


@probes(
  attention_signature=(
    "the signatures of linen's and nnx's dot_product_attention and the keywords their "
    "attention layers pass"
  ),
  attention_defaults="the defaults in those signatures",
)
def _check_attention() -> None:
  declared = set(attention_signature().parameters)
  for fn in _attention_functions():
    missing = set(inspect.signature(fn).parameters) - declared
    _expect(not missing, f"attention_signature lacks {sorted(missing)}")
  seen: dict[str, set] = {"linen": set(), "nnx": set()}

  def recorder(where):
    def attention_fn(query, key, value, **kwargs):
      seen[where].update(kwargs)
      return nn.dot_product_attention(query, key, value)

    attention_fn.__signature__ = attention_signature()
    return attention_fn

  x = jnp.ones((1, 2, 4))
  nn.MultiHeadDotProductAttention(2, attention_fn=recorder("linen")).init(jax.random.key(0), x)
  nnx.MultiHeadAttention(2, 4, decode=False, attention_fn=recorder("nnx"), rngs=nnx.Rngs(0))(x)
  for where, names in seen.items():
    _expect(
      names and names <= declared,
      f"{where} attention passes keywords {sorted(names - declared)} that Flax's "
      f"dot_product_attention does not take"
      if names
      else f"{where} attention passed none",
    )
