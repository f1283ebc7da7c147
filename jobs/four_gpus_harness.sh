#!/usr/bin/env bash
# Issue "Many GPUs for real", on a 4-GPU host: the whole suite under -n 4 within 5 minutes (interrupted there).
# jobs/four_gpus_grid.sh has the benchmark grid. Usage: bash jobs/four_gpus_harness.sh COMMIT   (logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
nvidia-smi -L | tee $OUT/gpus.txt
start=$(date +%s)
timeout -s INT -k 20 300 python -m pytest -n 4 tests/ -p no:cacheprovider -q -rs --durations=25 > $OUT/tests_n4.log 2>&1
echo "tests -n 4: exit $?, $(( $(date +%s) - start )) s"
grep -E "passed|failed|error" $OUT/tests_n4.log | tail -3
grep -A6 "= GPU tests =" $OUT/tests_n4.log
grep -E "^FAILED|^ERROR" $OUT/tests_n4.log | head -20

