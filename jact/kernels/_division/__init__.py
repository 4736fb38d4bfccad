"""DIVISION compression, the pooled LFC and the quantized HFC (op "division_compress"):

* `reference`: the XLA reference, the kernel's oracle;
* `jax_triton`: the kernels in Triton's language, launched with jax-triton (a
  pooling launch, then the residual's quantization);
* `pallas_triton`: the one-pass Pallas (Triton backend) kernel;
* `api`: the validated entry point `division_compress` (what
  `jact.compressors.Division` runs).

The pooling and upsampling the implementations share are `jact._core.division`.
This package imports nothing itself (see `jact.kernels._quantize`).
"""
