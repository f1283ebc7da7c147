"""What a data-parallel training run is: `TrainSpec`, every lever of it typed and checked once.

A lever arrives as text (an option, torchrun's command line) or as its object; `TrainSpec` turns text into the
object with the lever's own parser (`get_precision`, `Attention`, `Fused`, and systems.levers' `Variant`,
`Optimizer`, `Gather`, `Checkpointing.parse`; `data_layout` here), and keeps the object. Whether a layout fits
the process group is checked where the group exists (`layout_for`, called by `train`). `parallelize`
(systems.parallel.parallelize) and `train` (systems.parallel.train) read it; it imports nothing of
torch.distributed, so reading a history does not.
"""

from __future__ import annotations

from dataclasses import dataclass

from systems.accounting.transformer import checkpointed
from systems.levers.checkpointing import Checkpointing
from systems.levers.layout import Layout
from systems.levers.sharding import DEFAULT_GATHER, DEFAULT_PREFETCH, Gather, check_prefetch
from systems.levers.variant import Optimizer, Variant
from systems.loss import check_chunk
from systems.model import DEFAULT_EDITION, Attention, Fused, TransformerConfig, get_config
from systems.precision import PRECISIONS, Precision, get_precision


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
    # variants take none (they share the step over the whole world: `Variant.world_layout`).
    layout: Layout | None = None

    def __post_init__(self):
        parsers = {"variant": Variant, "optimizer": Optimizer, "precision": get_precision, "attention": Attention,
                   "fused": Fused, "fsdp_gather": Gather, "checkpoint": Checkpointing.parse}
        for name, parse in parsers.items():
            object.__setattr__(self, name, parse(getattr(self, name)))
        if self.variant.meshed and self.layout is None:
            raise ValueError(f"{self.variant} needs a layout of replicas x shards, e.g. 2x2")
        if not self.variant.meshed and self.layout is not None:
            raise ValueError(f"a layout is for {Variant.HSDP} and {Variant.TORCH_HSDP}; {self.variant} shares the "
                             f"step over every rank")
        if self.layout is not None:
            object.__setattr__(self, "layout", data_layout(self.layout))
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
        self.checkpoint.configure(self._unchecked_config())  # a known preset, and levers that go together

    def layout_for(self, world_size: int) -> Layout:
        """This run's layout on a process group of `world_size` ranks, which must be as many as it has."""
        layout = self.layout or self.variant.world_layout(world_size)
        if layout.world_size != world_size:
            raise ValueError(f"{self.variant}'s layout {layout} has {layout.world_size} ranks; this process group "
                             f"has {world_size}")
        return layout

    def config(self, device: str = "cuda") -> TransformerConfig:
        """The model this run trains; `device` ("cuda" or "cpu") decides nested checkpointing's sizes."""
        return checkpointed(self.checkpoint, self._unchecked_config(), self.batch_size, self.context, self.precision,
                            device=device)

    def _unchecked_config(self) -> TransformerConfig:
        """The preset with this run's levers but not yet its checkpointing."""
        return get_config(self.preset, self.edition, context_length=self.context, loss_chunk=self.loss_chunk,
                          attention=self.attention, fused=self.fused, compile=self.compile)


def data_layout(layout: Layout | str) -> Layout:
    """A training run's layout, or its text: replicas x shards, since the training loop has no tensor
    parallelism (systems.parallel.tensor)."""
    layout = Layout.parse(layout)
    if layout.tensor != 1:
        raise ValueError(f"layout {layout}: the training loop has no tensor parallelism (systems.parallel.tensor); "
                         f"give replicas x shards, e.g. 2x2")
    return layout
