"""FSDP training steps: one process, our bucketed DDP, our FSDP and torch's FSDP2 at the same point.

The full-size point on 2 x H200: `--fsdp-preset xl --contexts 512 --precisions bf16 --batch-size 16`. The CPU
default is the tiny preset on 2 gloo ranks. `--fsdp-prefetch 1,2,5` sweeps how many all-gathers our FSDP keeps
in flight ahead of the computing layer, and `--fsdp-gather layer,block` what one of its collectives covers
(the other variants run once). Each point trains through systems.parallel.train.train in spawned ranks
(systems.bench.training: the ranks time their steps, pytest-benchmark's rounds are those steps), with the
variant's own sharding: bf16 means bf16 compute, fp32 master weights (autocast for one process and DDP; weights
cast before the all-gathers for FSDP and FSDP2, with gradients reduce-scattered in bf16).

A point measures (systems.bench.schema.FSDPMeasured) the step and its phases, `gather_wait_s` for our FSDP (the
time the compute stream waited on all-gathers, CUDA events around the waits: the all-gathers prefetch did not
hide), peak memory per rank (the largest rank's) beside the accounting's prediction (fsdp_memory for our FSDP,
peak_memory for one process and DDP), the gathered weights our FSDP held at once, and on a GPU one more step
profiled per rank for where its GPU time went (systems.bench.breakdown). nsys shows whether the all-gathers
finish in time: every all-gather and reduce-scatter is an NVTX range named after its weight
(`nsys profile -t cuda,nvtx,nccl ...`).
"""

from __future__ import annotations

import itertools

from systems.bench.options import grid_of, points_or_usage_error
from systems.bench.predictions import predicted_peak_mb
from systems.bench.schema import FSDPMeasured, FSDPPoint
from systems.bench.schema.distributed import FSDP_DDP_BUCKET_MB
from systems.bench.timing import record_measured, record_point
from systems.bench.training import (breakdowns, gathered_mb, on_rank_gpus, schedule_of, step_breakdown,
                                    train_in_ranks, training_measured)
from systems.levers.variant import Variant
from systems.parallel.spec import TrainSpec


def fsdp_grid(grid) -> list[FSDPPoint]:
    """Per shape: one process, then on each world size bucketed DDP, ours at each gather and prefetch depth, and
    FSDP2 (FSDP_VARIANTS' order)."""
    points = []
    for precision in grid.precisions:
        for context in grid.contexts:
            def point(variant: Variant, world_size: int, **levers) -> FSDPPoint:
                return FSDPPoint(TrainSpec(preset=grid.fsdp_preset, edition=grid.edition, variant=variant,
                                           precision=precision, batch_size=grid.batch_size, context=context,
                                           **levers), world_size)

            multi_rank = [n for n in grid.world_sizes if n > 1]
            points += [point(Variant.SINGLE, 1)] if multi_rank else []
            for world_size in multi_rank:
                points.append(point(Variant.BUCKETED, world_size, bucket_size_mb=FSDP_DDP_BUCKET_MB))
                points += [point(Variant.FSDP, world_size, fsdp_gather=gather, fsdp_prefetch=prefetch)
                           for gather, prefetch in itertools.product(grid.fsdp_gather, grid.fsdp_prefetch)]
                points.append(point(Variant.FSDP2, world_size))
    return points_or_usage_error(points, "test_fsdp_step", "--world-sizes", "FSDP needs 2 ranks or more")


def pytest_generate_tests(metafunc):
    if "fsdp_point" in metafunc.fixturenames:
        metafunc.parametrize("fsdp_point", on_rank_gpus(fsdp_grid(grid_of(metafunc.config))))


def test_fsdp_step(benchmark, fsdp_point, rank_pools, grid, device, skip_on_oom):
    point, spec = fsdp_point, fsdp_point.spec
    benchmark.group = f"fsdp-step-{spec.preset}-{spec.precision.name}-ctx{spec.context}"
    record_point(benchmark, point)
    with skip_on_oom:
        ranks = train_in_ranks(benchmark, rank_pools, point.world_size, spec, schedule_of(grid), step_breakdown)
    record_measured(benchmark, FSDPMeasured(
        **training_measured(spec, ranks, point.world_size, device),
        predicted_peak_mb=predicted_peak_mb(spec, point.world_size, device.type),
        peak_gathered_mb=gathered_mb(ranks), breakdown_per_rank=breakdowns(ranks)))
