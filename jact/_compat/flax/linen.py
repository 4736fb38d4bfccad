"""Private or internal flax.linen accesses: the lifted call, method interception, scope binding.

`jact.compressed(LinenModule)` runs a module's method through linen's lifting
machinery, and `jact.convert` intercepts every wrapped method and binds twins to
a layer's scope; none of it is public linen API.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import lift
from flax.linen import dtypes as linen_dtypes
from flax.linen import module as linen_module
from flax.linen import transforms as linen_transforms

from jact._compat._probes import probes

__all__ = [
  "pack_all",
  "lift_method_call",
  "state_restored",
  "run_methods_within",
  "suppress_capture",
  "bind_to_scope",
  "canonicalize_dtype",
  "lifted_target",
  "relift",
  "remat_body",
]


def _expect(condition, what: str) -> None:
  if not condition:
    raise AssertionError(what)


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


def lift_method_call(
  module: nn.Module,
  module_class: type,
  method: Callable[..., Any],
  transform: Callable[[Callable[..., Any]], Callable[..., Any]],
  args,
  kwargs,
) -> Any:
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
    attrs = {
      f.name: getattr(module, f.name)
      for f in dataclasses.fields(module)
      if f.name != "parent" and f.init
    }
    cloned = module_class(parent=None, **attrs)
    cloned, args, kwargs = linen_transforms.set_module_scopes(cloned, args, kwargs, scopes)
    object.__setattr__(cloned, "_state", state.export())
    out = method(cloned, *args, **kwargs)
    module._state.reimport(cloned._state)
    return out

  lifted = transform(core_fn)
  scopes, args, kwargs = linen_transforms.get_module_scopes(module, args, kwargs)
  return lifted(scopes, *args, **kwargs)


@probes(
  pack_all="flax.core.lift.pack: its signature and calling convention",
  lift_method_call="Module._state export()/reimport(), linen.transforms get/set_module_scopes",
)
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
  _expect(
    jax.tree.map(jnp.shape, plain) == jax.tree.map(jnp.shape, lifted),
    "the lifted module's variables differ from the plain module's",
  )
  run = lambda m, v: m.apply(v, x, rngs={"dropout": jax.random.key(1)}, mutable=["batch_stats"])
  (y0, s0), (y1, s1) = run(Block(), plain), run(Lifted(), plain)
  _expect(bool(jnp.array_equal(y0, y1)), "the lifted call's output differs from the plain call's")
  _expect(
    all(jax.tree.leaves(jax.tree.map(jnp.array_equal, s0, s1)))
    and not jnp.array_equal(
      s1["batch_stats"]["BatchNorm_0"]["var"], plain["batch_stats"]["BatchNorm_0"]["var"]
    ),
    "the lifted call did not write the batch statistics back",
  )


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


@probes(state_restored="a linen Module's private _state, its export() and reimport()")
def _check_state_restored() -> None:
  seen = []

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      with state_restored(self):  # what a lifted call may leave behind
        self._state.autoname_cursor["Dense"] = 5
        self._state.in_compact_method = False
      seen.append((self._state.in_compact_method, nn.Dense(2).name))
      return x

  Model().init(jax.random.key(0), jnp.ones((1, 3)))
  _expect(seen == [(True, "Dense_0")], f"the module's state was not restored: {seen}")


def lifted_target(cls: type) -> type | None:
  """The class a linen lifted transform was applied to (`S` of `nn.vmap(S, ...)`,
  `nn.remat(S)`, `nn.jit(S)`), or None when `cls` is no such class.

  Public replacement: none in flax 0.12.8. Watch: the closure of the methods that
  `flax.linen.transforms.module_class_lift_transform` (and its `_cached` variant)
  puts in the class it builds: `module_class`, `transform`, `trafo_args`,
  `trafo_kwargs`, `fn_name`.
  """
  lifted = _lifted_methods(cls)
  return next(iter(lifted.values()))["module_class"] if lifted else None


def _lifted_methods(cls: type) -> dict[str, dict]:
  if not isinstance(cls, type) or len(cls.__bases__) != 1:
    return {}
  inner, found = cls.__bases__[0], {}
  for name, fn in cls.__dict__.items():
    code = getattr(fn, "__code__", None)
    free = code.co_freevars if code is not None else ()
    if {"module_class", "transform", "trafo_kwargs", "fn_name"} <= set(free):
      cells = dict(zip(free, (c.cell_contents for c in fn.__closure__)))
      if cells["module_class"] is inner:
        found[name] = cells
  return found


def relift(cls: type, inner: type) -> type:
  """`cls` (a class built by a linen lifted transform, see `lifted_target`) built
  again, with the same transform and arguments, around `inner` (a subclass of
  its target): a lifted class's methods clone their target class with the
  instance's fields, so a target with more fields must be lifted itself.

  Public replacement: none in flax 0.12.8. Watch: as `lifted_target`, and the
  signatures of `module_class_lift_transform(transform, module_class,
  *trafo_args, methods=, **trafo_kwargs)` and of its `_cached` variant.
  """
  methods = {}
  for name, cells in _lifted_methods(cls).items():
    kwargs = cells["trafo_kwargs"]
    if "trafo_fn" in cells:  # the cached variant (nn.jit): trafo_kwargs only
      built = linen_transforms.module_class_lift_transform_cached(
        cells["transform"], inner, methods=[cells["fn_name"]], **kwargs
      )
    else:
      built = linen_transforms.module_class_lift_transform(
        cells["transform"], inner, *cells["trafo_args"], methods=[cells["fn_name"]], **kwargs
      )
    methods[name] = built.__dict__[cells["fn_name"]]
  return type(cls.__name__, (inner,), methods)


def remat_body(module: nn.Module) -> bool:
  """Whether `module` is the body of a linen remat call (`nn.remat(Block)` /
  `nn.checkpoint`): the clone of `Block` that Flax binds to the root scope it
  lifts into `jax.checkpoint`.

  Public replacement: none in flax 0.12.8. Watch: `flax.core.lift.checkpoint`
  packs its scopes under the name 'remat', which a lifted root scope's
  `Scope.debug_path` ends with (`'remat(<layer name>)'`).
  """
  scope = module.scope
  if scope is None or scope.parent is not None:
    return False
  path = getattr(scope, "debug_path", ())
  return bool(path) and str(path[-1]).startswith("remat(")


@probes(
  lifted_target="the closure of linen.transforms.module_class_lift_transform's methods",
  relift="linen.transforms.module_class_lift_transform(_cached) signatures",
)
def _check_relift() -> None:
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(x)

  class Wider(Block):
    extra: int = 0

  x = jnp.ones((3, 4, 2))
  for lift_fn in (
    lambda c: nn.vmap(c, variable_axes={"params": None}, split_rngs={"params": False}),
    nn.remat,
    nn.jit,
  ):
    lifted = lift_fn(Block)
    _expect(lifted_target(lifted) is Block, f"{lifted.__name__}: its target was not found")
    _expect(lifted_target(Block) is None, "a plain class was taken for a lifted one")
    again = relift(lifted, Wider)
    _expect(issubclass(again, Wider), f"{lifted.__name__} was not lifted around the subclass")
    variables = lifted().init(jax.random.key(0), x)
    _expect(
      bool(jnp.array_equal(again(extra=1).apply(variables, x), lifted().apply(variables, x))),
      f"{lifted.__name__} lifted again computes something else",
    )


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


@probes(run_methods_within="linen's private Module._call_wrapped_method dispatcher")
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
  _expect(
    any(isinstance(m, Recorded) for m in entered),
    "a method of a child module did not run inside the installed context",
  )


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


@probes(suppress_capture="flax.linen.module._context.capture_stack")
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
  _expect(
    "other" in captured and "inner" not in captured,
    f"capture filter not applied (captured {sorted(captured)})",
  )


@probes(remat_body="the debug_path of the root scope flax.core.lift.checkpoint lifts")
def _check_remat_body() -> None:
  seen = []

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      seen.append((remat_body(self), remat_body(nn.Dense(2, parent=self))))
      return x

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.remat(Block)()(Block()(x))

  Model().init(jax.random.key(0), jnp.ones((1, 3)))
  _expect(
    seen[-2:] == [(False, False), (True, False)],
    f"the body of nn.remat was not told from other layers: {seen}",
  )


def bind_to_scope(module: nn.Module, cls: type, **fields) -> nn.Module:
  """A `cls(**fields)` bound to (a rewound view of) `module`'s scope: same variables,
  RNG counters and path, and names that `module`'s own setup() reserved (Embed's
  table) can be claimed again.

  Public replacement: partial. `Module.scope` is public and passing a Scope as
  `parent` is how Flax's own transforms bind modules; `Scope.rewound(rewind_rngs=False)`
  has no underscore but is undocumented. Watch: `flax.core.scope.Scope.rewound`.
  """
  return cls(**fields, parent=module.scope.rewound())


@probes(bind_to_scope="flax.core Scope.rewound() as a module's parent")
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
    fields = {
      f.name: getattr(context.module, f.name)
      for f in dataclasses.fields(context.module)
      if f.init and f.name not in ("parent", "name")
    }
    bound.append(twin)
    return bind_to_scope(context.module, twin, **fields)(*args, **kwargs)

  ids = jnp.array([[0, 3]])
  plain = Model().init(jax.random.key(0), ids)
  with nn.intercept_methods(intercept):
    twin_vars = Model().init(jax.random.key(0), ids)
    y = Model().apply(plain, ids)
  _expect(set(bound) == {Twin, DenseTwin}, "the twins were not called")
  _expect(
    jax.tree.map(jnp.shape, plain) == jax.tree.map(jnp.shape, twin_vars)
    and all(jax.tree.leaves(jax.tree.map(jnp.array_equal, plain, twin_vars))),
    "a twin bound to a layer's scope made different variables",
  )
  _expect(
    bool(jnp.array_equal(y, Model().apply(plain, ids))),
    "a twin bound to a layer's scope computed a different output",
  )


def canonicalize_dtype(*args, dtype=None):
  """linen's output dtype of a layer: `dtype`, or the promoted dtype of `args` (None skipped).

  Public replacement: none exported from `flax.linen` in flax 0.12.8
  (`flax.linen.dtypes` is a submodule). Watch: `flax.linen.dtypes.canonicalize_dtype`.
  """
  return linen_dtypes.canonicalize_dtype(*args, dtype=dtype)


@probes(canonicalize_dtype="flax.linen.dtypes.canonicalize_dtype")
def _check_dtype() -> None:
  got = canonicalize_dtype(jnp.ones(2, jnp.bfloat16), None, jnp.ones(2, jnp.float32))
  _expect(
    got == jnp.float32 and canonicalize_dtype(jnp.ones(2), dtype=jnp.bfloat16) == jnp.bfloat16,
    f"canonicalize_dtype gave {got}",
  )
