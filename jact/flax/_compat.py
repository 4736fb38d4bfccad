"""Every private or internal Flax access jact makes, in one module (written for flax 0.12.8).

jact's Flax integration reaches past Flax's public API in a few places: the
lifted-transform plumbing behind `jact.compressed(LinenModule)`, linen's method
dispatcher and capture stack behind `jact.convert`, binding a twin to a layer's
scope, building an nnx twin around a layer's own Variables, an RNG stream's key
derivation, and which Variables an nnx call replaced. Each is one small
function here, with a comment naming the public Flax API that would replace it
(or "none public in flax 0.12.8" and what to watch). Nothing else in jact may
touch Flax internals (tests/test_compat_flax.py greps for them), and `check()`
exercises every function here on tiny models, so a Flax upgrade that breaks one
fails in one place, naming it, instead of deep inside a conversion.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, ContextManager, Iterator

import flax
import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import lift
from flax.linen import dtypes as linen_dtypes
from flax.linen import module as linen_module
from flax.linen import transforms as linen_transforms

__all__ = [
    "pack_all", "lift_method_call", "state_restored", "run_methods_within", "suppress_capture", "bind_to_scope",
    "nnx_twin_of", "peek_stream_key", "variable_values", "replaced_variables",
    "canonicalize_dtype", "attention_signature", "attention_defaults", "trace_context_error",
    "FlaxCompatError",
    "check",
]


# ----------------------------------------------------------------------------- linen lifting


def pack_all(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
  """`flax.core.lift.pack` lifting every variable collection in and out and every RNG
  stream in: `fn(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs)`.

  Public replacement: none public in flax 0.12.8. `lift.pack` is the building
  block of every linen lifted transform (`nn.remat`, `nn.jit`, ...) but is not
  in the API reference; the public lifted transforms (`nn.custom_vjp`, `nn.vjp`)
  fix the VJP's shape. Watch: pack's signature and its calling convention above.
  """
  return lift.pack(fn, (True,), (True,), (True,), name=name, enable_kwargs=True)


def lift_method_call(module: nn.Module, module_class: type, method: Callable[..., Any],
                     transform: Callable[[Callable[..., Any]], Callable[..., Any]], args,
                     kwargs) -> Any:
  """`method(clone, *args, **kwargs)` run through a lifted transform, as linen's own
  lifted transforms run a module's method.

  `transform(core_fn)` returns the lifted function of `(scopes, *args, **kwargs)`
  (e.g. built with `pack_all`); `core_fn(scopes, *args, **kwargs)` rebuilds
  `module` as a `module_class` bound to the lifted scopes, carrying the module's
  internal state (setup state, autoname cursor) in and out. This is the body of
  `flax.linen.transforms.module_class_lift_transform` (flax 0.12.8).

  Public replacement: none public in flax 0.12.8. Watch: `Module._state` and its
  `export()`/`reimport()`, and `flax.linen.transforms.get_module_scopes` /
  `set_module_scopes`. `flax.linen.transforms.lift_direct_transform` (not
  exported either) does the same steps but clones `type(module)` rather than
  `module_class`, so a converted model would no longer see the plain class.
  """
  state = module._state.export()

  def core_fn(scopes, *args, **kwargs):
    attrs = {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
             if f.name != "parent" and f.init}
    cloned = module_class(parent=None, **attrs)
    cloned, args, kwargs = linen_transforms.set_module_scopes(cloned, args, kwargs, scopes)
    object.__setattr__(cloned, "_state", state.export())
    out = method(cloned, *args, **kwargs)
    module._state.reimport(cloned._state)
    return out

  lifted = transform(core_fn)
  scopes, args, kwargs = linen_transforms.get_module_scopes(module, args, kwargs)
  return lifted(scopes, *args, **kwargs)


@contextlib.contextmanager
def state_restored(module: nn.Module) -> Iterator[None]:
  """Runs a lifted call of `module` (through `lift_method_call`) whose effect on the
  module's internal state (setup state, autoname cursor) is then undone: a
  measurement that traces the call once more must not shift the names the real
  call gives its submodules.

  Public replacement: none public in flax 0.12.8. Watch: `Module._state` and its
  `export()`/`reimport()` (as in `lift_method_call`).
  """
  saved = module._state.export()
  try:
    yield
  finally:
    module._state.reimport(saved)


# ----------------------------------------------------------------------------- linen interception


def run_methods_within(cls: type, around: Callable[[nn.Module], ContextManager]) -> None:
  """Makes every Flax-wrapped method of `cls` (a linen Module subclass) run inside
  `around(module)`, also when the module is a child of another model.

  Public replacement: none equivalent in flax 0.12.8. `nn.intercept_methods` is
  public but must be installed by whoever calls the outermost `init`/`apply`, so
  a converted model used as a child of a plain model would escape it. Watch:
  linen's private `Module._call_wrapped_method(self, fun, args, kwargs)`, the
  one dispatcher every wrapped method passes through.
  """

  @nn.nowrap
  def _call_wrapped_method(self, fun, args, kwargs):
    with around(self):
      return super(cls, self)._call_wrapped_method(fun, args, kwargs)

  cls._call_wrapped_method = _call_wrapped_method


def _capture_stack() -> list | None:
  return getattr(getattr(linen_module, "_context", None), "capture_stack", None)


@contextlib.contextmanager
def suppress_capture(module: nn.Module) -> Iterator[None]:
  """Under `apply(..., capture_intermediates=...)`, keeps `module` (not its
  sublayers) from recording its output.

  Public replacement: none public in flax 0.12.8: the capture filter is set only
  through `apply(capture_intermediates=...)`. Watch: the filter stack
  `flax.linen.module._context.capture_stack`. A missing stack is tolerated here
  (the output would be recorded twice, nothing else changes); `check()` reports it.
  """
  stack = _capture_stack()
  if not stack or not stack[-1]:
    yield
    return
  outer = stack[-1]
  stack.append(lambda mdl, method: mdl is not module and outer(mdl, method))
  try:
    yield
  finally:
    stack.pop()


def bind_to_scope(module: nn.Module, cls: type, **fields) -> nn.Module:
  """A `cls(**fields)` bound to (a rewound view of) `module`'s scope: same variables,
  RNG counters and path, and names that `module`'s own setup() reserved (Embed's
  table) can be claimed again.

  Public replacement: partial. `Module.scope` is public and passing a Scope as
  `parent` is how Flax's own transforms bind modules; `Scope.rewound(rewind_rngs=False)`
  has no underscore but is undocumented. Watch: `flax.core.scope.Scope.rewound`.
  """
  return cls(**fields, parent=module.scope.rewound())


def canonicalize_dtype(*args, dtype=None):
  """linen's output dtype of a layer: `dtype`, or the promoted dtype of `args` (None skipped).

  Public replacement: none exported from `flax.linen` in flax 0.12.8
  (`flax.linen.dtypes` is a submodule). Watch: `flax.linen.dtypes.canonicalize_dtype`.
  """
  return linen_dtypes.canonicalize_dtype(*args, dtype=dtype)


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


def peek_stream_key(stream: nnx.RngStream) -> jax.Array:
  """The key `stream()` would return next, without consuming it.

  Public replacement: partial. `RngStream.key`/`.count` are public Variables;
  that a draw is `fold_in(key, count)` is nnx's internal derivation. Watch:
  `flax.nnx.RngStream.__call__`.
  """
  return jax.random.fold_in(stream.key[...], stream.count[...])


def stream_key_shape(stream: nnx.RngStream) -> tuple:
  """Shape of the key array behind `stream`: () for one stream, (n,) for the
  streams of n layers stacked by `nnx.vmap`. Public: `RngStream.key` is a
  public Variable; `[...]` reads its value."""
  return tuple(stream.key[...].shape)


def trace_context_error() -> type:
  """The exception nnx raises when a Variable (an RNG stream's count) is updated
  inside a JAX transform that closes over its module (`jax.vmap(lambda x:
  model(x))`).

  Public replacement: partial. `flax.errors.TraceContextError` is listed in
  Flax's error reference; which update raises it is nnx's internal check.
  Watch: `flax.nnx.variablelib.Variable._check_can_update`.
  """
  return flax.errors.TraceContextError


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
  changed = [(path, var) for path, var in nnx.to_flat_state(state)
             if path not in before or not _same(_leaf(var), before[path])]
  return nnx.from_flat_state(changed)


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
  params = {name: p.replace(annotation=p.empty)
            for name, p in inspect.signature(linen_fn).parameters.items()}
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


# ----------------------------------------------------------------------------- self-check


class FlaxCompatError(RuntimeError):
  """A private or internal Flax access in `jact.flax._compat` no longer works."""


def _expect(condition, what: str) -> None:
  if not condition:
    raise AssertionError(what)


def _check_lift() -> None:
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False)(nn.Dense(3)(x))
      return nn.Dropout(0.5, deterministic=False)(x)

  class Lifted(Block):
    def __call__(self, x):
      def transform(core_fn):
        def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
          scope = scope_fn(variable_groups, rng_groups)
          return core_fn(scope, *args, **kwargs), repack_fn(scope)
        return pack_all(inner, "check")
      return lift_method_call(self, Block, Block.__call__, transform, (x,), {})

  x, rngs = jnp.arange(8.0).reshape(2, 4), {"params": jax.random.key(0)}
  plain, lifted = Block().init(rngs, x), Lifted().init(rngs, x)
  _expect(jax.tree.map(jnp.shape, plain) == jax.tree.map(jnp.shape, lifted),
          "the lifted module's variables differ from the plain module's")
  run = lambda m, v: m.apply(v, x, rngs={"dropout": jax.random.key(1)}, mutable=["batch_stats"])
  (y0, s0), (y1, s1) = run(Block(), plain), run(Lifted(), plain)
  _expect(bool(jnp.array_equal(y0, y1)), "the lifted call's output differs from the plain call's")
  _expect(all(jax.tree.leaves(jax.tree.map(jnp.array_equal, s0, s1)))
          and not jnp.array_equal(s1["batch_stats"]["BatchNorm_0"]["var"],
                                  plain["batch_stats"]["BatchNorm_0"]["var"]),
          "the lifted call did not write the batch statistics back")


def _check_methods_within() -> None:
  entered = []

  class Child(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(x)

  class Recorded(Child):
    pass

  @contextlib.contextmanager
  def record(module):
    entered.append(module)
    yield

  run_methods_within(Recorded, record)

  class Parent(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Recorded()(x)

  Parent().init(jax.random.key(0), jnp.ones((1, 3)))
  _expect(any(isinstance(m, Recorded) for m in entered),
          "a method of a child module did not run inside the installed context")


def _check_capture() -> None:
  _expect(isinstance(_capture_stack(), list), "flax.linen.module._context.capture_stack is gone")

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      inner = nn.Dense(2, name="inner")
      with suppress_capture(inner):
        y = inner(x)
      return nn.Dense(2, name="other")(y)

  x = jnp.ones((1, 3))
  variables = Model().init(jax.random.key(0), x)
  _, state = Model().apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
  captured = set(state["intermediates"])
  _expect("other" in captured and "inner" not in captured,
          f"capture filter not applied (captured {sorted(captured)})")


def _check_bind() -> None:
  class Model(nn.Module):
    @nn.compact
    def __call__(self, ids):
      return nn.Dense(3)(nn.Embed(5, 4)(ids))

  class Twin(nn.Embed):
    pass

  class DenseTwin(nn.Dense):
    pass

  twins = {nn.Embed: Twin, nn.Dense: DenseTwin}
  bound = []

  def intercept(next_fun, args, kwargs, context):
    twin = twins.get(type(context.module))
    if twin is None or context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    fields = {f.name: getattr(context.module, f.name) for f in dataclasses.fields(context.module)
              if f.init and f.name not in ("parent", "name")}
    bound.append(twin)
    return bind_to_scope(context.module, twin, **fields)(*args, **kwargs)

  ids = jnp.array([[0, 3]])
  plain = Model().init(jax.random.key(0), ids)
  with nn.intercept_methods(intercept):
    twin_vars = Model().init(jax.random.key(0), ids)
    y = Model().apply(plain, ids)
  _expect(set(bound) == {Twin, DenseTwin}, "the twins were not called")
  _expect(jax.tree.map(jnp.shape, plain) == jax.tree.map(jnp.shape, twin_vars)
          and all(jax.tree.leaves(jax.tree.map(jnp.array_equal, plain, twin_vars))),
          "a twin bound to a layer's scope made different variables")
  _expect(bool(jnp.array_equal(y, Model().apply(plain, ids))),
          "a twin bound to a layer's scope computed a different output")


def _check_nnx_twin() -> None:
  class Twin(nnx.Linear):
    pass

  plain = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  twin = nnx_twin_of(plain, Twin)
  _expect(type(twin) is Twin and twin.kernel is plain.kernel and twin.bias is plain.bias,
          "the twin does not hold the plain layer's Variables")
  twin.extra = nnx.data(jnp.zeros(()))  # an assignment through nnx's checks
  graphdef, state = nnx.split(twin)
  _expect(type(nnx.merge(graphdef, state)) is Twin, "split/merge does not round-trip the twin")
  x = jnp.ones((1, 2))
  _expect(bool(jnp.array_equal(nnx.jit(lambda m, x: m(x))(twin, x), plain(x))),
          "the twin computes a different output under nnx.jit")


def _check_stream() -> None:
  stream = nnx.Rngs(default=3)["default"]
  stream()
  peeked = peek_stream_key(stream)
  _expect(bool(jnp.array_equal(jax.random.key_data(peeked), jax.random.key_data(stream()))),
          "the peeked key is not the stream's next key")


def _check_stream_key_shape() -> None:
  _expect(stream_key_shape(nnx.Rngs(default=3)["default"]) == (), "a stream's key is not a scalar")

  @nnx.vmap(in_axes=0, out_axes=0)
  def stacked(key):
    return nnx.Rngs(default=key)

  rngs = stacked(jax.random.split(jax.random.key(0), 4))
  _expect(stream_key_shape(rngs["default"]) == (4,), "stacked streams do not hold one key per layer")


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


def _check_dtype() -> None:
  got = canonicalize_dtype(jnp.ones(2, jnp.bfloat16), None, jnp.ones(2, jnp.float32))
  _expect(got == jnp.float32 and canonicalize_dtype(jnp.ones(2), dtype=jnp.bfloat16)
          == jnp.bfloat16, f"canonicalize_dtype gave {got}")


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
  nnx.MultiHeadAttention(2, 4, decode=False, attention_fn=recorder("nnx"),
                         rngs=nnx.Rngs(0))(x)
  for where, names in seen.items():
    _expect(names and names <= declared,
            f"{where} attention passes keywords {sorted(names - declared)} that Flax's "
            f"dot_product_attention does not take" if names else f"{where} attention passed none")


def _check_trace_context_error() -> None:
  stream = nnx.Rngs(default=0)["default"]
  try:
    jax.vmap(lambda x: jax.random.normal(stream(), ()) * x)(jnp.ones(2))
  except trace_context_error():
    return
  raise AssertionError("advancing a stream inside jax.vmap closing over it did not raise "
                       "trace_context_error()")


_CHECKS: dict[str, Callable[[], None]] = {
    "pack_all / lift_method_call": _check_lift,
    "run_methods_within": _check_methods_within,
    "suppress_capture": _check_capture,
    "bind_to_scope": _check_bind,
    "nnx_twin_of": _check_nnx_twin,
    "peek_stream_key": _check_stream,
    "stream_key_shape": _check_stream_key_shape,
    "variable_values / replaced_variables": _check_replaced,
    "canonicalize_dtype": _check_dtype,
    "attention_signature": _check_attention,
    "trace_context_error": _check_trace_context_error,
}


def check() -> None:
  """Exercises every access in this module on tiny models.

  Raises:
    FlaxCompatError: naming each access that no longer works with the installed
      Flax and what went wrong; the fix is to port that function (only that
      function) to the new Flax.
  """
  broken = []
  for name, probe in _CHECKS.items():
    try:
      probe()
    except Exception as err:  # noqa: BLE001 -- every failure is reported, by name
      broken.append(f"{name}: {type(err).__name__}: {err}")
  if broken:
    raise FlaxCompatError(
        f"jact.flax._compat: {len(broken)} Flax access(es) broken with flax "
        f"{flax.__version__}:\n  " + "\n  ".join(broken))
