"""Misuses of the public API get a clear error naming the argument, the value and the fix.

One table: each row calls jact the wrong way and lists the exception type
and the pieces its message must contain (the argument, the value given,
the fix). Rows only build objects or trace (nothing compiles), except the
few that run a small dense layer eagerly. Below the table, the cases that
were errors and are now supported (static arguments to `jact.checkpoint`).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jact
from jact import compressors as C

X = jnp.ones((8, 256))
W = jnp.eye(256) / 16
KEY = jax.random.key(0)


def _block(w, x):
  return jnp.tanh(x @ w)


def _grad(wrapped, key=KEY):
  """Traces the gradient of a wrapped `_block` (no compile)."""
  return jax.make_jaxpr(jax.grad(lambda w: wrapped(w, X, key=key).sum()))(W)


def _dense_loss(names):
  def loss(ws, x, key):
    h = x
    for w, name, k in zip(ws, names, jax.random.split(key, len(names))):
      h = jnp.tanh(jact.ops.dense(h, w, key=k, name=name))
    return jnp.sum(h**2)

  return loss


def _strict_plan_with_unknown_name():
  with jact.use_plan(jact.BitPlan({"nope.lhs": 2}), strict=True):
    jax.make_jaxpr(jax.grad(lambda w: jact.ops.dense(X, w, key=KEY, name="fc").sum()))(W)


# (id, call, exception type, substrings the message must hold: argument, value, fix)
CASES = [
  # jact.checkpoint / jact.compressed arguments
  (
    "checkpoint-policy-str",
    lambda: jact.checkpoint(_block, policy="dots", compress_argnums=(1,)),
    TypeError,
    ["policy", "'dots'", "jax.checkpoint_policies.dots_saveable"],
  ),
  (
    "compressed-policy-str",
    lambda: jact.compressed(_block, policy="nothing_saveable"),
    TypeError,
    ["policy", "'nothing_saveable'", "jax.checkpoint_policies.nothing_saveable"],
  ),
  (
    "compressed-bits-9",
    lambda: jact.compressed(_block, bits=9),
    ValueError,
    ["bits", "got 9", "Pick an integer width 1 to 8 or 16"],
  ),
  (
    "compressed-bits-str",
    lambda: jact.compressed(_block, bits="4"),
    ValueError,
    ["bits", "'4'", "Pick an integer width 1 to 8 or 16"],
  ),
  (
    "compressed-group-size",
    lambda: jact.compressed(_block, compressor=C.PerGroup(4, group_size=100)),
    ValueError,
    ["group_size", "100", "usual value is 256"],
  ),
  (
    "compressed-min-size",
    lambda: jact.compressed(_block, min_size=0),
    ValueError,
    ["min_size", "got 0", "min_size=1"],
  ),
  (
    "compressed-stochastic-str",
    lambda: jact.compressed(_block, compressor=C.PerGroup(4, stochastic="yes")),
    TypeError,
    ["stochastic", "'yes'", "True", "False"],
  ),
  (
    "compressed-name-empty",
    lambda: jact.compressed(_block, name=""),
    ValueError,
    ["name", "''", "name='block1'"],
  ),
  (
    "compressed-argnums-float",
    lambda: jact.compressed(_block, compress_argnums=1.0),
    ValueError,
    ["compress_argnums", "1.0", "compress_argnums=(1,)"],
  ),
  (
    "compressed-argnums-negative",
    lambda: jact.compressed(_block, compress_argnums=(-1,)),
    ValueError,
    ["compress_argnums", "-1", "compress_argnums=(1,)"],
  ),
  (
    "compressed-argnums-out-of-range",
    lambda: _grad(jact.compressed(_block, compress_argnums=5)),
    ValueError,
    ["compress_argnums=(5,)", "_block got 2 positional arguments", "positions below 2"],
  ),
  (
    "compressed-bits-and-compressor",
    lambda: jact.compressed(_block, bits=2, compressor=C.PerGroup(4)),
    ValueError,
    ["bits=2", "compressor=PerGroup", "Pass compressor= alone"],
  ),
  (
    "compressed-compressor-str",
    lambda: jact.compressed(_block, compressor="division"),
    TypeError,
    ["compressor=", "'division'", "jact.compressors.Division()"],
  ),
  (
    "compressed-not-callable",
    lambda: jact.compressed(3),
    TypeError,
    ["jact.compressed", "int", "takes a function"],
  ),
  (
    "compressed-no-key",
    lambda: _grad(jact.compressed(_block, bits=2), key=None),
    ValueError,
    ["key", "key=jax.random.key", "stochastic=False"],
  ),
  # keys
  (
    "key-batch",
    lambda: _grad(jact.compressed(_block), key=jax.random.split(KEY, 4)),
    ValueError,
    ["key=", "shape (4,)", "keys[i]", "jax.vmap"],
  ),
  (
    "key-batch-legacy",
    lambda: _grad(jact.compressed(_block), key=jax.random.split(jax.random.PRNGKey(0), 3)),
    ValueError,
    ["key=", "shape (3,)", "keys[i]"],
  ),
  (
    "key-int",
    lambda: _grad(jact.compressed(_block), key=0),
    TypeError,
    ["key", "got int", "key=jax.random.key(seed)"],
  ),
  (
    "key-float",
    lambda: _grad(jact.compressed(_block), key=jnp.ones(2)),
    TypeError,
    ["key", "float32", "key=jax.random.key(seed)"],
  ),
  (
    "checkpoint-key-batch",
    lambda: _grad(jact.checkpoint(_block, compress_argnums=(1,)), key=jax.random.split(KEY, 4)),
    ValueError,
    ["key=", "shape (4,)", "keys[i]"],
  ),
  # overrides
  (
    "overrides-width-12",
    lambda: jact.compressed(_block, overrides={"compressed.1": 12}),
    ValueError,
    ["overrides['compressed.1'] = 12", "(1, 2, 3, 4, 5, 6, 7, 8, 16)", "None to keep"],
  ),
  (
    "overrides-width-str",
    lambda: jact.compressed(_block, overrides={"compressed.1": "4"}),
    ValueError,
    ["overrides['compressed.1'] = '4'", "jact.compressors"],
  ),
  (
    "overrides-key-int",
    lambda: jact.compressed(_block, overrides={1: 4}),
    TypeError,
    ["overrides keys", "int 1", "'compressed.3'"],
  ),
  (
    "overrides-not-mapping",
    lambda: jact.compressed(_block, overrides=[("compressed.1", 4)]),
    TypeError,
    ["overrides", "list", "bits_for"],
  ),
  # compressors
  ("division-block-1", lambda: C.Division(block=1), ValueError, ["block", "block=1", "block=8"]),
  ("division-block-0", lambda: C.Division(block=0), ValueError, ["block", "got 0", "e.g. 8"]),
  (
    "division-rank-1",
    lambda: C.Division().compress(jnp.ones(16), jnp.uint32(0)),
    ValueError,
    ["Division", "(16,)", "PerGroup"],
  ),
  (
    "division-lfc-rank-2",
    lambda: C.Division(keep="lfc").compress(X, jnp.uint32(0)),
    ValueError,
    ["keep='lfc'", "(8, 256)", "keep='both'"],
  ),
  (
    "pergroup-bits-32",
    lambda: C.PerGroup(32),
    ValueError,
    ["bits", "got 32", "Pick an integer width 1 to 8 or 16"],
  ),
  ("fixpoint-bits-1", lambda: C.Fixpoint(1), ValueError, ["bits", "got 1", "use 2..16 bits"]),
  (
    "zerovalue-capacity",
    lambda: C.ZeroValue(C.Fixpoint(8), capacity=2.0),
    ValueError,
    ["capacity", "2.0", "expected density"],
  ),
  # packing and quantization
  (
    "quantize-int-dtype",
    lambda: jact.quantize(jnp.ones((4, 256), jnp.int32), KEY, bits=2),
    TypeError,
    ["int32", "x.astype(jnp.float32)"],
  ),
  (
    "dequantize-array",
    lambda: jact.dequantize(X),
    TypeError,
    ["jact.dequantize", "an array", "jact.quantize(x, key, bits=4)"],
  ),
  (
    "unpack-codes-array",
    lambda: jact.unpack_codes(X),
    TypeError,
    ["unpack_codes", "ArrayImpl", "jact.pack_codes(codes, bits)"],
  ),
  (
    "pack-codes-bits-0",
    lambda: jact.pack_codes(jnp.zeros((8, 256), jnp.uint8), 0),
    ValueError,
    ["bits", "got 0", "Pick an integer width 1 to 8 or 16"],
  ),
  # plans
  (
    "bitplan-width-12",
    lambda: jact.BitPlan({"a.lhs": 12}),
    ValueError,
    ["'a.lhs'", "got 12", "None or 32 keeps"],
  ),
  (
    "bitplan-size-negative",
    lambda: jact.BitPlan({"a.lhs": 2}, sizes={"a.lhs": -1}),
    ValueError,
    ["sizes['a.lhs']", "-1", "number of elements"],
  ),
  (
    "use-plan-dict",
    lambda: jact.use_plan({"a.lhs": 2}),
    TypeError,
    ["use_plan", "dict", "jact.BitPlan({name: bits"],
  ),
  (
    "use-plan-unknown-name",
    _strict_plan_with_unknown_name,
    ValueError,
    ["'nope.lhs'", "traced: 'fc.lhs'", "jact.residual_report"],
  ),
  ("planned-not-callable", lambda: jact.planned(3), TypeError, ["jact.planned", "int 3", "plan="]),
  # controller
  (
    "controller-loss",
    lambda: jact.Controller(3),
    TypeError,
    ["loss_fn", "int 3", "loss_fn(params, batch, key)"],
  ),
  (
    "controller-avg-bits-str",
    lambda: jact.Controller(_dense_loss(("a",)), avg_bits="2"),
    TypeError,
    ["avg_bits", "'2'", "a number"],
  ),
  (
    "controller-alert-negative",
    lambda: jact.Controller(_dense_loss(("a",)), alert_fraction=-1),
    ValueError,
    ["alert_fraction", "-1", "e.g. 0.5"],
  ),
  (
    "controller-adapt-interval",
    lambda: jact.Controller(_dense_loss(("a",)), adapt_interval=0),
    ValueError,
    ["adapt_interval", "got 0", "e.g. 50"],
  ),
  (
    "controller-allowed",
    lambda: jact.Controller(_dense_loss(("a",)), allowed=(9,)),
    ValueError,
    ["allowed", "(9,)", "1..8 or 16", "allowed=(1, 2, 4, 8)"],
  ),
  # reports, conversion, sharding
  (
    "residual-report-not-callable",
    lambda: jact.residual_report(3, X),
    TypeError,
    ["fn", "int 3", "jact.residual_report(fn, *args)"],
  ),
  (
    "compiled-memory-not-callable",
    lambda: jact.compiled_memory(X),
    TypeError,
    ["fn", "ArrayImpl", "jact.compiled_memory(fn, *args)"],
  ),
  (
    "conversion-report-not-callable",
    lambda: jact.conversion_report(3),
    TypeError,
    ["fn", "int 3", "model.apply(v, x)"],
  ),
  (
    "convert-function",
    lambda: jact.convert(_block),
    TypeError,
    ["jact.convert", "function", "jact.compressed(model_or_loss"],
  ),
  (
    "convert-linen-class",
    lambda: jact.convert(nn.Dense),
    TypeError,
    ["jact.convert", "builtins.type", "as an instance"],
  ),
  (
    "convert-bits-9",
    lambda: jact.convert(nn.Dense(4), bits=9),
    ValueError,
    ["bits", "got 9", "Pick an integer width 1 to 8 or 16"],
  ),
  (
    "sharded-batch-axis-int",
    lambda: jact.sharded_batch(3, jax.make_mesh((1,), ("data",))),
    ValueError,
    ["axes", "got 3", "mesh axis names"],
  ),
  (
    "save-compressed-prefix",
    lambda: jact.save_compressed(3),
    ValueError,
    ["prefixes", "got 3", "non-empty strings"],
  ),
  (
    "offload-dst-none",
    lambda: jact.offload_compressed(dst=None),
    ValueError,
    ["dst", "None", "'pinned_host'"],
  ),
]


@pytest.mark.parametrize("call,error,parts", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_misuse_gets_a_clear_error(call, error, parts):
  with pytest.raises(error) as caught:
    result = call()
    if hasattr(result, "__enter__"):  # a context manager checks its arguments on entry
      with result:
        pass
  message = str(caught.value)
  missing = [p for p in parts if p not in message]
  assert not missing, f"{missing} not in: {message}"
  assert "Traceback" not in message and not re.search(r"\bjaxlib\b", message)


def test_the_table_covers_each_known_misuse_once():
  ids = [c[0] for c in CASES]
  assert len(ids) == len(set(ids)) and len(ids) >= 40


# ----------------------------------------------------------------------------- controller restore


@pytest.fixture(name="saved_controller")
def _saved_controller(tmp_path):
  ctrl = jact.Controller(_dense_loss(("a", "b")))
  state = ctrl.init((W, W), X, KEY)
  ctrl.save(state, tmp_path / "ctrl")
  return ctrl, state, tmp_path


def _edited_copy(tmp_path, label, edit):
  path = tmp_path / label
  shutil.copytree(tmp_path / "ctrl", path)
  meta_file = os.path.join(path, "meta", "metadata")
  with open(meta_file) as f:
    meta = json.load(f)
  edit(meta)
  with open(meta_file, "w") as f:
    json.dump(meta, f)
  return path


def test_restore_with_like_none_names_like_and_the_fix(saved_controller):
  ctrl, _, tmp_path = saved_controller
  with pytest.raises(
    TypeError,
    match=r"like must be a ControllerState.*got NoneType None.*"
    r"like=controller\.init\(params, batch, key\)",
  ):
    ctrl.restore(tmp_path / "ctrl", None)


_EDITS = [
  (
    "names",
    lambda m: m.__setitem__("names", ["a.lhs", "z.lhs"]),
    r"the residual names \['a\.lhs', 'z\.lhs'\] are not those of its plan \['a\.lhs', 'b\.lhs'\]",
  ),
  ("names-type", lambda m: m.__setitem__("names", "a.lhs"), r"names='a\.lhs' is not a list"),
  ("step-negative", lambda m: m.__setitem__("step", -4), r"step=-4 is not a non-negative int"),
  ("step-str", lambda m: m.__setitem__("step", "x"), r"step='x' is not a non-negative int"),
  ("report", lambda m: m.__setitem__("report", [1]), r"report=\[1\] is not a mapping"),
  (
    "estimator",
    lambda m: m.__setitem__("estimator", "bogus"),
    r"estimator='bogus' is none of \('numeric', 'analytic', 'acgc'\)",
  ),
  (
    "plan-width",
    lambda m: m["plan"]["bits"].__setitem__("a.lhs", 12),
    r"the plan is not valid .*bits of 'a\.lhs'.*got 12",
  ),
]


@pytest.mark.parametrize("label,edit,shown", _EDITS, ids=[e[0] for e in _EDITS])
def test_restore_detects_hand_edited_metadata(saved_controller, label, edit, shown):
  ctrl, state, tmp_path = saved_controller
  path = _edited_copy(tmp_path, label, edit)
  with pytest.raises(
    ValueError,
    match=rf"jact\.Controller\.restore: {shown}.*edited or damaged"
    r".*Controller\.init",
  ):
    ctrl.restore(path, state)
  # The unedited checkpoint still restores.
  assert ctrl.restore(tmp_path / "ctrl", state).plan == state.plan


# ----------------------------------------------------------------------------- now supported


def _scaled(w, x, scale, act="tanh", transform=None):
  y = getattr(jnp, act)(x @ w) * scale
  return y if transform is None else transform(y)


@pytest.mark.parametrize(
  "wrap", [jact.checkpoint, jact.compressed], ids=["checkpoint", "compressed"]
)
def test_static_non_array_arguments_are_held_fixed_like_jact_compressed(wrap):
  """A Python number, a string and a function among the arguments: plain gradients at bits=None."""
  wrapped = wrap(_scaled, bits=None, compress_argnums=(1,))

  def loss(w, fn):
    return jnp.sum(fn(w, X, 3, act="sin", transform=jnp.cos) ** 2)

  got = jax.grad(loss)(W, lambda *a, **k: wrapped(*a, key=KEY, **k))
  want = jax.grad(loss)(W, _scaled)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
