"""The GPU campaign's chunks: each measurement `experiments.gpu_campaign` runs as one
subprocess (its module, GPU and smoke arguments, budget), and their command lines."""

from __future__ import annotations

import dataclasses
import os
import sys

__all__ = ["CHUNKS", "STAGES", "Chunk", "select", "command"]


_TINY_RESNET = (
  "--image",
  "16",
  "--classes",
  "10",
  "--stage-sizes",
  "1",
  "--width",
  "4",
  "--dataset",
  "sklearn_digits",
)  # one bottleneck block: the plumbing only
_SEARCH_SMOKE = _TINY_RESNET + (
  "--batches",
  "--max-batch-search",
  "2",
  "--search-start",
  "2",
  "--memory-limit-gb",
  "1",
)


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One measurement run as one subprocess.

  Attributes:
    name: the chunk's name (its JSON is `<name>.json`).
    stage: the campaign stage it belongs to ("i" ... "v").
    module: the `experiments` module it runs.
    gpu_args: its arguments on a GPU.
    smoke_args: its arguments in a smoke run (tiny sizes).
    budget_s: its timeout on a GPU in seconds (None: the time left).
    measures: what it measures.

  Arguments may name `{out}` (the campaign's folder) and `{per_variant_s}`
  (the chunk's timeout, less a minute for start-up, shared among its
  `--variants`), filled in when it runs.
  """

  name: str
  stage: str
  module: str
  gpu_args: tuple[str, ...]
  smoke_args: tuple[str, ...]
  budget_s: float | None
  measures: str


_FIDELITY = (
  "--variants",
  "fp",
  "pergroup2",
  "actnn_l3",
  "blpa2",
  "--epochs",
  "10",
  "--runs",
  "{out}/runs",
  "--results",
  "{out}/actnn_cifar",
  "--stop-after",
  "{per_variant_s}",
)
_FIDELITY_SMOKE = (
  "--variants",
  "fp",
  "blpa2",
  "--epochs",
  "1",
  "--dataset",
  "cifar10",
  "--train-size",
  "128",
  "--test-size",
  "100",
  "--widths",
  "4",
  "--blocks",
  "1",
  "--batch",
  "32",
  "--runs",
  "{out}/runs",
  "--results",
  "{out}/actnn_cifar",
)

# In order of value: what a GPU minute buys first. `budget_s` caps a chunk on a GPU.
CHUNKS = (
  Chunk(
    "checks",
    "i",
    "gpu.gpu_checks",
    (),
    (),
    30,
    "versions, device, every jact._compat probe (JAX and Flax), kernels chosen",
  ),
  Chunk(
    "kernels_exact",
    "i",
    "bench.bench_kernels",
    ("--sizes-mb", "1", "16", "--reps", "3", "--rotate-mb", "32", "--check-cpu"),
    (
      "--sizes-mb",
      "0.0625",
      "--reps",
      "1",
      "--rotate-mb",
      "0",
      "--ops",
      "relu_mask",
      "quantize",
      "--impls",
      "xla",
      "pallas_triton",
      "jax_triton",
      "--check-cpu",
    ),
    45,
    "every registered kernel's bits vs the XLA reference on the GPU and on the CPU",
  ),
  Chunk(
    "kernels_bandwidth",
    "ii",
    "bench.bench_kernels",
    ("--sizes-mb", "4", "64", "512", "--reps", "10", "--rotate-mb", "256"),
    (
      "--sizes-mb",
      "0.25",
      "--reps",
      "2",
      "--rotate-mb",
      "0.5",
      "--ops",
      "relu_mask",
      "--impls",
      "xla",
    ),
    60,
    "every registered kernel's GB/s (XLA, Pallas/Triton, jax-triton) vs a same-run device copy",
  ),
  Chunk(
    "frontier",
    "iii",
    "bench.frontier",
    (
      "--measure",
      "--models",
      "lm_6x512",
      "resnet50_224",
      "--attention",
      "xla",
      "--configs",
      "plain",
      "remat_nothing",
      "jact4",
      "jact2",
      "jact2_xla",
      "jact_ckpt2",
      "--fit",
      "--fresh",
    ),
    (
      "--measure",
      "--small",
      "--models",
      "lm_6x512",
      "--attention",
      "xla",
      "--configs",
      "plain",
      "remat_nothing",
      "--fit",
      "--fresh",
    ),
    170,
    "the frontier on the device (the 6x512 LM and ResNet-50 224x224 at batch 128; plain, JAX's "
    "remat, jact 4/2 bits with the Triton kernels and 2 bits with the XLA quantizer XLA fuses "
    "into producers (the registry's kernel-or-XLA choice), jact.checkpoint): step time measured, "
    "device temp bytes next to the deviceless XLA:GPU compile's (the time model's error on them)",
  ),
  Chunk(
    "largest_batch",
    "iv",
    "bench.bench_train_step",
    (
      "--image",
      "224",
      "--batches",
      "--bits",
      "2",
      "--max-batch-search",
      "4096",
      "--search-start",
      "512",
    ),
    _SEARCH_SMOKE + ("--bits", "2"),
    75,
    "largest ResNet-50 224x224 batch that fits, plain Flax vs jact 2 bits",
  ),
  Chunk(
    "fidelity_seed0",
    "v",
    "papers.actnn_cifar",
    _FIDELITY + ("--seed", "0"),
    _FIDELITY_SMOKE + ("--seed", "0"),
    None,
    "pre-act ResNet-20 on full CIFAR-10: FP vs 2-bit vs ActNN L3 vs BLPA 2-bit, "
    "10 epochs or what the time left allows (needs the CIFAR-10 data kit)",
  ),
  Chunk(
    "fidelity_seed1",
    "v",
    "papers.actnn_cifar",
    _FIDELITY + ("--seed", "1"),
    _FIDELITY_SMOKE + ("--seed", "1"),
    None,
    "the same with a second seed",
  ),
)

STAGES = tuple(dict.fromkeys(c.stage for c in CHUNKS))


def select(names: list[str] | None) -> list[Chunk]:
  """The chunks named (chunk or stage names; None or "all": every chunk), in campaign order."""
  if not names or "all" in names:
    return list(CHUNKS)
  known = {c.name for c in CHUNKS} | set(STAGES)
  unknown = [n for n in names if n not in known]
  if unknown:
    raise ValueError(
      f"unknown chunks {unknown}; chunks: {[c.name for c in CHUNKS]}, "
      f"stages: {list(STAGES)}, or all"
    )
  return [c for c in CHUNKS if c.name in names or c.stage in names]


def command(
  chunk: Chunk,
  smoke: bool,
  json_path: str | os.PathLike,
  out: str | os.PathLike = "DIR",
  timeout_s: float | None = None,
) -> list[str]:
  """The chunk's command line, `{out}` and `{per_variant_s}` filled in."""
  args = chunk.smoke_args if smoke else chunk.gpu_args
  variants = _count_variants(args)
  per_variant = "600" if timeout_s is None else f"{max(30.0, (timeout_s - 60) / variants):.0f}"
  filled = [a.format(out=out, per_variant_s=per_variant) for a in args]
  return [sys.executable, "-m", f"experiments.{chunk.module}", *filled, "--json", str(json_path)]


def _count_variants(args) -> int:
  if "--variants" not in args:
    return 1
  rest = args[args.index("--variants") + 1 :]
  return max(1, next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest)))
