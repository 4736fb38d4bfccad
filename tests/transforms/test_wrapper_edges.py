"""Edge cases of `jact.compressed` / `jact.checkpoint` and jact's residual names.

* Residual names: jact's policies and nested `compressed` calls decide from a
  value's name alone (jact's reserved namespace), never from what else the
  process traced before.
* A rounding key works under `lax.scan`, `fori_loop`, `jax.checkpoint` and
  `lax.cond` (scan over layers), with the gradients of the unrolled stack.
* A wrapped function with its own `key` parameter, or returning something
  other than arrays, gets an error that names jact and the fix.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jact
from jact.compressors import PerGroup

# ----------------------------------------------------------------------------- residual names

BITS, GROUP = 2, 256
X = jnp.linspace(-2.0, 2.0, 64 * 256, dtype=jnp.float32).reshape(64, 256)


def _stored_bytes(n: int) -> int:
  """Bytes of one residual of n float32 values at BITS bits: the packed codes
  plus a bfloat16 minimum and scale per group of GROUP values."""
  return n * BITS // 8 + 2 * 2 * (n // GROUP)


def _user_block(x):
  h = checkpoint_name(jnp.sin(x), "blk.2")  # the user's own name for an activation
  return h * h  # saves cos(x) and h


def _trace_other_block_named_blk():
  """An unrelated compressed block whose residuals are named blk.0, blk.1, blk.2
  (the flips keep the three sines from folding into one elementwise chain,
  which would store one derivative)."""
  other = jact.compressed(
    lambda a: jnp.sin(jnp.flip(jnp.sin(jnp.flip(jnp.sin(a))))), bits=BITS, name="blk"
  )
  report = jact.residual_report(lambda a: other(a, key=jax.random.key(1)).sum(), X)
  assert "blk.2" in {r.name for r in report.residuals}


def _user_block_report():
  block = jact.compressed(_user_block, compressor=PerGroup(BITS, GROUP), name="mine")
  return jact.residual_report(lambda x: block(x, key=jax.random.key(0)).sum(), X)


def test_a_user_checkpoint_name_is_compressed_whatever_was_traced_before():
  before = _user_block_report()
  _trace_other_block_named_blk()
  after = _user_block_report()
  # Both residuals (h and cos(x)) are stored at 2 bits, in either order.
  for report in (before, after):
    assert {r.dtype for r in report.residuals} <= {jnp.dtype(jnp.uint8), jnp.dtype(jnp.bfloat16)}
    assert report.total_bytes == 2 * _stored_bytes(X.size)
    names = {
      r.name for r in report.residuals if not r.is_argument
    }  # as users see them: no reserved prefix
    assert len(names) == 2 and all(n.startswith("mine.") for n in names), names


def test_jact_policies_never_select_a_user_name():
  _trace_other_block_named_blk()
  plain = jax.checkpoint(lambda x: _user_block(x).sum(), policy=jact.save_compressed("blk"))
  report = jact.residual_report(plain, X)
  assert report.total_bytes == 0  # the user's "blk.2" is recomputed, not saved in float32
  keep = jax.checkpoint(
    lambda x: _user_block(x).sum(), policy=jax.checkpoint_policies.save_only_these_names("blk.2")
  )
  assert jact.residual_report(keep, X).total_bytes == X.nbytes  # jax's own policy still can


def test_jact_policies_select_jact_residuals_under_their_user_visible_names():
  block = jact.compressed(
    lambda a: jnp.sin(jnp.flip(jnp.sin(a))), compressor=PerGroup(BITS, GROUP), name="blk"
  )  # two residuals: the flip keeps them from folding into one
  alone = jact.residual_report(lambda a: block(a, key=jax.random.key(2)).sum(), X)
  for policy in (
    jact.save_compressed("blk"),
    jact.save_compressed(),
    jact.offload_compressed("blk"),
    jax.checkpoint_policies.save_only_these_names("blk.0", "blk.1"),
  ):
    rematted = jax.checkpoint(lambda a: block(a, key=jax.random.key(2)), policy=policy)
    report = jact.residual_report(lambda a: rematted(a).sum(), X)
    assert report.total_bytes == alone.total_bytes == 2 * _stored_bytes(X.size), policy
    if policy != jact.offload_compressed("blk"):  # (an offloaded copy is unnamed in reports)
      assert {r.name for r in report.residuals if not r.is_argument} == {"blk.0", "blk.1"}, policy
  other = jax.checkpoint(
    lambda a: block(a, key=jax.random.key(2)), policy=jact.save_compressed("other")
  )
  assert jact.residual_report(lambda a: other(a).sum(), X).total_bytes == 0


# ------------------------------------------------------------------------- keys under control flow

# two layers (four before: the unrolled stacks compiled twice as long; each
# structure still threads two distinct keys through two wrapped layers)
LAYERS, WIDTH, BATCH = 2, 64, 32  # 2,048 activation values per layer: above min_size


def _layer(w, x):
  return x + jnp.tanh(x @ w)


def _stack_inputs():
  ws = jax.random.normal(jax.random.key(10), (LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH)
  x = jax.random.normal(jax.random.key(11), (BATCH, WIDTH))
  keys = jax.random.split(jax.random.key(12), LAYERS)
  return ws, x, keys


def _wrapped(kind):
  if kind == "checkpoint":
    return jact.checkpoint(_layer, bits=8, compress_argnums=(1,), name="ck")
  return jact.compressed(_layer, bits=8, compress_argnums=(1,), name="cp")


def _unrolled(layer, ws, x, keys):
  for i in range(LAYERS):
    x = layer(ws[i], x, key=keys[i])
  return x


def _scanned(layer, ws, x, keys):
  return lax.scan(lambda h, wk: (layer(wk[0], h, key=wk[1]), None), x, (ws, keys))[0]


def _fori(layer, ws, x, keys):
  return lax.fori_loop(0, LAYERS, lambda i, h: layer(ws[i], h, key=keys[i]), x)


def _remat(layer, ws, x, keys):
  return jax.checkpoint(lambda ws, x, keys: _unrolled(layer, ws, x, keys))(ws, x, keys)


def _cond(layer, ws, x, keys):
  return lax.cond(x[0, 0] < 100.0, lambda h: _unrolled(layer, ws, h, keys), lambda h: h, x)


def _grads(structure, layer, ws, x, keys):
  loss = lambda ws, x, keys: jnp.sum(structure(layer, ws, x, keys) ** 2)
  return jax.jit(jax.grad(loss, argnums=(0, 1)))(ws, x, keys)


@functools.lru_cache(maxsize=None)
def _exact_grads():
  ws, x, keys = _stack_inputs()
  plain = lambda w, h, key: _layer(w, h)
  return jax.jit(
    jax.grad(lambda ws, x: jnp.sum(_unrolled(plain, ws, x, keys) ** 2), argnums=(0, 1))
  )(ws, x)


@functools.lru_cache(maxsize=None)
def _unrolled_grads(kind):
  return _grads(_unrolled, _wrapped(kind), *_stack_inputs())


def _check_close_to_unrolled(got, expected):
  for g, e, ex in zip(got, expected, _exact_grads()):
    scale = float(jnp.abs(ex).max())
    # Same keys, same rounding: equal up to float reassociation (1e-5 of the scale) ...
    np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=0, atol=1e-5 * scale)
    # ... and the 8-bit rounding really ran (not the exact gradient), within 5% of it.
    assert 0 < float(jnp.abs(e - ex).max()) < 0.05 * scale


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["checkpoint", "compressed"])
@pytest.mark.parametrize(
  "structure", [_scanned, _fori, _remat, _cond], ids=["scan", "fori_loop", "jax_checkpoint", "cond"]
)
def test_keys_work_under_control_flow_with_the_gradients_of_the_unrolled_stack(kind, structure):
  ws, x, keys = _stack_inputs()
  layer = _wrapped(kind)
  _check_close_to_unrolled(_grads(structure, layer, ws, x, keys), _unrolled_grads(kind))


@pytest.mark.slow
@pytest.mark.parametrize("wrap", [jact.checkpoint, jact.compressed])
def test_a_wrapper_built_in_a_loop_body_can_close_over_the_loop_index(wrap):
  ws, x, keys = _stack_inputs()

  def layer(ws, i, h, key):  # i: a traced layer index, closed over by the wrapped function
    return wrap(lambda h: _layer(ws[i], h), bits=8, name="loop", compress_argnums=(0,))(h, key=key)

  def looped(ws, x, keys, index):
    del index
    return lax.fori_loop(0, LAYERS, lambda i, h: layer(ws, i, h, keys[i]), x)

  def unrolled(ws, x, keys, index):
    for i in range(LAYERS):
      x = layer(ws, index[i], x, keys[i])
    return x

  def grads(stack):
    loss = lambda *a: jnp.sum(stack(*a) ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(ws, x, keys, jnp.arange(LAYERS))

  _check_close_to_unrolled(grads(looped), grads(unrolled))


# ----------------------------------------------------------------------------- clear errors


def _with_key_param(x, key):
  return x * jax.random.uniform(key, x.shape)


def _with_keyword_only_key(x, *, key):
  return _with_key_param(x, key)


@pytest.mark.parametrize(
  "wrap,api", [(jact.compressed, "jact.compressed"), (jact.checkpoint, "jact.checkpoint")]
)
@pytest.mark.parametrize("fn", [_with_key_param, _with_keyword_only_key])
def test_a_function_with_its_own_key_parameter_gets_a_clear_error(wrap, api, fn):
  x = jnp.ones((BATCH, WIDTH))
  with pytest.raises(
    TypeError,
    match=rf"{api}: {fn.__name__} needs its own parameter `key`, but "
    r"the keyword `key=` is reserved.*Rename.*functools\.partial",
  ):
    wrap(fn, bits=4, compress_argnums=(0,))(x, key=jax.random.key(4))
  # The fixes the message names work: the function's key bound before wrapping, or passed
  # positionally, while `key=` is the rounding key.
  expected = _with_key_param(x, jax.random.key(3))
  bound = wrap(functools.partial(fn, key=jax.random.key(3)), bits=4, compress_argnums=(0,))
  np.testing.assert_array_equal(bound(x, key=jax.random.key(4)), expected)
  if fn is _with_key_param:
    np.testing.assert_array_equal(
      wrap(fn, bits=4, compress_argnums=(0,))(x, jax.random.key(3), key=jax.random.key(4)), expected
    )


@pytest.mark.parametrize(
  "wrap,api", [(jact.compressed, "jact.compressed"), (jact.checkpoint, "jact.checkpoint")]
)
@pytest.mark.parametrize(
  "returned,shown",
  [
    (3, r"returned int 3"),
    ("done", r"returned str 'done'"),
    (None, r"returned None, which holds no array"),
    ("pair", r"returned str 'aux' at output\[1\]"),
  ],
)
def test_a_function_returning_a_non_array_gets_a_clear_error(wrap, api, returned, shown):
  def fn(x):
    y = jnp.tanh(x)
    return (y, "aux") if returned == "pair" else returned

  with pytest.raises(
    TypeError,
    match=rf"{api}: fn {shown}; a wrapped function must return an "
    r"array.*jnp\.asarray.*outside the wrapped function",
  ):
    wrap(fn, bits=4, compress_argnums=(0,))(jnp.ones((BATCH, WIDTH)), key=jax.random.key(5))
