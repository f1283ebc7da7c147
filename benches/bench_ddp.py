"""Data-parallel training steps: every DDP variant against torch's DistributedDataParallel and one process, a
bucket-size sweep, and ShardedOptimizer's memory against AdamW and ZeroRedundancyOptimizer.

The grid comes from the command line (systems.bench.options): --ddp-preset, --edition, --batch-size (per rank),
--contexts, --precisions, --world-sizes, --bucket-sizes-mb, --warmup-steps, --rounds (timed steps). Every rank
trains on its own --batch-size rows (systems.parallel.train.train), so the single-process point does the work of
one rank, and the report's `vs single` is the cost of data parallelism. With --precisions bf16-weights the
gradients, and so the all-reduces, are bf16: half the bytes.

A step point measures (systems.bench.schema.DDPMeasured) the step and its phases (forward, backward, comm_wait:
waiting in finish_gradient_synchronization for the all-reduces, optimizer), the spread of the step between
ranks, the communication share, tokens/s over all ranks, TFLOP/s and MFU per GPU, and peak memory. Torch DDP
waits for its all-reduces inside backward, so its comm_wait is zero and backward includes the wait. The ranks
time themselves (systems.bench.training).
"""

from __future__ import annotations

import statistics

from systems.bench.options import grid_of, points_or_usage_error
from systems.bench.schema import DDP_VARIANTS, DDPMeasured, DDPPoint, OptimizerMeasured, OptimizerPoint
from systems.bench.schema.distributed import SHARDED_BUCKET_MB
from systems.bench.timing import record_measured, record_point
from systems.bench.training import memory_mb, on_rank_gpus, phases, schedule_of, train_in_ranks, training_measured
from systems.levers.variant import Optimizer, Variant
from systems.parallel.spec import TrainSpec

TORCH_DDP_BUCKET_MB = 25.0  # torch's default bucket_cap_mb


def step_grid(grid) -> list[DDPPoint]:
    """Per precision and context: one process first, then torch DDP, then the variants and the bucket sweep."""
    points = []
    for precision in grid.precisions:
        for context in grid.contexts:
            def point(variant: Variant, bucket_size_mb: float | None, world_size: int) -> DDPPoint:
                return DDPPoint(TrainSpec(preset=grid.ddp_preset, edition=grid.edition, variant=variant,
                                          bucket_size_mb=bucket_size_mb, precision=precision,
                                          batch_size=grid.batch_size, context=context), world_size)

            points.append(point(Variant.SINGLE, None, 1))
            for world_size in (n for n in grid.world_sizes if n > 1):
                points.append(point(Variant.TORCH, TORCH_DDP_BUCKET_MB, world_size))
                points += [point(variant, None, world_size) for variant in DDP_VARIANTS if not variant.bucketed
                           and variant != Variant.SINGLE]
                points += [point(Variant.BUCKETED, size, world_size) for size in grid.bucket_sizes_mb]
    return points


def optimizer_grid(grid) -> list[OptimizerPoint]:
    points = [OptimizerPoint(TrainSpec(preset=grid.ddp_preset, edition=grid.edition, variant=Variant.BUCKETED,
                                       bucket_size_mb=SHARDED_BUCKET_MB, optimizer=optimizer,
                                       precision=grid.precisions[0], batch_size=grid.batch_size,
                                       context=grid.contexts[0]), world_size)
              for world_size in grid.world_sizes if world_size > 1 for optimizer in Optimizer]
    return points_or_usage_error(points, "test_optimizer_memory", "--world-sizes", "sharding needs 2 ranks or more")


def pytest_generate_tests(metafunc):
    grid = grid_of(metafunc.config)
    if "point" in metafunc.fixturenames:
        metafunc.parametrize("point", on_rank_gpus(step_grid(grid)))
    if "optimizer_point" in metafunc.fixturenames:
        metafunc.parametrize("optimizer_point", on_rank_gpus(optimizer_grid(grid)))


def test_ddp_step(benchmark, point, rank_pools, grid, device, skip_on_oom):
    spec = point.spec
    benchmark.group = f"ddp-step-{spec.precision.name}-ctx{spec.context}"
    record_point(benchmark, point)
    with skip_on_oom:
        ranks = train_in_ranks(benchmark, rank_pools, point.world_size, spec, schedule_of(grid))
    measured = training_measured(spec, ranks, point.world_size, device)
    steps = [statistics.median(rank["seconds"]["step"]) for rank in ranks]
    record_measured(benchmark, DDPMeasured(**measured, step_spread_s=max(steps) - min(steps),
                                           comm_share=measured["phases"].comm_wait_s / measured["phases"].step_s))


def test_optimizer_memory(benchmark, optimizer_point, rank_pools, grid, skip_on_oom):
    """Optimizer state per rank and peak memory, for AdamW, ShardedOptimizer(AdamW) and ZeRO-1 of torch."""
    point = optimizer_point
    benchmark.group = f"optimizer-{point.world_size}ranks"
    record_point(benchmark, point)
    with skip_on_oom:
        ranks = train_in_ranks(benchmark, rank_pools, point.world_size, point.spec, schedule_of(grid))
    state = [rank["state_bytes"] for rank in ranks]
    # The sharded optimizers split the unsharded state between ranks; AdamW holds all of it on each.
    unsharded = state[0] if point.spec.optimizer == Optimizer.ADAMW else sum(state)
    timed = phases(ranks)
    record_measured(benchmark, OptimizerMeasured(
        state_mb=[s / 2**20 for s in state], unsharded_state_mb=unsharded / 2**20,
        state_fraction=max(state) / unsharded, ideal_fraction=1 / point.world_size, optimizer_s=timed.optimizer_s,
        step_s=timed.step_s, memory_mb=memory_mb(ranks)))
