"""Bytes each rank sends per training step on each axis of a layout (systems.parallel.mesh), as executable
arithmetic: FSDP/HSDP's collectives on the shard and replicate axes.

A collective over n ranks is counted as the ring algorithm sends it (NCCL's, and the bus bandwidth nccl-tests
reports): an all-gather or a reduce-scatter of chunks of c elements sends (n - 1) chunks, (n - 1) * c elements;
an all-reduce of m elements reduce-scatters and all-gathers chunks of ceil(m / n), 2 (n - 1) ceil(m / n). A
group of one sends nothing. Gloo's rank-ordered versions (systems.parallel.collectives) send as much for the
all-gather and the reduce-scatter (an all-to-all), and (n - 1) m for an all-reduce (an all-gather).

Per step of FSDP over the shard group of S ranks, replicated over R (HSDP; FSDP is R = 1, DDP-like S = 1), on the
Transformer LM:
- shard axis: every sharded weight all-gathered in the compute dtype in the forward, and again in the backward
  but the embedding's (it saves no weight; a checkpointed block's are gathered once, for its recomputation, so
  the count holds with checkpointing too); every weight's gradient reduce-scattered in the compute dtype; the
  replicated parameters' (norm gains') gradients all-reduced in their own dtype, packed flat;
- replicate axis: each gather group's chunks of the reduce-scattered gradients (ceil(numel / S) elements of each
  of its weights) all-reduced in the compute dtype, one collective per group; the replicated parameters'
  gradients all-reduced again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from systems.accounting.sharding import block_weights, sharded_weights
from systems.accounting.transformer import count_parameters
from systems.model import TransformerConfig
from systems.parallel.fsdp import DEFAULT_GATHER, Gather
from systems.parallel.mesh import Layout
from systems.precision import Precision


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


def hsdp_traffic(config: TransformerConfig, precision: Precision, layout: Layout,
                 gather: Gather = DEFAULT_GATHER) -> dict[str, AxisTraffic]:
    """{"shard": ..., "replicate": ...}: bytes a rank sends per step of FSDP over `layout` (replicas x shards),
    computing in `precision.compute` with weights in `precision.weights`, gathering by `gather` (FSDP's groups,
    which decide how the replicas' all-reduces are cut)."""
    if not isinstance(layout, Layout) or layout.tensor != 1:
        raise ValueError(f"hsdp_traffic takes a Layout of replicas and shards only, got {layout!r}")
    gather = Gather(gather)
    shards, replicas = layout.shard, layout.replicate
    compute, weight = precision.compute.itemsize, precision.weights.itemsize
    weights = sharded_weights(config)
    replicated = count_parameters(config) - sum(weights)

    def chunk(numel: int) -> int:
        return math.ceil(numel / shards)

    gathered = sum(gather_bytes(shards, chunk(n) * compute) for n in weights + weights[1:])  # forward, backward
    shard = AxisTraffic(all_gather=gathered,
                        reduce_scatter=sum(gather_bytes(shards, chunk(n) * compute) for n in weights),
                        all_reduce=all_reduce_bytes(shards, replicated, weight))
    replicate = AxisTraffic(all_reduce=sum(all_reduce_bytes(replicas, sum(chunk(n) for n in group), compute)
                                           for group in _groups(config, gather))
                            + all_reduce_bytes(replicas, replicated, weight))
    return {"shard": shard, "replicate": replicate}


def _groups(config: TransformerConfig, gather: Gather) -> list[list[int]]:
    """Element counts of the weights of each of FSDP's groups: the embedding, the blocks' (a block's five at
    once, or each on its own), the LM head."""
    block = block_weights(config)
    per_block = [block] if gather == Gather.BLOCK else [[n] for n in block]
    embedding, *_, head = sharded_weights(config)
    return [[embedding]] + config.num_layers * per_block + [[head]]
