#!/usr/bin/env bash
# Prepare, on a machine with pip, the wheels that benchmarks/gpu_run.sh installs on the device machine (which has
# PyTorch, transformers, accelerate, safetensors, numpy, imageio and huggingface_hub, cannot download, and lacks
# diffusers, torchao and ftfy): they land in .whl/ (ignored by git, about 11 MiB), which the device call carries.
#   bash benchmarks/gpu_prep.sh
#   then, with the device tool: run(command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=590)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
# Python 3.12 on x86-64 (the device image); --no-deps: the rest of their needs are there already.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    diffusers==0.42.1 torchao==0.18.0 ftfy==6.3.1 wcwidth==0.2.13 importlib_metadata==8.7.0
ls -la .whl
