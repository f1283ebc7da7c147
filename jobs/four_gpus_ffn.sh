#!/usr/bin/env bash
# Section 8's SwiGLU layer on 4 GPUs (docs/course-2026.md), after a probe of lone all-reduces against back-to-back
# ones on 2 and 4 GPUs. Usage: bash jobs/four_gpus_ffn.sh COMMIT   (the history and logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 90 python jobs/allreduce_alone.py 2>&1 | tee $OUT/probe_allreduce.log
KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9][0-9]*" | head -1 | tr H h)x$(nvidia-smi -L | wc -l)
start=$(date +%s)
timeout -s INT -k 20 400 python -m pytest -p no:cacheprovider -q -rs --benchmark-autosave benches/bench_ffn.py \
    --ffn-world-sizes 1,2,4 --ffn-precisions bf16 --ffn-batches 16384 --ffn-d-models 8192 --ffn-d-ffs 16384 \
    --ffn-bandwidth-mb 128,512 --rounds 10 --warmup-steps 3 --benchmark-save="$KIND-ffn" > $OUT/ffn.log 2>&1
echo "ffn: exit $?, $(( $(date +%s) - start )) s"; tail -3 $OUT/ffn.log
cp .benchmarks/*/*"$KIND"-ffn.json "$OUT/"
