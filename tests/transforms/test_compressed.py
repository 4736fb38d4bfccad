"""`jact.compressed` on whole blocks written in plain JAX.

Two blocks, neither using jact ops: a pre-LN transformer encoder block
(LayerNorm, softmax attention whose q/k/v projections share one input, GELU
MLP) and a residual conv block with batch norm (batch statistics) and ReLU.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact._transforms.compressed import call_compressed
from stats import assert_unbiased, over_keys


def layer_norm(x, scale, bias):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5) * scale + bias


def transformer_block(p, x, heads=4):
  b, s, d = x.shape
  h = layer_norm(x, p["ln1_s"], p["ln1_b"])
  split = lambda t: t.reshape(b, s, heads, d // heads)
  q, k, v = split(h @ p["wq"]), split(h @ p["wk"]), split(h @ p["wv"])
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
  a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v).reshape(b, s, d)
  x = x + a @ p["wo"]
  h = layer_norm(x, p["ln2_s"], p["ln2_b"])
  return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def transformer_params(key, d=32, mlp=64):
  ks = jax.random.split(key, 6)
  w = lambda k, m, n: jax.random.normal(k, (m, n)) / np.sqrt(m)
  return {
    "ln1_s": jnp.ones(d),
    "ln1_b": jnp.zeros(d),
    "ln2_s": jnp.ones(d),
    "ln2_b": jnp.zeros(d),
    "wq": w(ks[0], d, d),
    "wk": w(ks[1], d, d),
    "wv": w(ks[2], d, d),
    "wo": w(ks[3], d, d),
    "w1": w(ks[4], d, mlp),
    "w2": w(ks[5], mlp, d),
  }


def conv(x, w):
  return jax.lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def batch_norm(x, scale, bias):
  mu = x.mean((0, 1, 2))
  var = x.var((0, 1, 2))
  return (x - mu) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def conv_bn_block(p, x):
  h = jax.nn.relu(batch_norm(conv(x, p["w1"]), p["g1"], p["b1"]))
  h = batch_norm(conv(h, p["w2"]), p["g2"], p["b2"])
  return jax.nn.relu(h + x)


def conv_params(key, c=16):
  k1, k2 = jax.random.split(key)
  w = lambda k: jax.random.normal(k, (3, 3, c, c)) / np.sqrt(9 * c)
  return {
    "w1": w(k1),
    "w2": w(k2),
    "g1": jnp.ones(c),
    "b1": jnp.zeros(c),
    "g2": jnp.ones(c),
    "b2": jnp.zeros(c),
  }


BLOCKS = {
  "transformer": (transformer_block, transformer_params, (4, 16, 32)),
  "conv_bn": (conv_bn_block, conv_params, (8, 8, 8, 16)),
}


def setup(name):
  block, make_params, shape = BLOCKS[name]
  params = make_params(jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), shape)
  # A fixed random readout, so that every output element gets its own cotangent.
  r = jax.random.normal(jax.random.key(3), shape)
  return block, params, x, r


def losses(name, **config):
  block, params, x, r = setup(name)
  fast = jact.compressed(block, name=name, **config)
  plain_loss = lambda p, x: jnp.sum(block(p, x) * r)
  loss = lambda p, x, key: jnp.sum(fast(p, x, key=key) * r)
  return plain_loss, loss, params, x


def rel_err(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCKS)
def test_forward_is_exact(name):
  block, params, x, _ = setup(name)
  y = jax.jit(jact.compressed(block, bits=2))(params, x, key=jax.random.key(0))
  np.testing.assert_array_equal(y, jax.jit(block)(params, x))


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCKS)
def test_single_gradient_close_to_exact_at_8_bits(name):
  plain_loss, loss, params, x = losses(name, bits=8)
  exact = jax.grad(plain_loss, argnums=(0, 1))(params, x)
  approx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x, jax.random.key(0))
  for path, g, e in zip(
    jax.tree_util.tree_leaves_with_path(exact), jax.tree.leaves(approx), jax.tree.leaves(exact)
  ):
    assert rel_err(g, e) < 0.03, (path[0], rel_err(g, e))


# Residuals of nonlinear ops (softmax output, LayerNorm/BatchNorm statistics,
# GELU's derivative terms) enter the backward pass nonlinearly, so the
# gradient is unbiased only to first order: its bias is O(Var(rounding)),
# about 256x smaller at 4 bits than at 2 bits (ActNN App. B.2). At 4 bits
# and 256 keys it is far below the standard error and the test is a real
# check of the engine (a wrong reconstruction, shift or scale shows at once).
@pytest.mark.slow
@pytest.mark.parametrize("name,bits", [("transformer", 4), ("conv_bn", 4)])
def test_gradient_unbiased_over_keys(name, bits):
  plain_loss, loss, params, x = losses(name, bits=bits)
  exact = jax.grad(plain_loss)(params, x)
  keys = jax.random.split(jax.random.key(7), 256)
  samples = over_keys(lambda k: jax.grad(loss)(params, x, k), keys)
  for (path, e), s in zip(jax.tree_util.tree_leaves_with_path(exact), jax.tree.leaves(samples)):
    # A norm's 16 or 32 scale / bias gradients share the same rounding draws
    # (their errors are strongly correlated): pooled over the per-draw sums.
    stats = assert_unbiased(s, e, max_pooled_z=4.5, max_mean_z2=1.6, correlated=e.size < 256)
    if path[0].key.startswith("w"):  # weight gradients are noisy: the check is not vacuous
      assert stats["noisy_fraction"] > 0.5, (path, stats)


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCKS)
def test_bytes_saved_drop_at_least_6x_at_2_bits(name):
  plain_loss, loss, params, x = losses(name, bits=2)
  key = jax.random.key(0)
  plain = jact.residual_report(plain_loss, params, x)
  fast = jact.residual_report(loss, params, x, key)
  assert plain.total_bytes >= 6 * fast.total_bytes, (plain.total_bytes, fast.total_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("name", BLOCKS)
def test_parameters_and_inputs_are_kept_by_reference_not_compressed(name):
  plain_loss, loss, params, x = losses(name, bits=2)
  plain = jact.residual_report(plain_loss, params, x)
  fast = jact.residual_report(loss, params, x, jax.random.key(0))
  # The arguments the backward pass needs are the same buffers as in plain training ...
  assert fast.argument_bytes == plain.argument_bytes
  # ... and no other residual of at least min_size values is kept at full
  # precision: each is a named group of packed codes and bf16 group
  # statistics (an elementwise chain such as gelu's stores one derivative
  # for its several steps, `jact._transforms._folding`, so there may be fewer
  # groups than plain residuals, but never none).
  big = [
    r
    for r in plain.residuals
    if not r.is_argument
    and np.prod(r.shape) >= 1024
    and jnp.issubdtype(r.dtype, jnp.floating)
    and "broadcast_in_dim" not in r.source
  ]
  quantized = [
    g
    for n, g in fast.by_name().items()
    if n
    and n.startswith(name)
    and [p.dtype for p in g.pieces] == [jnp.uint8, jnp.bfloat16, jnp.bfloat16]
  ]
  full = [
    r
    for r in fast.residuals
    if not r.is_argument
    and np.prod(r.shape) >= 1024
    and r.dtype == jnp.float32
    and r.source != "from a constant"
  ]
  assert full == [] and 0 < len(quantized) <= len(big), (full, len(quantized), len(big))


def test_a_residual_shared_by_several_ops_is_stored_once():
  def qkv(wq, wk, wv, x):
    h = jnp.sin(x)  # residuals: h (input of three matmuls) and cos(x) (sin's derivative)
    return (h @ wq).sum() + (h @ wk).sum() + (h @ wv).sum()

  x, w = jnp.ones((64, 128)), jnp.ones((128, 128))
  fast = jact.compressed(qkv, bits=4, name="qkv")
  report = jact.residual_report(lambda *a: fast(*a, key=jax.random.key(0)), w, w, w, x)
  groups = {n: g for n, g in report.by_name().items() if n}
  assert len(groups) == 2, report
  # 4-bit codes + bf16 min and scale per group; a row of 128 values is a group of
  # its own (groups never span samples: jact._core.quantize.as_rows)
  one = 64 * 128 * 4 // 8 + 64 * 2 * 2
  assert report.total_bytes == 2 * one
  assert report.argument_bytes == 3 * w.nbytes  # weights kept once each, by reference


@pytest.mark.slow
def test_boolean_residuals_take_one_bit_and_integers_are_kept():
  def masked(w, x, ids):
    keep = x > 0.5  # a boolean residual, saved by jnp.where's VJP
    h = jnp.where(keep, x, 0.0) @ w
    return (h * ids.astype(jnp.float32)[:, None]).sum()

  x = jax.random.uniform(jax.random.key(0), (64, 100))
  w, ids = jnp.ones((100, 8)), jnp.arange(64)
  fast = jact.compressed(masked, bits=None, name="m")  # bits=None: floats kept, bools still packed
  report = jact.residual_report(lambda w, x: fast(w, x, jnp.arange(64)), w, x)
  masks = [r for r in report.residuals if r.name and r.dtype == jnp.uint8]
  assert [r.bytes for r in masks] == [64 * -(-100 // 8)]  # per row: 100 bits in 13 bytes
  chex.assert_trees_all_close(
    jax.grad(lambda w, x: fast(w, x, ids), argnums=(0, 1))(w, x),
    jax.grad(masked, argnums=(0, 1))(w, x, ids),
    rtol=1e-6,
  )


@pytest.mark.slow
def test_input_independent_residuals_are_recomputed_not_stored():
  f = lambda w, x: jax.nn.relu(x @ w).sum()  # jax saves a bool mask and a broadcast 0.0
  x, w = jax.random.normal(jax.random.key(0), (64, 256)), jnp.eye(256)
  plain = jact.residual_report(f, w, x)
  assert any(
    r.dtype == jnp.float32 and r.shape == (64, 256) for r in plain.residuals if not r.is_argument
  )
  fast = jact.compressed(f, bits=2)
  report = jact.residual_report(lambda w, x: fast(w, x, key=jax.random.key(0)), w, x)
  assert report.total_bytes == 64 * 256 // 8  # only the 1-bit mask
  np.testing.assert_array_equal(
    jax.grad(lambda w: fast(w, x, key=jax.random.key(0)))(w), jax.grad(f)(w, x)
  )


def test_small_residuals_are_kept_exactly():
  f = lambda w, x: jnp.tanh(x @ w).sum()
  x, w = jnp.ones((4, 8)), jnp.full((8, 8), 0.1)
  fast = jact.compressed(f, bits=2, min_size=1024)
  g = jax.grad(lambda w: fast(w, x, key=jax.random.key(0)))(w)
  np.testing.assert_array_equal(g, jax.grad(f)(w, x))


def test_overrides_address_residuals_by_name():
  f = lambda w, x: jnp.tanh(x @ w).sum()
  x, w = jax.random.normal(jax.random.key(0), (64, 64)), jnp.eye(64)
  names = [
    n
    for n in jact.residual_report(
      lambda w: jact.compressed(f, bits=2, name="t")(w, x, key=jax.random.key(0)), w
    ).by_name()
    if n
  ]
  assert names and all(n.startswith("t.") for n in names)
  keep_all = jact.compressed(f, bits=2, name="t", overrides={n: None for n in names})
  g = jax.grad(lambda w: keep_all(w, x, key=jax.random.key(0)))(w)
  np.testing.assert_allclose(g, jax.grad(f)(w, x), rtol=1e-6)


@pytest.mark.slow
def test_policy_chooses_fewer_residuals():
  block, params, x, r = setup("transformer")
  key = jax.random.key(0)
  every = jact.compressed(block, bits=2, name="all")
  dots = jact.compressed(block, bits=2, name="dots", policy=jax.checkpoint_policies.dots_saveable)
  n_every = jact.residual_report(lambda p, x: every(p, x, key=key).sum(), params, x).total_bytes
  n_dots = jact.residual_report(lambda p, x: dots(p, x, key=key).sum(), params, x).total_bytes
  assert n_dots < n_every
  g = jax.grad(
    lambda p: jnp.sum(
      jact.compressed(block, bits=None, policy=jax.checkpoint_policies.dots_saveable)(p, x) * r
    )
  )(params)
  e = jax.grad(lambda p: jnp.sum(block(p, x) * r))(params)
  # atol 1e-5: float32 rounding where terms of gradients up to ~10 in size cancel (on jax 0.12
  # one of 1024 entries differs by 1.3e-6 from jax's own order of operations).
  chex.assert_trees_all_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_nested_and_inside_scan():
  block, params, x, r = setup("transformer")
  inner = jact.compressed(block, bits=8, name="inner")

  def model(stacked, x, key):
    def step(h, pk):
      p, k = pk
      return inner(p, h, key=k), None

    keys = jax.random.split(key, 3)
    return jnp.sum(jax.lax.scan(step, x, (stacked, keys))[0] * r)

  outer = jact.compressed(model, bits=8, name="outer")
  stacked = jax.tree.map(lambda a: jnp.stack([a, 0.9 * a, 1.1 * a]), params)
  plain = lambda s, x: jnp.sum(jax.lax.scan(lambda h, p: (block(p, h), None), x, s)[0] * r)
  exact = jax.grad(plain)(stacked, x)
  for f in (
    lambda s: model(s, x, jax.random.key(0)),
    lambda s: outer(s, x, jax.random.key(0), key=jax.random.key(1)),
  ):
    g = jax.jit(jax.grad(f))(stacked)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(exact)):
      assert rel_err(a, b) < 0.05


@pytest.mark.slow
def test_bits_none_gives_the_exact_gradient_and_vmap_works():
  block, params, x, r = setup("conv_bn")
  fast = jact.compressed(block, bits=None)
  g = jax.grad(lambda p: jnp.sum(fast(p, x) * r))(params)
  # atol 1e-5: float32 rounding where terms of gradients up to ~25 in size cancel (on jax 0.12
  # one of 16 entries differs by 2.5e-6 from jax's own order of operations).
  chex.assert_trees_all_close(
    g, jax.grad(lambda p: jnp.sum(block(p, x) * r))(params), rtol=1e-5, atol=1e-5
  )
  batched = jax.vmap(
    lambda x: jact.compressed(block, bits=2)(params, x[None], key=jax.random.key(0))
  )(x)
  np.testing.assert_allclose(
    batched[:, 0], jax.vmap(lambda x: block(params, x[None]))(x)[:, 0], rtol=1e-6, atol=1e-6
  )


@pytest.mark.slow
def test_jitted_step_traces_once_for_new_keys_and_data():
  block, params, x, r = setup("transformer")
  fast = jact.compressed(block, bits=2)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(p, x, key):
    return jax.grad(lambda p: jnp.sum(fast(p, x, key=key) * r))(p)

  for i in range(3):
    step(params, x + i, jax.random.key(i))


@pytest.mark.slow
def test_clear_errors():
  f = lambda x: jnp.sin(x).sum()
  x = jnp.ones((64, 64))
  with pytest.raises(ValueError, match="key=jax.random.key"):
    jax.grad(jact.compressed(f, bits=2))(x)
  with pytest.raises(ValueError, match="bits"):
    jact.compressed(f, bits=9)
  with pytest.raises(ValueError, match="min_size"):
    jact.compressed(f, min_size=0)
  with pytest.raises(TypeError, match="takes a function"):
    jact.compressed(3)
  with pytest.raises(TypeError, match="overrides"):
    jact.compressed(f, overrides=[2, 4])
  # Round-to-nearest and bits=None need no key.
  jax.grad(jact.compressed(f, compressor=jact.compressors.PerGroup(2, stochastic=False)))(x)
  jax.grad(jact.compressed(f, bits=None))(x)


def test_compressed_as_decorator_with_keywords():
  @jact.compressed(bits=4, name="dec")
  def f(w, x):
    return jnp.tanh(x @ w).sum()

  x, w = jnp.ones((64, 64)), jnp.eye(64)
  assert f.residual_config.name == "dec"
  assert jnp.allclose(f(w, x, key=jax.random.key(0)), jnp.tanh(x).sum())


def test_call_compressed_rejects_misaligned_input_flags():
  with pytest.raises(ValueError, match="one flag per leaf"):
    call_compressed(
      lambda x: x,
      (jnp.ones(3),),
      {},
      key=None,
      config=jact.compressed(lambda x: x, bits=None).residual_config,
      compress_inputs=(True, False),
    )
