#!/usr/bin/env bash
# The suite on a 4-GPU host (README: Tests): the tiers TIERS (default: the default tier) under -n 4, RUNS times in
# a row, each stopped after LIMIT seconds. The first run records each item's seconds in pytest's cache and the next
# ones hand out the longest units first by them. jobs/four_gpus_grid.sh has the benchmark grid.
# Usage: bash jobs/four_gpus_harness.sh COMMIT [RUNS] [TIERS] [LIMIT]   (logs and junit XML under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
RUNS=${2:-1} TIERS=${3:-default} LIMIT=${4:-300}
nvidia-smi -L | tee -a $OUT/gpus.txt
for run in $(seq "$RUNS"); do
    name=tests_n4_${TIERS//,/-}_$run
    start=$(date +%s)
    timeout -s INT -k 20 "$LIMIT" python -m pytest -n 4 tests/ --tiers "$TIERS" -q -rs --durations=25 \
        --junitxml="$OUT/$name.xml" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?, $(( $(date +%s) - start )) s: $(grep -E "passed|failed" "$OUT/$name.log" | tail -1)"
    grep -E "^FAILED|^ERROR" "$OUT/$name.log" | head -20
    grep -A4 "= workers =" "$OUT/$name.log" | tail -4
done
cp .pytest_cache/v/systems-lab/durations "$OUT/durations_cache.json"  # each item's seconds, for schedule --save
python -m systems.bench.schedule -n 8 tests/ | tee $OUT/predicted_n8.txt
