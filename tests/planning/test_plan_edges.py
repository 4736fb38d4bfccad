"""Edge cases of bit plans, plan application and controller checkpoints.

Each test pins a case that used to be silently wrong or to fail with an
unclear error: restoring a controller into a model with other residuals,
plan and `overrides` entries naming no residual (typos), non-integer plan
sizes, the messages of bad plans and damaged checkpoints, and a plan
leaking into (or missing from) other threads, asyncio tasks and copied
contexts. Models are one or two narrow dense layers; plan checks only
trace (no compile).
"""

import asyncio
import contextvars
import os
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import pytest

import jact

X = jax.random.normal(jax.random.key(0), (8, 256))
KEY = jax.random.key(1)


def _loss(names):
  """A stack of tanh(dense) layers whose residuals are `f"{name}.lhs"`."""

  def loss(ws, x, key):
    h = x
    for w, name, k in zip(ws, names, jax.random.split(key, len(names))):
      h = jnp.tanh(jact.ops.dense(h, w, key=k, name=name))
    return jnp.sum(h**2)

  return loss


def _weights(n):
  return tuple(jnp.full((256, 256), 1 / 16) for _ in range(n))


def _saved(tmp_path, names=("a", "b")):
  """A controller over layers `names`, its init state saved at tmp_path/ctrl."""
  ctrl = jact.Controller(_loss(names))
  state = ctrl.init(_weights(len(names)), X, KEY)
  ctrl.save(state, tmp_path / "ctrl")
  return ctrl, state, tmp_path / "ctrl"


