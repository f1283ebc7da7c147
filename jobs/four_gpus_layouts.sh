#!/usr/bin/env bash
# Issues "The 2026 edition" and "Several nodes" on a 4-GPU host: section 8's SwiGLU layer under every layout at
# sizes where bandwidth dominates, with the collectives that calibrate W; xl's layouts at 2 x 2 (DDP, FSDP, ours and
# torch's HSDP) with each axis timed alone; and two torchrun "nodes" of two GPUs each over NCCL.
# Usage: bash jobs/four_gpus_layouts.sh COMMIT   (the commit the copied tree is; logs and histories under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]*")x4

run() {  # run NAME LIMIT ARGS...: pytest ARGS within LIMIT seconds, its log in $OUT/NAME.log
    local name=$1 limit=$2 start=$(date +%s)
    shift 2
    timeout "$limit" python -m pytest -p no:cacheprovider -q -rs "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?, $(( $(date +%s) - start )) s: $(tail -1 "$OUT/$name.log")"
}

run ffn 220 benches/bench_ffn.py --ffn-world-sizes 1,2,4 --ffn-precisions bf16 --ffn-batches 16384 \
    --ffn-d-models 4096,8192 --ffn-d-ffs 16384 --ffn-bandwidth-mb 128,512 --rounds 10 --warmup-steps 3 \
    --benchmark-autosave --benchmark-save="${KIND,,}-ffn"
run layouts 150 benches/bench_layouts.py --layout-preset xl --layouts 2x2 --precisions bf16 --contexts 512 \
    --batch-size 4 --rounds 10 --warmup-steps 3 --benchmark-autosave --benchmark-save="${KIND,,}-layouts"
run multinode 150 tests/test_multinode.py -m multigpu
cp .benchmarks/*/*"${KIND,,}"-{ffn,layouts}.json "$OUT/"
