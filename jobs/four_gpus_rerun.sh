#!/usr/bin/env bash
# After the fix that gives each xdist worker its own GPU where the package is not installed (conftest.py loads
# the plugin first): the 100-point grid under -n 4 and serially, then the suite under -n 4 until its limit (none
# with 0). Usage: bash jobs/four_gpus_rerun.sh COMMIT TESTS_LIMIT_S   (histories and logs under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9][0-9]*" | head -1 | tr H h)x4
for mode in n4 serial; do
    start=$(date +%s)
    timeout -s INT -k 15 "$([ $mode = n4 ] && echo 60 || echo 110)" python -m pytest $([ $mode = n4 ] && echo "-n 4") \
        benches/bench_model.py -k "test_model or test_warmup" --presets tiny,small,medium,large,xl,2.7b \
        --contexts 256,512,1024,2048 --precisions bf16 --warmup-steps 2 --rounds 5 -p no:cacheprovider -q \
        --benchmark-autosave --benchmark-save="$KIND-model-grid-$mode" > "$OUT/grid-$mode.log" 2>&1
    echo "grid $mode: exit $?, $(( $(date +%s) - start )) s: $(tail -1 "$OUT/grid-$mode.log")"
done
cp .benchmarks/*/*"$KIND"-model-grid-*.json "$OUT/"
KIND=$KIND python - <<'PY'
import glob, json, os, statistics
kind = os.environ["KIND"]
runs = {mode: json.load(open(sorted(glob.glob(f".benchmarks/*/*{kind}-model-grid-{mode}.json"))[-1]))
        for mode in ("serial", "n4")}
medians = {mode: {b["fullname"]: b["stats"]["median"] for b in run["benchmarks"]} for mode, run in runs.items()}
ratios = sorted(medians["n4"][name] / medians["serial"][name] for name in medians["serial"] if name in medians["n4"])
print(f"{len(ratios)} points in both; n4/serial medians: min {ratios[0]:.3f}, 10% {ratios[len(ratios)//10]:.3f}, "
      f"median {statistics.median(ratios):.3f}, 90% {ratios[9*len(ratios)//10]:.3f}, max {ratios[-1]:.3f}; "
      f"within 3%: {sum(abs(r - 1) <= 0.03 for r in ratios)}")
PY
[ "$2" = 0 ] && exit
start=$(date +%s)
timeout -s INT -k 15 "$2" python -m pytest -n 4 tests/ -p no:cacheprovider -q -rs --durations=15 > "$OUT/tests-n4.log" 2>&1
echo "tests -n 4: exit $?, $(( $(date +%s) - start )) s"
grep -E "passed|failed" "$OUT/tests-n4.log" | tail -2
grep -E "^(FAILED|ERROR)" "$OUT/tests-n4.log" | head -20
