"""Data-parallel training steps: every DDP variant against torch's DistributedDataParallel and one
process, a bucket-size sweep, and ShardedOptimizer's memory against AdamW and ZeroRedundancyOptimizer.

The grid comes from the command line (conftest.py): --ddp-preset, --batch-size (per rank),
--contexts, --precisions, --world-sizes, --bucket-sizes-mb, --warmup-steps, --rounds (timed
steps). The backend is NCCL with one GPU per rank where CUDA is available, gloo on CPU otherwise.
Every rank trains on its own --batch-size rows (systems.parallel.train.train), so the single-process
point does the work of one rank and the ratio `vs_single` is the cost of data parallelism.
With --precisions bf16-weights the gradients, and so the all-reduces, are bf16: half the bytes.

extra_info of a step point: the step and its phases in seconds (forward, backward, comm_wait:
waiting in finish_gradient_synchronization for the all-reduces, optimizer), each the mean over
ranks of the rank's median over the timed steps, the spread of the step between ranks, the
communication share, tokens/s over all ranks, TFLOP/s and MFU per GPU, peak memory, and the step
relative to the single-process point (`vs_single`) and to torch DDP (`vs_torch_ddp`) of the same
precision and context when those ran earlier in the session. Torch DDP waits for its all-reduces
inside backward, so its comm_wait is zero and backward includes the wait.

How it is timed: the steps run in spawned ranks, out of reach of pytest-benchmark's timer, and
are timed there (CUDA events on the compute stream on a GPU, so timing adds no host syncs; the
wall clock on a CPU). The ranks are started once per world size and kept. pytest-benchmark's
rounds are the timed steps, each as long as its slowest rank (systems.bench.timing.record_timings),
so its table, the history and the regression gate see the real step time.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from systems.accounting import flops, fsdp_memory, peak_memory
from systems.bench.breakdown import profile_step
from systems.bench.schema import DDP_BASELINES, DDP_TIMINGS, DDP_VARIANTS, POINT, DDPPoint, seconds_key
from systems.bench.timing import record_throughput, record_timings
from systems.parallel.train import OPTIMIZERS, TrainSpec, train
from systems.model import get_config
from systems.precision import get_precision

TORCH_DDP_BUCKET_MB = 25.0  # torch's default bucket_cap_mb
SHARDED_BUCKET_MB = 25.0  # the sharded-optimizer points all train with DDPBucketed at this size
BACKEND = "nccl" if torch.cuda.is_available() else "gloo"
UNBUCKETED = tuple(variant for variant in DDP_VARIANTS if variant not in (*DDP_BASELINES, "bucketed"))
_step_seconds: dict[tuple, float] = {}  # (variant, precision, context, world size) -> step seconds


def step_grid(config) -> list[DDPPoint]:
    """Per precision and context: one process first, then torch DDP, then the variants and the sweep."""
    opt = config.getoption
    points = []
    for precision in map(get_precision, opt("precisions")):
        for context in opt("contexts"):
            points.append(DDPPoint("single", None, precision, context, 1))
            for world_size in (n for n in opt("world_sizes") if n > 1):
                points.append(DDPPoint("torch", TORCH_DDP_BUCKET_MB, precision, context, world_size))
                points += [DDPPoint(variant, None, precision, context, world_size) for variant in UNBUCKETED]
                points += [DDPPoint("bucketed", size, precision, context, world_size)
                           for size in opt("bucket_sizes_mb")]
    return points


def pytest_generate_tests(metafunc):
    if "point" in metafunc.fixturenames:
        metafunc.parametrize("point", step_grid(metafunc.config), ids=str)
    if "world_size" in metafunc.fixturenames:
        world_sizes = [n for n in metafunc.config.getoption("world_sizes") if n > 1]
        metafunc.parametrize("world_size", world_sizes, ids=lambda n: f"{n}ranks")


def train_in_ranks(benchmark, rank_pools, world_size: int, spec: TrainSpec, then=None) -> list[dict]:
    """systems.parallel.train.train(spec, then) on every rank, its step times given to pytest-benchmark."""
    if BACKEND == "nccl" and world_size > torch.cuda.device_count():
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    ranks = rank_pools.run(world_size, BACKEND, train, spec, then)
    record_timings(benchmark, [rank["seconds"]["step"] for rank in ranks])
    return ranks


def spec_for(request, **fields) -> TrainSpec:
    """The grid options' TrainSpec (preset --ddp-preset, unless `fields` name another), with `fields`."""
    opt = request.config.getoption
    options = dict(preset=opt("ddp_preset"), batch_size=opt("batch_size"), warmup=opt("warmup_steps"),
                   steps=opt("rounds"))
    return TrainSpec(**options | fields)


