"""What a data-parallel training run is: `TrainSpec`, every lever of it typed and checked once.

A lever arrives as text (an option, torchrun's command line) or as its object; `TrainSpec` turns text into the
object with the lever's own parser (`get_precision`, `Checkpointing.parse`, `Attention`, `Gather`, `Variant`,
`Optimizer`, `Layout.parse`) and keeps the object. Whether a layout fits the process group is checked where the
group exists (`layout_for`, called by `train`). `parallelize` (systems.parallel.parallelize) and `train`
(systems.parallel.train) read it; it imports nothing of torch.distributed, so reading a history does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from systems.accounting.checkpointing import Checkpointing
from systems.accounting.transformer import checkpointed
from systems.choice import Choice
from systems.loss import check_chunk
from systems.model import DEFAULT_EDITION, Attention, Fused, TransformerConfig, get_config
from systems.parallel.fsdp_units import DEFAULT_GATHER, DEFAULT_PREFETCH, Gather, check_prefetch
from systems.parallel.mesh import Layout
from systems.precision import PRECISIONS, Precision, get_precision


class Variant(Choice):
    """How the ranks share a step: one process alone; our DDP variants (systems.parallel.ddp); torch's
    DistributedDataParallel; our FSDP; torch's FSDP2 (`fully_shard`); ours and torch's FSDP over a layout of
    replicas x shards (HSDP: shard inside a node, replicate across nodes; systems.parallel.mesh)."""

    SINGLE = "single"
    NAIVE = "naive"
    FLAT = "flat"
    INDIVIDUAL = "individual"
    BUCKETED = "bucketed"
    TORCH = "torch"
    FSDP = "fsdp"
    FSDP2 = "fsdp2"
    HSDP = "hsdp"
    TORCH_HSDP = "torch-hsdp"

    @property
    def sharded(self) -> bool:
        """Shards weights, gradients and optimizer state, computing in the precision's compute dtype (weights
        cast before the all-gathers) instead of under autocast."""
        return self in (Variant.FSDP, Variant.FSDP2, Variant.HSDP, Variant.TORCH_HSDP)

    @property
    def meshed(self) -> bool:
        """Takes a layout of replicas x shards: ours FSDP over a Mesh, torch's FSDP2 over a 2D DeviceMesh."""
        return self in (Variant.HSDP, Variant.TORCH_HSDP)

    def over_the_world(self, world_size: int) -> Layout:
        """The layout of a variant that takes none: one process; the DDP variants replicate over every rank, FSDP
        and FSDP2 shard over every rank."""
        if self == Variant.SINGLE:
            return Layout()
        return Layout(shard=world_size) if self.sharded else Layout(replicate=world_size)

    @property
    def bucketed(self) -> bool:
        """Takes a bucket size: DDPBucketed's, torch DDP's bucket_cap_mb."""
        return self in (Variant.BUCKETED, Variant.TORCH)


class Optimizer(Choice):
    """AdamW on every rank; ShardedOptimizer (ZeRO-1) over our AdamW; torch's ZeroRedundancyOptimizer."""

    ADAMW = "adamw"
    SHARDED = "sharded"
    ZERO = "zero"


