#!/usr/bin/env bash
# The gate's error rates on GPUs (docs/gate-error-rates.md): real gates against a commit of this very tree, one
# series per GPU at once, each gate's samples saved with its run (replay them at other turns or checks:
# python -m systems.bench.gate_rates replay).
#   POINT=sub-ms       the FlashAttention sweep's 1 x 1024, d 64, bf16 causal forward (our Triton kernel), 50 rounds
#   POINT=leaderboard  the leaderboard's 16 x 16384, d 64, bf16 causal forward + backward (compiled), 10 rounds
# PLANTS (leaderboard only) is the series' cycle of slowdowns, gate after gate: 0 gates unchanged code (A/A); a
# fraction f plants GPU time after each attention call of the working tree (torch.cuda._sleep), f of the point's
# median as measured here. UNTIL stops starting gates after that many seconds.
#   [GPUS="0 1"] [POINT=sub-ms] [PLANTS=0] [UNTIL=seconds] bash jobs/gpu_gate_rates.sh GATES TURNS
#   (under $OUT: storage-GPU/, a log per gate and a line per verdict in verdicts.txt)
set -u
gates=$1 turns=$2 point=${POINT:-sub-ms} plants=(${PLANTS:-0}) until=${UNTIL:-999999}
case $point in
  sub-ms) select=(benches/bench_attention.py --attn-grid full --attn-seqs 1024 --attn-dims 64 --attn-precisions bf16
                  --attn-impls triton -k "flash_sweep and forward and not backward" --rounds 50 --warmup-steps 5)
          row=seq1024 ;;
  leaderboard) select=(benches/bench_attention.py -k "test_leaderboard and triton and forward_backward and not after"
                       --rounds 10 --warmup-steps 2)
               row=seq16384 ;;
  *) echo "POINT: sub-ms or leaderboard, not $point" >&2; exit 2 ;;
esac
if [ "$point" = sub-ms ] && [ "${plants[*]}" != 0 ]; then echo "PLANTS: the sub-ms point is gated A/A only" >&2; exit 2; fi
repo=$(mktemp -d)/repo
cp -r . "$repo"
cd "$repo" && rm -rf .git && git init -q && git add -A && git -c user.name=gate -c user.email=gate@example.com \
    commit -qm "the tree, gated against itself"
export PYTHONPATH=. TRITON_CACHE_DIR=$(mktemp -d)

# A plant: the leaderboard's compiled attention followed by PLANT_CYCLES of GPU sleep, in the working tree only.
plant='        flash = (lambda f, cycles: lambda *a: (f(*a), torch.cuda._sleep(cycles))[0])(flash, int(__import__("os").environ["PLANT_CYCLES"]))'
sed -i "/^        flash = torch.compile(FlashAttentionTriton.apply)\$/a\\$plant" benches/bench_attention.py
git diff --quiet && { echo "the plant did not apply" >&2; exit 1; }
git diff > "$OUT/plant.diff"
git checkout -q benches/bench_attention.py
cycles_of() {  # the sleep cycles that add fraction $1 of the leaderboard step's median on GPU $2
  CUDA_VISIBLE_DEVICES=$2 python -c "
import statistics
from systems.bench.gate_rates import cycles_per_second, leaderboard_step, run_rounds
median = statistics.median(run_rounds(leaderboard_step(), 30, 0))
print(int($1 * median * cycles_per_second()))"
}

start=$(date +%s)
for gpu in ${GPUS:-$(seq 0 $(( $(nvidia-smi -L | wc -l) - 1 )))}; do
  (declare -A cycles
   for f in "${plants[@]}"; do [ "$f" = 0 ] || cycles[$f]=$(cycles_of "$f" "$gpu"); done
   echo "GPU $gpu: sleep cycles per plant: $(for f in "${!cycles[@]}"; do echo -n "$f=${cycles[$f]} "; done)"
   tree=$(mktemp -d)/tree
   cp -r . "$tree"  # each series plants in its own copy of the working tree
   cd "$tree"
   for gate in $(seq "$gates"); do
     [ $(( $(date +%s) - start )) -lt "$until" ] || break
     f=${plants[$(( (gate - 1) % ${#plants[@]} ))]}
     git checkout -q benches/bench_attention.py
     [ "$f" = 0 ] || git apply "$OUT/plant.diff"
     log=$OUT/gpu$gpu-gate$gate-plant$f.log
     CUDA_VISIBLE_DEVICES=$gpu PLANT_CYCLES=${cycles[$f]:-0} python -m pytest "${select[@]}" \
       --benchmark-gate median:5% --benchmark-gate-against HEAD --benchmark-gate-turns "$turns" \
       --benchmark-gate-accept-undecided --benchmark-storage "$OUT/storage-$gpu" -p no:cacheprovider -q \
       > "$log" 2>&1
     echo "gpu $gpu gate $gate plant $f: $(grep -h "$row" "$log" | grep -v "^test_" | tail -1)" | tee -a "$OUT/verdicts.txt"
   done) &
done
wait
