"""The gate's error rates: how often it fails unchanged code, and how often it catches a slowdown.

    python -m systems.bench.gate_rates simulate --gates 20 --turns 3 --out gate-rates.json   # on a GPU
    python -m systems.bench.gate_rates replay STORAGE --turns 2,3,5 --check median:5%        # real gates' evidence

`simulate` runs the leaderboard's attention and a sub-millisecond point in turns (baseline and working tree back to
back in this process, alternating which goes first; the gate itself runs two processes passing a baton, which real
gates measure: jobs/gpu_gate_rates.sh), each run its rounds after a warm-up, and decides with the gate's own
statistics (systems.bench.verdicts). A slowdown is extra GPU time after each call
(torch.cuda._sleep), calibrated to its share of the point's median. Both "trees" run in this process, each run on
fresh inputs. `replay` decides again from the samples that real gates saved with their runs (GATE_RECORD), at
fewer turns (the turns a shorter gate would have run, in its order) or another threshold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pytest_benchmark.utils import parse_compare_fail

from systems.bench.gate import BASELINE, GATE_RECORD, WORK, describe, turn_orders
from systems.bench.verdicts import decide

SLOWDOWNS = (0.0, 0.05, 0.10)  # A/A, and two slowdowns: at the 5% threshold, and twice it


def leaderboard_step() -> Callable[[], None]:
    """(16, 16384, 64) bf16 causal forward+backward through torch.compile(FlashAttentionTriton.apply), on inputs
    drawn anew for each run."""
    from systems.attention import FlashAttentionTriton

    flash = torch.compile(FlashAttentionTriton.apply)

    def make():
        q, k, v = (torch.randn(16, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))

        def step():
            flash(q, k, v, True).sum().backward()
            q.grad = k.grad = v.grad = None
        return step
    return make


def sub_millisecond_step() -> Callable[[], None]:
    """A forward of the FlashAttention sweep's (1, 1024, 64) bf16 causal point: well under a millisecond, host time
    included, as bench_attention times it."""
    from systems.attention import FlashAttentionTriton

    def make():
        q, k, v = (torch.randn(1, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        return lambda: FlashAttentionTriton.apply(q, k, v, True)
    return make


POINTS = {"leaderboard": (leaderboard_step, 10), "sub-ms": (sub_millisecond_step, 50)}  # step, default rounds


def run_rounds(make: Callable[[], Callable[[], None]], rounds: int, sleep_cycles: int) -> list[float]:
    """`rounds` timed calls on fresh inputs, each ended by a synchronize, as time_on_device times them."""
    step = make()
    times = []
    for _ in range(2 + rounds):  # two warm-up calls
        start = time.perf_counter()
        step()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[2:]


def cycles_per_second() -> float:
    """How many torch.cuda._sleep cycles make a second on this GPU, measured."""
    cycles = 10_000_000
    torch.cuda._sleep(1)  # loads the kernel: a first call's lazy module load would count as sleep
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return cycles / (time.perf_counter() - start)


def simulate(make: Callable[[], Callable[[], None]], rounds: int, slowdown: float, gates: int, turns: int,
             check) -> dict:
    """`gates` gates of `turns` turns each; the working tree `slowdown` slower."""
    base = statistics.median(run_rounds(make, rounds, 0))
    extra = int(slowdown * base * cycles_per_second())
    verdicts, samples = [], []
    for _ in range(gates):
        timings = {BASELINE: [], WORK: []}
        for order in turn_orders(turns):  # as the gate orders its turns
            for side in order:
                timings[side].append({"point": run_rounds(make, rounds, extra if side == WORK else 0)})
        [verdict] = decide(timings[BASELINE], timings[WORK], check)
        verdicts.append(verdict)
        samples.append({side: [run["point"] for run in runs] for side, runs in timings.items()})
    return {"slowdown": slowdown, "median_s": base, "statuses": [v.status for v in verdicts],
            "changes": [v.change for v in verdicts], "intervals": [(v.low, v.high) for v in verdicts],
            **tally(verdicts), "samples": samples}


def tally(verdicts) -> dict:
    return {"slower": sum(v.fails for v in verdicts), "undecided": sum(v.undecided for v in verdicts),
            "ok": sum(v.status == "ok" for v in verdicts)}


def replay(storage: Path, turns: list[int], check) -> dict:
    """Each saved gate's verdict again at each of `turns` (at most the turns it ran), from the samples of its last
    turns: the orders a gate of that many turns runs, ending with the session's own run."""
    records = [json.loads(path.read_text())[GATE_RECORD] for path in sorted(storage.glob("*/*.json"))]
    results = {}
    for k in turns:
        verdicts = []
        for record in records:
            ran = record["turns"]
            if k > ran:
                raise SystemExit(f"a gate of {ran} turns cannot be replayed at {k}")
            chosen = range(ran - k, ran)
            for name, point in record["points"].items():
                base = [{name: point["baseline"][t]} for t in chosen]
                work = [{name: point["work"][t]} for t in chosen]
                verdicts += decide(base, work, check)
        results[k] = {"gates": len(verdicts), **tally(verdicts)}
        print(f"{k} turns, {describe(check)}: {results[k]['slower']} slower, {results[k]['undecided']} undecided, "
              f"{results[k]['ok']} ok of {len(verdicts)}")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m systems.bench.gate_rates", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    simulated = commands.add_parser("simulate", help="gates simulated on this GPU")
    simulated.add_argument("--gates", type=int, default=20)
    simulated.add_argument("--turns", type=int, default=3)
    simulated.add_argument("--out", type=Path, required=True)
    simulated.add_argument("--points", type=lambda text: text.split(","), default=list(POINTS))
    replayed = commands.add_parser("replay", help="saved gates decided again")
    replayed.add_argument("storage", type=Path, help="the --benchmark-storage folder the gates saved into")
    replayed.add_argument("--turns", type=lambda text: [int(k) for k in text.split(",")], required=True)
    for command in (simulated, replayed):
        command.add_argument("--check", type=parse_compare_fail, default=parse_compare_fail("median:5%"))
    args = parser.parse_args(argv)
    if args.command == "replay":
        replay(args.storage, args.turns, args.check)
        return
    results = {"gpu": torch.cuda.get_device_name(), "turns": args.turns, "gates": args.gates, "points": {}}
    for name in args.points:
        make_step, rounds = POINTS[name]
        make = make_step()
        results["points"][name] = [simulate(make, rounds, slowdown, args.gates, args.turns, args.check)
                                   for slowdown in SLOWDOWNS]
        for row in results["points"][name]:
            print(f"{name}: +{row['slowdown']:.0%} (median {row['median_s'] * 1e3:.3f} ms): {row['slower']} slower, "
                  f"{row['undecided']} undecided, {row['ok']} ok of {args.gates} gates")
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