@dataclass(frozen=True)
class TrainSpec:
    preset: str = "tiny"
    edition: str = DEFAULT_EDITION  # whose table names the preset (systems.model.EDITIONS)
    variant: Variant = Variant.BUCKETED
    bucket_size_mb: float | None = 25.0  # bucketed and torch; None: one bucket (bucketed only)
    optimizer: Optimizer = Optimizer.ADAMW
    precision: Precision = PRECISIONS["fp32"]  # bf16-weights all-reduces bf16 gradients
    batch_size: int = 4  # per rank
    context: int = 128
    warmup: int = 2
    steps: int = 5  # timed, after the warm-up steps
    lr: float = 1e-3
    seed: int = 0
    # The model's levers (systems.model.TransformerConfig): which blocks the backward recomputes and what it
    # keeps, tokens per chunk of the chunked cross-entropy (None: the whole logits), the attention backend, the
    # fused Triton kernels, torch.compile of each block.
    checkpoint: Checkpointing = Checkpointing(())
    loss_chunk: int | None = None
    attention: Attention = Attention.SDPA
    fused: Fused = Fused.NONE
    compile: bool = False
    fsdp_prefetch: int = DEFAULT_PREFETCH  # our FSDP's all-gathers in flight ahead of the computing layer
    fsdp_gather: Gather = DEFAULT_GATHER  # our FSDP's collectives: one per layer's weight, or one per block
    # hsdp and torch-hsdp's replicas x shards ("2x2": two replicas, each sharded over two ranks); the other
    # variants take none (they share the step over the whole world: `Variant.over_the_world`).
    layout: Layout | None = None

    def __post_init__(self):
        parsers = {"variant": Variant, "optimizer": Optimizer, "precision": get_precision, "attention": Attention,
                   "fused": Fused, "fsdp_gather": Gather, "checkpoint": _checkpointing, "layout": _layout}
        for name, parse in parsers.items():
            object.__setattr__(self, name, parse(getattr(self, name)))
        if self.variant.meshed and self.layout is None:
            raise ValueError(f"{self.variant} needs a layout of replicas x shards, e.g. 2x2")
        if not self.variant.meshed and self.layout is not None:
            raise ValueError(f"a layout is for {Variant.HSDP} and {Variant.TORCH_HSDP}; {self.variant} shares the "
                             f"step over every rank")
        if self.layout is not None:
            check_data_layout(self.layout)
        if self.variant.sharded and self.optimizer != Optimizer.ADAMW:
            raise ValueError(f"{self.variant} shards the optimizer state itself: use optimizer 'adamw'")
        if self.variant == Variant.TORCH and self.bucket_size_mb is None:
            raise ValueError("torch's DistributedDataParallel needs a bucket size")
        if self.bucket_size_mb is not None and not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive or None, got {self.bucket_size_mb}")
        check_prefetch(self.fsdp_prefetch)
        if self.loss_chunk is not None:
            check_chunk(self.loss_chunk)
        if min(self.batch_size, self.context, self.steps) < 1 or self.warmup < 0:
            raise ValueError("batch_size, context and steps must be positive and warmup non-negative")
        self.config("cpu")  # a known preset of the edition, and model levers that go together

    def layout_for(self, world_size: int) -> Layout:
        """This run's layout on a process group of `world_size` ranks, which must be as many as it has."""
        layout = self.layout or self.variant.over_the_world(world_size)
        if layout.world_size != world_size:
            raise ValueError(f"{self.variant}'s layout {layout} has {layout.world_size} ranks; this process group "
                             f"has {world_size}")
        return layout

    def config(self, device: str = "cuda") -> TransformerConfig:
        """The model this run trains; `device` ("cuda" or "cpu") decides nested checkpointing's sizes."""
        base = get_config(self.preset, self.edition, context_length=self.context, loss_chunk=self.loss_chunk,
                          attention=self.attention, fused=self.fused, compile=self.compile)
        return checkpointed(self.checkpoint, base, self.batch_size, self.context, self.precision, device=device)


def _checkpointing(scheme: Checkpointing | str) -> Checkpointing:
    return scheme if isinstance(scheme, Checkpointing) else Checkpointing.parse(scheme)


def check_data_layout(layout: Layout) -> Layout:
    """A layout of replicas x shards: the training loop has no tensor parallelism (systems.parallel.tensor)."""
    if layout.tensor != 1:
        raise ValueError(f"layout {layout}: the training loop has no tensor parallelism (systems.parallel.tensor); "
                         f"give replicas x shards, e.g. 2x2")
    return layout


def _layout(layout: Layout | str | None) -> Layout | None:
    if layout is None or isinstance(layout, Layout):
        return layout
    if isinstance(layout, str):
        return Layout.parse(layout)
    raise TypeError(f"layout must be None, a Layout or its text (2x2), got {layout!r}")
