"""How the ranks share a step (`Variant`) and which optimizer they step (`Optimizer`)."""

from __future__ import annotations

from systems.choice import Choice
from systems.levers.layout import Layout


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

    def world_layout(self, world_size: int) -> Layout:
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
