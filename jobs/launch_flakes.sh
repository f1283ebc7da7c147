#!/usr/bin/env bash
# Issue "Fast feedback", item 4: launches of two torchrun nodes, again and again, counting those that fail (the
# rank abort at interpreter exit, about one in 50 before `python -m systems.parallel` left by os._exit, and the
# one-node reference's SIGSEGV). Each round is one pytest run of every two-node training test (every variant on
# gloo, and on NCCL where 4 GPUs are here) with the one-node reference's rank pool; PARALLEL rounds run at once,
# each on its own rendezvous. A failed round's log is kept.
# Usage: bash jobs/launch_flakes.sh ROUNDS [PARALLEL] [OUT]   (prints one line a round, then the totals)
set -u
ROUNDS=$1 PARALLEL=${2:-1} OUT=${3:-${OUT:-out/launch_flakes}}
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT"

round() {
    local log="$OUT/round_$1.log"
    python -m pytest -p no:cacheprovider -q -rs tests/test_multinode.py --tiers default,launch -k two_nodes \
        > "$log" 2>&1
    local code=$? summary
    summary=$(grep -E "passed|failed|error" "$log" | tail -1)
    echo "round $1: exit $code: $summary"
    [ "$code" = 0 ] && rm "$log"
}

start=$(date +%s)
{
    for r in $(seq "$ROUNDS"); do
        round "$r" &
        while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
    done
    wait
} | tee "$OUT/rounds.txt"
launches=$(grep -oE "[0-9]+ (passed|failed)" "$OUT/rounds.txt" | awk '{n += $1} END {print n + 0}')
failed=$(grep -c -v "exit 0:" "$OUT/rounds.txt")
echo "$ROUNDS rounds, $launches two-node launches, $failed rounds failed, $(( $(date +%s) - start )) s"
