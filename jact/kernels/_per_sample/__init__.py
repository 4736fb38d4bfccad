"""Per-sample mixed precision (ops "quantize_per_sample" and "dequantize_per_sample"):

* `reference`: the XLA reference, every kernel's oracle;
* `jax_triton`: the kernels in Triton's language, launched with jax-triton (a
  statistics pass, then one packing for every width, the width a runtime value);
* `pallas_triton`: the Pallas (Triton backend) kernels;
* `api`: the validated entry points `quantize_per_sample` /
  `dequantize_per_sample`.

The layout (`PackedPerSample`, `per_sample_capacity`) is `jact._core.persample`.
This package imports nothing itself (see `jact.kernels._quantize`).
"""
