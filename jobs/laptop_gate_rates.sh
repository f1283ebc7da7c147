#!/usr/bin/env bash
# The gate's error rates on a laptop CPU (docs/gate-error-rates.md): real gates of bench_model's tiny forward
# against HEAD from a clone of HEAD with a slowdown planted, each gate's samples saved with its run, then replayed
# at fewer turns (python -m systems.bench.gate_rates replay).
#   jobs/laptop_gate_rates.sh OUT GATES TURNS PLANT [ROUNDS]   PLANT: none, sleep (0.3 s in TransformerLM.forward)
#                                                  or twice (forward_loss runs the model twice: 2x); ROUNDS: 3,
#                                                  the issue's --rounds (a gate takes --benchmark-gate-rounds, 30, at least)
set -euo pipefail
out=$(realpath -m "$1") gates=$2 turns=$3 plant=$4 rounds=${5:-3}
root=$(git rev-parse --show-toplevel)
clone=$(mktemp -d)/planted
git -C "$root" worktree add -q --detach "$clone" HEAD
trap 'git -C "$root" worktree remove --force "$clone"' EXIT
case $plant in
  none) ;;
  sleep) sed -i '0,/^        """tokens: (batch, seq) integer ids/s//        __import__("time").sleep(0.3)\n&/' \
           "$clone/systems/model.py" ;;
  twice) sed -i 's/^        return model(tokens, targets)$/        model(tokens, targets)\n&/' "$clone/systems/step.py" ;;
esac
git -C "$clone" diff --stat
mkdir -p "$out"
for gate in $(seq "$gates"); do
  (cd "$clone" && python -m pytest benches/bench_model.py --precisions fp32 --rounds "$rounds" --warmup-steps 1 \
     -k 'test_model and forward and not backward' --benchmark-gate median:5% --benchmark-gate-against HEAD \
     --benchmark-gate-turns "$turns" --benchmark-gate-accept-undecided --benchmark-storage "$out/storage" \
     -p no:cacheprovider -q) > "$out/gate-$gate.log" 2>&1 || { echo "gate $gate failed"; tail "$out/gate-$gate.log"; }
  grep -h "tiny-2025" "$out/gate-$gate.log" | grep -v "^test_model" | tail -1 || true
done
