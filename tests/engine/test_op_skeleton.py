"""The op skeleton (jact/_engine/op.py) and the ops' one compressor argument.

Every op in jact.ops is a `compressed_op`; these tests check what the
skeleton owns (names, seeds, the forward-mode guard, statistics without
gradient, varying-axes casts) on an op written only from its forward and
backward formula, and that the ops take `bits=` or `compressor=` alone.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact import ops
from jact.compressors import PerGroup
from jact._engine.op import Keep, Save, Store, compressed_op
from jact._engine.rounding import resolve_compressor
from stats import saved_under_names

X = jnp.linspace(-2.0, 2.0, 512).reshape(2, 256)


def cube(x, *, key=None, bits=8, compressor=None, name="cube"):
  def forward(x):
    return x**3, {"dydx": Store(3 * x**2, dtype=jnp.float32)}

  def backward(res, g):
    return (g * res["dydx"],)

  compressor = resolve_compressor(bits, compressor, "jact.ops.cube", default_bits=8)
  return compressed_op(
    forward, backward, op="cube", name=name, compressor=compressor, key=key, elementwise=True
  )(x)


def scaled_with_stats(x, w, *, name="scaled"):
  """y = x * w (w kept by reference), plus the batch mean of x as a statistic."""

  def forward(x, w):
    mean = jnp.mean(x, 0)
    return (x * w, mean), {"mean": Save(mean), "x": Keep(x), "w": Keep(w, tie=True)}

  def backward(res, g):
    assert set(res) == {"mean", "x", "w"}
    return g * res["w"], jnp.sum(g * res["x"], 0)

  return compressed_op(forward, backward, op="scaled", name=name, statistics=1)(x, w)


def test_a_new_op_is_its_forward_and_backward():
  key = jax.random.key(0)
  assert bool((jax.jit(cube)(X, key=key) == X**3).all())
  exact = jax.jit(jax.grad(lambda x: cube(x, bits=None).sum()))(X)
  np.testing.assert_array_equal(exact, 3 * X**2)
  g8 = jax.jit(jax.grad(lambda x: cube(x, key=key).sum()))(X)
  step = float(jnp.max(3 * X**2)) / 255
  assert float(jnp.max(jnp.abs(g8 - exact))) <= step
  assert not np.array_equal(g8, exact)  # the stored derivative was rounded
  # the residual is named `name.role`, and it is the only value saved
  names, size = saved_under_names(
    lambda x: cube(x, key=key, name="c1").sum(), ["c1.dydx", "c1.x"], X
  )
  assert names == {"c1.dydx"} and size < X.nbytes // 2, (names, size)  # 8-bit codes + stats


def test_the_skeleton_guards_keys_and_forward_mode():
  with pytest.raises(ValueError, match=r"jact\.ops\.cube .*needs a PRNG key"):
    cube(X)
  cube(X, compressor=PerGroup(8, stochastic=False))  # round-to-nearest: no key needed
  with pytest.raises(TypeError, match=r"jact\.ops\.cube has a custom backward rule"):
    jax.jvp(lambda x: cube(x, bits=None), (X,), (X,))
  with pytest.raises(ValueError, match="non-empty string"):
    cube(X, name="")


def test_statistics_carry_no_gradient_and_kept_inputs_are_not_named():
  x, w = X, jnp.full((256,), 0.5)
  (y, mean) = scaled_with_stats(x, w)
  np.testing.assert_array_equal(y, x * w)
  np.testing.assert_array_equal(mean, jnp.mean(x, 0))
  gx, gw = jax.grad(lambda x, w: jnp.sum(scaled_with_stats(x, w)[1]), argnums=(0, 1))(x, w)
  assert not gx.any() and not gw.any()  # the statistic is stop_gradient'ed
  gx, gw = jax.grad(lambda x, w: jnp.sum(scaled_with_stats(x, w)[0]), argnums=(0, 1))(x, w)
  np.testing.assert_array_equal(gx, jnp.broadcast_to(w, x.shape))
  np.testing.assert_array_equal(gw, jnp.sum(x, 0))
  names, _ = saved_under_names(
    lambda x, w: jnp.sum(scaled_with_stats(x, w)[0]), ["scaled.mean", "scaled.x", "scaled.w"], x, w
  )
  assert names == {"scaled.mean"}, names


def test_an_invariant_table_meets_varying_ids_under_shard_map():
  """The skeleton casts invariant float inputs to the axes the others vary
  over (as JAX does for its own ops): the table's gradient is summed over the
  devices, exactly as plain `jnp.take`'s."""
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.sharding.PartitionSpec
  table = jnp.arange(12.0).reshape(6, 2)
  ids = jnp.array([[1, 5, 1], [0, 2, 2]])

  def grad_of(take):
    def step(table, ids):
      return jax.grad(lambda t: jnp.sum(jnp.sin(take(ids, t))))(table)

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))

  plain = grad_of(lambda ids, t: jnp.take(t, ids, axis=0))(table, ids)
  np.testing.assert_array_equal(grad_of(ops.embed)(table, ids), plain)


def _public_ops_with_bits():
  return sorted(
    n
    for n in ops.__all__
    if inspect.isfunction(getattr(ops, n))
    and "bits" in inspect.signature(getattr(ops, n)).parameters
  )


def test_public_ops_take_one_compressor_argument():
  names = _public_ops_with_bits()
  assert {
    "dense",
    "conv",
    "gelu",
    "softmax",
    "layer_norm",
    "chunked_attention",
    "dot_product_attention",
  } <= set(names)
  for n in names:
    params = inspect.signature(getattr(ops, n)).parameters
    assert "compressor" in params and not {"group_size", "stochastic"} & set(params), n


def test_a_plan_width_applies_to_a_per_group_compressor():
  """A plan's integer entry is the call site's compressor at that width
  (`with_bits`): PerGroup keeps its group size and rounding mode."""
  x = X + 0.1

  def grad(compressor, plan=None):
    f = lambda x: jnp.sum(jnp.sin(ops.gelu(x, compressor=compressor, name="act")))
    if plan is None:
      return jax.jit(jax.grad(f))(x)
    with jact.use_plan(plan):
      return jax.jit(jax.grad(f))(x)

  planned = grad(PerGroup(8, 64, False), jact.BitPlan({"act.dydx": 2}))
  np.testing.assert_array_equal(planned, grad(PerGroup(2, 64, False)))
  assert not np.array_equal(planned, grad(PerGroup(2, 256, False)))
  assert resolve_compressor(4, PerGroup(2, 64, False), "jact.ops.gelu") == PerGroup(2, 64, False)
  assert resolve_compressor(2, None, "jact.ops.gelu") == PerGroup(2)
