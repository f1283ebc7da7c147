"""What a parallel training run is: `TrainSpec`, every lever of what it trains typed and checked once, and apart from
it `Schedule`, how long the run is timed: a training benchmark's point holds the spec it trains, which says nothing
of the steps a run of it timed.

Each field names its lever's one text parser and help (`lever`; `lever_parser` finds it by name): torchrun's command
line (systems.parallel's `--bucket-size-mb`) and the benchmarks' options are made from them, and TrainSpec given
text parses it with the same function. Nested checkpointing's levels are worked out once, where a run starts
(`resolved`); `config` is then the model the run trains, without a search. Whether a layout fits the process group
is checked where the group exists (`layout_for`). It imports nothing of torch.distributed, so reading a history
does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from systems.accounting.transformer import nested_checkpoint
from systems.choice import on_off
from systems.levers import spelling
from systems.levers.checkpointing import Checkpointing
from systems.levers.layout import Layout
from systems.levers.sharding import DEFAULT_GATHER, DEFAULT_PREFETCH, Gather, check_prefetch, parse_prefetch
from systems.levers.variant import Optimizer, Variant
from systems.loss import check_chunk
from systems.model import DEFAULT_EDITION, EDITIONS, Attention, Fused, TransformerConfig, get_config
from systems.precision import PRECISIONS, Precision, get_precision


def check_layout(variant: Variant, layout: Layout) -> None:
    """A meshed variant's layout: a tensor axis for tensor parallelism under FSDP, none for HSDP."""
    if variant.tensor_parallel and layout.tensor == 1:
        raise ValueError(f"layout {layout}: {variant} splits every block over the layout's tensor axis; give "
                         f"replicas x shards x tensor, e.g. 1x2x2")
    if not variant.tensor_parallel and layout.tensor != 1:
        raise ValueError(f"layout {layout}: {variant} has no tensor parallelism; {Variant.FSDP_TP} (ours) and "
                         f"{Variant.TORCH_FSDP_TP} (torch's) put tensor parallelism under FSDP")


def lever(default, parse: Callable[[str], object], help: str):
    """A field of TrainSpec or Schedule: its default, the one parser of its text and what it means."""
    return dataclasses.field(default=default, metadata={"parse": parse, "help": help})


