"""Small nnx language models written the ordinary way, for measuring compressed gradients on
selective-scan (state-space) layers against attention: `SSMLM`, a Mamba2-like model (RMSNorm,
in-projection, depthwise causal convolution, SiLU, a per-head selective scan, SiLU gate,
out-projection), and `AttentionLM`, a pre-norm transformer (RMSNorm, causal attention, SwiGLU) of
the same width and depth. Both take character ids (`fit_subjects.shakespeare`) and return logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Config", "SSMLM", "AttentionLM", "selective_scan", "chunked_scan"]


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 65
  width: int = 64
  depth: int = 2
  state: int = 16  # SSM state size per head
  head: int = 16  # channels per SSM head / attention head
  expand: int = 2  # SSM inner width = expand * width
  conv: int = 4  # causal convolution width
  chunk: int = 16  # chunk length of `chunked_scan`
  scan: str = "associative"  # "associative" or "chunked"


def selective_scan(x, dt, a, b, c):
  """h_t = exp(dt_t a) h_{t-1} + dt_t b_t x_t, y_t = c_t . h_t by `jax.lax.associative_scan`.

  x: (batch, time, heads, head), dt: (batch, time, heads), a: (heads,), b, c: (batch, time, state).
  """
  decay = jnp.exp(dt * a)[..., None, None]  # (batch, time, heads, 1, 1)
  inputs = (dt[..., None] * x)[..., None] * b[:, :, None, None, :]  # (b, t, h, p, n)

  def combine(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]

  _, states = jax.lax.associative_scan(combine, (decay, inputs), axis=1)
  return jnp.einsum("bthpn,btn->bthp", states, c)


def _segment_sums(log_decay):
  """(..., t) -> (..., t, t): entry [i, j] sums log_decay over (j, i], -inf above the diagonal."""
  t = log_decay.shape[-1]
  totals = jnp.cumsum(log_decay, axis=-1)
  sums = totals[..., :, None] - totals[..., None, :]
  return jnp.where(jnp.tril(jnp.ones((t, t), bool)), sums, -jnp.inf)


def chunked_scan(x, dt, a, b, c, chunk):
  """The same recurrence as `selective_scan` in Mamba2's chunked form: exact inside each chunk by
  a masked decay matrix, chunk states carried by a short recurrence over chunks."""
  bsz, t, heads, p = x.shape
  k = t // chunk
  xs = (x * dt[..., None]).reshape(bsz, k, chunk, heads, p)
  log_decay = (dt * a).reshape(bsz, k, chunk, heads).transpose(0, 3, 1, 2)  # (b, h, k, l)
  bs, cs = b.reshape(bsz, k, chunk, -1), c.reshape(bsz, k, chunk, -1)
  cum = jnp.cumsum(log_decay, axis=-1)
  inner = jnp.exp(_segment_sums(log_decay))  # (b, h, k, l, l)
  y_diag = jnp.einsum("bkln,bksn,bhkls,bkshp->bklhp", cs, bs, inner, xs)
  to_end = jnp.exp(cum[..., -1:] - cum)  # (b, h, k, l)
  states = jnp.einsum("bkln,bhkl,bklhp->bkhpn", bs, to_end, xs)
  states = jnp.concatenate([jnp.zeros_like(states[:, :1]), states], axis=1)
  chunk_decay = jnp.exp(_segment_sums(jnp.pad(cum[..., -1], ((0, 0), (0, 0), (1, 0)))))
  states = jnp.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]
  y_off = jnp.einsum("bkln,bkhpn,bhkl->bklhp", cs, states, jnp.exp(cum))
  return (y_diag + y_off).reshape(bsz, t, heads, p)


class SSMBlock(nnx.Module):
  """A Mamba2-like mixer with a residual connection."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.cfg = cfg
    inner = cfg.expand * cfg.width
    heads = inner // cfg.head
    self.norm = nnx.RMSNorm(cfg.width, rngs=rngs)
    self.in_proj = nnx.Linear(
      cfg.width, 2 * inner + 2 * cfg.state + heads, use_bias=False, rngs=rngs
    )
    conv_width = inner + 2 * cfg.state
    self.conv = nnx.Conv(
      conv_width,
      conv_width,
      (cfg.conv,),
      feature_group_count=conv_width,
      padding=[(cfg.conv - 1, 0)],
      rngs=rngs,
    )
    self.dt_bias = nnx.Param(jnp.log(jnp.expm1(jnp.linspace(1e-3, 1e-1, heads))))
    self.a_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, heads)))
    self.d = nnx.Param(jnp.ones(heads))
    self.out_norm = nnx.RMSNorm(inner, rngs=rngs)
    self.out_proj = nnx.Linear(inner, cfg.width, use_bias=False, rngs=rngs)

  def __call__(self, u):
    cfg = self.cfg
    inner = cfg.expand * cfg.width
    heads = inner // cfg.head
    z, xbc, dt = jnp.split(self.in_proj(self.norm(u)), [inner, 2 * inner + 2 * cfg.state], axis=-1)
    xbc = nnx.silu(self.conv(xbc))
    x, b, c = jnp.split(xbc, [inner, inner + cfg.state], axis=-1)
    dt = jax.nn.softplus(dt + self.dt_bias[...])
    a = -jnp.exp(self.a_log[...])
    x = x.reshape(*x.shape[:2], heads, cfg.head)
    if cfg.scan == "chunked":
      y = chunked_scan(x, dt, a, b, c, cfg.chunk)
    else:
      y = selective_scan(x, dt, a, b, c)
    y = (y + self.d[...][:, None] * x).reshape(*u.shape[:2], inner)
    return u + self.out_proj(self.out_norm(y * nnx.silu(z)))


