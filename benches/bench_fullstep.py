"""A whole training step (forward, cross-entropy, backward, AdamW) with its levers, timed as the course's 2026
leaderboard times it: the handout's 8.1B model (preset leaderboard-2026) at context 32768 on two GPUs.

The full-size point on 2 x H200 (one sequence per GPU, batch 2 in all):

    pytest benches/bench_fullstep.py --fullstep-preset leaderboard-2026 --contexts 32768 --batch-size 1 \\
        --world-sizes 2 --precisions bf16 --checkpoint every1 --loss-chunk 4096 --attention sdpa

The CPU default is the same shape made tiny (`leaderboard-2026-tiny`, context 128) on 2 gloo ranks, so CI runs
the code path in seconds. Levers: --fullstep-variants (default our FSDP, whose optimizer is systems AdamW, fused
on CUDA; `fsdp,fsdp2` times torch's FSDP2 beside it in turns), --checkpoint (none, everyK, KxK, nested, attn, ops;
-keepN), --loss-chunk (tokens at a time, or full), --attention (naive, sdpa, flash), --fused (the model's Triton
kernels), --compile-blocks (regional torch.compile), and our FSDP's --fsdp-gather and --fsdp-prefetch.
docs/fusion-and-checkpointing.md has the commands that measure the kernels, compilation and selective
checkpointing on the leaderboard's step.

Each point trains through systems.parallel.train.train in spawned ranks (systems.bench.training):
pytest-benchmark's rounds are its timed steps, as long as their slowest rank. On a GPU each rank then times
more whole steps with `triton.testing.do_bench` (median), as the leaderboard does. A point measures
(systems.bench.schema.FullStepMeasured) the step and its phases, `do_bench_s`, TFLOP/s and MFU per GPU against
model FLOPs (Flops.flash_step: the leaderboard's count, recomputation left out), tokens/s, peak memory per rank
beside the largest rank's prediction (systems.accounting.fsdp_memory for our FSDP) and `cold_start_s`: from
this pytest process's start to the end of the point's timed job. For a cold run as the leaderboard's, give it an
empty TRITON_CACHE_DIR and run this point alone.

`breakdown_per_rank` says where each rank's GPU time went in one profiled step (systems.bench.breakdown:
matmuls, attention forward and backward, communication and the part of it not hidden, the optimizer, the loss,
recomputation). nsys splits the step by the same ranges: `forward`, `backward`, `optimizer_step`
(systems.step), one per all-gather and reduce-scatter (systems.parallel.collectives), `loss` and
`loss_recompute` (systems.loss), `recompute` (systems.model's checkpointing):
`nsys profile -t cuda,nvtx,nccl --capture-range=none -o fullstep pytest benches/bench_fullstep.py ...`.
"""

from __future__ import annotations

import itertools

import torch

from systems.accounting import flops, recomputed_flops
from systems.bench.options import grid_of
from systems.bench.predictions import predicted_peak_mb
from systems.bench.schema import FullStepMeasured, FullStepPoint
from systems.bench.timing import record_measured, record_point, seconds_since_process_start
from systems.bench.training import (breakdowns, gathered_mb, on_rank_gpus, schedule_of, step_breakdown,
                                    train_in_ranks, training_measured)
from systems.leaderboard import agreed_step_ms
from systems.levers.variant import Variant
from systems.parallel.spec import TrainSpec

# do_bench runs as many steps as fit in its time budgets, as each rank measures them; every rank must run the
# same number (a step is collectives), so the budgets sit halfway between step counts of the agreed step time.
DO_BENCH_WARMUP, DO_BENCH_REPEATS = 1, 3


def fullstep_grid(grid) -> list[FullStepPoint]:
    """Per shape and lever, every variant in turn (ours beside torch's FSDP2, say), our FSDP at each of its levers."""
    points = []
    for precision, context, checkpoint, fused, compile, world_size, variant in itertools.product(
            grid.precisions, grid.contexts, grid.checkpoint, grid.fused, grid.compile_blocks, grid.world_sizes,
            grid.fullstep_variants):
        ours = ([dict(fsdp_gather=gather, fsdp_prefetch=prefetch)
                 for gather, prefetch in itertools.product(grid.fsdp_gather, grid.fsdp_prefetch)]
                if variant == Variant.FSDP else [{}])
        points += [FullStepPoint(TrainSpec(preset=grid.fullstep_preset, edition=grid.edition, variant=variant,
                                           precision=precision, batch_size=grid.batch_size, context=context,
                                           checkpoint=checkpoint, loss_chunk=grid.loss_chunk,
                                           attention=grid.attention, fused=fused, compile=compile, **levers),
                                 1 if variant == Variant.SINGLE else world_size)
                   for levers in ours]
    return list(dict.fromkeys(points))  # one process once, whatever the world sizes


def pytest_generate_tests(metafunc):
    if "fullstep_point" in metafunc.fixturenames:
        metafunc.parametrize("fullstep_point", on_rank_gpus(fullstep_grid(grid_of(metafunc.config))))


def leaderboard_timing(model, step) -> dict:
    """`step()` (one whole training step) timed by triton.testing.do_bench, median seconds, and one more step
    profiled for where its GPU time goes (systems.bench.breakdown); on a GPU only."""
    if not torch.cuda.is_available():
        return {}
    from triton.testing import do_bench  # here: triton is a GPU dependency of this timing only

    ms = agreed_step_ms(step, torch.device("cuda"), steps=1)
    seconds = do_bench(step, warmup=(DO_BENCH_WARMUP + 0.5) * ms, rep=(DO_BENCH_REPEATS + 0.5) * ms,
                       return_mode="median") / 1e3
    return {"do_bench_s": seconds} | step_breakdown(model, step)


def test_fullstep(benchmark, fullstep_point, rank_pools, grid, device, skip_on_oom):
    point, spec = fullstep_point, fullstep_point.spec.resolved(device.type)
    benchmark.group = f"fullstep-{spec.preset}-{spec.precision.name}-ctx{spec.context}"
    record_point(benchmark, point)
    with skip_on_oom:
        ranks = train_in_ranks(benchmark, rank_pools, point.world_size, spec, schedule_of(grid), leaderboard_timing)
    cold_start = seconds_since_process_start()
    do_bench = max(rank["do_bench_s"] for rank in ranks) if "do_bench_s" in ranks[0] else None
    config = spec.config()
    model = flops(config, spec.batch_size, spec.context)
    measured = training_measured(spec, ranks, point.world_size, device, step_seconds=do_bench,
                                 step_flops=model.flash_step)
    peaks = [max(rank["memory_mb"].values()) for rank in ranks] if "memory_mb" in ranks[0] else None
    record_measured(benchmark, FullStepMeasured(
        **measured, predicted_peak_mb=predicted_peak_mb(spec, point.world_size, device.type),
        peak_gathered_mb=gathered_mb(ranks), breakdown_per_rank=breakdowns(ranks), do_bench_s=do_bench,
        cold_start_s=cold_start,
        step_pflop=point.world_size * model.flash_step / 1e15,
        recomputed_tflop=recomputed_flops(config, spec.batch_size, spec.context, device=device.type).forward / 1e12,
        peak_memory_mb_per_rank=peaks))
