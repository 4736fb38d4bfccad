"""jact.convert on unmodified Flax example-style models (experiments/lib/zoo.py).

Each zoo model, its code untouched, converted with `jact.convert`: the
training forward pass gives the plain model's output, the bytes saved for the
backward pass at 2 bits are at least `MIN_CUT[name]` times fewer than plain
(each floor is about half of the cut measured on a batch of 4 with the
library of the commit that set it; `python -m experiments.bench.bench_models`
gives the full-batch figures), and one 8-bit draw of the gradient is within
`GRAD_TOL` of the exact one. Batches are cut to 4 examples to keep compiles
small.

To keep compiles small, too, the models whose depth is a constructor argument
are built shallower than the experiments build them (`TEST_BUILDS`: the same
classes and code, one block per stage or layer -- ResNet keeps an identity
block and projection blocks), and each model's plain and 8-bit gradients are
compiled once, with its training forward pass's output, for all three tests.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jact
from experiments.lib import zoo
from experiments.lib.zoo import CASES
from experiments.lib.zoo_harness import flat, variant_fns

pytestmark = pytest.mark.slow

KEY = jax.random.key(1)
GRAD_TOL = 0.02
MIN_CUT = {
  "resnet18": 2,
  "bilstm_sst2": 8,
  "transformer_lm": 8,
  "gemma_nnx": 7,
  "seq2seq": 5,
  "scan_mlp_nnx": 7,
  "mnist_cnn": 1.8,
}
# Shallower instances of the zoo's deep models (same classes; depth is structural here).
TEST_BUILDS = {
  "resnet18": lambda: zoo.ResNet(stage_sizes=(1, 1, 1, 1), num_filters=16),
  "transformer_lm": lambda: zoo.TransformerLM(dataclasses.replace(zoo.LM_CONFIG, num_layers=1)),
  "gemma_nnx": lambda: zoo.GemmaLike(num_layers=1, rngs=nnx.Rngs(0)),
}
# Programs compiled without LLVM's optimizations (XLA's HLO passes still run):
# what is checked is values, not speed.
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def small(batch, n=4):
  return jax.tree.map(lambda a: a[:n], batch)


@dataclasses.dataclass(frozen=True)
class _TestCase(zoo.Case):
  """A zoo case whose linen variables are initialized once, compiled, on the test batch
  with an "rbg" key (op by op with threefry keys, initializing a zoo model takes several
  seconds of small compiles); the initializers, hence the distributions, are the model's."""

  def init(self, seed: int = 0):
    return _variables(self.name, seed)


@functools.cache
def _variables(name, seed):
  case = _case(name)
  init = lambda key, *inputs: case.build().init(key, *inputs, **case.train_kwargs)
  return jax.jit(init)(jax.random.key(seed, impl="rbg"), *_batch(name)["inputs"])


@functools.cache
def _built(name):
  return TEST_BUILDS.get(name, CASES[name].build)()


@functools.cache
def _case(name):
  case = CASES[name]
  fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(case)}
  build = TEST_BUILDS.get(name, case.build)
  if case.framework == "nnx":  # built (initialized op by op) once, then copied per variant
    build = lambda: nnx.clone(_built(name))  # noqa: E731
  return _TestCase(**{**fields, "build": build})


# A model's parameters and batch are made once for the three tests (initializing
# the zoo's models compiles them); the tests only read them.
@functools.cache
def _batch(name):
  return small(CASES[name].batch(0))


@functools.cache
def _fns(name, variant, bits=None):
  return variant_fns(_case(name), variant, bits)


@functools.cache
def _trained(name, variant, bits=None):
  """(logits of the training forward pass, flat gradient of the loss), one program."""
  fns, case = _fns(name, variant, bits), _case(name)

  def loss(params, state, batch, key):
    logits, _ = fns.forward(params, state, batch, key)
    return case.loss(logits, batch["labels"]), logits

  grads, logits = _jit(jax.grad(loss, has_aux=True))(fns.params, fns.state, _batch(name), KEY)
  return logits, flat(grads)


def saved_bytes(fns, batch):
  return jact.residual_report(
    lambda p, s, b: fns.loss(p, s, b, KEY)[0], fns.params, fns.state, batch
  ).total_bytes


@pytest.mark.parametrize("name", list(CASES))
def test_forward_identical_after_convert(name):
  """The 8-bit model's forward pass under `jax.grad` and the 2-bit model's forward
  pass alone both give the plain model's output."""
  want = _trained(name, "plain")[0]
  converted = _fns(name, "convert", 2)
  alone = _jit(converted.forward)(converted.params, converted.state, _batch(name), KEY)[0]
  for got in (_trained(name, "convert", 8)[0], alone):
    assert jnp.allclose(got, want, rtol=1e-5, atol=1e-5), float(jnp.abs(got - want).max())


@pytest.mark.parametrize("name", list(CASES))
def test_saved_bytes_cut_at_2_bits(name):
  batch = _batch(name)
  plain, converted = _fns(name, "plain"), _fns(name, "convert", 2)
  cut = saved_bytes(plain, batch) / saved_bytes(converted, batch)
  assert cut >= MIN_CUT[name], cut


GRAD_CASES = list(CASES)  # nnx: converted without rngs=, keys from jact.nnx.use_key


@pytest.mark.parametrize("name", GRAD_CASES)
def test_8bit_gradient_close(name):
  exact, approx = _trained(name, "plain")[1], _trained(name, "convert", 8)[1]
  err = float(jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact))
  assert err < GRAD_TOL, err
