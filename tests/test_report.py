"""Tests for jact._report against hand-computable residual and buffer sizes."""

import dataclasses
import doctest

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jact._report
from jact.ops._linear import dense
from jact._compiled_memory import CompiledMemory, compiled_memory
from jact._report import Residual, ResidualReport, format_bytes, residual_report


def test_doctests():
  result = doctest.testmod(jact._report, optionflags=doctest.ELLIPSIS)
  assert result.attempted >= 8 and result.failed == 0


def test_sin_saves_cos_of_input():
  x = jnp.ones((16, 100), jnp.float32)
  r = residual_report(lambda x: jnp.sin(x).sum(), x)
  assert len(r.residuals) == 1
  (res,) = r.residuals
  assert res.name is None and not res.is_argument
  assert res.shape == (16, 100) and res.dtype == jnp.float32
  assert res.bytes == x.nbytes == 16 * 100 * 4
  assert "cos" in res.source
  assert r.total_bytes == x.nbytes and r.argument_bytes == 0
  assert r.by_name()[None].bytes == x.nbytes


def test_bf16_residual_bytes_use_itemsize():
  x = jnp.ones((8, 64), jnp.bfloat16)
  r = residual_report(lambda x: jnp.sin(x).astype(jnp.float32).sum(), x)
  assert r.total_bytes == 8 * 64 * 2


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_dense_saves_documented_packed_bytes(bits):
  n, d, g = 8, 512, 256
  x, w = jnp.ones((n, d)), jnp.ones((d, 4))
  r = residual_report(lambda x, w: dense(x, w, key=jax.random.key(0), bits=bits).sum(), x, w)
  groups = r.by_name()
  assert set(groups) == {"dense.lhs"}
  lhs = groups["dense.lhs"]
  # Packed layout (jact.quantize docs): bits/8 bytes per value, bf16 minimum + bf16 scale per group.
  expected = n * d * bits // 8 + n * (d // g) * (2 + 2)
  assert lhs.bytes == expected
  assert len(lhs.pieces) == 3
  assert sorted(str(p.dtype) for p in lhs.pieces) == ["bfloat16", "bfloat16", "uint8"]
  # The weight is saved as it is (alive anyway) and flagged as an argument.
  assert r.total_bytes == expected
  assert r.argument_bytes == w.nbytes
  args = [p for p in r.residuals if p.is_argument]
  assert len(args) == 1 and args[0].source == "from the argument w" and args[0].name is None


def test_uncompressed_named_argument_is_flagged():
  x, w = jnp.ones((8, 512)), jnp.ones((512, 4))
  r = residual_report(lambda x, w: dense(x, w, bits=None).sum(), x, w)
  named = [p for p in r.residuals if p.name == "dense.lhs"]
  assert len(named) == 1 and named[0].is_argument and named[0].bytes == x.nbytes
  assert "the argument x" in named[0].source


def test_same_as_jax_saved_residuals_without_barriers():
  from jact._compat.testing import saved_residuals

  def f(params, x):
    h = checkpoint_name(jnp.tanh(x @ params["w"]), "h")
    return (jnp.sin(h) * params["b"]).sum() + jnp.float32(3.0) * (x * x).sum()

  args = ({"w": jnp.ones((16, 8)), "b": jnp.ones((8,))}, jnp.ones((4, 16)))
  ours = sorted((p.shape, str(p.dtype), p.source) for p in residual_report(f, *args).residuals)
  theirs = sorted((tuple(a.shape), str(a.dtype), s) for a, s in saved_residuals(f, *args))
  assert ours == theirs


def test_looks_through_barriers_and_jit():
  x = jnp.ones((4, 32))

  @jax.jit
  def inner(x):
    h = checkpoint_name(jnp.sin(x), "hidden")
    h, x2 = jax.lax.optimization_barrier((h, x))
    return h * x2

  r = residual_report(lambda x: inner(x).sum(), x)
  groups = r.by_name()
  # Saved: the named sin(x) (through the barrier), x itself (through the barrier), cos(x).
  assert set(groups) == {"hidden", None}
  assert groups["hidden"].bytes == x.nbytes and "cos" in groups[None].pieces[0].source
  assert r.argument_bytes == x.nbytes and r.total_bytes == 2 * x.nbytes


def test_arguments_excluded_from_total():
  x, y = jnp.ones((4, 32)), jnp.ones((4, 32))
  r = residual_report(lambda x, y: (x * y * jnp.exp(x)).sum(), x, y)
  assert r.argument_bytes == x.nbytes + y.nbytes
  computed = [p for p in r.residuals if not p.is_argument]
  assert r.total_bytes == sum(p.bytes for p in computed) > 0
  assert sum(g.bytes for g in r.by_name().values()) == r.total_bytes
  assert all(p.source.startswith("from the argument") for p in r.residuals if p.is_argument)


def test_named_residual_and_pytree_args_and_kwargs():
  x = jnp.ones((4, 32))

  def f(params, *, scale):
    h = checkpoint_name(jnp.sin(params["a"]) * scale, "hidden")
    return (h * h).sum()

  r = residual_report(f, {"a": x}, scale=jnp.float32(2.0))
  groups = r.by_name()
  assert "hidden" in groups and groups["hidden"].bytes == x.nbytes
  assert all(p.name == "hidden" for p in groups["hidden"].pieces)


