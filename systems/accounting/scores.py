"""Written-out attention's seq² tensors (systems.attention.naive_attention), as executable arithmetic: what it
saves for the backward, and what its forward and its softmax's backward hold at their peaks.

Each op of it makes a new (batch, heads, seq, seq) tensor: q kᵀ, the scaling, the masked fill (with a bool
(seq, seq) causal mask, made and then negated) and the softmax, before P @ V. Autocast runs the matmuls in the
low-precision dtype. CUDA autocast also runs the softmax in fp32, so P @ V takes a low-precision cast of its
output; CPU autocast keeps the softmax in the scores' dtype. transformer.peak_memory adds these to what a block
holds; tests/test_checkpointing.py checks them against the CPU allocator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from systems.accounting.activations import Activations, BlockActivations
from systems.accounting.checkpointing import inputs_in_forward
from systems.model import TransformerConfig
from systems.precision import FP32, Precision


@dataclass(frozen=True)
class WrittenOutScores:
    elements: int  # of one (batch, heads, seq, seq) tensor
    mask: int  # bytes of one bool (seq, seq) mask
    low: int  # bytes per element of the scores: the matmuls' dtype
    softmax: int  # bytes per element of the probabilities
    upcast: int  # bytes per element of the softmax's own fp32 copy of its input, where it makes one
    cuda: bool

    @property
    def probs(self) -> int:
        """The softmax's output, which its backward keeps (and P @ V's, where it takes them as they are)."""
        return self.softmax * self.elements

    @property
    def probs_cast(self) -> int:
        """P @ V's low-precision copy of fp32 probabilities, which it keeps."""
        return self.low * self.elements if self.softmax != self.low else 0

    @property
    def forward_working_set(self) -> int:
        """What the forward holds at its peak inside attention besides q, k and v. Where the softmax keeps the
        scores' dtype, at the masked fill: the scaled scores, their masked copy and both masks (the softmax,
        between its input and output, holds one mask less). Under CUDA autocast, at the softmax: the masked
        scores, its fp32 copy of them and its fp32 output, and the negated mask the masked fill saves."""
        if self.softmax == self.low:
            return 2 * self.low * self.elements + 2 * self.mask
        return (self.low + self.upcast + self.softmax) * self.elements + self.mask

    @property
    def backward_working_set(self) -> int:
        """What the softmax's backward holds besides the probabilities: their gradient (under autocast cast to
        fp32 from P @ V's, which is freed by then) and the gradient of its input, in the dtype it read. CUDA's
        kernel takes the product of the first and the probabilities before it starts (ATen's
        softmax_backward_cuda_out); the CPU's does without. P @ V's backward before it, and the masked fill's
        and the scaling's after it, hold less."""
        product = self.softmax if self.cuda else 0
        return (self.softmax + product + (self.upcast or self.low)) * self.elements


def written_out_scores(config: TransformerConfig, batch_size: int, seq: int, precision: Precision,
                       device: str) -> WrittenOutScores:
    low = precision.compute.itemsize
    cuda_autocast = precision.uses_autocast and device == "cuda"
    # Asked for fp32 probabilities, ATen's CUDA softmax reads an fp16 input as it is and casts any other first.
    upcast = FP32 if cuda_autocast and precision.compute != torch.float16 else 0
    return WrittenOutScores(elements=batch_size * config.num_heads * seq * seq, mask=seq * seq, low=low,
                            softmax=FP32 if cuda_autocast else low, upcast=upcast, cuda=device == "cuda")


def written_out_forward_peak(config: TransformerConfig, batch_size: int, seq: int, precision: Precision, device: str,
                             acts: Activations, block: BlockActivations) -> int:
    """Written-out attention's forward peak, weights aside: inside the top block's attention, or under
    checkpointing in the block whose forward holds the most segment inputs (and what op-level selection kept
    below it) or in the top block left out, with the autocast weight copies made so far and qkv's output, whose
    views q, k and v are."""
    copy = precision.autocast_copy_bytes
    d, d_ff = config.d_model, config.d_ff
    act = batch_size * seq * d * precision.compute.itemsize
    scores = written_out_scores(config, batch_size, seq, precision, device)

    def in_attention(i: int, held: int) -> int:
        return i * copy * (4 * d * d + 3 * d * d_ff) + copy * 3 * d * d + held + 3 * act + scores.forward_working_set

    residual = acts.segment_input
    # The top block, not checkpointed: the blocks below saved what they keep, this one's saves up to q and k;
    # under autocast one more residual-stream tensor, unsaved: the fp32 norm output that qkv takes a cast of, or
    # the bf16 block input the norm saves in fp32.
    top = config.num_layers - 1
    unsaved = residual if precision.uses_autocast else 0
    in_top = in_attention(top, acts.blocks - acts.per_layer + block.attention_in + unsaved)
    if not config.checkpoint:
        return in_top
    # Nothing is saved inside a segment but what op-level selection keeps: the inputs alive, the norm's output
    # (qkv's input), q and k.
    checkpointed = config.num_layers - config.checkpoint_keep
    in_segments = max(in_attention(i, (inputs_in_forward(config.checkpoint, i) + 1) * residual + 2 * act
                                   + i * acts.selected) for i in range(checkpointed))
    return max(in_segments, in_top) if config.checkpoint_keep else in_segments


def written_out_backward_peak(config: TransformerConfig, batch_size: int, seq: int, precision: Precision,
                              device: str, block: BlockActivations) -> int:
    """What a block's backward holds inside written-out attention's softmax backward beyond the activations held
    at its start and the residual stream's gradient: the gradients of the FFN, its norm and the out projection,
    less what their backward has freed (the FFN's activations, the out projection's input, what P @ V kept,
    those layers' weight copies); V's gradient, waiting for q's and k's; and the softmax's working set."""
    d, d_ff = config.d_model, config.d_ff
    later_weights = d * d + 3 * d * d_ff  # out, w1, w3, w2
    freed = block.ffn + block.attention_out + precision.autocast_copy_bytes * later_weights
    v_grad = batch_size * seq * d * precision.compute.itemsize
    scores = written_out_scores(config, batch_size, seq, precision, device)
    return precision.grad_bytes * (later_weights + d) - freed + v_grad + scores.backward_working_set
