"""FSDP training steps: one process, our bucketed DDP, our FSDP and torch's FSDP2 at the same point.

The issue's point on 2 x H200: `--fsdp-preset xl --contexts 512 --precisions bf16 --batch-size 16`. The CPU
default is the tiny preset on 2 gloo ranks. `--fsdp-prefetch 1,2,5` sweeps how many all-gathers our FSDP keeps
in flight ahead of the computing layer, and `--fsdp-gather layer,block` what one of its collectives covers
(the other variants run once). Each point trains through
systems.parallel.train.train in spawned ranks (bench_ddp's machinery: the ranks time their steps,
pytest-benchmark's rounds are those steps), with the variant's own sharding: bf16 means bf16 compute, fp32
master weights (autocast for one process and DDP; weights cast before the all-gathers for FSDP and FSDP2, with
gradients reduce-scattered in bf16).

extra_info: the step and its phases in seconds (bench_ddp's), `gather_wait_s` for our FSDP (the time the
compute stream waited on all-gathers, CUDA events around the waits: the all-gathers prefetch did not hide),
peak memory per rank (`memory_*_mb`, the largest rank's) beside `predicted_peak_mb`
(systems.accounting.fsdp_memory for our FSDP; systems.accounting.peak_memory for one process and DDP),
`peak_gathered_mb` (the gathered weights our FSDP held at once), `vs_single`, and on a GPU
`breakdown_per_rank`: one more step profiled for where its GPU time went (systems.bench.breakdown: matmuls,
attention, communication and the part of it not hidden, the optimizer, GPU idle as `span_s - busy_s`).
nsys shows whether the all-gathers finish in time: every all-gather and reduce-scatter is an NVTX range
named after its weight (`nsys profile -t cuda,nvtx,nccl ...`).
"""

from __future__ import annotations

from bench_ddp import (BACKEND, mean_of_medians, predicted_peak_mb, record_breakdown, record_memory, spec_for,
                       step_breakdown, train_in_ranks)

from systems.accounting import flops
from systems.bench.schema import FSDP_TIMINGS, FSDP_VARIANTS, POINT, FSDPPoint, seconds_key
from systems.bench.timing import record_throughput
from systems.precision import get_precision

DDP_BUCKET_MB = 100.0
_step_seconds: dict[tuple, float] = {}  # the point with variant "single" -> its step seconds


def fsdp_grid(config) -> list[FSDPPoint]:
    """Every variant once per shape, ours at each --fsdp-prefetch depth and --fsdp-gather group."""
    opt = config.getoption
    return [FSDPPoint(variant, opt("fsdp_preset"), get_precision(precision), context, opt("batch_size"),
                      1 if variant == "single" else world_size, prefetch, gather)
            for precision in opt("precisions") for context in opt("contexts")
            for world_size in (n for n in opt("world_sizes") if n > 1) for variant in FSDP_VARIANTS
            for gather in (opt("fsdp_gather") if variant == "fsdp" else ["layer"])
            for prefetch in (opt("fsdp_prefetch") if variant == "fsdp" else [1])]


def pytest_generate_tests(metafunc):
    if "fsdp_point" in metafunc.fixturenames:
        metafunc.parametrize("fsdp_point", list(dict.fromkeys(fsdp_grid(metafunc.config))), ids=str)


def test_fsdp_step(benchmark, fsdp_point, rank_pools, request, device, skip_on_oom):
    point = fsdp_point
    benchmark.group = f"fsdp-step-{point.preset}-{point.precision.name}-ctx{point.context}"
    spec = spec_for(request, preset=point.preset, variant=point.variant, precision=point.precision.name,
                    bucket_size_mb=DDP_BUCKET_MB if point.variant == "bucketed" else 25.0,
                    batch_size=point.batch_size, context=point.context, fsdp_prefetch=point.prefetch,
                    fsdp_gather=point.gather)
    info = benchmark.extra_info
    info[POINT] = point.to_dict()
    with skip_on_oom:
        ranks = train_in_ranks(benchmark, rank_pools, point.world_size, spec, step_breakdown)
    info.update(backend=BACKEND, **{seconds_key(t): mean_of_medians(ranks, t) for t in FSDP_TIMINGS
                                    if t in ranks[0]["seconds"]})
    step = info[seconds_key("step")]
    info["tokens_per_s"] = point.world_size * point.batch_size * point.context / step
    record_throughput(benchmark, seconds=step, flops=flops(spec.config(), point.batch_size, point.context).step,
                      device=device, precision=point.precision)
    record_memory(benchmark, ranks)
    record_breakdown(benchmark, ranks)
    info["predicted_peak_mb"] = predicted_peak_mb(spec, point.world_size, device)
    if "peak_gathered_bytes" in ranks[0]:
        info["peak_gathered_mb"] = max(rank["peak_gathered_bytes"] for rank in ranks) / 2**20
    shape = point.precision, point.context, point.batch_size
    if point.variant == "single":
        _step_seconds[shape] = step
    elif shape in _step_seconds:
        info["vs_single"] = step / _step_seconds[shape]
