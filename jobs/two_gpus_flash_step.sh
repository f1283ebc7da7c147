#!/usr/bin/env bash
# Issue "Attention ahead of cuDNN": the 8.1B leaderboard step on 2 GPUs with our attention (`flash`: on Hopper the
# Gluon forward and the Triton backward) against SDPA, same levers (every block checkpointed, the fused kernels,
# loss chunks of 4096, our FSDP), in turns: SDPA, flash. Usage: bash jobs/two_gpus_flash_step.sh COMMIT [GPUS]
# (GPUS: CUDA_VISIBLE_DEVICES, default 0,1; histories and logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1 CUDA_VISIBLE_DEVICES=${2:-0,1}
source "$(dirname "$0")/common.sh"
KIND=${KIND%x*}x2  # the two GPUs this job holds
STEP=(python -m pytest benches/bench_fullstep.py --fullstep-preset leaderboard-2026 --contexts 32768
      --batch-size 1 --world-sizes 2 --precisions bf16 --loss-chunk 4096 --checkpoint every1 --fused all
      --warmup-steps 1 --rounds 2 --fullstep-variants fsdp -p no:cacheprovider -q -rs --benchmark-autosave)
for attention in sdpa flash; do
    run "$attention" 280 "${STEP[@]}" --attention "$attention" --benchmark-save="$KIND-step-$attention"
done
cp .benchmarks/*/*"$KIND"-step-*.json "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
grep -h -E "passed|failed|rror|SKIP" "$LOGS"/*.log | tail
