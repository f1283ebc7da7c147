"""All-reduce bandwidth over backends, float32 tensor sizes and numbers of ranks.

The grid comes from the command line (conftest.py): --allreduce-backends (gloo on CPU tensors,
nccl with one GPU per rank), --allreduce-sizes-mb, --world-sizes, --rounds. Each point's
extra_info holds the time per all-reduce (mean over ranks of each rank's median, and the spread
between ranks), algorithm bandwidth (bytes / time) and bus bandwidth (algbw · 2(n−1)/n, the
nccl-tests convention); under NCCL also the bus bandwidth of a bare NCCL all-reduce timed with
CUDA events in the same ranks, and the ratio of the two.

How it is timed: the all-reduces run in spawned ranks, out of reach of pytest-benchmark's timer.
The ranks are started once per (world size, backend) and kept. Each rank makes 5 warm-up calls,
then `--rounds` calls, each started together after a barrier and ended by a device synchronize,
and rank 0 gathers every rank's times (all_gather_object). pytest-benchmark's rounds are those
calls, each as long as its slowest rank (systems.benchmarking.record_timings), so its table, the
history and the regression gate see the real time per all-reduce. The bare NCCL figure is
nccl-tests' method: `--rounds` back-to-back all-reduces
between two CUDA events, with no host synchronization in between.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from systems.benchmarking import record_timings, synchronize
from systems.distributed import rank_device

WARMUP_CALLS = 5


@dataclass(frozen=True)
class AllReducePoint:
    backend: str
    world_size: int
    size_mb: float

    def __str__(self) -> str:
        return f"{self.backend}-{self.world_size}ranks-{self.size_mb:g}MiB"


def pytest_generate_tests(metafunc):
    if "point" in metafunc.fixturenames:
        opt = metafunc.config.getoption
        points = [AllReducePoint(backend, world_size, size_mb) for backend in opt("allreduce_backends")
                  for world_size in opt("world_sizes") if world_size > 1 for size_mb in opt("allreduce_sizes_mb")]
        metafunc.parametrize("point", points, ids=str)


def time_all_reduce(size_mb: float, rounds: int) -> list[dict]:
    """On every rank: seconds per all-reduce, gathered from all ranks."""
    device = rank_device()
    tensor = torch.randn(int(size_mb * 2**20) // 4, device=device)  # float32
    for _ in range(WARMUP_CALLS):
        dist.all_reduce(tensor)
    seconds = []
    for _ in range(rounds):
        dist.barrier()  # start together: time the collective, not the ranks' skew
        synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    timings = {"seconds": seconds}
    if device.type == "cuda":
        timings["bare_seconds"] = bare_nccl_seconds(tensor, rounds)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, timings)
    return gathered


def bare_nccl_seconds(tensor: torch.Tensor, calls: int) -> float:
    """Back-to-back all-reduces between two CUDA events: what NCCL itself sustains."""
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        dist.all_reduce(tensor)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def bus_bandwidth_gbps(nbytes: int, seconds: float, world_size: int) -> float:
    return nbytes / seconds / 1e9 * 2 * (world_size - 1) / world_size


def test_allreduce(benchmark, point, rank_pools, request, skip_on_oom):
    if point.backend == "nccl" and point.world_size > torch.cuda.device_count():
        pytest.skip(f"needs {point.world_size} GPUs, found {torch.cuda.device_count()}")
    benchmark.group = f"allreduce-{point.backend}-{point.world_size}ranks"
    rounds = request.config.getoption("rounds")
    with skip_on_oom:
        ranks = rank_pools.run(point.world_size, point.backend, time_all_reduce, point.size_mb, rounds)[0]
    record_timings(benchmark, [rank["seconds"] for rank in ranks])
    nbytes = int(point.size_mb * 2**20) // 4 * 4
    medians = [statistics.median(rank["seconds"]) for rank in ranks]
    seconds = statistics.mean(medians)
    info = benchmark.extra_info
    info.update(backend=point.backend, world_size=point.world_size, size_mb=point.size_mb, bytes=nbytes,
                warmup_calls=WARMUP_CALLS, calls=rounds, time_s=seconds, time_spread_s=max(medians) - min(medians),
                rank_median_s=medians, algbw_gbps=nbytes / seconds / 1e9,
                busbw_gbps=bus_bandwidth_gbps(nbytes, seconds, point.world_size))
    if "bare_seconds" in ranks[0]:
        bare = statistics.mean(rank["bare_seconds"] for rank in ranks)
        info.update(bare_time_s=bare, bare_busbw_gbps=bus_bandwidth_gbps(nbytes, bare, point.world_size))
        info["busbw_vs_bare"] = info["busbw_gbps"] / info["bare_busbw_gbps"]
