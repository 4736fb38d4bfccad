"""FP8 codes with a per-block scale (op "float8_compress"):

* `reference`: the XLA reference, the kernel's oracle;
* `jax_triton`: the kernel in Triton's language, launched with jax-triton, codes and
  scales in one pass;
* `pallas_triton`: the Pallas (Triton backend) kernel, the same pass;
* `api`: the validated entry point `float8_compress` (what `jact.compressors.Float8` runs).

The numerics are `jact._core.float8`'s. This package imports nothing itself
(see `jact.kernels._quantize`).
"""
