# Sourced by the GPU jobs after their own environment: KIND (the card and how many, h100x4 or h200x2, which names
# the histories), LOGS, and the steps the jobs share.
KIND=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o "H[0-9][0-9]*" | head -1 | tr H h)
KIND=${KIND}x$(nvidia-smi -L | wc -l)
LOGS=$(mktemp -d)

run() {  # run NAME LIMIT COMMAND...: within LIMIT seconds (then interrupted: a benchmark saves a partial run)
    local name=$1 limit=$2 start=$(date +%s)
    shift 2
    timeout -s INT -k 20 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    echo "$name: exit $?, $(( $(date +%s) - start )) s: $(tail -1 "$LOGS/$name.log")"
}

model_grid() {  # model_grid serial|n4 LIMIT: the 100-point model grid, saved as one history named by its mode
    run "grid-$1" "$2" python -m pytest $([ "$1" = n4 ] && echo "-n 4") benches/bench_model.py \
        -k "test_model or test_warmup" --presets tiny,small,medium,large,xl,2.7b --contexts 256,512,1024,2048 \
        --precisions bf16 --warmup-steps 2 --rounds 5 -p no:cacheprovider -q --benchmark-autosave \
        --benchmark-save="$KIND-model-grid-$1"
}

compare_grids() {  # the n4 grid's per-point medians over the serial grid's, as a distribution
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
}
