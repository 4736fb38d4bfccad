"""jact.convert on unmodified Flax example-style models (experiments/zoo.py).

Each zoo model, its code untouched, converted with `jact.convert`: the
training forward pass gives the plain model's output, the bytes saved for the
backward pass at 2 bits are at least `MIN_CUT[name]` times fewer than plain
(each floor is about half of the cut measured on a batch of 4 with the
library of the commit that set it; `python -m experiments.bench_models`
gives the full-batch figures), and one 8-bit draw of the gradient is within
`GRAD_TOL` of the exact one. Batches are cut to 4 examples to keep compiles
small.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import jact
from experiments.zoo import CASES
from experiments.zoo_harness import flat, variant_fns

pytestmark = pytest.mark.slow

KEY = jax.random.key(1)
GRAD_TOL = 0.02
MIN_CUT = {"resnet18": 2, "bilstm_sst2": 8, "transformer_lm": 8, "gemma_nnx": 7, "seq2seq": 5,
           "scan_mlp_nnx": 7, "mnist_cnn": 1.8}


def small(batch, n=4):
  return jax.tree.map(lambda a: a[:n], batch)


# A model's parameters and batch are made once for the three tests (initializing
# the zoo's models compiles them); the tests only read them.
@functools.cache
def _batch(name):
  return small(CASES[name].batch(0))


@functools.cache
def _fns(name, variant, bits=None):
  return variant_fns(CASES[name], variant, bits)


def saved_bytes(fns, batch):
  return jact.residual_report(lambda p, s, b: fns.loss(p, s, b, KEY)[0], fns.params, fns.state,
                              batch).total_bytes


@pytest.mark.parametrize("name", list(CASES))
def test_forward_identical_after_convert(name):
  batch = _batch(name)
  plain, converted = _fns(name, "plain"), _fns(name, "convert", 2)
  want = jax.jit(plain.forward)(plain.params, plain.state, batch, KEY)
  got = jax.jit(converted.forward)(converted.params, converted.state, batch, KEY)
  assert jnp.allclose(got[0], want[0], rtol=1e-5, atol=1e-5), float(jnp.abs(got[0] - want[0]).max())


@pytest.mark.parametrize("name", list(CASES))
def test_saved_bytes_cut_at_2_bits(name):
  batch = _batch(name)
  plain, converted = _fns(name, "plain"), _fns(name, "convert", 2)
  cut = saved_bytes(plain, batch) / saved_bytes(converted, batch)
  assert cut >= MIN_CUT[name], cut


GRAD_CASES = list(CASES)  # nnx: converted without rngs=, keys from jact.nnx.use_key


@pytest.mark.parametrize("name", GRAD_CASES)
def test_8bit_gradient_close(name):
  batch = _batch(name)
  plain, converted = _fns(name, "plain"), _fns(name, "convert", 8)
  grad = lambda f: flat(jax.jit(jax.grad(f.loss, has_aux=True))(f.params, f.state, batch, KEY)[0])
  exact, approx = grad(plain), grad(converted)
  err = float(jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact))
  assert err < GRAD_TOL, err
