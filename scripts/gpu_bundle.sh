#!/usr/bin/env bash
# Fill gpu_data/ (git-ignored) with what the GPU campaign needs beside the working tree on a
# GPU machine that has Python 3.12 and jax/flax/optax/triton but no network: the CIFAR-10
# and tiny Shakespeare files of the data kit (about 22 MB) and the wheels of the extras the
# campaign imports that such a machine may lack (Pillow, to decode CIFAR-10's JPEGs, and
# jax-triton 0.3.1, which launches jact's GPU kernels; about 5 MB). The campaign installs
# these wheels itself when they are missing (experiments/gpu/extras.py). Everything stays
# under the 64 MiB a device call takes along.
#
#   scripts/gpu_bundle.sh [DATA_DIR]      (default: $JACT_DATA, else ../shared/data)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
data=${1:-${JACT_DATA:-$repo/../shared/data}}
out=$repo/gpu_data
mkdir -p "$out/cifar10" "$out/tinyshakespeare" "$out/wheels"
cp "$data"/cifar10/cifar10_jpeg_q75_full.npz "$data"/cifar10/cifar10_jpeg_q75_10k_2k.npz "$out/cifar10/"
cp "$data"/tinyshakespeare/input.txt "$out/tinyshakespeare/"
python -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$out/wheels" \
  "pillow>=10" "jax-triton==0.3.1"
du -sh "$out"
