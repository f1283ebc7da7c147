"""The collectives FSDP and tensor parallelism are built from, asynchronous, with sums and means whose rounding
one process can reproduce; and a clock for the time the compute stream spends waiting on them. Each runs over
a process group (None: the world; a Mesh's axis for HSDP and TP).

`all_gather` and `reduce_scatter_mean` take lists of tensors (one coalesced call under NCCL), `all_reduce_mean` and
`all_reduce_sum` one tensor; each returns a `Pending` whose `wait()` completes it. A mean is a sum divided by N on
this rank (not `ReduceOp.AVG`), and under gloo every reduction sums the ranks' contributions in rank order.
`WaitClock` measures the compute stream's wait on them. docs/design-notes.md has the design.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from systems.device import nvtx_range

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Pending:
    """Asynchronous collectives and what completes them once they have arrived (the division by N, and under
    gloo the rank-ordered sum before it)."""

    def __init__(self, *works: dist.Work, on_arrival: Callable[[], None] | None = None):
        self.works, self.on_arrival = works, on_arrival

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        if self.on_arrival is not None:
            self.on_arrival()
            self.on_arrival = None


def all_gather(outputs: list[torch.Tensor], shards: list[torch.Tensor], name: str,
               group: dist.ProcessGroup | None = None) -> Pending:
    """Every rank's `shards[i]` (the same size on every rank of `group`, None: the world), concatenated in rank
    order into `outputs[i]`: under NCCL one call however many tensors, run as one group of all-gathers."""
    with nvtx_range(f"all_gather {name}"):
        if dist.get_backend(group) == "nccl":
            return Pending((group or dist.group.WORLD).allgather_into_tensor_coalesced(outputs, shards))
        return Pending(*(_all_gather_single(output, shard, group=group, async_op=True)
                         for output, shard in zip(outputs, shards)))


def reduce_scatter_mean(outputs: list[torch.Tensor], fulls: list[torch.Tensor], name: str,
                        group: dist.ProcessGroup | None = None) -> Pending:
    """This rank's chunk of the mean over the ranks of `group` (None: the world) of each `fulls[i]` (as many
    chunks as ranks, each the size of `outputs[i]`): under NCCL one call, run as one group."""
    size = dist.get_world_size(group)
    with nvtx_range(f"reduce_scatter {name}"):
        if dist.get_backend(group) == "nccl":
            work = (group or dist.group.WORLD).reduce_scatter_tensor_coalesced(outputs, fulls,
                                                                               dist.ReduceScatterOptions())
            return Pending(work, on_arrival=lambda: torch._foreach_div_(outputs, size))
        works, means = [], []
        for output, full in zip(outputs, fulls):
            chunks = torch.empty_like(full)  # chunk r: rank r's part of this rank's chunk
            works.append(dist.all_to_all_single(chunks, full, group=group, async_op=True))
            means.append((chunks.view(size, -1), output))
        return Pending(*works, on_arrival=lambda: [_sum_in_rank_order(rows, output, mean=True)
                                                   for rows, output in means])


def all_reduce_mean(tensor: torch.Tensor, name: str, group: dist.ProcessGroup | None = None) -> Pending:
    """`tensor` (contiguous) averaged over the ranks of `group` (None: the world), in place."""
    return _all_reduce(tensor, name, group, mean=True)


def all_reduce_sum(tensor: torch.Tensor, name: str, group: dist.ProcessGroup | None = None) -> Pending:
    """`tensor` (contiguous) summed over the ranks of `group` (None: the world), in place: in rank order under
    gloo, so every rank holds the same bits and one process adding the terms in that order gets them too."""
    return _all_reduce(tensor, name, group, mean=False)


def _all_reduce(tensor: torch.Tensor, name: str, group: dist.ProcessGroup | None, mean: bool) -> Pending:
    size = dist.get_world_size(group)
    with nvtx_range(f"all_reduce {name}"):
        if dist.get_backend(group) == "nccl":
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
            return Pending(work, on_arrival=(lambda: tensor.div_(size)) if mean else None)
        rows = tensor.new_empty(size * tensor.numel())
        work = _all_gather_single(rows, tensor.view(-1), group=group, async_op=True)
        return Pending(work, on_arrival=lambda: _sum_in_rank_order(rows.view(size, -1), tensor.view(-1), mean))


def _sum_in_rank_order(rows: torch.Tensor, out: torch.Tensor, mean: bool) -> None:
    """out = rows[0] + rows[1] + ..., added one row at a time, then divided by len(rows) if `mean`."""
    out.copy_(rows[0])
    for row in rows[1:]:
        out.add_(row)
    if mean:
        out.div_(len(rows))


class WaitClock:
    """Seconds the compute stream spent waiting on collectives, per lap (a training step).

    On a GPU a CUDA event on each side of the wait, read only when asked for the seconds, so no host sync:
    the time between them is how long the stream stalled for data that had not arrived. On a CPU the
    wall clock around the blocking wait.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._waits, self._laps = [], []

    def wait(self, pending: Pending) -> None:
        if self.device.type != "cuda":
            start = time.perf_counter()
            pending.wait()
            self._waits.append(time.perf_counter() - start)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        pending.wait()
        end.record()
        self._waits.append((start, end))

    def lap(self) -> None:
        self._laps.append(self._waits)
        self._waits = []

    def seconds(self) -> list[float]:
        """The waiting of each lap since the last call, summed."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            laps = [sum(start.elapsed_time(end) for start, end in waits) / 1e3 for waits in self._laps]
        else:
            laps = [sum(waits) for waits in self._laps]
        self._laps = []
        return laps
