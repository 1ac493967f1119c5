#!/usr/bin/env bash
# The end-to-end GPU figures in one run (about 6-8 min on an H200; the steps' timeouts add up to 550 s, so that it fits
# one 600 s device command on an H100 too), for a session that is lent a GPU:
#   1. bench_end_to_end.py --scale 1.3b                  Wan2.1-1.3B shapes, bf16, 480x832, 81 frames: Wan VAE and
#                                                        tiny decoder rows (frames/s, first frame, per chunk, peak)
#   2. bench_end_to_end.py --scale 1.3b --weights float8 the same with FP8 linears (tiny decoder row): ratio to 1.
#   3. bench_end_to_end.py --scale 14b --memory-cap 24   Krea Realtime 14B shapes, FP8, recompute (context 3), text
#                                                        encoder offloaded, capped at 24 GiB: plan vs peak
#   4. bench_gpu_scale.py --compile --cuda-graphs        the transformer alone: eager, compiled, CUDA graphs
# Every step has its own timeout and the script goes on after a failure. torchao (FP8) is not on the device machine:
# install it here with `pip install --no-deps --target .torchao torchao==0.18.0` and carry `.torchao` (28 MiB).
# Usage: bash benchmarks/gpu_run.sh [output folder, default $OUT or ./gpu_out]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_out}}"
mkdir -p "$out"
if [ -d .torchao ]; then export PYTHONPATH="$PWD/.torchao${PYTHONPATH:+:$PYTHONPATH}"; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
python -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1 | tee -a "$out/gpu.txt"
step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    echo "=== $name: $*" | tee "$out/$name.txt"
    timeout "$seconds" "$@" 2>&1 | grep -v "^W[0-9]\{4\}" | tee -a "$out/$name.txt"
    echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$out/$name.txt"
}
step e2e_1.3b 130 python benchmarks/bench_end_to_end.py --scale 1.3b --repeats 2
step e2e_1.3b_fp8 100 python benchmarks/bench_end_to_end.py --scale 1.3b --weights float8 --decoders tiny --repeats 2
step e2e_14b_24gib 200 python benchmarks/bench_end_to_end.py --scale 14b --memory-cap 24 --decoders tiny --repeats 1
step gpu_scale 120 python benchmarks/bench_gpu_scale.py --compile --cuda-graphs
