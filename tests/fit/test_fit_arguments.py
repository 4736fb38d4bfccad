"""`jact.fit` and `jact.largest_batch` misuse: each bad argument is a clear error naming it and
the fix, raised before anything compiles; `FitError` pickles and says truly what was reached."""

import math
import pickle
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact


def mlp(w, x):
  return x + jnp.tanh(x @ w[0]) @ w[1]


SEGMENTS = [jact.segment(mlp, name=f"s{i}", compress_argnums=(1,)) for i in range(2)]


def loss(ws, x):
  for s, w in zip(SEGMENTS, ws):
    x = s(w, x)
  return jnp.sum(x**2)


WS = [(jnp.eye(64, 256) / 2, jnp.eye(256, 64) / 2) for _ in range(2)]
X = jax.random.normal(jax.random.key(0), (64, 64))
SDS = jax.ShapeDtypeStruct((64, 64), jnp.float32)


def loss_with_keyword_key(ws, x, *, key):
  return loss(ws, x)


def loss_with_default_key(ws, x, key=None):
  return loss(ws, x)


@pytest.mark.parametrize(
  "loss_fn, args, kwargs, error, message",
  [
    (loss, (WS, X), dict(budget_bytes="2GiB"), TypeError, "string '2GiB'.*2 \\* 2\\*\\*30"),
    (loss, (WS, X), dict(budget_bytes=math.nan), TypeError, "budget_bytes.*nan"),
    (
      loss,
      (WS, X),
      dict(budget_bytes=10**6, argnums=-1),
      ValueError,
      "argnums must.*argnums=0.*got -1",
    ),
    (loss, (WS, X), dict(budget_bytes=10**6, argnums=(2,)), ValueError, "argnums=\\(2,\\).*2 exam"),
    (loss, (WS, X), dict(budget_bytes=10**6, argnums="0"), ValueError, "argnums.*'0'"),
    (loss, (WS, X), dict(budget_bytes=10**6, widths=4), TypeError, "widths.*4.*widths=\\(2, 4"),
    (loss, (WS, X), dict(budget_bytes=10**6, widths=(True,)), ValueError, "widths"),
    (loss, (WS, X), dict(budget_bytes=10**6, calibration=X), TypeError, "calibration.*tuple"),
    (loss, (WS, X), dict(budget_bytes=10**6, calibration=(X,)), ValueError, "calibration has 1"),
    (loss, (WS, X), dict(budget_bytes=10**6, calibration=(WS, SDS)), TypeError, "real arrays"),
    (
      loss,
      (WS, X),
      dict(budget_bytes=10**6, calibration=(WS, X.at[0, 0].set(jnp.nan))),
      ValueError,
      "calibration holds NaN or inf",
    ),
    (loss, (WS, X), dict(budget_bytes=10**6, sensitivity=[1.0]), TypeError, "sensitivity must"),
    (loss, (WS, X), dict(budget_bytes=10**6, sensitivity={"s0.2": -1.0}), ValueError, "s0.2.*>= 0"),
    (loss, (WS, X), dict(budget_bytes=10**6, sensitivity={"s0.2": math.inf}), ValueError, "s0.2"),
    (loss, (WS, SDS), dict(budget_bytes=10**6, sensitivity={"s0.2": math.nan}), ValueError, "NaN"),
    (loss_with_keyword_key, (WS, X), dict(budget_bytes=10**6), ValueError, "parameter 'key'"),
    (loss_with_default_key, (WS, X), dict(budget_bytes=10**6), ValueError, "rename the param"),
  ],
)
def test_fit_misuse_names_the_argument_and_the_fix(loss_fn, args, kwargs, error, message):
  with pytest.raises(error, match=message):
    jact.fit(loss_fn, *args, **kwargs)


def test_a_loss_given_its_key_positionally_is_accepted():
  # the configured loss reserves key= for its noise; a key among the example arguments is fine
  def keyed(ws, x, key):
    return loss(ws, x) + 0 * jax.random.normal(key)

  result = jact.fit(keyed, WS, X, jax.random.key(0), budget_bytes=2**40)
  assert result.peak_bytes == result.written_peak_bytes


