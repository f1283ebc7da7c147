"""The 2026 leaderboard's training step timed exactly as the course times it (systems.leaderboard: the handout's
inputs, `cross_entropy(res, targets).sum()`, zero_grad(set_to_none=True), AdamW, triton.testing.do_bench with
rep=30_000, warmup=10_000), our model and the course's reference (cs336_basics) on the same GPUs and inputs.

The handout's run on 2 GPUs (docs/course-2026.md), from an empty cache:

    TRITON_CACHE_DIR=$(mktemp -d) pytest benches/bench_leaderboard.py --leaderboard-preset leaderboard-2026 \\
        --leaderboard-context 32768 --leaderboard-world-size 2 --leaderboard-checkpoint attn-keep8 --fused all \\
        --loss-chunk 4096

(every block checkpointed, `every1`, on 80 GB cards: attn-keep8 needs an H200's memory.)

The CPU default is the leaderboard's shape made tiny at context 64 on 2 gloo ranks, with do_bench's algorithm
on the host clock and budgets of a few milliseconds (--leaderboard-rep-ms, --leaderboard-warmup-ms: the
handout's 30000 and 10000 by default on a GPU), so that CI runs the code path. The point records the budgets, and
the measurements which timer ran. pytest-benchmark's rounds are do_bench's timed steps, each as long as its
slowest rank; the headline figure is do_bench's mean (the handout's), the slowest rank's.
"""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from systems.bench.options import grid_of, points_or_usage_error
from systems.bench.schema import LeaderboardMeasured, LeaderboardPoint
from systems.bench.timing import record_measured, record_point, record_timings, seconds_since_process_start
from systems.bench.training import BACKEND, on_rank_gpus
from systems.leaderboard import (CPU_REP_MS, CPU_WARMUP_MS, HANDOUT_REP_MS, HANDOUT_WARMUP_MS, Reference,
                                 run_leaderboard)
from systems.model import get_config

REFERENCE = Reference()


def leaderboard_grid(grid) -> list[LeaderboardPoint]:
    gpu = torch.cuda.is_available()
    rep = grid.leaderboard_rep_ms or (HANDOUT_REP_MS if gpu else CPU_REP_MS)
    warmup = grid.leaderboard_warmup_ms or (HANDOUT_WARMUP_MS if gpu else CPU_WARMUP_MS)
    world = grid.leaderboard_world_size
    if grid.leaderboard_batch % world:
        raise pytest.UsageError(f"--leaderboard-batch {grid.leaderboard_batch} does not split evenly over "
                                f"--leaderboard-world-size {world} ranks")
    points = []
    for model in grid.leaderboard_models:
        shape = (model, grid.leaderboard_preset, grid.edition, grid.leaderboard_precision, grid.leaderboard_batch,
                 grid.leaderboard_context, world)
        if model != "ours":
            points.append(LeaderboardPoint(*shape, None, None, None, rep, warmup))
            continue
        points += [LeaderboardPoint(*shape, grid.attention, scheme, grid.loss_chunk, rep, warmup, fused, compile)
                   for scheme, fused, compile in itertools.product(grid.leaderboard_checkpoint, grid.fused,
                                                                    grid.compile_blocks)]
    return points_or_usage_error(points, "test_leaderboard", "--leaderboard-models", "name ours or cs336_basics")


def pytest_generate_tests(metafunc):
    if "leaderboard_point" in metafunc.fixturenames:
        points = leaderboard_grid(grid_of(metafunc.config))
        metafunc.parametrize("leaderboard_point", on_rank_gpus(points))


def config_of(point: LeaderboardPoint, device: torch.device):
    """Ours: the preset with its levers (nested checkpointing resolved for the rank's batch); the reference: the
    preset's sizes alone."""
    if point.model != "ours":
        return get_config(point.preset, point.edition, context_length=point.context)
    return point.spec().resolved(device.type).config()


def test_leaderboard(benchmark, leaderboard_point, rank_pools, device, skip_on_oom):
    point = leaderboard_point
    if point.model == "cs336_basics" and importlib.util.find_spec(REFERENCE.package) is None:
        pytest.skip("the course's reference model: cs336_basics is not importable here (pip install -e "
                    "assignment2-systems/cs336-basics; docs/course-2026.md)")
    benchmark.group = f"leaderboard-{point.preset}-ctx{point.context}"
    record_point(benchmark, point)
    with skip_on_oom:
        ranks = rank_pools.run(point.world_size, BACKEND, run_leaderboard, point.model, config_of(point, device),
                               point.precision, point.batch, point.rep_ms, point.warmup_ms)
    cold_start = seconds_since_process_start()
    timings = [rank["timing"] for rank in ranks]
    record_timings(benchmark, [[ms / 1e3 for ms in timing.times_ms] for timing in timings])
    medians = [timing.median_ms for timing in timings]
    peaks = [rank["peak_memory_mb"] for rank in ranks]
    record_measured(benchmark, LeaderboardMeasured(
        timer=timings[0].timer, mean_s=max(timing.mean_ms for timing in timings) / 1e3,
        median_s=None if None in medians else max(medians) / 1e3, warmup_steps=timings[0].warmup_steps,
        timed_steps=len(timings[0].times_ms), rep_ms_run=timings[0].rep_ms, warmup_ms_run=timings[0].warmup_ms,
        first_loss=ranks[0]["first_loss"], peak_memory_mb_per_rank=None if None in peaks else peaks,
        cold_start_s=cold_start))
