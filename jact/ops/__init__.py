"""Compressed ops: exact forward, compressed residuals, exact backward formulas.

Every op is a `jax.custom_vjp` whose inputs and outputs stay in the model
dtype; only what the backward pass keeps is compressed. Residuals are tagged
with `jax.ad_checkpoint.checkpoint_name` (the op's `name=` plus a role), so
`jax.checkpoint` policies can select them. Reverse mode only: forward mode
(`jax.jvp`, `jax.jacfwd`, `jax.linearize`) raises, and so does a second
derivative through a compressed residual (exact ones, bits=None, allow it).

>>> import jax, jax.numpy as jnp
>>> from jact import ops
>>> x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
>>> y = ops.relu(ops.dense(x, w, key=jax.random.key(0), bits=4))
>>> y.shape
(4, 3)
"""

from jact.ops._activation import gelu, leaky_relu, relu, sigmoid, silu, softmax, tanh
from jact.ops._attention import dot_product_attention
from jact.ops._blpa import blpa_block
from jact.ops._chunked_attention import chunked_attention
from jact.ops._dropout import dropout
from jact.ops._embedding import embed
from jact.ops._linear import conv, conv_general_dilated, conv_transpose, dense, dot_general, einsum
from jact.ops._norm import batch_norm, layer_norm, rms_norm, update_running_stats
from jact.ops._pooling import avg_pool, max_pool

__all__ = [
  "dot_general",
  "dense",
  "einsum",
  "conv_general_dilated",
  "conv",
  "conv_transpose",
  "batch_norm",
  "layer_norm",
  "rms_norm",
  "update_running_stats",
  "relu",
  "leaky_relu",
  "gelu",
  "silu",
  "tanh",
  "sigmoid",
  "softmax",
  "dropout",
  "max_pool",
  "avg_pool",
  "embed",
  "dot_product_attention",
  "chunked_attention",
  "blpa_block",
]
