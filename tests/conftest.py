import os
import sys

# XLA:CPU's experimental YNN fusion in jaxlib 0.10.2 miscompiles a row
# reduction whose operand is broadcast along a leading batch axis of >= ~2**18
# values -- exactly the shape of vmapping a gradient over many PRNG keys in
# the statistical tests (reproduced: max error 2.3 instead of 2e-7). Turn it
# off for the test process before jax initializes its backend.
_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

sys.path.insert(0, os.path.dirname(__file__))