@dataclass(frozen=True)
class TrainSpec:
    preset: str = lever("tiny", spelling.name, "model preset (systems.model.EDITIONS)")
    edition: str = lever(DEFAULT_EDITION, spelling.one_of(tuple(EDITIONS), "edition"),
                         "the CS336 edition whose table names the preset: 2025 or 2026")
    variant: Variant = lever(Variant.BUCKETED, Variant, "how the ranks share the step: " + ", ".join(Variant))
    bucket_size_mb: float | None = lever(25.0, spelling.positive(float),
                                         "DDP bucket size, MiB (bucketed and torch; None in Python: one bucket)")
    optimizer: Optimizer = lever(Optimizer.ADAMW, Optimizer, "optimizer: " + ", ".join(Optimizer))
    precision: Precision = lever(PRECISIONS["fp32"], get_precision,
                                 "fp32, bf16 (autocast), fp16, bf16-weights (bf16 weights and gradients)")
    batch_size: int = lever(4, spelling.positive(int), "sequences per step, per data-parallel rank (the ranks of a "
                            "tensor-parallel group share theirs)")
    context: int = lever(128, spelling.positive(int), "tokens per sequence")
    lr: float = lever(1e-3, spelling.positive(float), "learning rate")
    seed: int = lever(0, spelling.integer, "seed of rank 0's weights and every rank's batches")
    checkpoint: Checkpointing = lever(Checkpointing(()), Checkpointing.parse,
                                      "which blocks the backward recomputes: none, everyK, KxK, nested, attn, ops; "
                                      "-keepN leaves the top N blocks out")
    loss_chunk: int | None = lever(None, spelling.chunk, "tokens per chunk of the cross-entropy, or full")
    attention: Attention = lever(Attention.SDPA, Attention, "attention backend: " + ", ".join(Attention))
    fused: Fused = lever(Fused.NONE, Fused, "the model's fused Triton kernels: " + ", ".join(Fused))
    compile: bool = lever(False, on_off, "torch.compile of each block: off or on")
    fsdp_prefetch: int = lever(DEFAULT_PREFETCH, parse_prefetch,
                               "our FSDP's all-gathers in flight ahead of the computing layer")
    fsdp_gather: Gather = lever(DEFAULT_GATHER, Gather, "what one of our FSDP's collectives covers: layer or block")
    layout: Layout | None = lever(None, Layout.parse, "the layout of hsdp and torch-hsdp (replicas x shards, e.g. "
                                  "2x2) and of fsdp-tp and torch-fsdp-tp (x tensor, e.g. 1x2x2); the other variants "
                                  "share the step over the whole world")

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, str):
                object.__setattr__(self, field.name, field.metadata["parse"](value))
        if self.variant.meshed and self.layout is None:
            axes = "replicas x shards" + (" x tensor, e.g. 1x2x2" if self.variant.tensor_parallel else ", e.g. 2x2")
            raise ValueError(f"{self.variant} needs a layout of {axes}")
        if not self.variant.meshed and self.layout is not None:
            raise ValueError(f"a layout is for {', '.join(v for v in Variant if v.meshed)}; {self.variant} shares the "
                             f"step over every rank")
        if self.layout is not None:
            check_layout(self.variant, self.layout)
        if (self.variant.sharded or self.variant.tensor_parallel) and self.optimizer != Optimizer.ADAMW:
            what = "shards the optimizer state" if self.variant.sharded else "splits the weights and their state"
            raise ValueError(f"{self.variant} {what} itself: use optimizer 'adamw'")
        if self.variant == Variant.TORCH and self.bucket_size_mb is None:
            raise ValueError("torch's DistributedDataParallel needs a bucket size")
        if self.bucket_size_mb is not None and not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive or None, got {self.bucket_size_mb}")
        check_prefetch(self.fsdp_prefetch)
        if self.loss_chunk is not None:
            check_chunk(self.loss_chunk)
        if min(self.batch_size, self.context) < 1:
            raise ValueError("batch_size and context must be positive")
        self.checkpoint.configure(self._levered_config())  # a known preset, and levers that go together

    def layout_for(self, world_size: int) -> Layout:
        """This run's layout on a process group of `world_size` ranks, which must be as many as it has."""
        layout = self.layout or self.variant.world_layout(world_size)
        if layout.world_size != world_size:
            raise ValueError(f"{self.variant}'s layout {layout} has {layout.world_size} ranks; this process group "
                             f"has {world_size}")
        return layout

    def resolved(self, device: str) -> TrainSpec:
        """This run with nested checkpointing's levels worked out for its model and batch on `device` ("cuda" or
        "cpu"), as a run does once where it starts; a spec of any other scheme is already resolved."""
        if self.checkpoint.levels is not None:
            return self
        levels = nested_checkpoint(self.checkpoint.configure(self._levered_config()), self.batch_size, self.context,
                                   self.precision, device=device)
        return dataclasses.replace(self, checkpoint=dataclasses.replace(self.checkpoint, levels=levels))

    def config(self) -> TransformerConfig:
        """The model this run trains."""
        if self.checkpoint.levels is None:
            raise ValueError("nested checkpointing's levels are worked out where the run starts: "
                             "TrainSpec.resolved(device) first")
        return self.checkpoint.configure(self._levered_config())

    def _levered_config(self) -> TransformerConfig:
        """The preset with this run's levers but not yet its checkpointing."""
        return get_config(self.preset, self.edition, context_length=self.context, loss_chunk=self.loss_chunk,
                          attention=self.attention, fused=self.fused, compile=self.compile)


@dataclass(frozen=True)
class Schedule:
    """How long a run is timed: `warmup` untimed steps, then `steps` timed ones."""

    warmup: int = lever(2, spelling.at_least_zero, "untimed steps first")
    steps: int = lever(5, spelling.positive(int), "timed steps, after the warm-up")

    def __post_init__(self):
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be positive and warmup non-negative, got {self.steps} and {self.warmup}")


def lever_parser(name: str) -> Callable[[str], object]:
    """The one parser of lever `name`'s text: a field of TrainSpec or of Schedule."""
    return next(field.metadata["parse"] for cls in (TrainSpec, Schedule) for field in dataclasses.fields(cls)
                if field.name == name)
