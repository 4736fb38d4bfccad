"""`conversion_report` of an nnx model: the same byte columns as the linen
report (each layer call's plain and saved bytes), measured the same way."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jact
from jact._convert import ConversionWarning


class LinenNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm()(nn.Dense(64)(x))
    x = nn.LayerNorm(reduction_axes=(-2, -1))(x)  # no twin: left plain
    x = nn.DenseGeneral((4, 8))(nn.relu(x))  # no twin: the engine
    return nn.Dense(8)(x.reshape(*x.shape[:-2], 32))


class NnxNet(nnx.Module):
  """`LinenNet` written for nnx."""

  def __init__(self, rngs):
    self.fc = nnx.Linear(32, 64, rngs=rngs)
    self.norm = nnx.LayerNorm(64, rngs=rngs)
    self.odd = nnx.LayerNorm(64, reduction_axes=(-2, -1), rngs=rngs)
    self.gen = nnx.LinearGeneral(64, (4, 8), rngs=rngs)
    self.out = nnx.Linear(32, 8, rngs=rngs)
    self.unused = nnx.LayerNorm(8, reduction_axes=(-2, -1), rngs=rngs)

  def __call__(self, x):
    x = self.gen(nnx.relu(self.odd(self.norm(self.fc(x)))))
    return self.out(x.reshape(*x.shape[:-2], 32))


X = jnp.ones((4, 16, 32))


def _reports(functions: bool):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", ConversionWarning)
    linen = jact.convert(LinenNet(), bits=2, functions=functions)
    variables = LinenNet().init(jax.random.key(0), X)
    key = jax.random.key(1)
    linen_report = jact.conversion_report(
      lambda v, x: linen.apply(v, x, rngs={"jact": key}).sum(), variables, X
    )
    model = jact.convert(NnxNet(nnx.Rngs(0)), bits=2, rngs=nnx.Rngs(jact=1), functions=functions)
    nnx_report = jact.conversion_report(nnx.jit(lambda m, x: m(x).sum()), model, X)
  return linen_report, nnx_report, model


@pytest.mark.parametrize("functions", [True, False])
def test_nnx_report_has_the_linen_reports_bytes(functions):
  linen_report, nnx_report, model = _reports(functions)
  columns = lambda report: [(r.how, r.plain_bytes, r.saved_bytes) for r in report.rows]
  called = [r for r in nnx_report.rows if r.path != "unused"]
  assert columns(linen_report) == [(r.how, r.plain_bytes, r.saved_bytes) for r in called]
  assert nnx_report.total_bytes == linen_report.total_bytes
  rows = {r.path: r for r in nnx_report.rows}
  for name in ("fc", "norm", "gen", "out"):  # 2 bits: at most a tenth of the plain bytes
    assert 0 < rows[name].saved_bytes * 10 < rows[name].plain_bytes, str(nnx_report)
  assert rows["odd"].plain_bytes > 0
  assert rows["unused"].plain_bytes is None  # never called: nothing measured
  (line,) = [line for line in str(nnx_report).splitlines() if line.startswith("gen ")]
  assert line.split()[3:5] == [f"{rows['gen'].plain_bytes:,}", f"{rows['gen'].saved_bytes:,}"]
  # the plain layers are the model's own again
  assert type(model.odd) is nnx.LayerNorm and "_jact_note" not in vars(model.odd)


def test_nnx_report_warns_about_a_plain_layer_with_its_share():
  model = jact.convert(NnxNet(nnx.Rngs(0)), bits=2, rngs=nnx.Rngs(jact=1), functions=False)
  with pytest.warns(ConversionWarning, match=r"odd \(flax LayerNorm\) runs uncompressed.*\d+% of"):
    report = jact.conversion_report(lambda m, x: m(x).sum(), model, X)
  (odd, _) = report.plain()
  assert odd.path == "odd" and 0 < odd.saved_bytes <= report.total_bytes
