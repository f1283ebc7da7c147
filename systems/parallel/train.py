"""The parallel training loop, every step split into its phases.

`train(spec, schedule)` runs on each rank of a process group (or alone, as the single-process baseline): each rank
takes its data-parallel rank's slice of one global batch (the ranks of a tensor-parallel group take the same rows),
builds the model, wraps it with `parallelize(model, spec)` and times each step after the schedule's warm-up
as forward, backward, waiting for gradient communication and optimizer step. The benchmarks run it through
`systems.parallel.ranks`; torchrun runs it through `python -m systems.parallel` (systems/parallel/__main__.py).

On a GPU the phases are timed with CUDA events on the compute stream, so timing adds no host syncs and an
all-reduce that overlaps backward costs only the time the stream waits for it. Torch's
DistributedDataParallel waits for its all-reduces inside backward, so its communication wait shows up as part
of backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from systems.levers.layout import Layout
from systems.levers.variant import Optimizer, Variant
from systems.model import TransformerConfig
from systems.optim import AdamW, ShardedOptimizer
from systems.parallel.collectives import all_gather, all_reduce_mean
from systems.parallel.fsdp import FSDP
from systems.parallel.meters import PeakMeter, PhaseClock
from systems.parallel.parallelize import parallelize
from systems.parallel.ranks import rank_device
from systems.parallel.spec import Schedule, TrainSpec
from systems.precision import Precision
from systems.step import backward, forward_loss, make_model, optimizer_step, random_batch

PHASES = ("forward", "backward", "comm_wait", "optimizer")


@dataclass(frozen=True)
class Rank:
    """Where this process trains: its rank among `world_size` (0 of 1 without a process group), its device, and
    the layout of the ranks (`TrainSpec.layout_for`: checked against the group here, before anything is built)."""

    index: int
    world_size: int
    device: torch.device
    layout: Layout

    @classmethod
    def current(cls, spec: TrainSpec) -> Rank:
        if dist.is_initialized():
            world_size = dist.get_world_size()
            return cls(dist.get_rank(), world_size, rank_device(), spec.layout_for(world_size))
        if spec.variant != Variant.SINGLE:
            raise ValueError(f"variant '{spec.variant}' needs a process group")
        return cls(0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"), spec.layout_for(1))

    @property
    def data_size(self) -> int:
        """The data-parallel ranks, which split a global batch: replicas x shards."""
        return self.layout.replicate * self.layout.shard

    @property
    def data_index(self) -> int:
        """This rank's among them: the ranks of a tensor-parallel group share it."""
        return self.index // self.layout.tensor

    def rows(self, per_rank: int) -> slice:
        """This rank's rows of a global batch: its data-parallel rank's."""
        return slice(self.data_index * per_rank, (self.data_index + 1) * per_rank)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """`values` averaged over the data-parallel ranks, in place: in rank order under gloo
        (systems.parallel.collectives), so one process averaging those ranks' values in that order gets the same
        bits. The ranks of a tensor-parallel group hold the same values, counted once: every rank's gathered, and
        the first of each group's summed in rank order, then divided."""
        if self.layout.tensor > 1:
            every = values.new_empty(self.world_size * values.numel())
            all_gather([every], [values.contiguous().view(-1)], "values of every rank").wait()
            firsts = every.view(self.world_size, *values.shape)[::self.layout.tensor]
            total = firsts[0].clone()
            for term in firsts[1:]:
                total.add_(term)
            values.copy_(total.div_(len(firsts)))
        elif self.world_size > 1:
            all_reduce_mean(values, "mean over ranks").wait()
        return values