def _trace(fn, *args):
  """Traces `fn`'s gradient only (no compile), recording jact warnings."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.make_jaxpr(jax.grad(fn))(*args)
  return [w for w in caught if "jact" in str(w.message)]


# ----------------------------------------------------------------------------- 1: restore by name


def test_restore_into_model_with_renamed_residuals_raises(tmp_path):
  ctrl, state, path = _saved(tmp_path, names=("a", "b"))
  renamed = jact.Controller(_loss(("p", "q")))
  like = renamed.init(_weights(2), X, KEY)  # same count and shapes, other names
  with pytest.raises(ValueError, match=r"jact\.Controller\.restore.*names differ") as e:
    renamed.restore(path, like)
  assert "['a.lhs', 'b.lhs']" in str(e.value) and "['p.lhs', 'q.lhs']" in str(e.value)
  same = ctrl.restore(path, ctrl.init(_weights(2), X, KEY))  # the same model still restores
  assert same.plan == state.plan and same.estimates.names == ("a.lhs", "b.lhs")


def test_restore_into_model_with_resized_residuals_raises(tmp_path):
  ctrl, _, path = _saved(tmp_path, names=("a", "b"))
  like = ctrl.init(_weights(2), X[:4], KEY)  # same names, half the values each
  with pytest.raises(ValueError, match=r"jact\.Controller\.restore.*other sizes.*2048.*1024"):
    ctrl.restore(path, like)


# ----------------------------------------------------------------------------- 2: unknown names


def test_plan_typo_warns_once_with_closest_names():
  plan = jact.BitPlan({"fc.lsh": 2, "fc2.lhs": 4}, budgets={"fx.lhs": 2.0})
  loss = _loss(("fc",))
  caught = _trace(lambda w: jact.planned(loss)(w, X, KEY, plan=plan), _weights(1))
  assert len(caught) == 1, [str(w.message) for w in caught]  # one report per plan block
  message = str(caught[0].message)
  assert issubclass(caught[0].category, jact.UnknownResidualWarning)
  for unknown in ("'fc.lsh' (closest: 'fc.lhs'", "'fc2.lhs' (closest: 'fc.lhs'", "'fx.lhs'"):
    assert unknown in message, message
  assert "strict=True" in message


def test_plan_typo_raises_when_strict():
  loss = _loss(("fc",))
  plan = jact.BitPlan({"fc.lsh": 2})
  with pytest.raises(ValueError, match=r"jact: .*'fc\.lsh' \(closest: 'fc\.lhs'\)"):
    jax.make_jaxpr(jax.grad(lambda w: jact.planned(loss, strict=True)(w, X, KEY, plan=plan)))(
      _weights(1)
    )

  def step(w):
    with jact.use_plan(plan, strict=True):
      return loss(w, X, KEY)

  with pytest.raises(ValueError, match="fc.lsh"):
    jax.make_jaxpr(jax.grad(step))(_weights(1))


def test_correct_plans_give_no_warning():
  loss = _loss(("fc", "out"))
  kept = lambda w, x, key: jnp.sum(jact.ops.dense(x, w[0], key=key, bits=None, name="kept"))

  def nested(w):  # the outer plan's entry is traced inside an inner plan's block
    with jact.use_plan(jact.BitPlan({"out.lhs": 8, "fc.lhs": 4})):
      with jact.use_plan(jact.BitPlan({"fc.lhs": 2})):
        return loss(w, X, KEY)

  def uncompressed_call_site(w):  # a residual the call site keeps is still a residual
    with jact.use_plan(jact.BitPlan({"kept.lhs": 2})):
      return kept(w, X, KEY)

  assert not _trace(nested, _weights(2))
  assert not _trace(uncompressed_call_site, _weights(1))
  assert not _trace(
    lambda w: jact.planned(loss)(
      w, X, KEY, plan=jact.BitPlan({"fc.lhs": 2}, budgets={"out.lhs": 2.0})
    ),
    _weights(2),
  )


def test_override_typo_warns_and_raises_when_strict():
  f = lambda w, x: jnp.tanh(x @ w).sum()
  w = jnp.eye(256)
  names = [
    n
    for n in jact.residual_report(
      lambda w: jact.compressed(f, bits=2, name="t")(w, X, key=KEY), w
    ).by_name()
    if n
  ]
  assert names
  good = jact.compressed(f, bits=2, name="t", overrides={names[0]: 4})
  bad = jact.compressed(f, bits=2, name="t", overrides={names[0] + "9": 4})
  assert not _trace(lambda w: good(w, X, key=KEY), w)
  caught = _trace(lambda w: bad(w, X, key=KEY), w)
  assert len(caught) == 1 and issubclass(caught[0].category, jact.UnknownResidualWarning)
  assert f"{names[0] + '9'!r} (closest: {names[0]!r}" in str(caught[0].message)

  def strict(w):
    with jact.use_plan(None, strict=True):
      return bad(w, X, key=KEY)

  with pytest.raises(ValueError, match=r"jact: the overrides mapping of jact\.compressed"):
    jax.make_jaxpr(jax.grad(strict))(w)


# ----------------------------------------------------------------------------- 3: integer sizes


def test_from_json_rejects_non_integer_sizes():
  with pytest.raises(ValueError, match=r"jact\.BitPlan: sizes\['a'\] must be a positive integer"):
    jact.BitPlan.from_json('{"sizes": {"a": 2.7}}')
  for bad in ('"3"', "true", "0"):
    with pytest.raises(ValueError, match="positive integer"):
      jact.BitPlan.from_json('{"sizes": {"a": %s}}' % bad)
  assert dict(jact.BitPlan.from_json('{"sizes": {"a": 3.0}}').sizes) == {"a": 3}


# ----------------------------------------------------------------------------- 4: clear errors


def test_truncated_controller_checkpoint_names_jact_and_the_fix(tmp_path):
  ctrl, state, path = _saved(tmp_path, names=("a",))
  meta = os.path.join(path, "meta", "metadata")
  with open(meta) as f:
    text = f.read()
  with open(meta, "w") as f:
    f.write(text[: len(text) // 2])
  with pytest.raises(ValueError, match=r"jact\.Controller\.restore.*cut off.*Controller\.init"):
    ctrl.restore(path, state)


def test_restore_with_other_residual_count_names_jact_and_the_fix(tmp_path):
  _, _, path = _saved(tmp_path, names=("a", "b"))
  bigger = jact.Controller(_loss(("a", "b", "c")))
  with pytest.raises(
    ValueError,
    match=r"jact\.Controller\.restore.*only in the model: \['c\.lhs'\]"
    r".*Controller\.init",
  ):
    bigger.restore(path, bigger.init(_weights(3), X, KEY))


def test_save_and_restore_without_orbax_name_the_package_to_install(tmp_path, monkeypatch):
  ctrl, state, path = _saved(tmp_path, names=("a",))
  monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # `import orbax.checkpoint` fails
  fix = r"jact\.Controller\.save/restore.*orbax-checkpoint.*pip install orbax-checkpoint"
  with pytest.raises(ImportError, match=fix):
    ctrl.save(state, tmp_path / "again")
  with pytest.raises(ImportError, match=fix):
    ctrl.restore(path, state)


@pytest.mark.parametrize("allowed", [(), (32,), (9,)])
def test_controller_rejects_allowed_without_a_compressed_width(allowed):
  with pytest.raises(ValueError, match=r"jact\.Controller: allowed .* allowed=\(1, 2, 4, 8\)"):
    jact.Controller(_loss(("fc",)), allowed=allowed)


def test_bitplan_errors_name_jact_and_the_fix():
  with pytest.raises(ValueError, match=r"jact\.BitPlan\.nbytes: .* 'a'.*sizes="):
    jact.BitPlan({"a": 2}).nbytes("a")
  with pytest.raises(
    ValueError, match=r"jact\.BitPlan\.from_dict / from_json .* got list \[1, 2\]"
  ):
    jact.BitPlan.from_json("[1, 2]")
  with pytest.raises(ValueError, match=r"jact\.BitPlan\.from_json: the text is not valid JSON"):
    jact.BitPlan.from_json('{"bits": ')


# --------------------------------------------------------------------------- 5: execution contexts


_ONE_BIT = jact.BitPlan({"fc.lhs": 1})


def _fc_bytes():
  """Stored bytes of residual fc.lhs (call site: 8 bits) under the plan active here."""
  loss = lambda w: jnp.sum(jact.ops.dense(X, w, key=KEY, bits=8, name="fc"))
  return jact.residual_report(loss, _weights(1)[0]).by_name()["fc.lhs"].bytes


def _plan_bytes(plan):
  def loss(w):
    with jact.use_plan(plan):
      return jnp.sum(jact.ops.dense(X, w, key=KEY, bits=8, name="fc"))

  return jact.residual_report(loss, _weights(1)[0]).by_name()["fc.lhs"].bytes


def test_plan_entered_in_one_thread_is_not_seen_in_another():
  call_site, one_bit = _plan_bytes(None), _plan_bytes(_ONE_BIT)
  assert one_bit < call_site
  entered, done, inside = threading.Event(), threading.Event(), []

  def hold_plan():
    with jact.use_plan(_ONE_BIT):
      inside.append(_fc_bytes())
      entered.set()
      done.wait(timeout=60)

  thread = threading.Thread(target=hold_plan)
  thread.start()
  try:
    assert entered.wait(timeout=60), "the thread did not enter its plan"
    outside = _fc_bytes()  # traced here while the other thread's block is open
  finally:
    done.set()
    thread.join(timeout=60)
  assert inside == [one_bit] and outside == call_site


def test_copied_context_keeps_the_plan_active_when_copied():
  two_bits = jact.BitPlan({"fc.lhs": 2})
  call_site, one_bit, two_bit = _plan_bytes(None), _plan_bytes(_ONE_BIT), _plan_bytes(two_bits)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jact.UnknownResidualWarning)
    with jact.use_plan(_ONE_BIT):
      assert _fc_bytes() == one_bit
      copied = contextvars.copy_context()
    assert _fc_bytes() == call_site  # the block has ended here ...
    assert copied.run(_fc_bytes) == one_bit  # ... but not in the copy made inside it
    with jact.use_plan(two_bits):  # a later block applies here but does not reach the copy
      assert _fc_bytes() == two_bit and copied.run(_fc_bytes) == one_bit


def test_interleaved_asyncio_tasks_each_see_their_own_plan():
  plans = {"a": _ONE_BIT, "b": jact.BitPlan({"fc.lhs": 4})}
  expected = {k: _plan_bytes(p) for k, p in plans.items()}
  assert expected["a"] != expected["b"]

  async def main():
    b_entered, a_traced = asyncio.Event(), asyncio.Event()

    async def task_a():
      with jact.use_plan(plans["a"]):
        await b_entered.wait()
        traced = _fc_bytes()  # while b's block, entered later, is open
        a_traced.set()
        return traced

    async def task_b():
      with jact.use_plan(plans["b"]):
        b_entered.set()
        await a_traced.wait()
        return _fc_bytes()  # after a's block, entered first, has ended

    return dict(zip(plans, await asyncio.gather(task_a(), task_b())))

  assert asyncio.run(main()) == expected
  assert _fc_bytes() == _plan_bytes(None)
