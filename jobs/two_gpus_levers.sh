#!/usr/bin/env bash
# Issue "Performance" on 2 x H200: the 8.1B leaderboard step (context 32768, one sequence per GPU, bf16, our FSDP,
# loss chunks of 4096, SDPA) with the levers that the accounting says pay (docs/fusion-and-checkpointing.md):
# first the candidate (attention's outputs kept and the top 4 blocks left out of checkpointing, the fused kernels),
# run 0050's step and torch's FSDP2 at it, then each lever alone. A cold Triton and inductor cache.
# Usage: bash jobs/two_gpus_levers.sh COMMIT   (histories and logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
source "$(dirname "$0")/common.sh"
STEP=(python -m pytest benches/bench_fullstep.py --fullstep-preset leaderboard-2026 --contexts 32768
      --batch-size 1 --world-sizes 2 --precisions bf16 --loss-chunk 4096 --attention sdpa --warmup-steps 1
      --rounds 2 --fullstep-variants fsdp,fsdp2 -p no:cacheprovider -q -rs --benchmark-autosave)

run candidate 330 "${STEP[@]}" --checkpoint attn-keep4,every1 --fused all,none \
    -k "(attn-keep4 and fused-all and not fsdp2) or (every1 and not fused)" --benchmark-save="$KIND-levers-candidate"
run alone 230 "${STEP[@]}" --checkpoint attn-keep4,every1 --fused none,all \
    -k "not fsdp2 and ((attn-keep4 and not fused) or (every1 and fused-all))" --benchmark-save="$KIND-levers-alone"
cp .benchmarks/*/*"$KIND"-levers-*.json "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
grep -h -E "passed|failed|rror|SKIP" "$LOGS"/*.log | tail
