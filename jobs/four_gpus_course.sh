#!/usr/bin/env bash
# Issues "Trust", "The 2026 edition" and "Several nodes" on a 4-GPU host, one part at a time: the gate's error
# rates on one GPU; the leaderboard harness as the course times it (ours at the handout's shape on 2 GPUs, then ours
# beside the course's reference, cs336_basics from .course/, at a shape it fits on 4); section 8's SwiGLU layer
# under every layout where bandwidth dominates; xl's layouts at 2 x 2; two torchrun "nodes" of two GPUs over NCCL.
# Usage: bash jobs/four_gpus_course.sh COMMIT   (histories and gate-rates.json under $OUT, the logs in logs.tgz)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=.:.course:.course/site PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
source "$(dirname "$0")/common.sh"

BENCH=(python -m pytest -p no:cacheprovider -q -rs --benchmark-autosave)

CUDA_VISIBLE_DEVICES=0 run gate-rates 120 python -m systems.bench.gate_rates simulate --gates 10 --turns 3 \
    --out "$OUT/gate-rates.json"
cat "$LOGS/gate-rates.log"
run leaderboard 150 "${BENCH[@]}" benches/bench_leaderboard.py --leaderboard-models ours \
    --leaderboard-preset leaderboard-2026 --leaderboard-context 32768 --leaderboard-world-size 2 \
    --leaderboard-checkpoint "${LEADERBOARD_CHECKPOINT:-every1}" --loss-chunk 4096 --attention sdpa \
    --benchmark-save="$KIND-leaderboard-handout"
run leaderboard-reference 120 "${BENCH[@]}" benches/bench_leaderboard.py --leaderboard-models ours,cs336_basics \
    --leaderboard-preset leaderboard-2026 --leaderboard-context 1024 --leaderboard-batch 4 \
    --leaderboard-world-size 4 --leaderboard-checkpoint none --loss-chunk 1024 --attention sdpa \
    --leaderboard-rep-ms 5000 --leaderboard-warmup-ms 2000 --benchmark-save="$KIND-leaderboard-reference"
run ffn 100 "${BENCH[@]}" benches/bench_ffn.py --ffn-world-sizes 1,2,4 --ffn-precisions bf16 --ffn-batches 16384 \
    --ffn-d-models 8192 --ffn-d-ffs 16384 --ffn-bandwidth-mb 128,512 --rounds 10 --warmup-steps 3 \
    --benchmark-save="$KIND-ffn"
run layouts 120 "${BENCH[@]}" benches/bench_layouts.py --layout-preset xl --layouts 2x2 --precisions bf16 \
    --contexts 512 --batch-size 4 --rounds 10 --warmup-steps 3 --benchmark-save="$KIND-layouts"
run multinode 100 python -m pytest -p no:cacheprovider -q -rs tests/test_multinode.py -m multigpu
cp .benchmarks/*/*"$KIND"-{leaderboard-handout,leaderboard-reference,ffn,layouts}.json "$OUT/" 2>/dev/null
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
