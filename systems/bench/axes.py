"""Each axis's communication time: a training step's collectives (systems.accounting.traffic's StepCollective list)
replayed on the groups of one axis of the layout at a time, back to back, with nothing else running.

It runs inside the ranks as `train`'s `then` (`axis_timer(...)`), after the training steps, on the same process
group: every rank builds the layout's Mesh (new groups) and issues the same collectives in the same order. The
collectives are the ones the variant issues (systems.parallel.collectives for our FSDP, whose gloo versions sum in
rank order; DDP's plain all-reduce), on tensors of the step's sizes in its dtypes, cut from one buffer. Torch's
FSDP2 is timed with our FSDP's collectives of the same sizes. A round is a barrier, the axis's collectives, and a
synchronize; the seconds are the median of `rounds` after one untimed round.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch
import torch.distributed as dist

from systems.accounting.traffic import StepCollective
from systems.device import synchronize
from systems.levers.layout import Layout
from systems.parallel.collectives import all_gather, all_reduce_mean, reduce_scatter_mean
from systems.parallel.mesh import Mesh
from systems.parallel.ranks import rank_device

DTYPES = {4: torch.float32, 2: torch.bfloat16}  # a collective's itemsize: the step's fp32 or low-precision tensors


def axis_timer(layout: Layout, collectives: list[StepCollective], plain_all_reduce: bool, rounds: int):
    """`train`'s `then`: {"axis_seconds": {axis: seconds}} for each axis the collectives use (picklable, for
    spawned ranks). `plain_all_reduce`: all-reduce as DDP does (dist.all_reduce), not as our FSDP does."""
    return functools.partial(_time_axes, layout=layout, collectives=collectives, plain_all_reduce=plain_all_reduce,
                             rounds=rounds)


def _time_axes(model, step, *, layout: Layout, collectives: list[StepCollective], plain_all_reduce: bool,
               rounds: int) -> dict:
    mesh, device = Mesh(layout), rank_device()
    seconds = {}
    for axis in dict.fromkeys(c.axis for c in collectives):
        mine = [c for c in collectives if c.axis == axis]
        group = getattr(mesh, axis).group
        issue = functools.partial(_issue, mine, _buffers(mine, device), group, plain_all_reduce)
        issue()  # untimed: the groups' connections and the library's buffers are made here
        seconds[axis] = statistics.median(_timed(issue, group, device) for _ in range(rounds))
    return {"axis_seconds": seconds}


def _buffers(collectives: list[StepCollective], device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    """Per dtype, one flat buffer as large as the largest collective's input and output together."""
    largest = {}
    for c in collectives:
        dtype = DTYPES[c.itemsize]
        # all-gather: chunk in, ranks x chunk out; reduce-scatter: ranks x chunk in, chunk out; all-reduce: in place.
        largest[dtype] = max(largest.get(dtype, 0), c.numel * (1 if c.kind == "all_reduce" else c.ranks + 1))
    return {dtype: torch.randn(numel, device=device, dtype=dtype) for dtype, numel in largest.items()}


def _issue(collectives: list[StepCollective], buffers: dict, group, plain_all_reduce: bool) -> None:
    pending = []
    for c in collectives:
        flat = buffers[DTYPES[c.itemsize]]
        if c.kind == "all_gather":
            pending.append(all_gather([flat[c.numel:c.numel * (c.ranks + 1)]], [flat[:c.numel]], "axis", group))
        elif c.kind == "reduce_scatter":
            pending.append(reduce_scatter_mean([flat[:c.numel]], [flat[c.numel:c.numel * (c.ranks + 1)]], "axis",
                                               group))
        elif plain_all_reduce:
            dist.all_reduce(flat[:c.numel], group=group)
        else:
            pending.append(all_reduce_mean(flat[:c.numel], "axis", group))
        if len(pending) > 1:  # one in flight behind the one issued, as FSDP keeps them
            pending.pop(0).wait()
    for work in pending:
        work.wait()


def _timed(issue, group, device: torch.device) -> float:
    dist.barrier(group=group)
    synchronize(device)
    start = time.perf_counter()
    issue()
    synchronize(device)
    return time.perf_counter() - start
