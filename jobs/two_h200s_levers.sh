#!/usr/bin/env bash
# Issue "Performance" on 2 x H200 (attention's kept outputs do not fit an H100's 80 GB at this step): the 8.1B
# leaderboard step with the levers that paid on 2 x H100 (jobs/two_gpus_levers.sh: the fused kernels) and the one
# that needs the memory (attention's outputs kept, the top 4 blocks left out of checkpointing), on our FSDP and on
# torch's FSDP2, then run 0050's step as the baseline; then the compile and selective-checkpointing tests that
# failed on 2 x H100 at edb2e49. A cold Triton and inductor cache.
# Usage: bash jobs/two_h200s_levers.sh COMMIT   (histories and logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
source "$(dirname "$0")/common.sh"

run levers 440 python -m pytest benches/bench_fullstep.py --fullstep-preset leaderboard-2026 --contexts 32768 \
    --batch-size 1 --world-sizes 2 --precisions bf16 --loss-chunk 4096 --attention sdpa --warmup-steps 1 \
    --rounds 1 --fullstep-variants fsdp,fsdp2 --checkpoint attn-keep4,every1 --fused all,none \
    -k "(attn-keep4 and fused-all) or (every1 and not fused and not fsdp2)" -p no:cacheprovider -q -rs \
    --benchmark-autosave --benchmark-save="$KIND-levers"
run tests 130 python -m pytest -p no:cacheprovider -q -rs tests/test_compile.py \
    tests/test_selective_checkpointing.py -k "compile or fused_kernels"
cp .benchmarks/*/*"$KIND"-levers.json "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
grep -h -E "^(FAILED|ERROR)|passed|failed" "$LOGS"/*.log | tail -20
