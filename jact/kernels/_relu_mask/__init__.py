"""ReLU / leaky ReLU output and its packed 1-bit mask (op "relu_mask"):

* `reference`: the XLA reference, the kernel's oracle;
* `pallas_triton`: the Pallas (Triton backend) kernel, both outputs in one pass;
* `api`: the validated entry point `relu_mask` (what `jact.ops.relu` runs).

This package imports nothing itself (see `jact.kernels._quantize`).
"""
