"""Per-group quantization (ops "quantize" and "dequantize"), one module per implementation:

* `reference`: the XLA reference (`quantize_reference`, `dequantize_reference`),
  every kernel's oracle and the implementation off GPU;
* `pallas_triton`: the Pallas (Triton backend) kernels;
* `jax_triton`: a quantize kernel written in Triton's language, launched with
  jax-triton (imports `triton`);
* `api`: the validated entry points `quantize` / `dequantize` (`jact.quantize`,
  `jact.dequantize`).

The group math the implementations share is `jact._core.quantize`. This
package imports nothing itself, so `jact.kernels` can build its table from
the implementations without a cycle; import the module you need.
"""
