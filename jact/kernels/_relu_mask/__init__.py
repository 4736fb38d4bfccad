"""ReLU / leaky ReLU output and its packed 1-bit mask (op "relu_mask"):

* `reference`: the XLA reference, the kernel's oracle;
* `jax_triton`: the kernel in Triton's language, launched with jax-triton, both
  outputs in one pass;
* `pallas_triton`: the Pallas (Triton backend) kernel, the same pass;
* `api`: the validated entry point `relu_mask` (what `jact.ops.relu` runs).

This package imports nothing itself (see `jact.kernels._quantize`).
"""
