#!/usr/bin/env bash
# After the fix that gives each xdist worker its own GPU where the package is not installed (conftest.py loads
# the plugin first): the 100-point grid under -n 4 and serially, then the suite under -n 4 until its limit (none
# with 0). Usage: bash jobs/four_gpus_rerun.sh COMMIT TESTS_LIMIT_S   (histories and logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
source "$(dirname "$0")/common.sh"

model_grid n4 60
model_grid serial 110
cp .benchmarks/*/*"$KIND"-model-grid-*.json "$OUT/"
compare_grids
if [ "$2" != 0 ]; then
    run tests-n4 "$2" python -m pytest -n 4 tests/ -p no:cacheprovider -q -rs --durations=15
    grep -E "^(FAILED|ERROR)" "$LOGS/tests-n4.log" | head -20
fi
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
