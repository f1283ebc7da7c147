#!/usr/bin/env bash
# The default tier on a 2-GPU host, one half of the test files per call (a call runs at most 10 minutes):
# HALF a is tests/test_[a-f]* up to test_float_sums, b the rest. Under -n 2, each item's seconds recorded.
# Usage: bash jobs/two_gpus_suite.sh COMMIT HALF [LIMIT]   (log and junit XML under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
HALF=$2 LIMIT=${3:-540}
nvidia-smi -L | tee -a "$OUT/gpus.txt"
files=()
for file in tests/test_*.py; do
    name=$(basename "$file")
    if [[ ($HALF == a && $name < test_fsdp) || ($HALF == b && ! $name < test_fsdp) ]]; then files+=("$file"); fi
done
start=$(date +%s)
timeout -s INT -k 20 "$LIMIT" python -m pytest -n 2 "${files[@]}" -q -rs --durations=25 \
    --junitxml="$OUT/tests_n2_$HALF.xml" > "$OUT/tests_n2_$HALF.log" 2>&1
echo "half $HALF (${#files[@]} files): exit $?, $(( $(date +%s) - start )) s: $(grep -E "passed|failed" "$OUT/tests_n2_$HALF.log" | tail -1)"
grep -E "^FAILED|^ERROR" "$OUT/tests_n2_$HALF.log" | head -20
