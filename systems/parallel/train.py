"""Data-parallel training of the Transformer LM, with every step split into its phases.

`train(spec)` runs on each rank of a process group (or alone, as the single-process baseline):
each rank takes its slice of one global batch, and the step is timed as forward, backward,
waiting for gradient communication and optimizer step. The benchmarks run it through
`systems.parallel.ranks.launch`; the same code runs under torchrun, on one node or several:

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 -m systems.parallel.train \\
        --preset small --variant bucketed --bucket-size-mb 25 --steps 10

On a GPU the phases are timed with CUDA events on the compute stream, so timing adds no host
syncs and an all-reduce that overlaps backward costs only the time the stream waits for it.
Torch's DistributedDataParallel waits for its all-reduces inside backward, so its
communication wait shows up as part of backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from systems.device import synchronize
from systems.parallel import ddp
from systems.parallel.ddp import check_bucket_size, make_ddp
from systems.parallel.ranks import init_from_env, rank_device
from systems.model import PRESETS, get_config
from systems.optim import AdamW, ShardedOptimizer
from systems.precision import PRECISIONS, get_precision
from systems.step import backward, forward_loss, make_model, optimizer_step, random_batch

VARIANTS = ("single", *ddp.VARIANTS, "torch")  # one process; ours; torch's DistributedDataParallel
OPTIMIZERS = ("adamw", "sharded", "zero")
PHASES = ("forward", "backward", "comm_wait", "optimizer")


@dataclass(frozen=True)
class TrainSpec:
    preset: str = "tiny"
    variant: str = "bucketed"
    bucket_size_mb: float | None = 25.0  # bucketed and torch; None: one bucket (bucketed only)
    optimizer: str = "adamw"
    precision: str = "fp32"  # a name in systems.precision.PRECISIONS; bf16-weights all-reduces bf16 gradients
    batch_size: int = 4  # per rank
    context: int = 128
    warmup: int = 2
    steps: int = 5  # timed, after the warm-up steps
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        for field, value, choices in (("preset", self.preset, PRESETS), ("variant", self.variant, VARIANTS),
                                      ("optimizer", self.optimizer, OPTIMIZERS),
                                      ("precision", self.precision, PRECISIONS)):
            if value not in choices:
                raise ValueError(f"unknown {field} {value!r}; choose from {list(choices)}")
        if self.variant == "torch" and self.bucket_size_mb is None:
            raise ValueError("torch's DistributedDataParallel needs a bucket size")
        check_bucket_size(self.bucket_size_mb)
        if min(self.batch_size, self.context, self.steps) < 1 or self.warmup < 0:
            raise ValueError("batch_size, context and steps must be positive and warmup non-negative")


class TorchDDP(DistributedDataParallel):
    """Torch's DistributedDataParallel with the interface of the wrappers in systems.parallel.ddp."""

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do: torch's reducer waits for its all-reduces at the end of backward."""


class PhaseClock:
    """Timestamps between the phases of a step: CUDA events on a GPU, the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks = []

    def mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks."""
        synchronize(self.device)
        if self.device.type == "cuda":
            return [start.elapsed_time(end) / 1e3 for start, end in zip(self.marks, self.marks[1:])]
        return [end - start for start, end in zip(self.marks, self.marks[1:])]


def wrap(model: nn.Module, spec: TrainSpec, device: torch.device) -> nn.Module:
    if spec.variant == "single":
        return model
    if spec.variant == "torch":
        return TorchDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        bucket_cap_mb=spec.bucket_size_mb)
    return make_ddp(spec.variant, model, spec.bucket_size_mb if spec.variant == "bucketed" else None)


def build_optimizer(model: nn.Module, spec: TrainSpec) -> torch.optim.Optimizer:
    if spec.optimizer == "sharded":
        return ShardedOptimizer(model.parameters(), AdamW, lr=spec.lr)
    if spec.optimizer == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer  # here: importing it costs each rank ~2 s

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=AdamW, lr=spec.lr)
    return AdamW(model.parameters(), lr=spec.lr)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors held by this rank."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer there
    return sum(t.numel() * t.element_size() for state in inner.state.values() for t in state.values()
               if isinstance(t, torch.Tensor))


def train(spec: TrainSpec) -> dict:
    """Train data-parallel on this rank (or alone without a process group); return its measurements.

    Returns per-step losses averaged over ranks (warm-up steps included), per-phase seconds of
    each timed step, this rank's optimizer-state bytes and, on a GPU, peak memory in MiB: during
    construction, and in the last step before and during the optimizer step.
    """
    distributed = dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    device = rank_device() if distributed else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec.variant != "single" and not distributed:
        raise ValueError(f"variant {spec.variant!r} needs a process group")

    torch.manual_seed(spec.seed + rank)  # ranks start apart; the wrapper broadcasts rank 0's weights
    _reset_peak(device)
    config = get_config(spec.preset, context_length=spec.context)
    precision = get_precision(spec.precision)
    model = wrap(make_model(config, device, precision), spec, device)
    optimizer = build_optimizer(model.module if spec.variant != "single" else model, spec)
    memory = {"construction": _peak_mb(device)}
    data = torch.Generator().manual_seed(spec.seed)  # one stream of global batches, the same on every rank
    losses, clocks = [], []
    for step in range(spec.warmup + spec.steps):
        tokens, targets = random_batch(config, spec.batch_size * world_size, spec.context, device, data)
        mine = slice(rank * spec.batch_size, (rank + 1) * spec.batch_size)
        clock = PhaseClock(device)
        _reset_peak(device)
        clock.mark()
        loss = forward_loss(model, tokens[mine], targets[mine], precision)
        clock.mark()
        backward(loss)
        clock.mark()
        if spec.variant != "single":
            model.finish_gradient_synchronization()
        clock.mark()
        memory["before_step"] = _peak_mb(device)
        _reset_peak(device)
        optimizer_step(optimizer)
        clock.mark()
        memory["after_step"] = _peak_mb(device)
        losses.append(loss.detach())
        if step >= spec.warmup:
            clocks.append(clock)

    phases = {name: [] for name in PHASES + ("step",)}
    for clock in clocks:
        seconds = clock.seconds()
        for name, value in zip(PHASES, seconds):
            phases[name].append(value)
        phases["step"].append(sum(seconds))
    losses = torch.stack(losses).float()
    if distributed:
        dist.all_reduce(losses)
        losses /= world_size
    result = {"losses": losses.tolist(), "seconds": phases, "state_bytes": optimizer_state_bytes(optimizer)}
    if device.type == "cuda":
        result["memory_mb"] = memory
    return result


def _peak_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Data-parallel training under torchrun (env:// rendezvous).")
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    for field in dataclasses.fields(TrainSpec):
        default = field.default
        kind = float if field.name == "bucket_size_mb" else type(default)
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=default)
    args = vars(parser.parse_args(argv))
    backend = args.pop("backend")
    spec = TrainSpec(**args)
    init_from_env(backend)
    try:
        result = train(spec)
        rank = dist.get_rank()
        # No rank tears the group down while another still talks to it: gloo can abort a rank whose peer
        # closed their connection under it.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        for step, loss in enumerate(result["losses"]):
            print(f"step {step} loss {loss!r}")
        print("median ms:", ", ".join(f"{name} {statistics.median(seconds) * 1e3:.3f}"
                                      for name, seconds in result["seconds"].items()))


if __name__ == "__main__":
    main()