def test_duplicate_segment_names_are_an_error_naming_the_duplicate():
  twins = [jact.segment(mlp, name="same", compress_argnums=(1,)) for _ in range(2)]

  def twin_loss(ws, x):
    for s, w in zip(twins, ws):
      x = s(w, x)
    return jnp.sum(x**2)

  with pytest.raises(ValueError, match="two different jact.segment blocks are named 'same'"):
    jact.fit(twin_loss, WS, SDS, budget_bytes=10**5)


def test_fit_error_pickles():
  error = jact.FitError(1000, 2000, 1500, "remat [s0]; widths 1:3", 1, 4, 2.5)
  back = pickle.loads(pickle.dumps(error))
  assert type(back) is jact.FitError and str(back) == str(error)
  assert (back.budget_bytes, back.written_peak_bytes, back.smallest_peak_bytes) == (
    1000,
    2000,
    1500,
  )


def test_fit_error_never_calls_a_configuration_above_the_written_step_the_smallest():
  # One block: compressing it does not lower the step's peak (its live residual dominates),
  # so the least compiled peak is the step as written, and the error says so.
  one = jact.segment(mlp, name="one", compress_argnums=(1,))
  x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
  with pytest.raises(jact.FitError) as e:
    jact.fit(lambda w, x: jnp.sum(one(w, x) ** 2), WS[0], x, budget_bytes=10_000)
  assert e.value.smallest_peak_bytes <= e.value.written_peak_bytes
  if e.value.smallest_peak_bytes == e.value.written_peak_bytes:
    assert "no configuration compiled below the step as written" in str(e.value)


def _args(b):
  return (WS, jax.ShapeDtypeStruct((b, 64), jnp.float32))


@pytest.mark.parametrize("max_batch", [4, 1])
def test_largest_batch_respects_max_batch(max_batch):
  found = jact.largest_batch(loss, _args, 2**40, max_batch=max_batch)
  assert found.batch == max_batch and found.failing_batch is None


@pytest.mark.parametrize(
  "args_for_batch, budget, kwargs, error, message",
  [
    (_args, 2**30, dict(max_batch=0), ValueError, "max_batch must be a positive int.*0"),
    (_args, 2**30, dict(max_batch=-3), ValueError, "max_batch.*-3"),
    (_args, 2**30, dict(start=0), ValueError, "start.*0"),
    (_args, 2**30, dict(tolerance=0), ValueError, "tolerance"),
    (_args, math.nan, {}, TypeError, "budget_bytes.*nan"),
    (_args, "2GiB", {}, TypeError, "string '2GiB'"),
    (_args, 0, {}, ValueError, "positive"),
    ((WS, SDS), 2**30, {}, TypeError, "args_for_batch must be a function"),
    (lambda b: WS[0][0], 2**30, {}, TypeError, "args_for_batch\\(8\\) must return a tuple"),
    (_args, 2**30, dict(argnums=(0, 7)), ValueError, "argnums"),
  ],
)
def test_largest_batch_misuse_names_the_argument_and_the_fix(
  args_for_batch, budget, kwargs, error, message
):
  with pytest.raises(error, match=message):
    jact.largest_batch(loss, args_for_batch, budget, **kwargs)


def test_an_indivisible_sharded_batch_is_named():
  from jact._fit.checks import check_sharded

  class Uneven:  # a sharding that does not divide dimension 0 (as a 3-device mesh on 64 rows)
    def shard_shape(self, shape):
      raise ValueError(f"dimension 0 of {shape} is not divisible by 3")

  x = types.SimpleNamespace(shape=(64, 64), dtype=jnp.float32, sharding=Uneven())
  with pytest.raises(ValueError, match=r"\[1\].*\(64, 64\).*multiples of the mesh"):
    check_sharded((WS, x))
  check_sharded((WS, np.zeros((64, 64))))  # unsharded: nothing to check
