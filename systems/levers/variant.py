"""How the ranks share a step (`Variant`) and which optimizer they step (`Optimizer`)."""

from __future__ import annotations

from systems.choice import Choice
from systems.levers.layout import Layout


class Variant(Choice):
    """How the ranks share a step: one process alone; our DDP variants (systems.parallel.ddp); torch's
    DistributedDataParallel; our FSDP; torch's FSDP2 (`fully_shard`); ours and torch's FSDP over a layout of
    replicas x shards (HSDP: shard inside a node, replicate across nodes; systems.parallel.mesh); tensor
    parallelism, ours and torch's (systems.parallel.tensor), alone over every rank and under FSDP over a layout
    with a tensor axis (`fsdp-tp`: ours under our FSDP; `torch-fsdp-tp`: torch's under FSDP2)."""

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
    TP = "tp"
    TORCH_TP = "torch-tp"
    FSDP_TP = "fsdp-tp"
    TORCH_FSDP_TP = "torch-fsdp-tp"

    @property
    def sharded(self) -> bool:
        """Shards weights, gradients and optimizer state, computing in the precision's compute dtype (weights
        cast before the all-gathers) instead of under autocast."""
        return self in (Variant.FSDP, Variant.FSDP2, Variant.HSDP, Variant.TORCH_HSDP, Variant.FSDP_TP,
                        Variant.TORCH_FSDP_TP)

    @property
    def meshed(self) -> bool:
        """Takes a layout: of replicas x shards (HSDP: ours FSDP over a Mesh, torch's FSDP2 over a 2D DeviceMesh),
        or of replicas x shards x tensor (FSDP over the data axes of tensor-parallel blocks)."""
        return self in (Variant.HSDP, Variant.TORCH_HSDP, Variant.FSDP_TP, Variant.TORCH_FSDP_TP)

    @property
    def tensor_parallel(self) -> bool:
        """Splits every block's attention and SwiGLU over the layout's tensor axis, before any data-parallel
        wrapper (torchtitan's order)."""
        return self in (Variant.TP, Variant.TORCH_TP, Variant.FSDP_TP, Variant.TORCH_FSDP_TP)

    @property
    def dtensors(self) -> bool:
        """Trains torch's DTensor parameters (FSDP2's shards, torch's TP slices), which torch's AdamW steps."""
        return self in (Variant.FSDP2, Variant.TORCH_HSDP, Variant.TORCH_TP, Variant.TORCH_FSDP_TP)

    def world_layout(self, world_size: int) -> Layout:
        """The layout of a variant that takes none: one process; the DDP variants replicate over every rank, FSDP
        and FSDP2 shard over every rank, tensor parallelism splits every block over every rank."""
        if self == Variant.SINGLE:
            return Layout()
        if self.tensor_parallel:
            return Layout(tensor=world_size)
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
