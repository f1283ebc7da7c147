#!/usr/bin/env bash
# Issue "Performance" on a 4-GPU host, as two pairs of GPUs: the 8.1B leaderboard step (context 32768, one sequence
# per GPU, bf16, our FSDP) with its levers added one at a time, and torch's FSDP2 beside it. Each point is its own
# pytest run, interrupted (and so saved as a partial run) if it outlives its limit. A cold Triton and inductor cache.
# Usage: bash jobs/four_gpus_leaderboard_levers.sh COMMIT   (logs and histories under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
source "$(dirname "$0")/common.sh"
STEP=(benches/bench_fullstep.py --fullstep-preset leaderboard-2026 --contexts 32768 --batch-size 1 --world-sizes 2
      --precisions bf16 --loss-chunk 4096 --warmup-steps 1 --rounds 3 -p no:cacheprovider -q -rs
      --benchmark-autosave)

point() {  # point GPUS NAME LIMIT ARGS...: one point on GPUS, its log in $OUT/NAME.log
    local gpus=$1 name=$2 limit=$3 start=$(date +%s)
    shift 3
    CUDA_VISIBLE_DEVICES=$gpus timeout -s INT -k 30 "$limit" python -m pytest "${STEP[@]}" \
        --benchmark-save="$KIND-leaderboard-$name" "$@" >> "$OUT/pair$gpus.log" 2>&1
    echo "$name on GPUs $gpus: exit $?, $(( $(date +%s) - start )) s"
}

{
    point 0,1 sdpa-every1 170 --attention sdpa --checkpoint every1
    point 0,1 sdpa-attn-fused 170 --attention sdpa --checkpoint attn --fused all
} &
{
    point 2,3 fsdp2-sdpa-every1 170 --fullstep-variants fsdp2 --attention sdpa --checkpoint every1
    point 2,3 sdpa-every1-fused 170 --attention sdpa --checkpoint every1 --fused all
} &
wait
grep -h -E "passed|failed|error|SKIPPED|OutOfMemory" $OUT/pair*.log | tail -20
cp .benchmarks/*/*"$KIND"-leaderboard-*.json "$OUT/" 2>/dev/null
ls $OUT
