"""Does the backward pass's ordering matter? The planned stacks and a ResNet-18 compiled with the
shipped scheduling rule and three weaker ones (`ORDERING_MODES`), for
`experiments.gpu.gpu_measures`."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from experiments.gpu import measure_kit as kit
from experiments.lib import blocks, models

__all__ = ["ORDERING_MODES", "measure_ordering", "ordering_ties"]


ORDERING_MODES = ("shipped", "ties", "no_ties", "no_ties_no_barriers")


def _ties_everywhere(rule, values, anchors):
  return list(rule(list(values), list(anchors))) if values else list(values)


def _no_ties(rule, values, anchors):
  del rule, anchors
  return list(values)


@contextlib.contextmanager
def ordering_ties(mode: str):
  """Within the block, jact's XLA:CPU ordering ties (`jact._core.xla_cpu.on_cpu`)
  are as shipped (in programs for the CPU only: "shipped"), traced into every
  program whatever its platform, as before they were CPU-only ("ties"),
  left out everywhere ("no_ties"), also without optimization barriers
  ("no_ties_no_barriers"). jax's caches are cleared on entry and exit so no
  trace made in another mode is reused."""
  if mode not in ORDERING_MODES:
    raise ValueError(f"mode must be one of {ORDERING_MODES}, got {mode!r}")
  from jact._core import xla_cpu
  from jact._engine import scheduling

  patches = []
  if mode == "ties":
    patches.append((xla_cpu, "on_cpu", _ties_everywhere))
  elif mode != "shipped":
    patches.append((xla_cpu, "on_cpu", _no_ties))
  if mode == "no_ties_no_barriers":
    patches.append((scheduling, "_optimization_barrier", lambda tree: tree))
  saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
  jax.clear_caches()
  try:
    for m, name, value in patches:
      setattr(m, name, value)
    yield
  finally:
    for m, name, value in saved:
      setattr(m, name, value)
    jax.clear_caches()


def _stack_workloads(small: bool) -> dict[str, tuple]:
  """name -> (make_loss, params, x), make_loss() -> loss(params, x, key) built
  afresh in each mode: memory_scaling's stacks plain, with jact.ops and with
  jact.compressed at 2 bits, and a CIFAR ResNet-18 (small: the ReLU CNN stack
  plain and with jact.ops only)."""
  depth = 2 if small else 8
  shapes = {
    "relu_cnn": (2, 8, 8, 8) if small else (32, 32, 32, 64),
    "transformer": (2, 16, 32) if small else (16, 256, 256),
  }
  kwargs = {
    "relu_cnn": dict(channels=8) if small else {},
    "transformer": dict(dim=32, mlp=64) if small else {},
  }
  out = {}
  names = ["relu_cnn"] if small else list(blocks.BLOCKS)
  variants = [("plain", None, "ops"), ("ops 2 bit", 2, "ops")] + (
    [] if small else [("compressed 2 bit", 2, "compressed")]
  )
  for name in names:
    block, make_params, _ = blocks.BLOCKS[name]
    params = [
      kit.random_params(make_params(**kwargs[name]), jax.random.key(i)) for i in range(depth)
    ]
    x = jax.random.normal(jax.random.key(5), shapes[name], jnp.float32)
    for label, bits, mode in ((f"{name} x{depth} {v}", b, m) for v, b, m in variants):
      make = lambda block=block, bits=bits, mode=mode: kit.stack_loss(
        blocks.wrap_block(block, bits, mode)
      )
      out[label] = (make, params, x)
  if not small:
    for label, bits in (
      ("ResNet-18 CIFAR b128 plain", None),
      ("ResNet-18 CIFAR b128 jact 2 bit", 2),
    ):
      out[label] = _resnet_workload(bits)
  return out


def _resnet_workload(bits):
  x = jax.random.normal(jax.random.key(0), (128, 32, 32, 3), jnp.float32)
  y = jnp.arange(128, dtype=jnp.int32) % 10
  init_model = models.ResNet18(num_classes=10, stem="cifar", layers=models.plain_layers())
  variables = init_model.init(jax.random.key(0), x[:1], train=False)

  def make():
    layers = models.plain_layers() if bits is None else models.jact_layers(bits)
    model = models.ResNet18(num_classes=10, stem="cifar", layers=layers)

    def loss(params, x, key):
      logits, _ = model.apply(
        {**variables, "params": params}, x, train=True, rngs={"jact": key}, mutable=["batch_stats"]
      )
      return jnp.mean(
        jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0]
      )

    return loss

  return make, variables["params"], x


def measure_ordering(small: bool, reps: int, modes=ORDERING_MODES, workloads=None) -> list[dict]:
  rows = []
  for name, (make_loss, params, x) in _stack_workloads(small).items():
    if workloads and not any(w in name for w in workloads):
      continue
    for mode in ("shipped",) if "plain" in name else modes:
      with ordering_ties(mode):
        grad = jax.grad(make_loss())  # a fresh function: traced in this mode
        row = {
          "workload": name,
          "mode": mode,
          **kit.compile_and_time(grad, (params, x, jax.random.key(1)), reps),
        }
      rows.append(row)
      print(
        f"   {name} [{mode}]: "
        + ", ".join(f"{k} {row[k]}" for k in ("temp_bytes", "ms", "error") if k in row),
        flush=True,
      )
  for r in rows:
    base = next(b for b in rows if b["workload"] == r["workload"] and b["mode"] == "shipped")
    if "error" not in r and "error" not in base:
      r["temp_vs_shipped"] = r["temp_bytes"] / base["temp_bytes"]
      r["time_vs_shipped"] = r["ms"] / base["ms"]
  kit.print_rows(
    rows, ("workload", "mode", "temp_bytes", "temp_vs_shipped", "ms", "time_vs_shipped")
  )
  return rows
