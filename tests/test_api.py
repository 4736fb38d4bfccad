"""The public API: `jact.__all__`, and one keyword per concept for how residuals
are stored -- `bits=` an int width (or None), `compressor=` a
`jact.compressors` object -- at every entry point that takes both."""

import inspect
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jact
from jact import compressors as C

KEY = jax.random.key(0)
X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 256)), jnp.float32)
W = jnp.asarray(np.random.default_rng(1).standard_normal((256, 8)) / 16, jnp.float32)
IMG = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, 8, 4)), jnp.float32)
KERN = jnp.asarray(np.random.default_rng(3).standard_normal((3, 3, 4, 5)) / 6, jnp.float32)
Q = jnp.asarray(np.random.default_rng(4).standard_normal((1, 8, 2, 16)), jnp.float32)
SEQ = Q.reshape(1, 8, 32)
NHWC = ("NHWC", "HWIO", "NHWC")
LINEN_KEYS = {"params": KEY, "jact": jax.random.key(1)}

# The public names of jact before the package was split into layers; each stays public.
PUBLIC = [
  "quantize",
  "dequantize",
  "Packed",
  "PackedBits",
  "pack_codes",
  "unpack_codes",
  "ops",
  "nn",
  "nnx",
  "rng",
  "compressors",
  "sensitivity",
  "acgc",
  "allocate",
  "levels",
  "Controller",
  "ControllerState",
  "CompressionVarianceWarning",
  "residual_report",
  "compiled_memory",
  "ResidualReport",
  "CompiledMemory",
  "compressed",
  "checkpoint",
  "convert",
  "save_compressed",
  "offload_compressed",
  "save_inputs_only",
  "BitPlan",
  "use_plan",
  "planned",
  "UnknownResidualWarning",
]


def test_every_name_in_all_exists_once():
  missing = [n for n in jact.__all__ if not hasattr(jact, n)]
  assert not missing, missing
  assert len(set(jact.__all__)) == len(jact.__all__)


def test_earlier_public_names_stay_public():
  assert set(PUBLIC) <= set(jact.__all__), sorted(set(PUBLIC) - set(jact.__all__))
  assert callable(jact.quantize) and callable(jact.dequantize)  # the functions, not modules
  for module in (
    "rng",
    "allocate",
    "acgc",
    "sensitivity",
    "levels",
    "compressors",
    "ops",
    "kernels",
  ):
    assert type(getattr(jact, module)).__name__ == "module", module


def test_public_names_are_explicit_re_exports():
  """Every `__all__` name is bound by a `from ... import name as name` line."""
  source = open(jact.__file__).read()
  bound = set(re.findall(r"^from \S+ import (\w+) as \1$", source, re.M))
  assert set(jact.__all__) <= bound, sorted(set(jact.__all__) - bound)


def _conv_block(k, x):
  return jnp.tanh(jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=NHWC))


def _mlp(w, x):
  return jnp.tanh(x @ w)


def _linen(model, x):
  """The model's output and variables: init with a 'jact' stream, then apply
  (mutable batch statistics)."""
  variables = model.init(LINEN_KEYS, x)
  out, _ = model.apply(variables, x, rngs={"jact": KEY}, mutable=["batch_stats"])
  return out, variables


