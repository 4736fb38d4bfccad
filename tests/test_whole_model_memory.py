"""A whole model in one `jact.compressed` call cuts compiled memory like
per-block wrapping does (compile-only: XLA's temp memory of the gradient; the
CNN stack measured by the bench: experiments/tests/test_bench_whole_model.py).

Residuals are compressed as soon as the forward pass is done with them and
rebuilt just before their first use in the backward pass; compressed only
after the whole forward pass (and rebuilt all at its start) they would all
be alive at full precision at once and the peak would not move.
"""

# Residuals a lax.scan produces per iteration are stored inside the loop and
# rebuilt inside the backward loop (jact/_transforms/_scan.py): without that,
# whole-model compressed left the stacks at full precision (temp ~1.0x plain).

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jact

pytestmark = pytest.mark.slow  # compiles scanned models' gradients

B, T, D, H = 16, 64, 64, 128


def _lstm(params, xs):
  wx, wh, wo = params

  def cell(carry, x):
    h, c = carry
    i, f, g, o = jnp.split(x @ wx + h @ wh, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return (h, c), h

  _, hs = jax.lax.scan(cell, (jnp.zeros((B, H)), jnp.zeros((B, H))), xs)
  return jnp.tanh(hs) @ wo


def _compiled(loss, *args):
  """The compiled gradient of `loss` (XLA's default optimizations: its memory is measured)."""
  return jax.jit(jax.grad(loss)).lower(*args).compile()


def _temp(loss, *args) -> int:
  return _compiled(loss, *args).memory_analysis().temp_size_in_bytes


# Gradients only compared as values compile without LLVM's optimizations.
_jit_o0 = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _rel_error(a, b) -> float:
  flat = lambda t: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(t)])
  return float(jnp.linalg.norm(flat(a) - flat(b)) / jnp.linalg.norm(flat(b)))


def _lstm_inputs():
  k = jax.random.split(jax.random.key(0), 4)
  params = (
    jax.random.normal(k[0], (D, 4 * H)) / 8,
    jax.random.normal(k[1], (H, 4 * H)) / 11,
    jax.random.normal(k[2], (H, 8)) / 11,
  )
  return params, jax.random.normal(k[3], (T, B, D))


@pytest.mark.slow
def test_whole_model_wrap_cuts_memory_of_an_lstm_scanned_over_time():
  params, xs = _lstm_inputs()
  key = jax.random.key(1)
  plain = lambda p, x: jnp.mean(_lstm(p, x) ** 2)
  two, eight = (jact.compressed(_lstm, bits=b, name="lstm") for b in (2, 8))
  plain_step = _compiled(plain, params, xs)
  temp_plain = plain_step.memory_analysis().temp_size_in_bytes
  temp_two = _temp(lambda p, x: jnp.mean(two(p, x, key=key) ** 2), params, xs)
  assert temp_two * 2.5 <= temp_plain, (temp_plain, temp_two)  # measured 3.4x
  assert bool(jnp.all(two(params, xs, key=key) == _lstm(params, xs)))
  exact = plain_step(params, xs)
  approx = _jit_o0(jax.grad(lambda p, x: jnp.mean(eight(p, x, key=key) ** 2)))(params, xs)
  assert _rel_error(approx, exact) < 0.01  # measured 0.3%, as with the stacks compressed whole


class _Block(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.linear2 = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x):
    return x + self.linear2(nnx.gelu(self.linear1(x)))


class _ScannedStack(nnx.Module):
  """Blocks created with nnx.vmap and run with nnx.scan (one layer per iteration)."""

  def __init__(self, dim: int, depth: int, *, rngs: nnx.Rngs):

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs):
      return _Block(dim, rngs=rngs)

    self.blocks = create(rngs)

  def __call__(self, x):

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    return forward(x, self.blocks)


def _stack_loss(model, key=None):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, x):
    m = nnx.merge(graphdef, params, rest)
    y = m(x) if key is None else m(x, key=key)
    return jnp.mean(y**2)

  return loss, params


@pytest.mark.slow
def test_whole_model_wrap_cuts_memory_of_an_nnx_scan_over_layers():
  x = jax.random.normal(jax.random.key(2), (8, 64, 64))
  key = jax.random.key(3)
  build = lambda: _ScannedStack(64, 8, rngs=nnx.Rngs(0))
  plain, params = _stack_loss(build())
  two, _ = _stack_loss(jact.compressed(build(), bits=2), key)
  eight, _ = _stack_loss(jact.compressed(build(), bits=8), key)
  plain_step = _compiled(plain, params, x)
  temp_plain, temp_two = plain_step.memory_analysis().temp_size_in_bytes, _temp(two, params, x)
  assert temp_two * 2.5 <= temp_plain, (temp_plain, temp_two)
  assert float(two(params, x)) == float(plain(params, x))
  assert _rel_error(_jit_o0(jax.grad(eight))(params, x), plain_step(params, x)) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("wrap", ["jit", "nested", "remat", "reverse"])
def test_scans_inside_calls_nests_and_remat_are_stored_per_iteration(wrap):
  """A scan inside jax.jit, a scan of scans, a jax.checkpoint body and a
  reversed scan: the residuals leave the loop packed per iteration (uint8
  pieces with the loop's length in front, named), the forward is exact and
  the 8-bit gradient close."""
  b, t, h = 8, 16, 64
  w = jax.random.normal(jax.random.key(0), (h, h)) / 8
  xs = jax.random.normal(jax.random.key(1), (t, b, h))

  def rnn(w, xs, reverse=False, remat=False):
    step = lambda c, x: (jnp.tanh(c @ w + x),) * 2
    step = jax.checkpoint(step) if remat else step
    return jax.lax.scan(step, jnp.zeros((b, h)), xs, reverse=reverse)[1]

  fn = {
    "jit": lambda w, xs: jax.jit(rnn)(w, xs),
    "nested": lambda w, xs: jax.lax.scan(lambda c, x: (c, rnn(w, x)), 0.0, xs.reshape(4, 4, b, h))[
      1
    ].reshape(t, b, h),
    "remat": lambda w, xs: rnn(w, xs, remat=True),
    "reverse": lambda w, xs: rnn(w, xs, reverse=True),
  }[wrap]
  key = jax.random.key(2)
  plain = lambda w, xs: jnp.sum(fn(w, xs) ** 2)
  eight = jact.compressed(fn, bits=8, name="rnn")
  loss = lambda w, xs: jnp.sum(eight(w, xs, key=key) ** 2)
  assert bool(jnp.all(eight(w, xs, key=key) == fn(w, xs)))
  assert (
    _rel_error(
      jax.jit(jax.grad(loss, argnums=(0, 1)))(w, xs), jax.grad(plain, argnums=(0, 1))(w, xs)
    )
    < 0.03
  )  # exact stacks: same error
  # A packed tensor's codes are uint8[rows, groups, bytes]; stacked per
  # iteration they get the loop's length in front (twice for a nested loop).
  report = jact.residual_report(loss, w, xs)
  packed = [r for r in report.residuals if str(r.dtype) == "uint8"]
  lengths = (4, 4) if wrap == "nested" else (t,)
  assert packed and all(
    tuple(r.shape[:-3]) == lengths and r.name.startswith("rnn.") for r in packed
  ), report
