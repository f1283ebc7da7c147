"""The same-job gate's error rates on this GPU: how often it trips on unchanged code, and how often it catches a
5% and a 10% slowdown, at the leaderboard's attention shape and at a sub-millisecond point.

    python -m systems.bench.gate_rates --gates 10 --turns 3 --out gate-rates.json

Each simulated gate runs the point in turns as --benchmark-gate-against does (baseline and working tree back to
back, alternating which goes first), each run `--rounds` timed calls after a warm-up, and decides with the gate's
own statistics (systems.bench.verdicts). A slowdown is extra GPU time after each call (torch.cuda._sleep),
calibrated to the share of the point's median. Both "trees" run in this process: the spread between processes
(allocations, autotuning) is not in it; the GPU test of the real gate (tests/test_benchmark_gate.py) covers that.
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

from systems.bench.gate import BASELINE, WORK, turn_orders
from systems.bench.verdicts import decide

SLOWDOWNS = (0.0, 0.05, 0.10)  # A/A, and the two slowdowns the issue asks for


def leaderboard_step() -> Callable[[], None]:
    """(16, 16384, 64) bf16 causal forward+backward through torch.compile(FlashAttentionTriton.apply)."""
    from systems.attention import FlashAttentionTriton

    flash = torch.compile(FlashAttentionTriton.apply)
    q, k, v = (torch.randn(16, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def step():
        flash(q, k, v, True).sum().backward()
        q.grad = k.grad = v.grad = None
    return step


def sub_millisecond_step() -> Callable[[], None]:
    """A forward of the FlashAttention sweep's (1, 1024, 64) bf16 causal point: well under a millisecond, host time
    included, as bench_attention times it."""
    from systems.attention import FlashAttentionTriton

    q, k, v = (torch.randn(1, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return lambda: FlashAttentionTriton.apply(q, k, v, True)


POINTS = {"leaderboard": (leaderboard_step, 10), "sub-ms": (sub_millisecond_step, 50)}  # step, default rounds


def run_seconds(step: Callable[[], None], rounds: int, sleep_cycles: int) -> float:
    """The median of `rounds` timed calls, each ended by a synchronize, as time_on_device times them."""
    times = []
    for _ in range(2 + rounds):  # two warm-up calls
        start = time.perf_counter()
        step()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def cycles_per_second() -> float:
    """How many torch.cuda._sleep cycles make a second on this GPU, measured."""
    cycles = 10_000_000
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return cycles / (time.perf_counter() - start)


def simulate(step: Callable[[], None], rounds: int, slowdown: float, gates: int, turns: int, check) -> dict:
    """`gates` gates of `turns` turns each; the working tree `slowdown` slower."""
    base = run_seconds(step, rounds, 0)
    extra = int(slowdown * base * cycles_per_second())
    verdicts = []
    for _ in range(gates):
        timings = {BASELINE: [], WORK: []}
        for order in turn_orders(turns):  # as the gate orders its turns
            for side in order:
                seconds = run_seconds(step, rounds, extra if side == WORK else 0)
                timings[side].append({"point": seconds})
        [verdict] = decide(timings[BASELINE], timings[WORK], check)
        verdicts.append(verdict)
    return {"slowdown": slowdown, "median_s": base, "statuses": [v.status for v in verdicts],
            "changes": [v.change for v in verdicts], "intervals": [(v.low, v.high) for v in verdicts],
            "tripped": sum(v.slower for v in verdicts), "too_noisy": sum(v.status == "too noisy" for v in verdicts)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m systems.bench.gate_rates", description=__doc__.splitlines()[0])
    parser.add_argument("--gates", type=int, default=10)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--check", type=parse_compare_fail, default=parse_compare_fail("median:5%"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    results = {"gpu": torch.cuda.get_device_name(), "turns": args.turns, "gates": args.gates, "points": {}}
    for name, (make_step, rounds) in POINTS.items():
        step = make_step()
        results["points"][name] = [simulate(step, rounds, slowdown, args.gates, args.turns, args.check)
                                   for slowdown in SLOWDOWNS]
        for row in results["points"][name]:
            print(f"{name}: +{row['slowdown']:.0%} (median {row['median_s'] * 1e3:.3f} ms): {row['tripped']} of "
                  f"{args.gates} gates tripped, {row['too_noisy']} too noisy")
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
