"""All-reduce time and bandwidth over backends, float32 tensor sizes and numbers of ranks.

The grid comes from the command line (systems.bench.options): --allreduce-backends (gloo on CPU tensors,
nccl with one GPU per rank), --allreduce-sizes-mb, --world-sizes, --rounds. Two figures per point
(systems.bench.schema.AllReduceMeasured):

- per call (`latency_s`, `latency_busbw_gbps`): one all-reduce at a time, started together after a
  barrier and ended by a device synchronize. Mostly latency at small sizes.
- back-to-back (`loop_time_s`, `algbw_gbps`, `busbw_gbps`): nccl-tests' method, comparable with its
  figures. Each round times LOOP_CALLS all-reduces issued back to back, with no host synchronization
  in between, between two CUDA events (on the CPU, the host clock around the loop); a round's figure
  is its time per all-reduce.

A time is the mean over ranks of each rank's median round, with the spread between ranks' medians.
Bus bandwidth is algbw · 2(n−1)/n (nccl-tests' busbw). pytest-benchmark's rounds are the back-to-back
rounds, each as long as its slowest rank (systems.bench.timing.record_timings), so its table, the
history and the regression gate see the back-to-back time per all-reduce. As a check on how the rounds
are taken (barrier and drain between them), a bare loop of `--rounds` · LOOP_CALLS all-reduces, timed
whole the same way, gives `bare_time_s`; `loop_vs_bare` (bare time / back-to-back time) should be 1.

How it is run: the all-reduces run in spawned ranks, out of reach of pytest-benchmark's timer, started
once per (world size, backend) and kept. Each rank makes WARMUP_CALLS untimed all-reduces first, and
rank 0 gathers every rank's times (all_gather_object).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

from systems.bench.leases import on_gpus
from systems.bench.options import grid_of, points_or_usage_error
from systems.bench.schema import AllReduceMeasured, AllReducePoint
from systems.bench.timing import record_measured, record_point, record_timings
from systems.device import synchronize
from systems.parallel.ranks import rank_device

WARMUP_CALLS = 5
LOOP_CALLS = 20  # all-reduces per back-to-back round: nccl-tests' default (-n 20)


def pytest_generate_tests(metafunc):
    if "point" in metafunc.fixturenames:
        grid = grid_of(metafunc.config)
        points = [AllReducePoint(backend, world_size, size_mb) for backend in grid.allreduce_backends
                  for world_size in grid.world_sizes if world_size > 1 for size_mb in grid.allreduce_sizes_mb]
        points_or_usage_error(points, "test_allreduce", "--world-sizes", "an all-reduce needs 2 ranks or more")
        metafunc.parametrize("point", [on_gpus(p, p.world_size if p.backend == "nccl" else 0) for p in points])


def time_all_reduce(size_mb: float, rounds: int) -> list[dict]:
    """On every rank: its seconds per all-reduce in each round, per call and back to back, and in a bare
    loop; gathered from all ranks."""
    device = rank_device()
    tensor = torch.randn(int(size_mb * 2**20) // 4, device=device)  # float32
    for _ in range(WARMUP_CALLS):
        dist.all_reduce(tensor)
    timings = {"latency_seconds": [one_call_seconds(tensor) for _ in range(rounds)],
               "loop_seconds": [back_to_back_seconds(tensor, LOOP_CALLS) for _ in range(rounds)],
               "bare_seconds": back_to_back_seconds(tensor, rounds * LOOP_CALLS)}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, timings)
    return gathered


def one_call_seconds(tensor: torch.Tensor) -> float:
    dist.barrier()  # start together: time the collective, not the ranks' skew
    synchronize(tensor.device)
    start = time.perf_counter()
    dist.all_reduce(tensor)
    synchronize(tensor.device)
    return time.perf_counter() - start


def back_to_back_seconds(tensor: torch.Tensor, calls: int) -> float:
    """Seconds per all-reduce of `calls` issued back to back: on a GPU between two CUDA events, so that
    the host never waits in between."""
    dist.barrier()
    synchronize(tensor.device)
    if tensor.device.type != "cuda":
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(tensor)
        return (time.perf_counter() - start) / calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        dist.all_reduce(tensor)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def bus_bandwidth_gbps(nbytes: int, seconds: float, world_size: int) -> float:
    return nbytes / seconds / 1e9 * 2 * (world_size - 1) / world_size


def across_ranks(rank_seconds: list[list[float]]) -> tuple[float, float]:
    """The mean over ranks of their medians, and the spread between those medians."""
    medians = [statistics.median(seconds) for seconds in rank_seconds]
    return statistics.mean(medians), max(medians) - min(medians)


def test_allreduce(benchmark, point, rank_pools, grid, skip_on_oom):
    benchmark.group = f"allreduce-{point.backend}-{point.world_size}ranks"
    record_point(benchmark, point)
    with skip_on_oom:
        ranks = rank_pools.run(point.world_size, point.backend, time_all_reduce, point.size_mb, grid.rounds)[0]
    record_timings(benchmark, [rank["loop_seconds"] for rank in ranks])
    nbytes = int(point.size_mb * 2**20) // 4 * 4
    latency, latency_spread = across_ranks([rank["latency_seconds"] for rank in ranks])
    loop, loop_spread = across_ranks([rank["loop_seconds"] for rank in ranks])
    bare = statistics.mean(rank["bare_seconds"] for rank in ranks)
    busbw = functools.partial(bus_bandwidth_gbps, nbytes, world_size=point.world_size)
    record_measured(benchmark, AllReduceMeasured(
        bytes=nbytes, warmup_calls=WARMUP_CALLS, rounds=grid.rounds, loop_calls=LOOP_CALLS,
        latency_s=latency, latency_spread_s=latency_spread, latency_busbw_gbps=busbw(latency),
        loop_time_s=loop, loop_spread_s=loop_spread, algbw_gbps=nbytes / loop / 1e9, busbw_gbps=busbw(loop),
        bare_time_s=bare, bare_busbw_gbps=busbw(bare), loop_vs_bare=bare / loop))
