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
import itertools
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from systems.model import ATTENTION_BACKENDS, PRESETS, TransformerConfig, TransformerLM, get_config
from systems.optim import AdamW, ShardedOptimizer
from systems.parallel import ddp
from systems.parallel.ddp import check_bucket_size, make_ddp
from systems.parallel.fsdp import DEFAULT_GATHER, DEFAULT_PREFETCH, FSDP, Gather, check_prefetch
from systems.parallel.meters import PeakMemory, PhaseClock
from systems.parallel.ranks import init_from_env, rank_device
from systems.precision import PRECISIONS, Precision, get_precision
from systems.step import backward, forward_loss, make_model, optimizer_step, random_batch

# One process; our DDP variants; torch's DistributedDataParallel; our FSDP; torch's FSDP2 (fully_shard).
VARIANTS = ("single", *ddp.VARIANTS, "torch", "fsdp", "fsdp2")
SHARDED = ("fsdp", "fsdp2")  # compute in the precision's compute dtype, weights cast before the all-gathers
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
    # The model's levers (systems.model.TransformerConfig): blocks per checkpointed segment, outermost first;
    # tokens per chunk of the chunked cross-entropy (None: the whole logits); the attention backend.
    checkpoint: tuple[int, ...] = ()
    loss_chunk: int | None = None
    attention: str = "sdpa"
    fsdp_prefetch: int = DEFAULT_PREFETCH  # our FSDP's all-gathers in flight ahead of the computing layer
    fsdp_gather: Gather = DEFAULT_GATHER  # our FSDP's collectives: one per layer's weight, or one per block

    def __post_init__(self):
        for field, value, choices in (("preset", self.preset, PRESETS), ("variant", self.variant, VARIANTS),
                                      ("optimizer", self.optimizer, OPTIMIZERS),
                                      ("precision", self.precision, PRECISIONS),
                                      ("attention", self.attention, ATTENTION_BACKENDS)):
            if value not in choices:
                raise ValueError(f"unknown {field} {value!r}; choose from {list(choices)}")
        if self.variant in SHARDED and self.optimizer != "adamw":
            raise ValueError(f"{self.variant} shards the optimizer state itself: use optimizer 'adamw'")
        if self.variant == "torch" and self.bucket_size_mb is None:
            raise ValueError("torch's DistributedDataParallel needs a bucket size")
        check_bucket_size(self.bucket_size_mb)
        check_prefetch(self.fsdp_prefetch)
        object.__setattr__(self, "fsdp_gather", Gather(self.fsdp_gather))
        if min(self.batch_size, self.context, self.steps) < 1 or self.warmup < 0:
            raise ValueError("batch_size, context and steps must be positive and warmup non-negative")
        self.config()  # checks the levers

    def config(self) -> TransformerConfig:
        return get_config(self.preset, context_length=self.context, checkpoint=self.checkpoint,
                          loss_chunk=self.loss_chunk, attention=self.attention)


