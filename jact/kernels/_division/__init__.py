"""DIVISION compression, the pooled LFC and the quantized HFC (op "division_compress"):

* `reference`: the XLA reference, the kernel's oracle;
* `pallas_triton`: the one-pass Pallas (Triton backend) kernel;
* `api`: the validated entry point `division_compress` (what
  `jact.compressors.Division` runs).

The pooling and upsampling the implementations share are `jact._core.division`.
This package imports nothing itself (see `jact.kernels._quantize`).
"""
