"""Where two implementations of the quantize kernel disagree: every output, kept for offline study.

`bench_kernels` says whether a kernel's bits equal the XLA reference's; this script keeps the
evidence when they do not. For each configuration it draws the benchmark's input, runs every
registered quantize implementation on the default device and the XLA reference on the CPU, prints
how many codes, minima and steps differ from the CPU reference, and saves the input, the seed and
every output in one `.npz` per configuration, so the differing values can be recomputed step by
step off the device.

    python -m experiments.gpu.kernel_diff --out /tmp/diff                     # 8 bit f32, 2 bit bf16
    python -m experiments.gpu.kernel_diff --configs 4:float32 --size-mb 0.25 --out /tmp/diff
"""  # noqa: E501 (tables and commands in this docstring)

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments.gpu.extras import ensure_extras
from experiments.lib import kernel_cases
from jact import kernels

__all__ = ["main", "compare"]


def _arrays(packed) -> dict[str, np.ndarray]:
  return {
    "data": np.asarray(packed.data),
    "minimum": np.asarray(packed.minimum).view(np.uint16),
    "scale": np.asarray(packed.scale).view(np.uint16),
  }


def compare(bits: int, dtype: str, size_mb: float, key: int = 0) -> tuple[dict, dict]:
  """(summary, arrays) of every quantize implementation against the XLA reference on the CPU."""
  case = kernel_cases.quantize_case(bits, jnp.dtype(dtype))
  x, seed = case.make(int(size_mb * kernel_cases.MB), jax.random.key(key))
  cpu = jax.devices("cpu")[0]
  x_host, seed_host = jax.device_put((x, seed), cpu)
  reference = kernels.available("quantize")["xla"].fn
  with jax.default_device(cpu):
    expected = _arrays(jax.jit(lambda a, s: reference(a, s, **case.kwargs))(x_host, seed_host))
  arrays = {
    "x": np.asarray(x).view(np.uint16 if x.dtype == jnp.bfloat16 else np.uint32),
    "seed": np.asarray(seed),
    **{f"cpu_{k}": v for k, v in expected.items()},
  }
  summary = {
    "bits": bits,
    "dtype": dtype,
    "shape": list(x.shape),
    "kwargs": case.kwargs,
    "device": jax.devices()[0].device_kind,
    "impls": {},
  }
  for name, impl in kernels.available("quantize").items():
    try:
      got = _arrays(jax.jit(lambda a, s, f=impl.fn: f(a, s, **case.kwargs))(x, seed))
    except Exception as e:  # noqa: BLE001 - a failing kernel is recorded, the others still run
      summary["impls"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
      continue
    arrays.update({f"{name}_{k}": v for k, v in got.items()})
    summary["impls"][name] = {k: int((got[k] != expected[k]).sum()) for k in expected}
  return summary, arrays


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--configs",
    nargs="+",
    default=["8:float32", "2:bfloat16"],
    help="bits:dtype of each configuration",
  )
  parser.add_argument("--size-mb", type=float, default=4.0)
  parser.add_argument("--out", required=True, help="folder for <bits>_<dtype>.npz and diff.json")
  args = parser.parse_args(argv)
  extras = ensure_extras(modules=("jax_triton",))
  print(f"extras: {extras}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  results = []
  for config in args.configs:
    bits, dtype = config.split(":")
    summary, arrays = compare(int(bits), dtype, args.size_mb)
    np.savez_compressed(os.path.join(args.out, f"{bits}_{dtype}.npz"), **arrays)
    results.append(summary)
    print(json.dumps(summary, default=str), flush=True)
  with open(os.path.join(args.out, "diff.json"), "w") as f:
    json.dump(
      {
        "command": "python -m experiments.gpu.kernel_diff " + " ".join(argv or []),
        "jax": jax.__version__,
        "extras": extras,
        "results": results,
      },
      f,
      indent=1,
      default=str,
    )


if __name__ == "__main__":
  main()
