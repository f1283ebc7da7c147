"""Per-rank memory of a training step under our FSDP (systems.parallel.fsdp), as executable arithmetic.

Each rank keeps ceil(numel / N) elements of every Linear and Embedding weight (fp32 masters in the weights'
dtype), the replicated parameters whole, AdamW's state and the gradients of both; while a step runs it also
holds at most two gathered weights in the compute dtype (the layer computing and the one prefetched), the
full-size gradients of the reduce-scatters in flight and the one being made, and the activations, which
are those of a model whose weights are in the compute dtype (the gathered weights are already cast, so the
residual stream is in it too: `bf16-weights`' activations for bf16 compute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from systems.accounting.transformer import activation_memory, count_parameters
from systems.model import TransformerConfig
from systems.precision import PRECISIONS, Precision

GATHERED_AT_ONCE = 2  # the layer computing and the one prefetched (systems.parallel.fsdp)
GRADIENTS_AT_ONCE = 3  # reduce-scatters in flight (fsdp.REDUCE_SCATTERS_IN_FLIGHT) and the one being made


def sharded_weights(config: TransformerConfig) -> list[int]:
    """Element counts of the weights FSDP shards: the embedding, every block's five Linears, the LM head."""
    d, d_ff = config.d_model, config.d_ff
    block = [3 * d * d, d * d, d * d_ff, d * d_ff, d * d_ff]
    return [config.vocab_size * d] + config.num_layers * block + [d * config.vocab_size]


@dataclass(frozen=True)
class ShardedMemory:
    """Bytes on the rank holding the largest shards."""

    params: int  # its shards and the replicated parameters
    grads: int
    optimizer: int
    gathered: int  # weights and full-size gradients in the compute dtype, at most, while a step runs
    activations: int  # saved for backward, plus the loss's backward transient

    @property
    def state(self) -> int:
        """What stays between steps and at the optimizer step."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.state + self.gathered + self.activations


def fsdp_memory(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, world_size: int,
                *, device: str = "cuda") -> ShardedMemory:
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    weights = sharded_weights(config)
    per_rank = sum(math.ceil(n / world_size) for n in weights) + count_parameters(config) - sum(weights)
    compute = precision.compute.itemsize
    largest = max(weights)
    computing = PRECISIONS["bf16-weights"] if precision.compute.itemsize < 4 else precision
    acts = activation_memory(config, batch_size, seq, computing, device=device)
    return ShardedMemory(params=precision.weight_bytes * per_rank, grads=precision.grad_bytes * per_rank,
                         optimizer=precision.optimizer_bytes * per_rank,
                         gathered=compute * largest * (GATHERED_AT_ONCE + GRADIENTS_AT_ONCE),
                         activations=acts.total + acts.logits + acts.logits // 4)
