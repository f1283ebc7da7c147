"""Layouts of the same ranks: DDP (bucketed, N x 1), FSDP (1 x N) and HSDP (R x S, ours and torch's) training one
model, each axis's traffic and communication time beside the step, and one process as the compute they share.

The full-size point on 4 GPUs (two "nodes" of two): `--layout-preset xl --layouts 2x2 --precisions bf16
--contexts 512 --batch-size 4`. The CPU default is the tiny preset on 4 gloo ranks at 2 x 2. Each point trains
through systems.parallel.train.train in spawned ranks (systems.bench.training: the ranks time their steps), then,
in the same ranks, times each axis's collectives of a step alone (systems.bench.axes).

A point measures (systems.bench.schema.LayoutMeasured) the step and its phases (the communication the step waited
for: comm_wait, and our FSDP's all-gather wait), and per axis (shard: inside a node under HSDP; replicate: across
nodes) the bytes a rank sends per step (systems.accounting.traffic) and the seconds that axis's collectives take
on their own, hence its bus bandwidth. The report (systems.report.layouts) puts the measured figures beside the
prediction of systems.accounting.layouts: which layout wins at 2, 8 and 64 nodes of 8 GPUs, from this run's
one-process compute and shard-axis bandwidth and an assumed inter-node bandwidth per GPU.
"""

from __future__ import annotations

from systems.accounting.traffic import axis_traffic, ddp_collectives, fsdp_collectives
from systems.bench.axes import axis_timer
from systems.bench.options import grid_of
from systems.bench.schema import LAYOUT_BUCKET_MB, AxisComm, LayoutMeasured, LayoutPoint
from systems.bench.timing import record_measured, record_point
from systems.bench.training import on_rank_gpus, schedule_of, train_in_ranks, training_measured
from systems.levers.layout import Layout
from systems.levers.variant import Variant
from systems.parallel.spec import TrainSpec

AXIS_ROUNDS = 5


def layout_grid(grid) -> list[LayoutPoint]:
    """Per precision and context: one process, then for each layout of R x S = N ranks DDP over N, FSDP over N
    (once per N), ours and torch's HSDP over R x S."""
    points = []
    for precision in grid.precisions:
        for context in grid.contexts:
            def point(variant: Variant, layout: Layout) -> LayoutPoint:
                return LayoutPoint(TrainSpec(preset=grid.layout_preset, edition=grid.edition, variant=variant,
                                             layout=layout if variant.meshed else None, precision=precision,
                                             batch_size=grid.batch_size, context=context,
                                             bucket_size_mb=LAYOUT_BUCKET_MB), layout)

            points.append(point(Variant.SINGLE, Layout()))
            for layout in grid.layouts:
                world = layout.world_size
                points += [point(Variant.BUCKETED, Layout(replicate=world)), point(Variant.FSDP, Layout(shard=world)),
                           point(Variant.HSDP, layout), point(Variant.TORCH_HSDP, layout)]
    return list(dict.fromkeys(points))  # layouts of as many ranks share their DDP and FSDP points


def pytest_generate_tests(metafunc):
    if "layout_point" in metafunc.fixturenames:
        metafunc.parametrize("layout_point", on_rank_gpus(layout_grid(grid_of(metafunc.config))))


def test_layout_step(benchmark, layout_point, rank_pools, grid, device, skip_on_oom):
    point, spec = layout_point, layout_point.spec
    benchmark.group = f"layouts-{spec.preset}-{spec.precision.name}-ctx{spec.context}-{point.world_size}ranks"
    config = spec.config()
    collectives = (ddp_collectives(config, spec.precision, point.world_size, spec.bucket_size_mb)
                   if spec.variant == Variant.BUCKETED
                   else fsdp_collectives(config, spec.precision, point.layout, spec.fsdp_gather))
    timer = axis_timer(point.layout, collectives, plain_all_reduce=spec.variant == Variant.BUCKETED,
                       rounds=AXIS_ROUNDS)
    record_point(benchmark, point)
    with skip_on_oom:
        ranks = train_in_ranks(benchmark, rank_pools, point.world_size, spec, schedule_of(grid),
                               timer if spec.variant != Variant.SINGLE else None)
    sent = axis_traffic(collectives)
    axes = {axis: AxisComm.of(getattr(point.layout, axis), sent[axis].total,
                              max(rank["axis_seconds"][axis] for rank in ranks))
            for axis in ranks[0].get("axis_seconds", {})}
    record_measured(benchmark, LayoutMeasured(**training_measured(spec, ranks, point.world_size, device), axes=axes))
