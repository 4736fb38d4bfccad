"""Per-group quantization (ops "quantize" and "dequantize"), one module per implementation:

* `reference`: the XLA reference (`quantize_reference`, `dequantize_reference`),
  every kernel's oracle and the implementation off GPU;
* `jax_triton`: the quantize and dequantize kernels written in Triton's language,
  launched with jax-triton (imports `triton`; jact's primary GPU path);
* `pallas_triton`: the Pallas (Triton backend) kernels, kept while jax has that
  deprecated backend;
* `layout`: the packing layout both kernel families share (no Pallas, no Triton);
* `api`: the validated entry points `quantize` / `dequantize` (`jact.quantize`,
  `jact.dequantize`).

The group math the implementations share is `jact._core.quantize`. This
package imports nothing itself, so `jact.kernels` can build its table from
the implementations without a cycle; import the module you need.
"""