def predicted_peak_mb(spec: TrainSpec, world_size: int, device: torch.device) -> float | None:
    """The largest rank's predicted peak: systems.accounting.fsdp_memory for our FSDP, peak_memory otherwise;
    None for torch's FSDP2, whose per-block gathers and sharded state the accounting does not model."""
    if spec.variant == "fsdp2":
        return None
    config, precision = spec.config(), get_precision(spec.precision)
    where = "cuda" if device.type == "cuda" else "cpu"
    if spec.variant == "fsdp":
        peak = fsdp_memory(config, spec.batch_size, spec.context, precision, world_size, device=where,
                           prefetch=spec.fsdp_prefetch, gather=spec.fsdp_gather).peak
    else:
        peak = peak_memory(config, spec.batch_size, spec.context, precision, device=where).train_step
    return peak / 2**20


def mean_of_medians(ranks: list[dict], phase: str) -> float:
    return statistics.mean(statistics.median(rank["seconds"][phase]) for rank in ranks)


def step_breakdown(model, step) -> dict:
    """`train`'s `then`: one more step profiled for where its GPU time goes (systems.bench.breakdown)."""
    return {"breakdown": profile_step(step).to_dict()} if torch.cuda.is_available() else {}


def record_breakdown(benchmark, ranks: list[dict]) -> None:
    if "breakdown" in ranks[0]:
        benchmark.extra_info["breakdown_per_rank"] = [rank["breakdown"] for rank in ranks]


def record_memory(benchmark, ranks: list[dict]) -> None:
    if "memory_mb" in ranks[0]:
        for moment in ranks[0]["memory_mb"]:
            benchmark.extra_info[f"memory_{moment}_mb"] = max(rank["memory_mb"][moment] for rank in ranks)


def test_ddp_step(benchmark, point, rank_pools, request, device, skip_on_oom):
    benchmark.group = f"ddp-step-{point.precision.name}-ctx{point.context}"
    spec = spec_for(request, variant=point.variant, bucket_size_mb=point.bucket_size_mb,
                    precision=point.precision.name, context=point.context)
    info = benchmark.extra_info
    info[POINT] = point.to_dict()
    with skip_on_oom:
        ranks = train_in_ranks(benchmark, rank_pools, point.world_size, spec)
    info.update(preset=spec.preset, batch_size_per_rank=spec.batch_size, backend=BACKEND)
    for timing in DDP_TIMINGS:
        info[seconds_key(timing)] = mean_of_medians(ranks, timing)
    step = info[seconds_key("step")]
    steps = [statistics.median(rank["seconds"]["step"]) for rank in ranks]
    info.update(step_spread_s=max(steps) - min(steps), comm_share=info[seconds_key("comm_wait")] / step,
                tokens_per_s=point.world_size * spec.batch_size * spec.context / step)
    step_flops = flops(get_config(spec.preset, context_length=spec.context), spec.batch_size, spec.context).step
    record_throughput(benchmark, seconds=step, flops=step_flops, device=device,
                      precision=point.precision)
    record_memory(benchmark, ranks)
    _step_seconds[point.variant, point.precision, point.context, point.world_size] = step
    for key, baseline in (("vs_single", ("single", 1)), ("vs_torch_ddp", ("torch", point.world_size))):
        reference = _step_seconds.get((baseline[0], point.precision, point.context, baseline[1]))
        if point.variant != baseline[0] and reference is not None:
            info[key] = step / reference


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_memory(benchmark, optimizer, world_size, rank_pools, request, skip_on_oom):
    """Optimizer state per rank and peak memory, for AdamW, ShardedOptimizer(AdamW) and ZeRO-1 of torch."""
    opt = request.config.getoption
    benchmark.group = f"optimizer-{world_size}ranks"
    spec = spec_for(request, variant="bucketed", bucket_size_mb=SHARDED_BUCKET_MB, optimizer=optimizer,
                    precision=opt("precisions")[0], context=opt("contexts")[0])
    with skip_on_oom:
        ranks = train_in_ranks(benchmark, rank_pools, world_size, spec)
    state = [rank["state_bytes"] for rank in ranks]
    # The sharded optimizers split the unsharded state between ranks; AdamW holds all of it on each.
    unsharded = state[0] if optimizer == "adamw" else sum(state)
    benchmark.extra_info.update(
        preset=spec.preset, optimizer=optimizer, world_size=world_size, precision=spec.precision,
        state_mb=[s / 2**20 for s in state], unsharded_state_mb=unsharded / 2**20,
        state_fraction=max(state) / unsharded, ideal_fraction=1 / world_size,
        **{seconds_key(timing): mean_of_medians(ranks, timing) for timing in ("optimizer", "step")},
    )
    record_memory(benchmark, ranks)
