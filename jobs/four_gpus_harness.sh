#!/usr/bin/env bash
# Issue "Many GPUs for real", on a 4-GPU host: the whole suite under -n 4, then a 100-point GPU benchmark grid
# serially and under -n 4 in the same job, each saved as one history, with each point's median compared.
# Usage: bash jobs/four_gpus_harness.sh COMMIT   (the commit the copied tree is; logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
nvidia-smi -L | tee $OUT/gpus.txt
KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9]*" | tr H h)x4
start=$(date +%s)
timeout -s INT -k 20 300 python -m pytest -n 4 tests/ -p no:cacheprovider -q -rs --durations=25 > $OUT/tests_n4.log 2>&1
echo "tests -n 4: exit $?, $(( $(date +%s) - start )) s"
grep -E "passed|failed|error" $OUT/tests_n4.log | tail -3
grep -A6 "= GPU tests =" $OUT/tests_n4.log
grep -E "^FAILED|^ERROR" $OUT/tests_n4.log | head -20

for mode in serial n4; do
    workers=$([ $mode = n4 ] && echo "-n 4" || echo "")
    start=$(date +%s)
    timeout -s INT -k 20 $([ $mode = n4 ] && echo 80 || echo 160) python -m pytest $workers benches/bench_model.py -k "test_model or test_warmup" \
        --presets tiny,small,medium,large,xl,2.7b --contexts 256,512,1024,2048 --precisions bf16 \
        --warmup-steps 2 --rounds 5 -p no:cacheprovider -q --benchmark-autosave \
        --benchmark-save=$KIND-model-grid-$mode > $OUT/grid_$mode.log 2>&1
    echo "grid $mode: exit $?, $(( $(date +%s) - start )) s"; tail -1 $OUT/grid_$mode.log
done
cp .benchmarks/*/*$KIND-model-grid-*.json $OUT/
KIND=$KIND python - <<'PY'
import glob, json, os, statistics
kind = os.environ["KIND"]
runs = {mode: json.load(open(next(iter(glob.glob(f".benchmarks/*/*{kind}-model-grid-{mode}.json")))))
        for mode in ("serial", "n4")}
medians = {mode: {b["fullname"]: b["stats"]["median"] for b in run["benchmarks"]} for mode, run in runs.items()}
ratios = sorted(medians["n4"][name] / medians["serial"][name] for name in medians["serial"] if name in medians["n4"])
print(f"{len(ratios)} points in both; n4/serial medians: min {ratios[0]:.3f}, 10% {ratios[len(ratios)//10]:.3f}, "
      f"median {statistics.median(ratios):.3f}, 90% {ratios[9*len(ratios)//10]:.3f}, max {ratios[-1]:.3f}; "
      f"within 3%: {sum(abs(r - 1) <= 0.03 for r in ratios)}")
print("histogram:", {f"{lo:.2f}": sum(lo <= r < lo + 0.01 for r in ratios) for lo in [0.95 + 0.01 * i for i in range(11)]})
PY
