"""NCCL all-reduce of bf16 tensors on 2 and 4 GPUs, timed alone (one call between two CUDA events), 3 and 20 back
to back (per call): how far a lone collective, as a tensor-parallel pass issues it, falls short of the bus bandwidth
that bench_ffn calibrates W with (20 back to back, the largest size). Prints rank 0's medians of 10 rounds.
    python jobs/allreduce_alone.py
"""

from __future__ import annotations

import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_MIB = (64, 128, 256, 512)
CALLS = (1, 3, 20)
ROUNDS = 10


def per_call_ms(x: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(ROUNDS):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for work in [dist.all_reduce(x, async_op=True) for _ in range(calls)]:
            work.wait()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def run(rank: int, world: int, path: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", store=dist.FileStore(path, world), rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    lines = []
    for mib in SIZES_MIB:
        x = torch.randn(mib * 2**20 // 2, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            dist.all_reduce(x)
        sent = 2 * (world - 1) / world * x.numel() * x.element_size()  # a ring's bytes per rank: busbw's
        ms = {calls: per_call_ms(x, calls) for calls in CALLS}
        lines.append(f"{mib} MiB: " + ", ".join(f"{calls} at a time {t:.3f} ms/call ({sent / t / 1e6:.0f} GB/s)"
                                                for calls, t in ms.items())
                     + f"; alone / 20 back to back {ms[1] / ms[20]:.3f}")
    if rank == 0:
        print(f"{world} ranks:", *lines, sep="\n  ", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    for world in (2, 4):
        with tempfile.NamedTemporaryFile() as store:
            mp.spawn(run, args=(world, store.name + ".store"), nprocs=world)
