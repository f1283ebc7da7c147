#!/usr/bin/env bash
# Issues "Many GPUs for real", "Trust" and "Performance" on a 4-GPU host, one part at a time: the fused kernels' and
# regional compilation's tests on the GPUs; the gate's error rates on one GPU; a 100-point GPU benchmark grid
# serially and under -n 4 in the same job, each saved as one history, each point's median compared, and the serial
# run's seconds per point saved for the scheduler (durations.json under $OUT, to commit).
# Usage: bash jobs/four_gpus_grid.sh COMMIT   (the commit the copied tree is; logs and histories under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
source "$(dirname "$0")/common.sh"

run kernel-tests 170 python -m pytest -p no:cacheprovider -q -rs -x -n 2 tests/test_kernels.py tests/test_compile.py
grep -E "^(FAILED|ERROR)|graph breaks not at" -A3 "$LOGS/kernel-tests.log" | head -30
CUDA_VISIBLE_DEVICES=0 run gate-rates 120 python -m systems.bench.gate_rates simulate --gates 10 --turns 3 \
    --out "$OUT/gate-rates.json"
cat "$LOGS/gate-rates.log"
model_grid serial 160
model_grid n4 80
grep -A5 "= workers =" "$LOGS/grid-n4.log"
cp .benchmarks/*/*"$KIND"-model-grid-*.json "$OUT/"
compare_grids serial n4
save_grid_durations && cp systems/bench/durations.json "$OUT/"
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
