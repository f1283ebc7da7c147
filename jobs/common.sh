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

model_grid() {  # model_grid MODE LIMIT: the 100-point model grid, under -n 4 for MODE n4, else serially (serial,
    # serial2: a second for the noise floor), saved as one history named by MODE.
    # The serial run records each point's seconds in pytest's cache (save_grid_durations); the n4 run reads no cache,
    # so it hands out its units by the committed systems/bench/durations.json, as a fresh clone does.
    local mode=()
    [ "$1" = n4 ] && mode=(-n 4 -p no:cacheprovider)
    run "grid-$1" "$2" python -m pytest "${mode[@]}" benches/bench_model.py \
        -k "test_model or test_warmup" --presets tiny,small,medium,large,xl,2.7b --contexts 256,512,1024,2048 \
        --precisions bf16 --warmup-steps 2 --rounds 5 -q --benchmark-autosave --benchmark-save="$KIND-model-grid-$1"
}

save_grid_durations() {  # the serial grid's seconds into systems/bench/durations.json, to commit
    python -m systems.bench.schedule --save benches/bench_model.py
    python -m systems.bench.schedule -n 4  # the wall time of 4 workers, predicted from them
}

compare_grids() {  # compare_grids BASE OTHER: OTHER's per-point medians over BASE's, as distributions (all points, and
    # those of 10 ms or more, which the target counts), and the points furthest off among the latter
    KIND=$KIND python - "$1" "$2" <<'PY'
import glob, json, os, statistics, sys
kind, base, other = os.environ["KIND"], sys.argv[1], sys.argv[2]
runs = {mode: json.load(open(sorted(glob.glob(f".benchmarks/*/*{kind}-model-grid-{mode}.json"))[-1]))
        for mode in (base, other)}
medians = {mode: {b["fullname"]: b["stats"]["median"] for b in run["benchmarks"]} for mode, run in runs.items()}
ratios = {name: medians[other][name] / medians[base][name] for name in medians[base] if name in medians[other]}
for label, chosen in ("", ratios), (" of 10 ms or more", {name: ratio for name, ratio in ratios.items()
                                                          if medians[base][name] >= 0.010}):
    r = sorted(chosen.values())
    print(f"{len(r)} points{label} in both; {other}/{base} medians: min {r[0]:.3f}, 10% {r[len(r)//10]:.3f}, "
          f"median {statistics.median(r):.3f}, 90% {r[9*len(r)//10]:.3f}, max {r[-1]:.3f}; "
          f"within 3%: {sum(abs(x - 1) <= 0.03 for x in r)}")
for name, ratio in sorted(chosen.items(), key=lambda pair: -abs(pair[1] - 1))[:8]:
    print(f"  {ratio:.3f} {name.split('[')[-1].rstrip(']')} ({medians[base][name] * 1e3:.1f} ms)")
PY
}
