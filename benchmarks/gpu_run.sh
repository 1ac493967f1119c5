#!/usr/bin/env bash
# The end-to-end GPU figures in one run (about 6-8 min on an H200; the steps' timeouts add up to 570 s, so that it fits
# one 600 s device command on an H100 too), for a session that is lent a GPU:
#   0. tests/test_decode_overlap.py                      the CUDA-only tests: decode on the side stream == serial
#                                                        (streamed decoder, and pipe() with enable_decode_overlap())
#   1. bench_end_to_end.py --scale 1.3b                  Wan2.1-1.3B shapes, bf16, 480x832, 81 frames: Wan VAE and
#                                                        tiny decoder, each serial and overlapped (frames/s, first
#                                                        frame, per chunk, peak vs plan); pipe() itself, serial and
#                                                        overlapped (frames/s, the same frames)
#   2. bench_end_to_end.py --scale 14b --memory-cap 24   Krea Realtime 14B shapes, FP8, recompute (context 3), text
#                                                        encoder offloaded, tiny decoder, capped at 24 GiB: plan vs peak
#   3. bench_gpu_scale.py --compile --cuda-graphs        the transformer alone: eager, FP8 (TorchAoConfig) eager and
#        --weights float8 --attention-backends ...      compiled with its ratio to bf16 and its error per chunk and on
#                                                        the final latents, each attention backend diffusers offers
#                                                        here (a missing package is one FAILED line), compiled, CUDA
#                                                        graphs
# Every step has its own timeout and the script goes on after a failure. diffusers, torchao (FP8) and ftfy are not on
# the device machine: `bash benchmarks/gpu_prep.sh` puts their wheels in .whl/ here; carry `.whl`, and this script
# installs them into /tmp/site first.
# Usage: bash benchmarks/gpu_run.sh [output folder, default $OUT or ./gpu_out]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_out}}"
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1 | tee -a "$out/gpu.txt"
step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    echo "=== $name: $*" | tee "$out/$name.txt"
    timeout "$seconds" "$@" 2>&1 | grep -v "^W[0-9]\{4\}" | tee -a "$out/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$out/$name.txt"
}
step overlap_tests 45 python3 -m pytest -q -p no:cacheprovider tests/test_decode_overlap.py
step e2e_1.3b 170 python3 benchmarks/bench_end_to_end.py --scale 1.3b --repeats 2
step e2e_14b_24gib 160 python3 benchmarks/bench_end_to_end.py --scale 14b --memory-cap 24 --decoders tiny --repeats 1 \
    --no-calls
backends=native,_native_cudnn,_native_flash,_native_efficient,flash,_flash_3,sage
step gpu_scale 195 python3 benchmarks/bench_gpu_scale.py --compile --cuda-graphs --weights float8 \
    --attention-backends "$backends"
