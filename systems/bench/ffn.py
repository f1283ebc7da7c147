"""What bench_ffn measures on every rank: one SwiGLU layer's step under a layout (systems.parallel.swiglu), beside
its math alone and its collectives alone, and the collectives' bandwidth that calibrates the handout's W.

`time_ffn` times, each round after `warmup` steps, the step, its compute alone, its communication alone (the
collectives of the layout's `handout_cost`) and the whole layer on this device (C), and counts the bytes each pass
sent. `time_bandwidth` measures W as nccl-tests' bus bandwidth, `LOOP_CALLS` collectives of each kind back to back
a round; `medians` reduces the ranks' rounds. docs/design-notes.md has what each timing covers.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from systems.accounting.ffn_layouts import Collective, StepCost, SwiGLULayer, dp_step, fsdp_step, fsdp_tp_step, tp_step
from systems.levers.layout import Layout
from systems.model import SwiGLU
from systems.parallel.collectives import all_gather, all_reduce_sum, reduce_scatter_mean
from systems.parallel.issued import IssuedCollectives
from systems.parallel.mesh import Mesh
from systems.parallel.meters import PhaseClock
from systems.parallel.ranks import rank_device
from systems.parallel.swiglu import FFNLayout, Placement, lay_out
from systems.precision import DTYPES

LOOP_CALLS = 20  # collectives per back-to-back round: nccl-tests' default (-n 20)
BANDWIDTH_KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def handout_cost(placement: Placement, layer: SwiGLULayer) -> StepCost:
    """The accounting's costs of the layout the placement runs."""
    match placement.layout:
        case FFNLayout.SINGLE | FFNLayout.DP:
            return dp_step(layer, placement.data)
        case FFNLayout.FSDP:
            return fsdp_step(layer, placement.data)
        case FFNLayout.FSDP_TP:
            return fsdp_tp_step(layer, placement.data, placement.tensor)
    return tp_step(layer, placement.tensor)


def time_ffn(placement: Placement, batch: int, d_model: int, d_ff: int, dtype_name: str, warmup: int,
             rounds: int) -> dict:
    """On every rank: its step, compute and communication per pass (seconds of each round), the bytes it sent per
    pass, and the whole layer's seconds on its device."""
    device, dtype = rank_device(), DTYPES[dtype_name]
    laid = lay_out(placement, batch, d_model, d_ff, dtype, device)
    rows = laid.rows.stop - laid.rows.start
    x = torch.randn(rows, d_model, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, d_model, device=device, dtype=dtype)
    parameters = list(laid.module.parameters())

    def step(clock: PhaseClock) -> None:
        for tensor in [x, *parameters]:
            tensor.grad = None  # zero_grad(set_to_none=True)
        clock.mark()
        y = laid.module(x)
        clock.mark()
        y.backward(dy)
        laid.finish()
        clock.mark()

    with IssuedCollectives() as forward:
        y = laid.module(x)
    with IssuedCollectives() as backward:
        y.backward(dy)
        laid.finish()
    del y
    local = SwiGLU(d_model, laid.d_ff).to(device, dtype)
    whole = SwiGLU(d_model, d_ff).to(device, dtype)
    x_whole = torch.randn(batch, d_model, device=device, dtype=dtype, requires_grad=True)
    groups = _groups(placement)
    cost = handout_cost(placement, SwiGLULayer(batch, d_model, d_ff, dtype.itemsize))
    return {"step": _rounds(step, warmup, rounds),
            "compute": _rounds(_matmuls(local, x, dy), warmup, rounds),
            "comm": _rounds(_collectives(cost, groups, dtype, device), warmup, rounds),
            "layer": _rounds(_matmuls(whole, x_whole, torch.randn_like(x_whole)), warmup, rounds),
            "sent_forward": forward.bytes_sent(), "sent_backward": backward.bytes_sent(),
            "rows": rows, "d_ff": laid.d_ff}