# name -> (call with the rounding keywords, a compressor the entry point takes)
FIXPOINT = C.Fixpoint(8)
ENTRY_POINTS = {
  "ops.dense": (lambda **kw: jact.ops.dense(X, W, key=KEY, **kw), FIXPOINT),
  "ops.dot_general": (
    lambda **kw: jact.ops.dot_general(X, W, (((1,), (0,)), ((), ())), key=KEY, **kw),
    FIXPOINT,
  ),
  "ops.einsum": (lambda **kw: jact.ops.einsum("ij,jk->ik", X, W, key=KEY, **kw), FIXPOINT),
  "ops.conv": (lambda **kw: jact.ops.conv(IMG, KERN, key=KEY, **kw), FIXPOINT),
  "ops.conv_general_dilated": (
    lambda **kw: jact.ops.conv_general_dilated(
      IMG, KERN, (1, 1), "SAME", dimension_numbers=NHWC, key=KEY, **kw
    ),
    FIXPOINT,
  ),
  "ops.conv_transpose": (
    lambda **kw: jact.ops.conv_transpose(IMG, KERN, (1, 1), "SAME", key=KEY, **kw),
    FIXPOINT,
  ),
  "ops.gelu": (lambda **kw: jact.ops.gelu(X, key=KEY, **kw), FIXPOINT),
  "ops.silu": (lambda **kw: jact.ops.silu(X, key=KEY, **kw), FIXPOINT),
  "ops.tanh": (lambda **kw: jact.ops.tanh(X, key=KEY, **kw), FIXPOINT),
  "ops.sigmoid": (lambda **kw: jact.ops.sigmoid(X, key=KEY, **kw), FIXPOINT),
  "ops.softmax": (lambda **kw: jact.ops.softmax(X, key=KEY, **kw), FIXPOINT),
  "ops.batch_norm": (lambda **kw: jact.ops.batch_norm(X, key=KEY, **kw), FIXPOINT),
  "ops.layer_norm": (lambda **kw: jact.ops.layer_norm(X, key=KEY, **kw), FIXPOINT),
  "ops.rms_norm": (lambda **kw: jact.ops.rms_norm(X, key=KEY, **kw), FIXPOINT),
  "ops.dot_product_attention": (
    lambda **kw: jact.ops.dot_product_attention(Q, Q, Q, key=KEY, **kw),
    FIXPOINT,
  ),
  "ops.chunked_attention": (
    lambda **kw: jact.ops.chunked_attention(Q, Q, Q, key=KEY, query_chunk=4, key_chunk=4, **kw),
    FIXPOINT,
  ),
  "ops.blpa_block": (
    lambda **kw: jact.ops.blpa_block(IMG, jnp.ones(4), jnp.zeros(4), KERN, **kw),
    C.BLPA(4),
  ),
  "compressed": (
    lambda **kw: jact.compressed(_mlp, compress_argnums=(1,), **kw)(W, X, key=KEY),
    FIXPOINT,
  ),
  "checkpoint": (
    lambda **kw: jact.checkpoint(_mlp, compress_argnums=(1,), **kw)(W, X, key=KEY),
    FIXPOINT,
  ),
  "levels.compress_convolutions": (
    lambda **kw: jact.levels.compress_convolutions(_conv_block, compress_argnums=(1,), **kw)(
      KERN, IMG, key=KEY
    ),
    FIXPOINT,
  ),
  "nn.Dense": (lambda **kw: _linen(jact.nn.Dense(3, **kw), X), FIXPOINT),
  "nn.Conv": (lambda **kw: _linen(jact.nn.Conv(3, (3, 3), **kw), IMG), FIXPOINT),
  "nn.BatchNorm": (
    lambda **kw: _linen(jact.nn.BatchNorm(use_running_average=False, **kw), X),
    FIXPOINT,
  ),
  "nn.LayerNorm": (lambda **kw: _linen(jact.nn.LayerNorm(**kw), X), FIXPOINT),
  "nn.RMSNorm": (lambda **kw: _linen(jact.nn.RMSNorm(**kw), X), FIXPOINT),
  "nn.MultiHeadDotProductAttention": (
    lambda **kw: _linen(jact.nn.MultiHeadDotProductAttention(num_heads=2, **kw), SEQ),
    FIXPOINT,
  ),
  "nn.SelfAttention": (
    lambda **kw: _linen(jact.nn.SelfAttention(num_heads=2, **kw), SEQ),
    FIXPOINT,
  ),
  "nn.GELU": (lambda **kw: _linen(jact.nn.GELU(**kw), X), FIXPOINT),
  "nn.SiLU": (lambda **kw: _linen(jact.nn.SiLU(**kw), X), FIXPOINT),
  "nn.Tanh": (lambda **kw: _linen(jact.nn.Tanh(**kw), X), FIXPOINT),
  "nn.Sigmoid": (lambda **kw: _linen(jact.nn.Sigmoid(**kw), X), FIXPOINT),
  "nn.Softmax": (lambda **kw: _linen(jact.nn.Softmax(**kw), X), FIXPOINT),
  "nnx.Linear": (lambda **kw: jact.nnx.Linear(256, 3, rngs=nnx.Rngs(0), **kw)(X), FIXPOINT),
  "nnx.Conv": (lambda **kw: jact.nnx.Conv(4, 3, (3, 3), rngs=nnx.Rngs(0), **kw)(IMG), FIXPOINT),
  "nnx.BatchNorm": (
    lambda **kw: jact.nnx.BatchNorm(256, use_running_average=False, rngs=nnx.Rngs(0), **kw)(X),
    FIXPOINT,
  ),
  "nnx.LayerNorm": (lambda **kw: jact.nnx.LayerNorm(256, rngs=nnx.Rngs(0), **kw)(X), FIXPOINT),
  "nnx.RMSNorm": (lambda **kw: jact.nnx.RMSNorm(256, rngs=nnx.Rngs(0), **kw)(X), FIXPOINT),
  "nnx.MultiHeadAttention": (
    lambda **kw: jact.nnx.MultiHeadAttention(2, 32, decode=False, rngs=nnx.Rngs(0), **kw)(SEQ),
    FIXPOINT,
  ),
  "nnx.GELU": (lambda **kw: jact.nnx.GELU(rngs=nnx.Rngs(0), **kw)(X), FIXPOINT),
  "nnx.SiLU": (lambda **kw: jact.nnx.SiLU(rngs=nnx.Rngs(0), **kw)(X), FIXPOINT),
  "nnx.Tanh": (lambda **kw: jact.nnx.Tanh(rngs=nnx.Rngs(0), **kw)(X), FIXPOINT),
  "nnx.Sigmoid": (lambda **kw: jact.nnx.Sigmoid(rngs=nnx.Rngs(0), **kw)(X), FIXPOINT),
  "nnx.Softmax": (lambda **kw: jact.nnx.Softmax(rngs=nnx.Rngs(0), **kw)(X), FIXPOINT),
  "convert.linen": (lambda **kw: _linen(jact.convert(nn.Dense(3), **kw), X), FIXPOINT),
  "convert.nnx": (
    lambda **kw: jact.convert(nnx.Linear(256, 3, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(jact=1), **kw)(X),
    FIXPOINT,
  ),
}


# Public callables that take bits= but are not entry points of the checks above, and why.
NOT_ENTRY_POINTS = {
  "nn.BLPABlock": "bits= is BLPA's own integer width; the block takes no compressor=",
  "nnx.BLPABlock": "bits= is BLPA's own integer width; the block takes no compressor=",
}


def _takes_bits(obj) -> bool:
  """Whether a public callable (a function, or a class's constructor) has a bits= parameter."""
  try:
    parameters = inspect.signature(obj.__init__ if isinstance(obj, type) else obj).parameters
  except (TypeError, ValueError):  # builtins without a signature
    return False
  return "bits" in parameters


def _public_taking_bits() -> set[str]:
  namespaces = {"ops": jact.ops, "nn": jact.nn, "nnx": jact.nnx}
  return {
    f"{prefix}.{name}"
    for prefix, namespace in namespaces.items()
    for name in namespace.__all__
    if callable(getattr(namespace, name)) and _takes_bits(getattr(namespace, name))
  }


def test_every_public_op_and_twin_taking_bits_is_an_entry_point():
  """A new op of jact.ops, or a new twin of jact.nn / jact.nnx, that takes bits= is
  checked below (bits= vs compressor=) once it is in ENTRY_POINTS: it cannot skip them."""
  missing = sorted(_public_taking_bits() - set(ENTRY_POINTS) - set(NOT_ENTRY_POINTS))
  assert not missing, (
    f"{missing} take bits= but are not in tests/test_api.py's ENTRY_POINTS: add a call "
    "and a compressor for each (or, if bits= there is not a residual width, a reason in "
    "NOT_ENTRY_POINTS)"
  )
  stale = sorted(set(NOT_ENTRY_POINTS) - _public_taking_bits())
  assert not stale, f"NOT_ENTRY_POINTS names {stale}, which no longer take bits=: remove them"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_compressor_passed_as_bits_is_a_type_error_naming_compressor(name):
  call, compressor = ENTRY_POINTS[name]
  with pytest.raises(TypeError, match=r"bits= takes an int width .* pass it as compressor="):
    call(bits=compressor)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_bits_and_a_compressor_together_are_a_value_error(name):
  call, compressor = ENTRY_POINTS[name]
  with pytest.raises(ValueError, match=r"both bits=2 and compressor=.*conflict"):
    call(bits=2, compressor=compressor)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_compressor_takes_only_a_compressor(name):
  call, _ = ENTRY_POINTS[name]
  with pytest.raises(TypeError, match=r"compressor= takes a jact.compressors object .* bits=2"):
    call(compressor=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_compressor_alone_keeps_the_exact_forward(name):
  call, compressor = ENTRY_POINTS[name]
  with_compressor, default = call(compressor=compressor), call()
  assert jax.tree.structure(with_compressor) == jax.tree.structure(default)
  for a, b in zip(jax.tree.leaves(with_compressor), jax.tree.leaves(default)):
    np.testing.assert_array_equal(a, b)


def _linen_loss(model):
  variables = model.init(LINEN_KEYS, X)
  return lambda v: model.apply(v, X, rngs={"jact": KEY}).sum(), variables


def _nnx_loss(layer):
  graphdef, state = nnx.split(layer)
  return lambda s: nnx.merge(graphdef, s)(X).sum(), state


# name -> (loss of the layer's state, the state), a layer storing its input with FIXPOINT
STORED = {
  "nn.Dense": lambda: _linen_loss(jact.nn.Dense(3, compressor=FIXPOINT)),
  "nnx.Linear": lambda: _nnx_loss(jact.nnx.Linear(256, 3, compressor=FIXPOINT, rngs=nnx.Rngs(0))),
  "convert.linen": lambda: _linen_loss(jact.convert(nn.Dense(3), compressor=FIXPOINT)),
  "convert.nnx": lambda: _nnx_loss(
    jact.convert(nnx.Linear(256, 3, rngs=nnx.Rngs(0)), compressor=FIXPOINT)
  ),
}


@pytest.mark.parametrize("name", STORED)
def test_the_layer_stores_its_input_with_the_compressor(name):
  loss, state = STORED[name]()
  groups = jact.residual_report(loss, state).by_name()
  stored = {n: g.bytes for n, g in groups.items() if n and n.endswith(".lhs")}
  assert list(stored.values()) == [FIXPOINT.stored_bytes(X.shape, X.dtype)], groups


# name -> function of (input, weight) through the entry point with the rounding keywords
GRADIENTS = {
  "ops.dense": lambda x, w, **kw: jact.ops.dense(x, w, key=KEY, **kw),
  "ops.gelu": lambda x, w, **kw: jact.ops.gelu(x @ w, key=KEY, **kw),
  "ops.layer_norm": lambda x, w, **kw: jact.ops.layer_norm(x @ w, key=KEY, **kw),
  "compressed": lambda x, w, **kw: jact.compressed(_mlp, compress_argnums=(1,), **kw)(
    w, x, key=KEY
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", GRADIENTS)
def test_the_per_group_compressor_is_what_an_int_width_means(name):
  """compressor=PerGroup(b) stores exactly what bits=b stores: the same
  gradients, bit for bit, and a different width does not (so the comparison
  can fail)."""
  f = GRADIENTS[name]

  def grads(**kw):
    return jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w, **kw))), argnums=(0, 1))(X, W)

  by_width = grads(bits=2)
  by_compressor = grads(compressor=C.PerGroup(2, 256, True))
  for a, b in zip(by_width, by_compressor):
    np.testing.assert_array_equal(a, b)
  other = grads(compressor=C.PerGroup(4, 256, True))
  assert any(not np.array_equal(a, b) for a, b in zip(by_width, other))