def test_pytree_output_is_accepted():
  x = jnp.ones((4, 32))
  r = residual_report(lambda x: {"s": jnp.sin(x), "c": jnp.exp(x)}, x)
  # sin' = cos (one array); exp' = exp(x) itself (one array).
  assert r.total_bytes == 2 * x.nbytes


def test_shape_dtype_structs_need_no_data():
  s = jax.ShapeDtypeStruct((2**14, 2**14), jnp.float32)  # 1 GiB, only traced
  r = residual_report(lambda x: jnp.sin(x).sum(), s)
  assert r.total_bytes == 2**30


def test_str_and_print(capsys):
  x, w = jnp.ones((8, 512)), jnp.ones((512, 4))
  r = residual_report(lambda x, w: jnp.tanh(dense(x, w, key=jax.random.key(0), bits=2)).sum(), x, w)
  text = str(r)
  assert "dense.lhs" in text and "(argument)" in text and "KiB" in text
  assert format_bytes(r.total_bytes) in text and format_bytes(r.argument_bytes) in text
  assert "/work/" not in text  # directories stripped from sources in the table
  r.print()
  assert capsys.readouterr().out.strip() == text.strip()


def test_format_bytes():
  assert format_bytes(0) == "0 B"
  assert format_bytes(1023) == "1023 B"
  assert format_bytes(1024) == "1.00 KiB"
  assert format_bytes(1536) == "1.50 KiB"
  assert format_bytes(64 * 2**20) == "64.00 MiB"
  assert format_bytes(5 * 2**40) == "5.00 TiB"
  assert format_bytes(2**52) == "4096.00 TiB"


def test_reports_are_frozen():
  r = ResidualReport(())
  assert r.total_bytes == 0 and r.argument_bytes == 0 and r.by_name() == {}
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.residuals = ()
  with pytest.raises(dataclasses.FrozenInstanceError):
    Residual(None, (), jnp.float32, 4, "x", False).bytes = 8
  with pytest.raises(dataclasses.FrozenInstanceError):
    CompiledMemory(0, 0, 0, 0, 0).temp_bytes = 1


def test_compiled_memory_output_and_argument_bytes():
  x = jnp.ones((256, 64), jnp.float32)
  m = compiled_memory(lambda x: jnp.sin(x) * 2, x)
  assert isinstance(m, CompiledMemory)
  assert m.argument_bytes == x.nbytes
  assert m.output_bytes == x.nbytes
  # A tuple output also counts XLA's tuple index table (one pointer per element).
  m = compiled_memory(lambda x: (jnp.sin(x) * 2, x.sum(1)), x)
  assert x.nbytes + 256 * 4 <= m.output_bytes <= x.nbytes + 256 * 4 + 8 * 2
  assert m.temp_bytes >= 0 and m.alias_bytes == 0 and m.generated_code_bytes >= 0
  text = str(m)
  for word in ("temp", "arguments", "outputs", "aliased", "code"):
    assert word in text
  assert format_bytes(m.output_bytes) in text


def test_compiled_memory_static_argnums_and_kwargs():
  s = jax.ShapeDtypeStruct((128, 32), jnp.float32)
  m = compiled_memory(lambda x, n, *, y: jnp.tile(x + y, (n, 1)), s, 3, static_argnums=1, y=s)
  assert m.output_bytes == 3 * 128 * 32 * 4
  assert m.argument_bytes == 2 * 128 * 32 * 4


def test_compiled_memory_does_not_allocate():
  # 64 GiB of arguments: far above this machine's memory, so only a compile-only path passes.
  big = jax.ShapeDtypeStruct((2**17, 2**17), jnp.float32)
  before = len(jax.live_arrays())
  m = compiled_memory(lambda x: x.max(0), big)
  assert m.argument_bytes == 2**36 and m.output_bytes == 2**17 * 4
  assert len(jax.live_arrays()) == before


def test_compiled_memory_temp_sees_scratch_buffers():
  # A matmul followed by a reduction that cannot fuse into it keeps the product as scratch.
  a = jax.ShapeDtypeStruct((512, 512), jnp.float32)
  m = compiled_memory(lambda a, b: jnp.sort(a @ b, axis=0)[0], a, a)
  assert m.output_bytes == 512 * 4
  assert m.temp_bytes >= 512 * 512 * 4


def test_residuals_inside_shard_map_keep_their_names_and_arguments():
  """A shard_map inside fn (one device here; 8 in tests/test_distributed.py):
  the body's residuals keep their names and the replicated weight stays an
  argument, as without the shard_map."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  x, w = jnp.ones((8, 512)), jnp.ones((512, 512))

  def body(w, x):
    h = jact.ops.relu(jact.ops.dense(x, w, key=jax.random.key(0), bits=2))
    return jax.lax.psum(jnp.sum(h), "data")

  mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
  inside = jact.residual_report(mapped, w, x)
  plain = jact.residual_report(
    lambda w, x: jnp.sum(jact.ops.relu(jact.ops.dense(x, w, key=jax.random.key(0), bits=2))), w, x
  )
  rows = lambda r: sorted((str(q.name), q.shape, q.bytes, q.is_argument) for q in r.residuals)  # noqa: E731
  assert rows(inside) == rows(plain)
  assert set(inside.by_name()) >= {"dense.lhs", "relu.mask"}