@dataclass(frozen=True)
class Rank:
    """Where this process trains: its rank among `world_size` (0 of 1 without a process group) and its device."""

    index: int
    world_size: int
    device: torch.device

    @classmethod
    def current(cls, variant: str) -> Rank:
        if dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), rank_device())
        if variant != "single":
            raise ValueError(f"variant {variant!r} needs a process group")
        return cls(0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu"))

    def rows(self, per_rank: int) -> slice:
        """This rank's rows of a global batch."""
        return slice(self.index * per_rank, (self.index + 1) * per_rank)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """`values` averaged over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(values)
            values /= self.world_size
        return values


class SingleProcess(nn.Module):
    """One process training alone, with the interface of the wrappers in systems.parallel.ddp."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing to synchronize."""


class TorchDDP(DistributedDataParallel):
    """Torch's DistributedDataParallel with the interface of the wrappers in systems.parallel.ddp."""

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do: torch's reducer waits for its all-reduces at the end of backward."""


class TorchFSDP2(nn.Module):
    """Torch's FSDP2 (`fully_shard`, block by block, then the root) with the interface of our wrappers,
    casting weights to `compute_dtype` before the all-gathers and reduce-scattering in it, as ours does."""

    def __init__(self, module: TransformerLM, compute_dtype: torch.dtype):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # here: a slow import

        super().__init__()
        with torch.no_grad():  # ranks start apart; ours and DDP broadcast rank 0's weights, fully_shard does not
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor, src=0)
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)
        for block in module.blocks:
            fully_shard(block, mp_policy=policy)
        self.module = fully_shard(module, mp_policy=policy)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Nothing left to do: FSDP2 waits for its reduce-scatters at the end of backward."""


def train(spec: TrainSpec, then: Callable[..., dict] | None = None) -> dict:
    """Train data-parallel on this rank (or alone without a process group); return its measurements.

    Returns per-step losses averaged over ranks (warm-up steps included), per-phase seconds of
    each timed step, this rank's optimizer-state bytes and, on a GPU, peak memory in MiB: during
    construction, and in the last step before and during the optimizer step. `then(model, step)`, given
    the wrapped model and a function that runs one more whole step (on the last batch), adds to the result.
    """
    rank = Rank.current(spec.variant)
    torch.manual_seed(spec.seed + rank.index)  # ranks start apart; the wrapper broadcasts rank 0's weights
    memory = PeakMemory(rank.device)
    config = spec.config()
    precision = get_precision(spec.precision)
    model = wrap(make_model(config, rank.device, precision), spec, rank.device)
    optimizer = build_optimizer(model, spec)
    memory.mark("construction")
    losses, clocks = [], []
    for tokens, targets in rank_batches(config, spec, rank):
        loss, clock = timed_step(model, optimizer, tokens, targets, precision, memory)
        losses.append(loss)
        clocks.append(clock)
    result = {"losses": rank.mean(torch.stack(losses).float()).tolist(),
              "seconds": phase_seconds(clocks[spec.warmup:]), "state_bytes": optimizer_state_bytes(optimizer)}
    if rank.device.type == "cuda":
        result["memory_mb"] = memory.mb
    if isinstance(model, FSDP):
        result["seconds"]["gather_wait"] = model.gather_wait.seconds()[spec.warmup:]
        result["peak_gathered_bytes"] = model.gathered.peak
    if then is not None:
        result |= then(model, lambda: timed_step(model, optimizer, tokens, targets, precision, memory))
    return result


def wrap(model: nn.Module, spec: TrainSpec, device: torch.device) -> nn.Module:
    """`model` in the variant's wrapper; each has `module` and `finish_gradient_synchronization()`."""
    if spec.variant == "single":
        return SingleProcess(model)
    if spec.variant == "torch":
        return TorchDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        bucket_cap_mb=spec.bucket_size_mb)
    compute = get_precision(spec.precision).compute
    if spec.variant == "fsdp":
        return FSDP(model, compute_dtype=compute, prefetch=spec.fsdp_prefetch, gather=spec.fsdp_gather)
    if spec.variant == "fsdp2":
        return TorchFSDP2(model, compute)
    return make_ddp(spec.variant, model, spec.bucket_size_mb if spec.variant == "bucketed" else None)


def build_optimizer(model: nn.Module, spec: TrainSpec) -> torch.optim.Optimizer:
    """The optimizer over what the wrapper `model` steps: the module's parameters, or FSDP's shards."""
    if spec.variant == "fsdp2":  # its parameters are DTensors, which torch's AdamW steps
        return torch.optim.AdamW(model.parameters(), lr=spec.lr)
    if spec.optimizer == "sharded":
        return ShardedOptimizer(model.parameters(), AdamW, lr=spec.lr)
    if spec.optimizer == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer  # here: a slow import, for this optimizer only

        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=AdamW, lr=spec.lr)
    return AdamW(model.parameters(), lr=spec.lr)


def rank_batches(config: TransformerConfig, spec: TrainSpec, rank: Rank) -> Iterator[tuple[torch.Tensor, ...]]:
    """This rank's rows of every global batch, warm-up steps included: (tokens, targets), each (batch_size, context)."""
    data = torch.Generator().manual_seed(spec.seed)  # one stream of global batches, the same on every rank
    mine = rank.rows(spec.batch_size)
    for _ in range(spec.warmup + spec.steps):
        tokens, targets = random_batch(config, spec.batch_size * rank.world_size, spec.context, rank.device, data)
        yield tokens[mine], targets[mine]


def timed_step(model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor,
               precision: Precision, memory: PeakMemory) -> tuple[torch.Tensor, PhaseClock]:
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


def main(argv: list[str] | None = None) -> None:
    """The torchrun entry point: train on every rank of an env:// process group; rank 0 prints the result."""
    backend, spec = parse_args(argv)
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
        print_result(result)


def _blocks_per_level(text: str) -> tuple[int, ...]:
    """--checkpoint 6,1: segments of 6 blocks, each recomputed as segments of 1; an empty string: none."""
    return tuple(int(k) for k in text.split(",") if k.strip())


OPTION_TYPES = {"checkpoint": _blocks_per_level, "loss_chunk": int}  # fields whose default's type parses nothing


def parse_args(argv: list[str] | None) -> tuple[str, TrainSpec]:
    """The process-group backend and a TrainSpec, one option per field (--bucket-size-mb for bucket_size_mb)."""
    parser = argparse.ArgumentParser(description="Data-parallel training under torchrun (env:// rendezvous).")
    parser.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    for field in dataclasses.fields(TrainSpec):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=OPTION_TYPES.get(field.name, type(field.default)),
                            default=field.default)
    args = vars(parser.parse_args(argv))
    backend = args.pop("backend")
    return backend, TrainSpec(**args)


def print_result(result: dict) -> None:
    for step, loss in enumerate(result["losses"]):
        print(f"step {step} loss {loss!r}")
    print("median ms:", ", ".join(f"{name} {statistics.median(seconds) * 1e3:.3f}"
                                  for name, seconds in result["seconds"].items()))


if __name__ == "__main__":
    main()
