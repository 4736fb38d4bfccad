"""FP8 codes with a per-block scale (op "float8_compress"):

* `reference`: the XLA reference, the kernel's oracle;
* `pallas_triton`: the Pallas (Triton backend) kernel, codes and scales in one pass;
* `api`: the validated entry point `float8_compress` (what `jact.compressors.Float8` runs).

The numerics are `jact._core.float8`'s. This package imports nothing itself
(see `jact.kernels._quantize`).
"""
