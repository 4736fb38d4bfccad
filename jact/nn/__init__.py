"""Drop-in `flax.linen` layers that save compressed activations.

Each twin has exactly the variables of the Flax layer it replaces (a plain
checkpoint loads) and Flax's forward; what it keeps for the backward pass is
a stochastically rounded low-bit copy (`bits`, default 4, or a
`jact.compressors` object as `compressor`). Rounding noise comes from the
'jact' RNG stream of `apply`. Without that stream (`init`, inference) a twin
runs the plain Flax computation, and differentiating it raises a ValueError
naming the fix. Residuals are named after the layer's module path.

>>> import jax, jax.numpy as jnp
>>> import flax.linen as nn
>>> import jact
>>> class MLP(nn.Module):
...   @nn.compact
...   def __call__(self, x):
...     return jact.nn.Dense(2, bits=2)(jact.nn.ReLU()(jact.nn.Dense(8, bits=2)(x)))
>>> x = jnp.ones((4, 3))
>>> variables = MLP().init(jax.random.key(0), x)
>>> y = MLP().apply(variables, x, rngs={'jact': jax.random.key(1)})
>>> y.shape
(4, 2)
>>> bool(jnp.allclose(MLP().apply(variables, x), y))   # inference needs no key
True
"""

from jact.nn._activation import GELU as GELU
from jact.nn._activation import LeakyReLU as LeakyReLU
from jact.nn._activation import ReLU as ReLU
from jact.nn._activation import Sigmoid as Sigmoid
from jact.nn._activation import SiLU as SiLU
from jact.nn._activation import Softmax as Softmax
from jact.nn._activation import Tanh as Tanh
from jact.nn._attention import MultiHeadDotProductAttention as MultiHeadDotProductAttention
from jact.nn._attention import SelfAttention as SelfAttention
from jact.nn._blpa import BLPABlock as BLPABlock
from jact.nn._layers import AvgPool as AvgPool
from jact.nn._layers import Conv as Conv
from jact.nn._layers import Dense as Dense
from jact.nn._layers import Dropout as Dropout
from jact.nn._layers import Embed as Embed
from jact.nn._layers import MaxPool as MaxPool
from jact.nn._norm import BatchNorm as BatchNorm
from jact.nn._norm import LayerNorm as LayerNorm
from jact.nn._norm import RMSNorm as RMSNorm

__all__ = [
  "Dense",
  "Conv",
  "BatchNorm",
  "LayerNorm",
  "RMSNorm",
  "Dropout",
  "Embed",
  "MultiHeadDotProductAttention",
  "SelfAttention",
  "ReLU",
  "LeakyReLU",
  "GELU",
  "SiLU",
  "Tanh",
  "Sigmoid",
  "Softmax",
  "MaxPool",
  "AvgPool",
  "BLPABlock",
]
