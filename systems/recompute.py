"""Activation checkpointing as the model runs it: `run_blocks`, the blocks in segments whose backward recomputes
them, the top blocks left out, and op-level selection of what a recomputed block keeps (`Saves`).

TransformerConfig.checkpoint gives the segment sizes (outermost first), `checkpoint_keep` how many blocks at the
top keep all their activations (torchtitan's selective checkpointing by layer: their backward runs first, so
what they hold is freed before the recomputed blocks' backward, whose peak it would otherwise add to), and
`checkpoint_saves` what else than its input a one-block segment keeps (torch.utils.checkpoint's selective
checkpointing, a policy over the ops the forward dispatches): the outputs of attention's kernel (its largest
recomputed cost at a long context), or those and every matmul's, so that the recomputation runs only the
elementwise ops (norms, RoPE, SiLU, residual adds, casts). systems.accounting models each.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from systems.choice import Choice
from systems.device import nvtx_range


class Saves(Choice):
    """What a checkpointed segment keeps for its backward: its input only; also its attention kernel's outputs
    (output and log-sum-exp); also every matmul's output. Beyond inputs, segments are single blocks."""

    INPUTS = "inputs"
    ATTENTION = "attention"
    MATMULS = "matmuls"

    @classmethod
    def noun(cls) -> str:
        return "checkpoint_saves"


aten = torch.ops.aten
# The fused attention kernels, whose outputs a backward reads (SDPA's on CPU and CUDA, and our FlashAttention-2's
# custom op, which FlashAttentionTriton calls under a dispatch mode). Written-out attention is matmuls (bmm) and a
# softmax of seq² scores: never kept.
_ATTENTION_OPS = (aten._scaled_dot_product_flash_attention_for_cpu.default,
                  aten._scaled_dot_product_flash_attention.default,
                  aten._scaled_dot_product_efficient_attention.default,
                  aten._scaled_dot_product_cudnn_attention.default)
_MATMUL_OPS = (aten.mm.default,)  # every Linear of a block, 2D after flattening its (batch, seq) rows


def _saved_ops(saves: Saves) -> frozenset:
    ops = set(_ATTENTION_OPS)
    if hasattr(torch.ops.systems, "flash_attention_forward"):  # registered once systems.attention's Triton loads
        ops.add(torch.ops.systems.flash_attention_forward.default)
    if saves == Saves.MATMULS:
        ops.update(_MATMUL_OPS)
    return frozenset(ops)


def _policy(saved: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_range():
    """Eager checkpointing's (forward, recomputation) contexts: the recomputation as a `recompute` range
    (systems.bench.breakdown, nsys)."""
    return contextlib.nullcontext(), nvtx_range("recompute")


def _selective_in_range(selective):
    forward, recompute = selective()
    return forward, _within(nvtx_range("recompute"), recompute)


@contextlib.contextmanager
def _within(outer, inner):
    with outer, inner:
        yield


def _context_fn(saves: Saves) -> dict:
    """checkpoint's context_fn for `saves`: selective checkpointing's dispatch modes, if any, and in eager code the
    recompute range. torch.compile traces checkpoint only with its default contexts or selective checkpointing's
    bare modes."""
    compiling = torch.compiler.is_compiling()
    if saves == Saves.INPUTS:
        return {} if compiling else {"context_fn": _recompute_range}
    selective = functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, _saved_ops(saves)))
    return {"context_fn": selective if compiling else functools.partial(_selective_in_range, selective)}


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, levels: tuple[int, ...], keep: int = 0,
               saves: Saves = Saves.INPUTS) -> torch.Tensor:
    """The blocks in order: all but the last `keep` with `levels` of checkpointing (none without), keeping what
    `saves` says; the last `keep` as they are.

    Non-reentrant checkpointing composes with module hooks (a recomputed forward runs a module's hooks again,
    as a sharded layer's all-gather needs) and with autocast, whose state it restores for the recomputation.
    The blocks draw no random numbers, so no RNG state is saved.
    """
    if not levels or not torch.is_grad_enabled():
        return _in_order(blocks, x)
    checkpointed = len(blocks) - keep
    return _in_order(blocks[checkpointed:], _segments(blocks[:checkpointed], x, levels, saves))


def _in_order(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def _segments(blocks: nn.ModuleList, x: torch.Tensor, levels: tuple[int, ...], saves: Saves) -> torch.Tensor:
    """Segments of levels[0] blocks of which autograd keeps only the input (and what `saves` selects), the rest
    recomputed in the backward, where the inner levels checkpoint the recomputation in turn."""
    if not levels:
        return _in_order(blocks, x)
    size, inner = levels[0], levels[1:]
    contexts = _context_fn(saves)
    for start in range(0, len(blocks), size):
        x = checkpoint(_segments, blocks[start:start + size], x, inner, saves, use_reentrant=False,
                       preserve_rng_state=False, **contexts)
    return x