def train(spec: TrainSpec, schedule: Schedule = Schedule(),
          after_training: Callable[..., dict] | None = None) -> dict:
    """Train on this rank as `spec.variant` shares the step (or alone without a process group), `schedule.warmup`
    untimed steps then `schedule.steps` timed ones; return its measurements.

    Returns per-step losses averaged over the data-parallel ranks (warm-up steps included), per-phase seconds of
    each timed step, this rank's optimizer-state bytes and, on a GPU, peak memory in MiB: during construction, and
    in the last step before and during the optimizer step. `after_training(model, step)`, given the wrapped model and a
    function that runs one more whole step (on the last batch), adds to the result.
    """
    rank = Rank.current(spec)
    torch.manual_seed(spec.seed + rank.index)  # ranks start apart; the wrapper broadcasts rank 0's weights
    memory = PeakMeter(rank.device)
    config = spec.config()
    precision = spec.precision
    model = parallelize(make_model(config, rank.device, precision), spec, rank.device, rank.layout)
    optimizer = build_optimizer(model, spec)
    memory.mark("construction")
    losses, clocks = [], []
    for tokens, targets in rank_batches(config, spec, schedule, rank):
        loss, clock = timed_step(model, optimizer, tokens, targets, precision, memory)
        losses.append(loss)
        clocks.append(clock)
    result = {"losses": rank.mean(torch.stack(losses).float()).tolist(),
              "seconds": phase_seconds(clocks[schedule.warmup:]), "state_bytes": optimizer_state_bytes(optimizer)}
    if rank.device.type == "cuda":
        result["memory_mb"] = memory.mb
    if isinstance(model, FSDP):
        result["seconds"]["gather_wait"] = model.gather_wait.seconds()[schedule.warmup:]
        result["peak_gathered_bytes"] = model.gathered.peak
    if after_training is not None:
        result |= after_training(model, lambda: timed_step(model, optimizer, tokens, targets, precision, memory))
    return result


def build_optimizer(model: nn.Module, spec: TrainSpec) -> torch.optim.Optimizer:
    """The optimizer over what the wrapper `model` steps: the module's parameters, or FSDP's shards."""
    if spec.variant.dtensors:  # torch's FSDP2 and TP: DTensor parameters, which torch's AdamW steps
        from torch.distributed.tensor import DTensor  # here: a slow import, already made by these variants

        params = list(model.parameters())
        # Its foreach kernels (CUDA's default) take DTensors or plain tensors, not both in one list: TP alone
        # leaves the weights it does not split (the norms') plain.
        mixed = len({isinstance(param, DTensor) for param in params}) > 1
        return torch.optim.AdamW(params, lr=spec.lr, foreach=False if mixed else None)
    if spec.optimizer == Optimizer.SHARDED:
        return ShardedOptimizer(model.parameters(), AdamW, lr=spec.lr)
    if spec.optimizer == Optimizer.ZERO:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # here: a slow import, for this optimizer only

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=AdamW, lr=spec.lr)
    return AdamW(model.parameters(), lr=spec.lr)


def rank_batches(config: TransformerConfig, spec: TrainSpec, schedule: Schedule,
                 rank: Rank) -> Iterator[tuple[torch.Tensor, ...]]:
    """This rank's rows of every global batch of the schedule, warm-up steps included: (tokens, targets), each
    (batch_size, context). A global batch has batch_size rows per data-parallel rank."""
    data = torch.Generator().manual_seed(spec.seed)  # one stream of global batches, the same on every rank
    mine = rank.rows(spec.batch_size)
    for _ in range(schedule.warmup + schedule.steps):
        tokens, targets = random_batch(config, spec.batch_size * rank.data_size, spec.context, rank.device, data)
        yield tokens[mine], targets[mine]


def timed_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor,
               precision: Precision, memory: PeakMeter) -> tuple[torch.Tensor, PhaseClock]:
    """One training step; returns its loss and a clock marked between PHASES. `memory` records the peak
    before the optimizer step and during it."""
    clock = PhaseClock(tokens.device)
    memory.reset()
    clock.mark()
    loss = forward_loss(model, tokens, targets, precision)
    clock.mark()
    backward(loss)
    clock.mark()
    model.finish_gradient_synchronization()
    clock.mark()
    memory.mark("before_step")
    optimizer_step(optimizer)
    clock.mark()
    memory.mark("after_step")
    return loss.detach(), clock


def phase_seconds(clocks: list[PhaseClock]) -> dict[str, list[float]]:
    """Per phase, and for the whole step, the seconds of each clocked step."""
    steps = [clock.seconds() for clock in clocks]
    phases = {name: [seconds[i] for seconds in steps] for i, name in enumerate(PHASES)}
    return phases | {"step": [sum(seconds) for seconds in steps]}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors held by this rank."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer there
    return sum(t.numel() * t.element_size() for state in inner.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))
