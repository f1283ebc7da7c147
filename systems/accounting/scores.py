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
