#!/usr/bin/env bash
# The gate's false failures on GPUs (docs/gate-error-rates.md): real A/A gates of a sub-millisecond attention
# forward (FlashAttention sweep, 1 x 1024, d 64, bf16, causal, our Triton kernel) against a commit of this very
# tree, one series per GPU at once, each gate's samples saved with its run (replay them at other turns or checks:
# python -m systems.bench.gate_rates replay).
#   [GPUS="0 1"] bash jobs/gpu_gate_rates.sh GATES TURNS     (under $OUT: storage-GPU/ and a log per gate)
set -u
gates=$1 turns=$2
repo=$(mktemp -d)/repo
cp -r . "$repo"
cd "$repo" && rm -rf .git && git init -q && git add -A && git -c user.name=gate -c user.email=gate@example.com \
    commit -qm "the tree, gated against itself"
export PYTHONPATH=. TRITON_CACHE_DIR=$(mktemp -d)
for gpu in ${GPUS:-$(seq 0 $(( $(nvidia-smi -L | wc -l) - 1 )))}; do
  (for gate in $(seq "$gates"); do
     CUDA_VISIBLE_DEVICES=$gpu python -m pytest benches/bench_attention.py --attn-grid full --attn-seqs 1024 \
       --attn-dims 64 --attn-precisions bf16 --attn-impls triton -k "flash_sweep and forward and not backward" \
       --rounds 50 --warmup-steps 5 --benchmark-gate median:5% --benchmark-gate-against HEAD \
       --benchmark-gate-turns "$turns" --benchmark-gate-accept-undecided --benchmark-storage "$OUT/storage-$gpu" \
       -p no:cacheprovider -q > "$OUT/gpu$gpu-gate$gate.log" 2>&1
     grep -h "seq1024" "$OUT/gpu$gpu-gate$gate.log" | grep -v "^test_" | tail -1
   done) &
done
wait
