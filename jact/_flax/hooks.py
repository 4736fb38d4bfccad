"""Plumbing shared by the linen and nnx twins.

Flax layers call their matmul, convolution and attention through hooks
(`dot_general`, `conv_general_dilated`, `attention_fn`) fixed when the layer is
built, but a compressed op also needs a fresh PRNG key on every call. A twin
therefore installs a `Hook` -- a static, hashable stand-in -- and, around each
call of Flax's own forward, `provide`s the concrete op (key and residual name
bound) that the hook forwards to. The provided ops live in `context.OPS`, so
nothing traced ever ends up in a module attribute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import zlib
from typing import Any, Callable, Sequence

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
from jax import lax

from jact import _compat as _jax_compat
from jact._engine.derivatives import inference_only
from jact._flax.context import OPS, USE_KEY, bound
from jact._compat import flax as _compat
from jact.ops import _linear as linear
from jact.ops._attention import dot_product_attention


@contextlib.contextmanager
def provide(**ops: Callable[..., Any]):
  """Makes `ops` (slot name -> callable) visible to the `Hook`s called inside."""
  with bound(OPS, {**(OPS.get() or {}), **ops}):
    yield


def lookup(slot: str) -> Callable[..., Any]:
  ops = OPS.get() or {}
  if slot not in ops:
    raise RuntimeError(
      f"a jact hook for {slot!r} was called outside a jact layer's forward. The hooks "
      f"are installed by jact's Flax twins (jact.nn.Dense, jact.nnx.Linear, ...) and only "
      f"work inside their __call__; do not copy them into plain Flax layers."
    )
  return ops[slot]


@dataclasses.dataclass(frozen=True)
class Hook:
  """Static stand-in for a Flax op hook; forwards to the op provided for `slot`."""

  slot: str

  def __call__(self, *args, **kwargs):
    return lookup(self.slot)(*args, **kwargs)


def _drop_sharding(kwargs: dict, op: str) -> dict:
  sharding = kwargs.pop("out_sharding", None)
  if sharding is not None:
    raise ValueError(f"jact's {op} does not support out_sharding; pass out_sharding=None.")
  return kwargs


class Calls:
  """Calls a compressed op with a fresh key and the next residual name per call.

  Several Flax sub-layers can share one hook (attention's query/key/value
  projections), so the i-th call gets `fold_in(key, i)` and `names[i]`.
  With `key=None` (no stochastic rounding) no key is passed. A call with
  complex operands runs `plain` (the lax op; jact's ops take real floats):
  its residuals are then JAX's own, exact (and, inside a converted model's
  call, kept exact by the engine).
  """

  def __init__(
    self,
    op: Callable[..., Any],
    key,
    names: Sequence[str],
    op_name: str,
    plain: Callable[..., Any] | None = None,
    **settings,
  ):
    self.op, self.key, self.names, self.op_name = op, key, tuple(names), op_name
    self.plain = plain
    self.settings = settings
    self.count = 0

  def next_key_and_name(self):
    i = self.count
    self.count += 1
    name = self.names[i] if i < len(self.names) else f"{self.names[-1]}.{i}"
    key = None if self.key is None else jax.random.fold_in(self.key, i)
    return key, name

  def __call__(self, *args, **kwargs):
    key, name = self.next_key_and_name()
    if self.plain is not None and any(hasattr(a, "dtype") and jnp.iscomplexobj(a) for a in args):
      return self.plain(*args, **kwargs)
    kwargs = _drop_sharding(dict(kwargs), self.op_name)
    return self.op(*args, key=key, name=name, **self.settings, **kwargs)


def needs_key(compressor) -> bool:
  """Whether a layer storing its residuals with `compressor` (a resolved
  `Compressor`, or None: kept exact) rounds stochastically (needs a key)."""
  return compressor is not None and compressor.needs_key


def last_axis_only(axes, ndim: int) -> bool:
  """Whether `axes` (an int or a sequence) names only the last axis of a rank-`ndim` input."""
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  return len(axes) == 1 and axes[0] % ndim == ndim - 1


# ----------------------------------------------------------------------------- no key


def linen_keyless_message(what: str, extra_fix: str = "") -> str:
  """The error of differentiating a linen layer or module (`what`, e.g.
  "jact.nn.Dense 'Dense_0'") that ran without a 'jact' stream."""
  return (
    f"{what} was differentiated without an RNG stream named 'jact'. It rounds the "
    f"activations it saves for the backward pass stochastically; without a key it runs "
    f"the plain computation, for inference only (nothing saved). Fixes: pass a fresh key "
    f"per step, e.g. model.apply(variables, x, rngs={{'jact': key}}){extra_fix}; or use "
    f"compressor=jact.compressors.PerGroup(bits, stochastic=False) (round-to-nearest) or "
    f"bits=None (no compression)."
  )


def nnx_keyless_message(what: str, own_stream: str) -> str:
  """The error of differentiating an nnx layer or module (`what`) that has no
  'jact' stream and ran outside `use_key`; `own_stream` says how to give it one."""
  return (
    f"{what} was differentiated without a rounding key. It rounds the activations it "
    f"saves for the backward pass stochastically; without a key it runs the plain "
    f"computation, for inference only (nothing saved). Fixes: differentiate under "
    f"jact.nnx.use_key, e.g. `with jact.nnx.use_key(key): grads = nnx.grad(loss_fn)"
    f"(model)` (a fresh PRNG key, or an nnx.Rngs with a 'jact' stream, per step); or "
    f"{own_stream}; or use compressor=jact.compressors.PerGroup(bits, stochastic=False) "
    f"(round-to-nearest) or bits=None (no compression)."
  )


def keyless(fn: Callable[..., Any], message: str) -> Callable[..., Any]:
  """`fn` (the plain computation of a layer called without a key) whose float
  outputs raise `ValueError(message)` when differentiated."""
  return lambda *args, **kwargs: inference_only(fn(*args, **kwargs), message)


def baked_key_message(name: str) -> str:
  """The error of a concrete `use_key` key read while a jitted function entered
  inside the block is traced (residual `name`)."""
  return (
    f"jact.nnx.use_key: {name!r} read the key of a use_key block entered outside the "
    f"jitted function being traced. That key is baked into the compiled function as a "
    f"constant: every later call would silently reuse this call's rounding noise, "
    f"whatever key later blocks hold. Enter use_key inside the jitted step with a traced "
    f"key: pass the key (or an nnx.Rngs) as an argument, e.g. `@nnx.jit def step(model, "
    f"x, key): with jact.nnx.use_key(key): grads = nnx.grad(loss_fn)(model, x)`; or give "
    f"the layers their own streams: jact.convert(model, rngs=nnx.Rngs(jact=0))."
  )


class _KeySource:
  """The key of a `use_key` block and how many keys each residual name drew.

  A concrete key (not a tracer) read inside a `jax.jit` / `nnx.jit` trace
  opened after the block was entered raises `baked_key_message`: the compiled
  function would keep it. A concrete key written inside the jitted step is the
  caller's constant (a fixed key in a test) and is left alone, as are traces
  that are never compiled (`jax.eval_shape`, `jax.make_jaxpr`)."""

  def __init__(self, key):
    self.key, self.calls = key, {}
    self.trace = _jax_compat.current_trace()
    self.concrete = not _jax_compat.is_tracer(key)

  def draw(self, name: str):
    if (
      self.concrete
      and _jax_compat.jit_traces_since(self.trace)
      and not _jax_compat.abstract_evaluation()
    ):
      raise ValueError(baked_key_message(name))
    i = self.calls.get(name, 0)
    self.calls[name] = i + 1
    salt = zlib.crc32(name.encode()) & 0x7FFFFFFF
    return jax.random.fold_in(jax.random.fold_in(self.key, salt), i)


def _one_key(key) -> jax.Array:
  """`key` as one typed PRNG key (a raw uint32[2] key wrapped); a clear error for
  anything else, a batch of keys included."""
  if not isinstance(key, jax.Array):
    raise TypeError(
      f"jact.nnx.use_key takes a PRNG key (jax.random.key(...)), an nnx.Rngs or "
      f"an nnx.RngStream, got {type(key).__name__}."
    )
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  raw = key.dtype == jnp.uint32 and key.ndim >= 1 and key.shape[-1] == 2
  if not (typed or raw):
    raise TypeError(
      f"jact.nnx.use_key: key must be a PRNG key (jax.random.key(seed), or a raw "
      f"uint32[2] key), got a {key.dtype} array of shape {key.shape}; pass "
      f"jax.random.key(seed) or a key split from one."
    )
  batch = key.shape if typed else key.shape[:-1]
  if batch:
    raise ValueError(
      f"jact.nnx.use_key: key must be one PRNG key, got a batch of keys "
      f"(shape {key.shape}{'' if typed else ', raw uint32 keys'}). Every layer inside "
      f"the block draws its rounding keys from that one key. Pass one key (e.g. "
      f"keys[0], a fresh one per step); for one key per example, enter the block "
      f"inside nnx.vmap over the keys, e.g. `nnx.vmap(step, in_axes=(None, 0, 0))"
      f"(model, x, keys)` with `with jact.nnx.use_key(key):` in `step(model, x, key)`."
    )
  return key if typed else jax.random.wrap_key_data(key)


@contextlib.contextmanager
def use_key(key):
  """Rounding keys for the nnx layers and modules called inside the block:
  what layers converted by `jact.convert(model)` without `rngs=` (no stream,
  no RNG state) draw from when they are differentiated.

  `key`: one PRNG key (a typed key, or a raw uint32[2] one), or an
  `nnx.Rngs` ('jact' stream, else 'default') or `nnx.RngStream` to draw one
  key from. A batch of keys is an error: for one key per example, enter the
  block inside `nnx.vmap` over the keys. A layer's i-th call inside the block
  gets `fold_in(fold_in(key, hash(residual name)), i)`, so every layer and
  call has its own noise; a layer's own stream, where it has one, is not
  used inside the block. Use a fresh key every step, entered inside the
  jitted step: draw it from an `nnx.Rngs` passed to the step, or pass the
  key as an argument. A block entered outside a jitted step is read only
  while the step is traced (its key would be baked into the compiled step,
  every later call reusing the first call's noise): a layer drawing such a
  concrete key inside a `jax.jit` / `nnx.jit` trace raises a ValueError
  naming the fix (`jax.eval_shape` / `jax.make_jaxpr`, which compile
  nothing, are fine; so is a constant key written inside the step). Keys are drawn
  while tracing, so the layers of an `nnx.scan` body share theirs across iterations:
  give stacked layers their own streams (`convert(..., rngs=)`) instead. Without a key
  (and without a stream) a layer runs plain: fine for inference, an error if
  differentiated.

  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import jact
  >>> model = jact.convert(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), bits=2)
  >>> x = jnp.ones((4, 3))
  >>> y = model(x)                                  # inference: no key needed
  >>> loss = lambda m: (m(x) ** 2).sum()
  >>> with jact.nnx.use_key(jax.random.key(1)):
  ...   grads = nnx.grad(loss)(model)
  >>> grads.kernel.shape
  (3, 2)
  """
  if isinstance(key, nnx.Rngs):
    if "jact" not in key and "default" not in key:
      raise ValueError(
        "jact.nnx.use_key got an nnx.Rngs with neither a 'jact' nor a "
        "'default' stream; pass nnx.Rngs(jact=seed) or a PRNG key."
      )
    key = key["jact"]() if "jact" in key else key["default"]()
  elif isinstance(key, nnx.RngStream):
    key = key()
  else:
    key = _one_key(key)
  with bound(USE_KEY, _KeySource(key)):
    yield


def draw(stream, what: str):
  """The next key of `stream`, the own 'jact' stream of `what` (a layer or
  model): a clear error where nnx forbids advancing it (inside a JAX
  transform that closes over the model)."""
  try:
    return stream()
  except _compat.trace_context_error() as err:
    raise ValueError(
      f"{what} draws its rounding key from its own 'jact' stream (jact.convert(model, "
      f"rngs=...)), which advances the stream's count, and nnx forbids that inside a JAX "
      f"transform that closes over the model (jax.vmap, jax.jit or jax.grad of a "
      f"closure). Use the nnx transforms (nnx.vmap, nnx.jit, nnx.grad), or nnx.split / "
      f"nnx.merge inside the JAX transform, as for any nnx model with RNG streams; or "
      f"convert without rngs= and pass keys with jact.nnx.use_key inside the "
      f"transform."
    ) from err


def context_key(name: str):
  """The next key of residual `name` inside `use_key`, or None outside it."""
  source = USE_KEY.get()
  return None if source is None else source.draw(name)


# ----------------------------------------------------------------------------- attention


def _causal_mask(query, key):
  t, s = query.shape[-3], key.shape[-3]
  return jnp.tril(jnp.ones((t, s), bool))[None, :, :]


# Keywords of Flax's dot_product_attention that jact's attention implements, and
# those it ignores by design (documented on the twins); any other keyword is
# accepted at Flax's default value and rejected, by name, otherwise.
ATTENTION_HANDLED = (
  "bias",
  "mask",
  "dropout_rng",
  "dropout_rate",
  "deterministic",
  "precision",
  "module",
  "is_causal",
  "broadcast_dropout",
)
ATTENTION_IGNORED = ("dtype", "force_fp32_for_softmax")
_ATTENTION_SIGNATURE = _compat.attention_signature()
_ATTENTION_DEFAULTS = _compat.attention_defaults()
_LINEN_ATTENTION = tuple(inspect.signature(nn.dot_product_attention).parameters)


def attention_slot(query, key, value, *args, **kwargs):
  """`attention_fn` installed in the attention twins.

  It declares every parameter of the installed Flax's dot_product_attention
  (linen's and nnx's; linen passes only the keywords its attention_fn
  declares), and forwards all of them, defaults filled in, to the op provided
  for "attention"."""
  bound = _ATTENTION_SIGNATURE.bind(query, key, value, *args, **kwargs)
  bound.apply_defaults()
  arguments = dict(bound.arguments)
  query, key, value = (arguments.pop(n) for n in ("query", "key", "value"))
  return lookup("attention")(query, key, value, **arguments)


attention_slot.__signature__ = _ATTENTION_SIGNATURE


def _is_flax_default(name: str, value) -> bool:
  for default in _ATTENTION_DEFAULTS.get(name, ()):
    if value is default:
      return True
    if isinstance(value, (bool, int, float, str)) and type(value) is type(default):
      if value == default:
        return True
  return False


def _check_attention_keywords(kwargs: dict, supported) -> None:
  for name, value in kwargs.items():
    if name not in supported and not _is_flax_default(name, value):
      raise ValueError(
        f"jact attention does not support {name}={value!r} (a keyword of Flax's "
        f"dot_product_attention); leave {name} at Flax's default, or keep this attention "
        f"layer a plain Flax layer."
      )


def compressed_attention(key, name: str, **settings) -> Callable[..., Any]:
  """The op behind `attention_slot`: jact's attention with the layer's key and settings.

  Dropout (when active) draws its mask from Flax's dropout key (the layer's
  'dropout' stream) exactly as Flax's attention does, `broadcast_dropout`
  included, so the weights are Flax's; its backward keeps only that key.
  """

  def op(query, keys, value, **kwargs):
    _check_attention_keywords(kwargs, ATTENTION_HANDLED + ATTENTION_IGNORED)
    (
      bias,
      mask,
      dropout_rng,
      dropout_rate,
      deterministic,
      precision,
      module,
      is_causal,
      broadcast_dropout,
    ) = (kwargs[n] for n in ATTENTION_HANDLED)
    if module is not None:
      raise ValueError(
        "jact attention does not return the attention weights, so sow_weights=True is not "
        "supported; call with sow_weights=False."
      )
    if is_causal:
      causal = _causal_mask(query, keys)
      mask = causal if mask is None else jnp.logical_and(mask, causal)
    return dot_product_attention(
      query,
      keys,
      value,
      bias=bias,
      mask=mask,
      dropout_rate=dropout_rate,
      deterministic=deterministic,
      key=key,
      dropout_key=dropout_rng,
      broadcast_dropout=bool(broadcast_dropout),
      precision=precision,
      name=name,
      **settings,
    )

  return op


def attention_ops(key, name: str, rounding: dict) -> dict[str, Callable[..., Any]]:
  """The compressed ops an attention twin provides: q/k/v projections, output
  projection and the attention itself, each with its own key and residual name;
  `rounding`: the ops' keywords for the twin's compressor (`compressor_keywords`)."""
  sub = (lambda i: None) if key is None else (lambda i: jax.random.fold_in(key, i))
  qkv = Calls(
    linear.dot_general,
    sub(0),
    tuple(f"{name}/{p}" for p in ("query", "key", "value")),
    "dot_general",
    plain=lax.dot_general,
    compress=(True, False),
    **rounding,
  )
  out = Calls(
    linear.dot_general,
    sub(1),
    (f"{name}/out",),
    "dot_general",
    plain=lax.dot_general,
    compress=(True, False),
    **rounding,
  )
  return {
    "qkv": qkv,
    "out": out,
    "attention": compressed_attention(sub(2), f"{name}/attention", **rounding),
  }


_NNX_ATTENTION = tuple(inspect.signature(nnx.dot_product_attention).parameters)


def plain_nnx_attention(query, keys, value, **kwargs):
  """Flax's own nnx attention: what an nnx attention twin runs without a key."""
  _check_attention_keywords(kwargs, _NNX_ATTENTION)
  return nnx.dot_product_attention(
    query, keys, value, **{n: v for n, v in kwargs.items() if n in _NNX_ATTENTION}
  )


def plain_attention(query, keys, value, **kwargs):
  """Flax's own (linen) attention: the fallback while initializing a linen model."""
  _check_attention_keywords(kwargs, _LINEN_ATTENTION)  # nnx-only keywords: at their defaults
  return nn.dot_product_attention(
    query, keys, value, **{n: v for n, v in kwargs.items() if n in _LINEN_ATTENTION}
  )
