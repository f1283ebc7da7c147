"""Section 8 of the 2026 handout measured: one SwiGLU feed-forward layer (input (B, D), weights (D, D_FF), forward
and backward) under DP, FSDP, TP (ours and torch's) and FSDP x TP, beside the collectives' bandwidth that
calibrates the section's W.

The full-size run on 4 GPUs (docs/course-2026.md):

    pytest benches/bench_ffn.py --ffn-world-sizes 1,2,4 --ffn-precisions bf16 --ffn-batches 4096,16384 \\
        --ffn-d-models 4096,8192 --ffn-d-ffs 16384,28672 --ffn-bandwidth-mb 128,512 --rounds 10

The CPU default is a tiny layer on 1, 2 and 4 gloo ranks, so CI runs every code path. A point (FFNPoint) is a
layout placed over data x tensor ranks (systems.parallel.swiglu) at one shape and precision; it measures
(FFNMeasured, timed as systems.bench.ffn says) the step, its compute alone, the handout's collectives alone,
exposed communication (step - compute) per pass, the bytes each pass sent, and C: the whole layer's TFLOP/s on
one device. A bandwidth point (FFNBandwidthPoint) measures W: the busbw of all-reduce, all-gather and
reduce-scatter at --ffn-bandwidth-mb. The report (systems.report.course) puts the accounting's prediction with
this run's C and W beside each measurement. pytest-benchmark's rounds are the steps (or the collectives), each
as long as its slowest rank.
"""

from __future__ import annotations

import itertools
import statistics

import pytest

from systems.accounting.ffn_layouts import Collective
from systems.bench.ffn import BANDWIDTH_KINDS, bandwidth_bytes, medians, time_bandwidth, time_ffn
from systems.bench.options import grid_of, points_or_usage_error
from systems.bench.schema import (CollectiveBandwidth, FFNBandwidthMeasured, FFNBandwidthPoint, FFNMeasured,
                                  FFNPoint, Passes)
from systems.bench.timing import record_measured, record_point, record_timings
from systems.bench.training import BACKEND, on_rank_gpus
from systems.parallel.swiglu import placements



def ffn_grid(grid) -> list[FFNPoint]:
    points = []
    for precision, batch, d_model, d_ff, world_size, layout in itertools.product(
            grid.ffn_precisions, grid.ffn_batches, grid.ffn_d_models, grid.ffn_d_ffs, grid.ffn_world_sizes,
            grid.ffn_layouts):
        for placement in placements(layout, world_size):
            try:
                points.append(FFNPoint(placement.layout, placement.data, placement.tensor, batch, d_model, d_ff,
                                       precision, BACKEND))
            except ValueError as exc:
                raise pytest.UsageError(f"--ffn-batches, --ffn-d-ffs: {exc}") from None
    return points_or_usage_error(points, "test_ffn", "--ffn-layouts, --ffn-world-sizes",
                                 "single runs on 1 rank, the others on 2 or more (fsdp-tp on 4 or more)")


def bandwidth_grid(grid) -> list[FFNBandwidthPoint]:
    return [FFNBandwidthPoint(BACKEND, world_size, size_mb, precision) for precision in grid.ffn_precisions
            for world_size in grid.ffn_world_sizes if world_size > 1 for size_mb in grid.ffn_bandwidth_mb]


def pytest_generate_tests(metafunc):
    grid = grid_of(metafunc.config)
    if "ffn_point" in metafunc.fixturenames:
        metafunc.parametrize("ffn_point", on_rank_gpus(ffn_grid(grid)))
    if "bandwidth_point" in metafunc.fixturenames:
        metafunc.parametrize("bandwidth_point", on_rank_gpus(bandwidth_grid(grid)))


def test_ffn(benchmark, ffn_point, rank_pools, grid, skip_on_oom):
    point = ffn_point
    benchmark.group = f"ffn-b{point.batch}-d{point.d_model}-f{point.d_ff}-{point.precision.name}"
    record_point(benchmark, point)
    with skip_on_oom:
        ranks = rank_pools.run(point.world_size, BACKEND, time_ffn, point.placement, point.batch, point.d_model,
                               point.d_ff, point.precision.name, grid.warmup_steps, grid.rounds)
    record_timings(benchmark, [[sum(seconds) for seconds in rank["step"]] for rank in ranks])
    step, compute = (Passes(*medians([rank[part] for rank in ranks])) for part in ("step", "compute"))
    layer_s = sum(medians([rank["layer"] for rank in ranks]))
    record_measured(benchmark, FFNMeasured(
        backend=BACKEND, rows=ranks[0]["rows"], d_ff_per_rank=ranks[0]["d_ff"], step=step, compute=compute,
        comm=Passes(*medians([rank["comm"] for rank in ranks])),
        exposed=Passes(max(0.0, step.forward_s - compute.forward_s), max(0.0, step.backward_s - compute.backward_s)),
        sent_forward=ranks[0]["sent_forward"], sent_backward=ranks[0]["sent_backward"],
        layer_tflops=18 * point.batch * point.d_model * point.d_ff / layer_s / 1e12))


def test_ffn_bandwidth(benchmark, bandwidth_point, rank_pools, grid, skip_on_oom):
    point = bandwidth_point
    benchmark.group = f"ffn-bandwidth-{point.backend}-{point.world_size}ranks"
    record_point(benchmark, point)
    with skip_on_oom:
        ranks = rank_pools.run(point.world_size, BACKEND, time_bandwidth, point.size_mb, point.precision.name,
                               grid.warmup_steps, grid.rounds)
    record_timings(benchmark, [rank["all-reduce"] for rank in ranks])
    nbytes = bandwidth_bytes(point.size_mb, point.precision.compute.itemsize, point.world_size)

    def measured(kind: str) -> CollectiveBandwidth:
        seconds = statistics.mean(statistics.median(rank[kind]) for rank in ranks)
        return CollectiveBandwidth(seconds, Collective(kind, nbytes, point.world_size).bytes_sent / seconds / 1e9)

    record_measured(benchmark, FFNBandwidthMeasured(nbytes, *(measured(kind) for kind in BANDWIDTH_KINDS)))
