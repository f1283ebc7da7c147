"""Bytes each rank sends per training step on each axis of a layout (systems.parallel.mesh), as executable
arithmetic: the collectives of a step of FSDP/HSDP on the shard and replicate axes, and of DDPBucketed on the
replicate axis, one `StepCollective` each (`fsdp_collectives`, `ddp_collectives`: what bench_layouts times axis
by axis), summed by `axis_traffic` (`hsdp_traffic`, `ddp_traffic`).

A collective is counted as the ring algorithm sends it (`gather_bytes`, `all_reduce_bytes`: NCCL's count, and the
bus bandwidth nccl-tests reports). docs/design-notes.md has the counts and what each axis sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from systems.accounting.sharding import block_weights, sharded_weights
from systems.accounting.transformer import count_parameters, parameter_numels
from systems.levers.buckets import fill_buckets
from systems.levers.layout import Layout
from systems.levers.sharding import DEFAULT_GATHER, Gather
from systems.model import TransformerConfig
from systems.precision import Precision

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
PASSES = ("forward", "backward")


def gather_bytes(ranks: int, chunk_bytes: int) -> int:
    """What a rank sends in an all-gather (or a reduce-scatter) of chunks of `chunk_bytes` over `ranks`."""
    return (ranks - 1) * chunk_bytes


def all_reduce_bytes(ranks: int, numel: int, itemsize: int) -> int:
    """What a rank sends in a ring all-reduce of `numel` elements over `ranks`."""
    return 2 * (ranks - 1) * math.ceil(numel / ranks) * itemsize


@dataclass(frozen=True)
class AxisTraffic:
    """Bytes one rank sends along one axis in a step, by collective."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce


@dataclass(frozen=True)
class StepCollective:
    """One collective of a step over one axis's group of `ranks`: each rank's part of it, `numel` elements of
    `itemsize` bytes (its chunk for an all-gather or a reduce-scatter, the whole tensor for an all-reduce), in
    the forward or the backward pass."""

    axis: str  # "shard" or "replicate"
    kind: str  # one of COLLECTIVES
    numel: int
    itemsize: int
    ranks: int
    pass_: str  # one of PASSES

    @property
    def bytes_sent(self) -> int:
        if self.kind == "all_reduce":
            return all_reduce_bytes(self.ranks, self.numel, self.itemsize)
        return gather_bytes(self.ranks, self.numel * self.itemsize)


def axis_traffic(collectives: list[StepCollective]) -> dict[str, AxisTraffic]:
    """{"shard": ..., "replicate": ...}: the bytes the collectives send on each axis, by kind."""
    return {axis: AxisTraffic(**{kind: sum(c.bytes_sent for c in collectives if (c.axis, c.kind) == (axis, kind))
                                 for kind in COLLECTIVES})
            for axis in ("shard", "replicate")}


def hsdp_traffic(config: TransformerConfig, precision: Precision, layout: Layout,
                 gather: Gather = DEFAULT_GATHER) -> dict[str, AxisTraffic]:
    """{"shard": ..., "replicate": ...}: bytes a rank sends per step of FSDP over `layout` (replicas x shards),
    computing in `precision.compute` with weights in `precision.weights`, gathering by `gather` (FSDP's groups,
    which decide how the replicas' all-reduces are cut)."""
    return axis_traffic(fsdp_collectives(config, precision, layout, gather))


def ddp_traffic(config: TransformerConfig, precision: Precision, world_size: int,
                bucket_size_mb: float | None) -> dict[str, AxisTraffic]:
    """Bytes a rank sends per step of DDPBucketed over `world_size` ranks: all on the replicate axis."""
    return axis_traffic(ddp_collectives(config, precision, world_size, bucket_size_mb))


def fsdp_collectives(config: TransformerConfig, precision: Precision, layout: Layout,
                     gather: Gather = DEFAULT_GATHER) -> list[StepCollective]:
    """A step of our FSDP over `layout`'s shard groups, replicated over its replicas (HSDP), one collective per
    group of weights (`gather`), in the order each pass issues them; none on an axis of one rank."""
    if not isinstance(layout, Layout) or layout.tensor != 1:
        raise ValueError(f"FSDP's traffic takes a Layout of replicas and shards only, got {layout!r}")
    gather = Gather(gather)
    shards, replicas = layout.shard, layout.replicate
    compute, weight = precision.compute.itemsize, precision.weights.itemsize
    replicated = count_parameters(config) - sum(sharded_weights(config))
    chunks = [sum(math.ceil(numel / shards) for numel in group) for group in _groups(config, gather)]
    collectives = []
    if shards > 1:
        def shard(kind: str, numel: int, itemsize: int, pass_: str) -> StepCollective:
            return StepCollective("shard", kind, numel, itemsize, shards, pass_)

        collectives += [shard("all_gather", chunk, compute, "forward") for chunk in chunks]
        # Backward gathers again every group but the embedding's (it saves no weight), last first.
        collectives += [shard("all_gather", chunk, compute, "backward") for chunk in reversed(chunks[1:])]
        collectives += [shard("reduce_scatter", chunk, compute, "backward") for chunk in reversed(chunks)]
        collectives.append(shard("all_reduce", replicated, weight, "backward"))
    if replicas > 1:
        collectives += [StepCollective("replicate", "all_reduce", chunk, compute, replicas, "backward")
                        for chunk in reversed(chunks)]
        collectives.append(StepCollective("replicate", "all_reduce", replicated, weight, replicas, "backward"))
    return collectives


def ddp_collectives(config: TransformerConfig, precision: Precision, world_size: int,
                    bucket_size_mb: float | None) -> list[StepCollective]:
    """A step of DDPBucketed over `world_size` ranks: one all-reduce per bucket (None: one bucket), in the
    order backward fills them, on the replicate axis (none on one rank)."""
    if world_size == 1:
        return []
    # The parameters' sizes and dtype in the model's order, as tensors without memory (what fill_buckets reads).
    params = [torch.empty(numel, dtype=precision.weights, device="meta") for numel in parameter_numels(config)]
    return [StepCollective("replicate", "all_reduce", sum(p.numel() for p in bucket), precision.weights.itemsize,
                           world_size, "backward")
            for bucket in fill_buckets(params[::-1], bucket_size_mb)]


def _groups(config: TransformerConfig, gather: Gather) -> list[list[int]]:
    """Element counts of the weights of each of FSDP's groups: the embedding, the blocks' (a block's five at
    once, or each on its own), the LM head."""
    block = block_weights(config)
    per_block = [block] if gather == Gather.BLOCK else [[n] for n in block]
    embedding, *_, head = sharded_weights(config)
    return [[embedding]] + config.num_layers * per_block + [[head]]
