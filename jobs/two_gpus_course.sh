#!/usr/bin/env bash
# Issues "The 2026 edition" and "Performance" on 2 x H200: the leaderboard harness at the handout's shape and
# timing (batch 2, context 32768, do_bench rep=30000 warmup=10000, from an empty cache), ours (with
# LEADERBOARD_CHECKPOINT, default attn-keep4, and LEADERBOARD_FUSED, default none) beside the course's reference (cs336_basics from .course/); the
# kernel, checkpointing, compile, loss and tensor-parallel tests on the GPUs; section 8's layer under our tensor
# parallelism and torch's at two shapes on 2 GPUs (the leaderboard alone with LEADERBOARD_ONLY=1).
# Usage: bash jobs/two_gpus_course.sh COMMIT   (histories and logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=.:.course:.course/site PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
source "$(dirname "$0")/common.sh"
BENCH=(python -m pytest -p no:cacheprovider -q -rs --benchmark-autosave)

run leaderboard 270 "${BENCH[@]}" benches/bench_leaderboard.py --leaderboard-models ours,cs336_basics \
    --leaderboard-preset leaderboard-2026 --leaderboard-context 32768 --leaderboard-world-size 2 \
    --leaderboard-checkpoint "${LEADERBOARD_CHECKPOINT:-attn-keep4}" --fused "${LEADERBOARD_FUSED:-none}" \
    --loss-chunk 4096 --attention sdpa \
    --benchmark-save="$KIND-leaderboard-handout"
if [ -z "${LEADERBOARD_ONLY:-}" ]; then
    run tests 170 python -m pytest -n 2 -p no:cacheprovider -q -rs --durations=8 tests/test_kernels.py \
        tests/test_selective_checkpointing.py tests/test_compile.py tests/test_loss.py \
        tests/test_tensor_parallel.py tests/test_swiglu_layouts.py
    run ffn 110 "${BENCH[@]}" benches/bench_ffn.py --ffn-world-sizes 2 --ffn-layouts tp,torch-tp \
        --ffn-precisions bf16 --ffn-batches 16384 --ffn-d-models 4096,8192 --ffn-d-ffs 16384 \
        --ffn-bandwidth-mb 512 --rounds 10 --warmup-steps 3 --benchmark-save="$KIND-ffn-tp"
fi
cp .benchmarks/*/*"$KIND"-{leaderboard-handout,ffn-tp}.json "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
grep -h -E "^(FAILED|ERROR)|passed|failed" "$LOGS"/*.log | tail -20
