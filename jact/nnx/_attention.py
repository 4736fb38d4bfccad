"""The nnx twin of MultiHeadAttention."""

from __future__ import annotations

from flax import nnx
from jax import lax

from jact._flax import hooks as _hooks
from jact._flax.conversion import Conversion
from jact._flax.hooks import Hook
from jact.compressors import Compressor
from jact.nnx._twin import _no_hook, _Twin


def _convertible(module) -> str | None:
  """Why `jact.convert` leaves an nnx attention layer plain, or None."""
  if module.attention_fn is not nnx.dot_product_attention:
    return "a custom 'attention_fn'"
  for f in ("qkv_dot_general", "out_dot_general", "qkv_dot_general_cls", "out_dot_general_cls"):
    if getattr(module, f, None) is not None:
      return f"a custom {f!r} (the twin installs its own)"
  for sub in ("query", "key", "value", "out"):
    layer = getattr(module, sub)
    if layer.dot_general is not None or layer.dot_general_cls is not None:
      return f"a custom dot_general in {sub!r}"
  return None


def _install_hooks(module) -> None:
  """The converted copy's hooks: the twin's attention and projections."""
  module.attention_fn = _hooks.attention_slot
  module.qkv_dot_general, module.out_dot_general = Hook("qkv"), Hook("out")
  for sub in ("query", "key", "value"):
    getattr(module, sub).dot_general = Hook("qkv")
  module.out.dot_general = Hook("out")


class MultiHeadAttention(_Twin, nnx.MultiHeadAttention):
  """`nnx.MultiHeadAttention` with compressed projections and attention.

  Residual names: "<name>/query", "/key", "/value", "/out" and
  "<name>/attention". Attention dropout draws Flax's own masks from the
  layer's dropout key (`broadcast_dropout` included). Not supported:
  sow_weights=True.
  """

  conversion = Conversion((nnx.MultiHeadAttention,), check=_convertible, patch=_install_hooks)

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    *,
    bits: int | None = 4,
    compressor: Compressor | None = None,
    name: str | None = None,
    rngs: nnx.Rngs,
    **kwargs,
  ):
    _no_hook(
      kwargs,
      "attention_fn",
      "qkv_dot_general",
      "out_dot_general",
      "qkv_dot_general_cls",
      "out_dot_general_cls",
    )
    self._check_settings(rngs, bits, compressor)
    super().__init__(
      num_heads,
      in_features,
      qkv_features,
      out_features,
      num_kv_heads,
      in_kv_features,
      attention_fn=_hooks.attention_slot,
      qkv_dot_general=Hook("qkv"),
      out_dot_general=Hook("out"),
      rngs=rngs,
      **kwargs,
    )
    self._init_jact(rngs, bits, name, compressor)

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, **kwargs):
    compress, key = self._key()
    if not compress:
      with _hooks.provide(
        qkv=lax.dot_general, out=lax.dot_general, attention=_hooks.plain_nnx_attention
      ):
        return self._keyless(super().__call__)(inputs_q, inputs_k, inputs_v, **kwargs)
    with _hooks.provide(**_hooks.attention_ops(key, self.residual_name, self._rounding())):
      return super().__call__(inputs_q, inputs_k, inputs_v, **kwargs)
