"""Drop-in `flax.nnx` layers that save compressed activations.

Each twin subclasses the Flax layer, so its `nnx.Param` / `nnx.BatchStat`
state is the plain layer's (`nnx.update(twin, nnx.state(plain, nnx.Param))`
loads plain weights). A layer that rounds stochastically forks a 'jact' RNG
stream ('default' otherwise) from `rngs` at construction and draws a fresh
key per call; inside a `use_key` block it draws from the block's key instead.
A layer with no key runs the plain Flax computation (fine for inference; a
ValueError naming the fix if differentiated). `name_residuals(model)` names
every twin's residuals after its attribute path.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> import jact
>>> layer = jact.nnx.Linear(3, 4, bits=2, rngs=nnx.Rngs(params=0, jact=1))
>>> layer(jnp.ones((2, 3))).shape
(2, 4)
"""

from jact._flax.hooks import use_key as use_key
from jact.nnx._activation import GELU as GELU
from jact.nnx._activation import LeakyReLU as LeakyReLU
from jact.nnx._activation import ReLU as ReLU
from jact.nnx._activation import Sigmoid as Sigmoid
from jact.nnx._activation import SiLU as SiLU
from jact.nnx._activation import Softmax as Softmax
from jact.nnx._activation import Tanh as Tanh
from jact.nnx._attention import MultiHeadAttention as MultiHeadAttention
from jact.nnx._blpa import BLPABlock as BLPABlock
from jact.nnx._layers import AvgPool as AvgPool
from jact.nnx._layers import Conv as Conv
from jact.nnx._layers import Dropout as Dropout
from jact.nnx._layers import Embed as Embed
from jact.nnx._layers import Linear as Linear
from jact.nnx._layers import MaxPool as MaxPool
from jact.nnx._norm import BatchNorm as BatchNorm
from jact.nnx._norm import LayerNorm as LayerNorm
from jact.nnx._norm import RMSNorm as RMSNorm
from jact.nnx._twin import name_residuals as name_residuals

__all__ = [
  "Linear",
  "Conv",
  "BatchNorm",
  "LayerNorm",
  "RMSNorm",
  "Dropout",
  "Embed",
  "MultiHeadAttention",
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
  "name_residuals",
  "use_key",
]
