"""The LM head and loss's memory (systems.loss): what they keep for the backward, and what they make and free inside
the forward and the backward, for each of the three ways the model computes its loss: whole, chunked and fused.

`loss_memory(config, tokens, ...)` gives a `LossMemory` (bytes saved, and made inside the forward, the backward and
under no_grad); `chunks_the_loss(config)` says whether the model's loss is chunked_cross_entropy's.
docs/design-notes.md has what each way holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from systems.model import Fused, TransformerConfig
from systems.precision import FP32


@dataclass(frozen=True)
class LossMemory:
    """Bytes of the LM head and loss beyond the final norm's saved tensors."""

    saved: int  # kept for the backward: the head's input and what the loss keeps
    forward: int  # made and freed inside the forward, at its peak, above `saved`
    backward: int  # held inside the loss's backward at its peak, above what the forward saved
    no_grad: int  # the forward's working set under no_grad, the hidden states included


def chunks_the_loss(config: TransformerConfig) -> bool:
    """Whether the model's loss is chunked_cross_entropy's (a loss chunk, or the fused loss), not the whole one."""
    return config.loss_chunk is not None or config.fused.fuses(Fused.LOSS)


def loss_memory(config: TransformerConfig, tokens: int, compute: int, hidden: int, weight_cast: int,
                weight_grad: int, device: str) -> LossMemory:
    """The loss's bytes for `tokens` tokens on `device` ("cuda" or "cpu"): matmuls in `compute` bytes an element,
    hidden states of `hidden` bytes an element as they reach the head, the weight cast to the compute dtype
    (`weight_cast` bytes an element, 0 where it is in it already), its gradient returned in `weight_grad` bytes an
    element."""
    d, vocab = config.d_model, config.vocab_size
    if not chunks_the_loss(config):
        logits = FP32 * tokens * vocab
        # The head's input in the compute dtype; the loss's fp32 logits (amax), exp (its backward), logits less
        # their max (gather), the max and the sum. Its backward briefly holds one more fp32 logits-sized
        # gradient and the bool mask of amax's gradient.
        return LossMemory(saved=tokens * d * compute + 3 * logits + 2 * FP32 * tokens, forward=0,
                          backward=logits + logits // FP32, no_grad=3 * logits)
    chunk = min(config.loss_chunk or tokens, tokens)
    fused = config.fused.fuses(Fused.LOSS)
    low_logits = chunk * vocab * compute  # the matmul's output
    fp32_logits = 0 if fused else FP32 * chunk * vocab  # eager: its upcast (the logits themselves in fp32)
    upcast = fp32_logits if compute < FP32 else 0  # eager: an upcast beside the matmul's output
    hidden_cast = chunk * d * compute if hidden != compute else 0  # a chunk's hidden states cast for the matmuls
    cast = vocab * d * weight_cast
    # Forward: the per-token losses beside the kept log-sum-exps; the matmul's output beside the hidden states'
    # cast, then its upcast beside it; eager, logsumexp's fp32 temporary beside the upcast (the logits less their
    # max, exponentiated in place).
    in_chunk = max(hidden_cast + low_logits, low_logits + upcast, 2 * fp32_logits)
    # Backward: the hidden states' gradient and the weight's, summed over the chunks in fp32; in a chunk, the
    # logits' gradient (eager: the fp32 softmax and its cast), the hidden states' cast and its term of the
    # weight's gradient, which a CPU's in-place add promotes to fp32 first where it is not (CUDA's kernel reads it
    # as it is: measured on an H100); at the end that sum cast to the weight's dtype.
    summed, term = FP32 * vocab * d, vocab * d * compute
    promoted = FP32 * vocab * d if compute < FP32 and device == "cpu" else 0
    logits_gradient = fp32_logits + (low_logits if fused or compute < FP32 else 0)  # eager in fp32: one tensor
    cast_sum = vocab * d * weight_grad if weight_grad < FP32 else 0
    gradient = max(logits_gradient + hidden_cast + term + promoted, cast_sum)
    saved, forward = tokens * d * hidden + FP32 * tokens, cast + FP32 * tokens + in_chunk
    # Under no_grad the forward holds the same: nothing it keeps is kept for a backward but the hidden states
    # and log-sum-exps it needs anyway.
    return LossMemory(saved=saved, forward=forward, backward=cast + tokens * d * hidden + summed + gradient,
                      no_grad=saved + forward)
