#!/usr/bin/env bash
# Issues "Many GPUs for real", "Trust" and "Performance" on a 4-GPU host, one part at a time: the fused kernels' and
# regional compilation's tests on the GPUs; the gate's error rates on one GPU; a 100-point GPU benchmark grid
# serially and under -n 4 in the same job, each saved as one history, each point's median compared.
# Usage: bash jobs/four_gpus_grid.sh COMMIT   (the commit the copied tree is; logs and histories under $OUT)
set -u
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 SYSTEMS_LAB_COMMIT=$1
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9][0-9]*" | head -1 | tr H h)x4
LOGS=$(mktemp -d)

run() {  # run NAME LIMIT COMMAND...: within LIMIT seconds (then interrupted: a benchmark saves a partial run)
    local name=$1 limit=$2 start=$(date +%s)
    shift 2
    timeout -s INT -k 20 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "$name: exit $?, $(( $(date +%s) - start )) s: $(tail -1 "$LOGS/$name.log")"
}

run kernel-tests 170 python -m pytest -p no:cacheprovider -q -rs -x -n 2 tests/test_kernels.py tests/test_compile.py
grep -E "^(FAILED|ERROR)|graph breaks not at" -A3 "$LOGS/kernel-tests.log" | head -30
CUDA_VISIBLE_DEVICES=0 run gate-rates 120 python -m systems.bench.gate_rates --gates 10 --turns 3 \
    --out "$OUT/gate-rates.json"
cat "$LOGS/gate-rates.log"
for mode in serial n4; do
    run "grid-$mode" "$([ $mode = n4 ] && echo 80 || echo 160)" python -m pytest $([ $mode = n4 ] && echo "-n 4") \
        benches/bench_model.py -k "test_model or test_warmup" --presets tiny,small,medium,large,xl,2.7b \
        --contexts 256,512,1024,2048 --precisions bf16 --warmup-steps 2 --rounds 5 -p no:cacheprovider -q \
        --benchmark-autosave --benchmark-save="$KIND-model-grid-$mode"
done
cp .benchmarks/*/*"$KIND"-model-grid-*.json "$OUT/"
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
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