class AttentionBlock(nnx.Module):
  """A pre-norm causal attention block with a SwiGLU MLP."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.cfg = cfg
    w = cfg.width
    self.norm1 = nnx.RMSNorm(w, rngs=rngs)
    self.qkv = nnx.Linear(w, 3 * w, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(w, w, use_bias=False, rngs=rngs)
    self.norm2 = nnx.RMSNorm(w, rngs=rngs)
    self.gate_up = nnx.Linear(w, 2 * cfg.expand * w, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(cfg.expand * w, w, use_bias=False, rngs=rngs)

  def __call__(self, u):
    b, t, w = u.shape
    heads = w // self.cfg.head
    q, k, v = jnp.split(self.qkv(self.norm1(u)).reshape(b, t, 3 * heads, self.cfg.head), 3, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.cfg.head).astype(u.dtype)
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v).reshape(b, t, w)
    u = u + self.out(mixed)
    gate, up = jnp.split(self.gate_up(self.norm2(u)), 2, axis=-1)
    return u + self.down(nnx.silu(gate) * up)


class _LM(nnx.Module):
  block = None

  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
    self.blocks = nnx.List([type(self).block(cfg, rngs) for _ in range(cfg.depth)])
    self.norm = nnx.RMSNorm(cfg.width, rngs=rngs)
    self.head = nnx.Linear(cfg.width, cfg.vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    for block in self.blocks:
      h = block(h)
    return self.head(self.norm(h))


class SSMLM(_LM):
  """Embedding, `Config.depth` Mamba2-like blocks, RMSNorm, LM head."""

  block = SSMBlock


class AttentionLM(_LM):
  """Embedding, `Config.depth` attention + SwiGLU blocks, RMSNorm, LM head."""

  block = AttentionBlock


def _tree_error(grads, reference) -> float:
  flat = lambda tree: jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
  return float(jnp.linalg.norm(flat(grads) - flat(reference)) / jnp.linalg.norm(flat(reference)))


def gradient_error(cls, cfg: Config, batch, bits, mode: str = "convert", plan=None, seed: int = 1):
  """Relative error of all parameter gradients of `cls(cfg)`'s next-character loss on `batch`
  (tokens, labels) against plain JAX's: `mode` "convert" (`jact.convert`, nnx in place) or
  "compressed" (the whole loss under `jact.compressed`, optionally with a `BitPlan`)."""
  import optax  # pylint: disable=import-outside-toplevel

  import jact  # pylint: disable=import-outside-toplevel

  graph, params, rest = nnx.split(cls(cfg, nnx.Rngs(0)), nnx.Param, ...)

  def plain(p, batch, graph=graph, rest=rest):
    logits = nnx.merge(graph, p, rest)(batch[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

  reference = jax.grad(plain)(params, batch)
  if mode == "convert":
    graph, _, rest = nnx.split(jact.convert(cls(cfg, nnx.Rngs(0)), bits=bits), nnx.Param, ...)

    def loss(p, batch, key):
      with jact.nnx.use_key(key):
        return plain(p, batch, graph, rest)
  else:
    compressed = jact.compressed(plain, bits=bits, name="model")
    loss = lambda p, batch, key: compressed(p, batch, key=key)
  step = jax.jit(jact.planned(jax.grad(loss)), static_argnames="plan")
  return _tree_error(step(params, batch, jax.random.key(seed), plan=plan), reference), loss, params


def compile_seconds(cls, cfg: Config, batch, mode: str = "plain", bits: int = 2) -> float:
  """Seconds to trace, lower and compile the gradient of `cls(cfg)`'s loss: `mode` "plain",
  "convert" (`jact.convert`) or "compressed" (`jact.compressed` on the model)."""
  import time  # pylint: disable=import-outside-toplevel

  import optax  # pylint: disable=import-outside-toplevel

  import jact  # pylint: disable=import-outside-toplevel

  model = cls(cfg, nnx.Rngs(0))
  model = {"plain": lambda m: m, "convert": lambda m: jact.convert(m, bits=bits)}.get(
    mode, lambda m: jact.compressed(m, bits=bits)
  )(model)
  graph, state = nnx.split(model)

  def grad(state, tokens, labels, key):
    def loss(state):
      with jact.nnx.use_key(key):
        logits = nnx.merge(graph, state)(tokens)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return jax.grad(loss)(state)

  start = time.perf_counter()
  jax.jit(grad).lower(state, *batch, jax.random.key(1)).compile()
  return time.perf_counter() - start


def main():
  """Prints the 8/4/2-bit gradient errors of both models (convert and whole-model) and their
  2-bit errors under a numeric sensitivity plan at 2 bits on average."""
  import warnings  # pylint: disable=import-outside-toplevel

  import jact  # pylint: disable=import-outside-toplevel
  from experiments.lib import fit_subjects  # pylint: disable=import-outside-toplevel

  cfg, batch = Config(), fit_subjects.shakespeare(8, 64)
  for cls in (SSMLM, AttentionLM):
    seconds = {m: compile_seconds(cls, cfg, batch, m) for m in ("plain", "convert", "compressed")}
    print(cls.__name__, "compile s:", " ".join(f"{m} {t:.1f}" for m, t in seconds.items()))
    for mode in ("convert", "compressed"):
      errors = [gradient_error(cls, cfg, batch, bits, mode)[0] for bits in (8, 4, 2)]
      print(cls.__name__, mode, "8/4/2 bits:", " ".join(f"{e:.3f}" for e in errors), flush=True)
    for mode in ("convert", "compressed"):
      _, loss, params = gradient_error(cls, cfg, batch, 2, mode)
      controller = jact.Controller(loss, estimator="numeric", avg_bits=2.0)
      state = controller.init(params, batch, jax.random.key(5))
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", jact.CompressionVarianceWarning)
        state = controller.update(state, params, batch, jax.random.key(6))
      error = gradient_error(cls, cfg, batch, 2, mode, plan=state.plan)[0]
      bits = state.plan.average_bits()
      print(cls.__name__, mode, f"numeric plan at {bits:.2f} bits: {error:.3f}", flush=True)


if __name__ == "__main__":
  main()