def _rounds(step, warmup: int, rounds: int) -> list[list[float]]:
    """[forward, backward] seconds of each timed round; every rank starts each round together."""
    for _ in range(warmup):
        step(PhaseClock(rank_device()))
    clocks = []
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        clock = PhaseClock(rank_device())
        step(clock)
        clocks.append(clock)
    return [clock.seconds() for clock in clocks]


def _matmuls(layer: SwiGLU, x: torch.Tensor, dy: torch.Tensor):
    def step(clock: PhaseClock) -> None:
        for tensor in [x, *layer.parameters()]:
            tensor.grad = None
        clock.mark()
        y = layer(x)
        clock.mark()
        y.backward(dy)
        clock.mark()
    return step


def _groups(placement: Placement) -> dict[str, dist.ProcessGroup | None]:
    """The process group of each axis the accounting names."""
    if placement.world_size == 1:
        return {}
    mesh = Mesh(Layout(shard=placement.data, tensor=placement.tensor))
    return {"dp": mesh.shard.group, "fsdp": mesh.shard.group, "tp": mesh.tensor.group}


def _collectives(cost: StepCost, groups: dict, dtype: torch.dtype, device: torch.device):
    """The passes' collectives on tensors of their sizes, issued back to back, waited at the end of each pass
    (none on one device)."""
    passes = [[(c, groups[axis]) for axis, collectives in costs.collectives.items() for c in collectives
               if c.devices > 1] for costs in (cost.forward, cost.backward)]
    buffers = {c: _buffers(c, dtype, device) for issued in passes for c, _ in issued}

    def step(clock: PhaseClock) -> None:
        clock.mark()
        for issued in passes:
            for pending in [_issue(c, group, *buffers[c]) for c, group in issued]:
                pending.wait()
            clock.mark()
    return step


def _buffers(collective: Collective, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole tensor (S bytes) and one rank's chunk of it."""
    numel = int(collective.nbytes) // dtype.itemsize
    chunk = -(-numel // collective.devices)
    return (torch.randn(chunk * collective.devices, device=device, dtype=dtype),
            torch.empty(chunk, device=device, dtype=dtype))


def _issue(collective: Collective, group, whole: torch.Tensor, chunk: torch.Tensor):
    if collective.kind == "all-reduce":
        return all_reduce_sum(whole, "ffn all-reduce", group)
    if collective.kind == "all-gather":
        return all_gather([whole], [chunk], "ffn all-gather", group)
    return reduce_scatter_mean([chunk], [whole], "ffn reduce-scatter", group)


def bandwidth_bytes(size_mb: float, itemsize: int, world_size: int) -> int:
    """S of the bandwidth collectives: `size_mb` MiB, in whole chunks of one element size per rank."""
    return int(size_mb * 2**20) // (itemsize * world_size) * itemsize * world_size


def time_bandwidth(size_mb: float, dtype_name: str, warmup: int, rounds: int) -> dict[str, list[float]]:
    """On every rank: seconds per collective of each kind, each round's mean over LOOP_CALLS back to back."""
    device, dtype = rank_device(), DTYPES[dtype_name]
    world = dist.get_world_size()
    nbytes = bandwidth_bytes(size_mb, dtype.itemsize, world)
    collectives = {kind: Collective(kind, nbytes, world) for kind in BANDWIDTH_KINDS}
    times = {}
    for kind, collective in collectives.items():
        buffers = _buffers(collective, dtype, device)

        def loop(clock: PhaseClock, collective=collective, buffers=buffers) -> None:
            clock.mark()
            for pending in [_issue(collective, None, *buffers) for _ in range(LOOP_CALLS)]:
                pending.wait()
            clock.mark()
        times[kind] = [seconds[0] / LOOP_CALLS for seconds in _rounds(loop, warmup, rounds)]
    return times


def medians(rank_rounds: list[list[list[float]]]) -> tuple[float, float]:
    """[forward, backward]: the mean over ranks of each rank's median round."""
    return tuple(statistics.mean(statistics.median(r[i] for r in rounds) for rounds in rank_rounds)
                 for i in range(2))
