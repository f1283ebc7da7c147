"""Per-rank memory of a training step under our FSDP (systems.parallel.fsdp), as executable arithmetic.

`fsdp_memory` (FSDP over the world) and `hsdp_memory` (a Layout of replicas x shards) give a `ShardedMemory`: what a
rank holds between steps (its shards, the replicated parameters, the buffers, AdamW's state) and the `Moment`s of a
step, each the gradients, gathered weights, gradients in flight and activations held where one of them peaks; the
step's peak is the largest moment. `sharded_weights` and `block_weights` count the weights FSDP shards.
docs/design-notes.md has the derivation: what each moment holds, and which moments are left out and why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from systems.accounting.checkpointing import held_in_backward, segment_starts
from systems.accounting.loss import chunks_the_loss
from systems.accounting.transformer import activation_memory, count_parameters, model_state
from systems.levers.layout import Layout
from systems.levers.sharding import REDUCE_SCATTERS_IN_FLIGHT
from systems.levers.sharding import DEFAULT_GATHER, DEFAULT_PREFETCH, Gather, check_prefetch
from systems.model import TransformerConfig
from systems.precision import FP32, Precision


def sharded_weights(config: TransformerConfig) -> list[int]:
    """Element counts of the weights FSDP shards, in forward order: the embedding, every block's five Linears
    (qkv, out, w1, w3, w2), the LM head."""
    d = config.d_model
    return [config.vocab_size * d] + config.num_layers * block_weights(config) + [d * config.vocab_size]


def block_weights(config: TransformerConfig) -> list[int]:
    d, d_ff = config.d_model, config.d_ff
    return [3 * d * d, d * d, d * d_ff, d * d_ff, d * d_ff]


@dataclass(frozen=True)
class Moment:
    """Bytes a step holds at one moment beyond the state between steps."""

    name: str
    grads: int  # shard and replicated gradients made so far
    gathered: int  # full weights in the compute dtype
    in_flight: int  # full-size gradients being made or reduce-scattered, and their chunks
    activations: int  # saved for the backward, and what the moment's op is making

    @property
    def total(self) -> int:
        return self.grads + self.gathered + self.in_flight + self.activations


@dataclass(frozen=True)
class ShardedMemory:
    """Bytes on the rank holding the largest shards (rank 0)."""

    params: int  # its shards and the replicated parameters
    grads: int  # at the optimizer step
    optimizer: int
    buffers: int
    moments: tuple[Moment, ...]

    @property
    def state(self) -> int:
        """What stays between steps."""
        return self.params + self.buffers + self.optimizer

    @property
    def peak_moment(self) -> Moment:
        return max(self.moments, key=lambda moment: moment.total)

    @property
    def peak(self) -> int:
        return self.state + self.peak_moment.total

    def at(self, name: str) -> int:
        """The bytes held at the moment `name` (the forward's end: "forward")."""
        return self.state + next(m for m in self.moments if m.name == name).total

    @property
    def forward_backward(self) -> int:
        """The peak of the forward and backward, the optimizer step left out."""
        return self.state + max(m.total for m in self.moments if m.name != "optimizer step")


class _Rank:
    """Sizes on rank 0 of a shard group of `world_size`: shards of ceil(numel / N), gathered buffers of N of them;
    and the replicas the shard gradients are averaged over (HSDP)."""

    def __init__(self, world_size: int, compute: int, grad: int, gloo: bool, replicate: int = 1):
        self.world_size, self.compute, self.grad, self.gloo = world_size, compute, grad, gloo
        self.replicate = replicate

    def chunk(self, numel: int) -> int:
        return math.ceil(numel / self.world_size)

    def gathered(self, numel: int) -> int:
        return self.world_size * self.chunk(numel) * self.compute

    def reducing(self, group: list[int]) -> int:
        """A reduce-scatter's full-size gradients, gloo's all-to-all copies of them, and the chunks it makes."""
        return sum((2 if self.gloo else 1) * self.gathered(n) + self.chunk(n) * self.compute for n in group)

    def replicating(self, group: list[int]) -> int:
        """HSDP's all-reduce of a group's chunks: their concatenation, and gloo's gathered copies of it."""
        if self.replicate == 1:
            return 0
        return (1 + (self.replicate if self.gloo else 0)) * sum(self.chunk(n) for n in group) * self.compute

    def stages(self, made: list[list[int]]) -> tuple[list, list, list]:
        """The groups of `made` (issued, in order) whose gradients are made, those in their replicas' all-reduce,
        and those in their reduce-scatter."""
        k = REDUCE_SCATTERS_IN_FLIGHT
        replicating = k if self.replicate > 1 else 0
        done = made[:max(0, len(made) - k - replicating)]
        return done, made[len(done):max(len(done), len(made) - k)], made[-k:]

    def shard_grads(self, numels) -> int:
        return sum(self.chunk(n) for n in numels) * self.grad


def fsdp_memory(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, world_size: int,
                *, device: str = "cuda", prefetch: int = DEFAULT_PREFETCH,
                gather: Gather = DEFAULT_GATHER) -> ShardedMemory:
    """Per-rank memory of `systems.parallel.train`'s FSDP step: weights in `precision.weights`, compute in
    `precision.compute`, with `config.checkpoint` and `config.loss_chunk`, gathering `prefetch` groups ahead
    (FSDP's `prefetch`), a group being a layer's weight or a block's (FSDP's `gather`). `device` "cpu" means
    gloo, whose reduce-scatter takes one more full-size buffer, and the unfused AdamW."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    return _sharded_memory(config, batch_size, seq, precision, world_size, 1, device, prefetch, gather)


def hsdp_memory(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, layout: Layout,
                *, device: str = "cuda", prefetch: int = DEFAULT_PREFETCH,
                gather: Gather = DEFAULT_GATHER) -> ShardedMemory:
    """Per-rank memory of FSDP's step over `layout` (systems.parallel.mesh: replicas x shards): fsdp_memory's
    over the shard group, with the replicas' all-reduce of the shard gradients in flight between a group's
    reduce-scatter and its gradients."""
    if not isinstance(layout, Layout) or layout.tensor != 1:
        raise ValueError(f"hsdp_memory takes a Layout of replicas and shards only, got {layout!r}")
    return _sharded_memory(config, batch_size, seq, precision, layout.shard, layout.replicate, device, prefetch,
                           gather)


def _sharded_memory(config, batch_size, seq, precision, shard, replicate, device, prefetch, gather) -> ShardedMemory:
    check_prefetch(prefetch)
    gather = Gather(gather)
    weights = sharded_weights(config)
    replicated = count_parameters(config) - sum(weights)
    rank = _Rank(shard, precision.compute.itemsize, precision.grad_bytes, gloo=device == "cpu", replicate=replicate)
    per_rank = sum(rank.chunk(n) for n in weights) + replicated
    groups = _gradient_order(config, gather)
    # Backward prefetches the groups whose forward saved a weight: the LM head's and, but for checkpointing, the
    # blocks' (the blocks left out of it).
    per_block = (len(groups) - 1) // config.num_layers
    saving = len(groups) if not config.checkpoint else 1 + config.checkpoint_keep * per_block
    ahead = _Prefetch(rank, groups[:saving], prefetch)
    moments = (*_forward_and_loss(config, batch_size, seq, precision, rank, ahead, device),
               *_blocks_backward(config, batch_size, seq, precision, rank, ahead, groups, device),
               _embedding_gradient(config, batch_size, seq, rank, weights[0], groups,
                                   replicated * precision.grad_bytes),
               _optimizer_step(config, precision, rank, weights, replicated, device))
    return ShardedMemory(params=precision.weight_bytes * per_rank, grads=precision.grad_bytes * per_rank,
                         optimizer=precision.optimizer_bytes * per_rank,
                         buffers=model_state(config, precision).buffers, moments=moments)


def _gradient_order(config: TransformerConfig, gather: Gather) -> list[list[int]]:
    """Element counts of each group's weights, in the order backward completes their gradients (and, but for
    checkpointing, gathers them from FSDP's placeholders): the LM head, then every block last first, whose
    Linears' gradients are made w2, w3, w1, out, qkv. The embedding, which saves no weight, is left out."""
    block = block_weights(config)[::-1]
    per_block = [block] if gather == Gather.BLOCK else [[n] for n in block]
    return [[config.d_model * config.vocab_size]] + config.num_layers * per_block


@dataclass(frozen=True)
class _Prefetch:
    """The gathered weights the backward has in flight ahead of the group it is using."""

    rank: _Rank
    order: list[list[int]]  # the groups backward gathers from FSDP's placeholders, in its order
    depth: int

    def after(self, used: int) -> int:
        """Bytes of the `depth` groups after the first `used` of the order, none past its end."""
        return sum(self.rank.gathered(n) for group in self.order[used:used + self.depth] for n in group)


def _activations(config, batch_size, seq, precision, device):
    """What the blocks and the head save with weights in the compute dtype; the RoPE tables stay in the
    weights' dtype and each block casts its cos and sin for q and for k."""
    compute = precision.compute
    computing = Precision("fsdp", weights=compute, compute=compute)
    acts = activation_memory(config, batch_size, seq, computing, device=device)
    if precision.weights != compute:
        rope_casts = 2 * 2 * seq * (config.d_head // 2) * compute.itemsize
        acts = dataclasses.replace(acts, per_layer=acts.per_layer + rope_casts)
    return acts


def _forward_and_loss(config, batch_size, seq, precision, rank, ahead, device) -> list[Moment]:
    d, vocab, tokens = config.d_model, config.vocab_size, batch_size * seq
    c = rank.compute
    acts = _activations(config, batch_size, seq, precision, device)
    head = rank.gathered(vocab * d)
    # The LM head's backward prefetches the top block's w2 onwards, unless checkpointing recomputes them first.
    prefetched = ahead.after(1)
    if chunks_the_loss(config):
        # The hidden states reach the head in the compute dtype (FSDP casts a sharded module's inputs), and so
        # does the gathered weight: the loss casts neither (loss.py).
        return [Moment("forward", 0, head, 0, acts.total + acts.loss.forward),
                Moment("loss backward", 0, head + prefetched, 0, acts.total + acts.loss.backward)]
    kept = acts.blocks + acts.final_norm + tokens * d * c  # and the LM head's input
    grad_logits, grad_hidden = tokens * vocab * c, tokens * d * c
    return [Moment("forward", 0, head, 0, acts.total),
            # Nothing gathered until the LM head's backward asks for its weight; the loss's gradient of the
            # fp32 logits and amax's mask beside what it saved.
            Moment("loss backward", 0, 0, 0, acts.total + acts.loss.backward),
            Moment("lm head gradient", 0, head + prefetched, vocab * d * c, kept + grad_logits + grad_hidden)]


def _blocks_backward(config, batch_size, seq, precision, rank, ahead, groups, device) -> list[Moment]:
    """Block i's backward inside SwiGLU's, w2's gradient just made: reduce-scattered at once with per-layer
    groups, beside the group before it; with block groups held until the block's last gradient, beside the two
    groups before it in their reduce-scatters. Shard gradients of the groups above those, the block's other
    weights (block groups) and those prefetched after them, the product's two gradients made from the gradient
    flowing in."""
    d, d_ff, layers, tokens = config.d_model, config.d_ff, config.num_layers, batch_size * seq
    c, levels = rank.compute, config.checkpoint
    acts = _activations(config, batch_size, seq, precision, device)
    w2 = block_weights(config)[-1]
    per_block = (len(groups) - 1) // layers
    # A norm saves an fp32 residual stream as it is: a recomputed block's first input is its segment's.
    shared = acts.segment_input if precision.compute == torch.float32 else 0
    norm_grads = 2 * d * rank.grad  # a block's two norm gains
    moments = []
    checkpointed = layers - config.checkpoint_keep if levels else 0
    for i in reversed(range(layers)):
        above = layers - 1 - i
        at = 1 + above * per_block  # the group of block i's w2
        complete = len(groups[at]) == 1  # w2's group is w2 alone: its reduce-scatter is issued with its gradient
        made = groups[:at + complete]  # groups whose reduce-scatter is issued
        waited, replicating, reducing = rank.stages(made)
        grads = rank.shard_grads(n for group in waited for n in group) + d * rank.grad + above * norm_grads
        in_flight = (sum(rank.reducing(group) for group in reducing) + (0 if complete else w2 * c)
                     + sum(rank.replicating(group) for group in replicating))
        # Unless recomputed: block i's group but w2, used, and the groups after it prefetched.
        gathered = (_recomputed_in_block(rank, block_weights(config), levels, i) if i < checkpointed
                    else sum(rank.gathered(n) for n in groups[at]) - rank.gathered(w2) + ahead.after(at + 1))
        held = held_in_backward(levels, i, acts.per_layer, acts.segment_input, shared, checkpointed=checkpointed,
                                selected=acts.selected, untaken=acts.untaken)
        activations = held + tokens * d * c + 2 * tokens * d_ff * c
        moments.append(Moment(f"block {i} backward", grads, gathered, in_flight, activations))
    return moments


def _recomputed_in_block(rank, block, levels, i) -> int:
    """Inside block i's SwiGLU backward under checkpointing: the blocks of its innermost segment from the first
    to block i, recomputed, but block i's w2."""
    qkv, out, w1, w3, w2 = (rank.gathered(n) for n in block)
    return (i - segment_starts(levels, i)[-1]) * (qkv + out + w1 + w3 + w2) + qkv + out + w1 + w3


def _embedding_gradient(config, batch_size, seq, rank, embedding, groups, replicated_grads) -> Moment:
    """The backward's end: the embedding's dense gradient joins the last groups' reduce-scatters in flight (the
    bottom block's qkv and out, or the two bottom blocks)."""
    waited, replicating, reducing = rank.stages(groups)
    done = rank.shard_grads(n for group in waited for n in group)
    in_flight = (sum(rank.reducing(group) for group in reducing) + rank.reducing([embedding])
                 + sum(rank.replicating(group) for group in replicating))
    return Moment("embedding gradient", done + replicated_grads, 0, in_flight,
                  batch_size * seq * config.d_model * rank.compute)


def _optimizer_step(config, precision, rank, weights, replicated, device) -> Moment:
    """Every gradient, and off CUDA AdamW's fp32 temporaries the size of the largest shard (the square root of
    the second moment and its quotient, and a low-precision shard's gradient in fp32)."""
    grads = rank.shard_grads(weights) + replicated * precision.grad_bytes
    temporaries = 0 if device == "cuda" else (2 if precision.weights == torch.float32 else 3)
    return Moment("optimizer step", grads, 0, 0, temporaries * FP32 * rank.chunk(max(weights)))
