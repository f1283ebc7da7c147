"""What autograd holds for backward: the model's activations after a forward pass and loss (`Activations`), and
one block's in the parts its backward frees in turn (`BlockActivations`). transformer.py computes them and
scores.py adds written-out attention's part; both read them from here."""

from __future__ import annotations

from dataclasses import dataclass

from systems.accounting.checkpointing import kept_inputs
from systems.accounting.loss import LossMemory


@dataclass(frozen=True)
class Activations:
    """Bytes autograd holds for backward after one forward pass and loss (inputs and weights excluded)."""

    per_layer: int
    num_layers: int
    final_norm: int  # the final norm's saved tensors
    loss: LossMemory  # the LM head's and the loss's
    segment_input: int  # one residual-stream tensor: what checkpointing keeps of a segment
    checkpoint: tuple[int, ...] = ()  # TransformerConfig.checkpoint
    keep: int = 0  # TransformerConfig.checkpoint_keep
    selected: int = 0  # what op-level selection keeps of a checkpointed block beside its input
    untaken: int = 0  # the part of `selected` that the block's recomputation leaves where it is

    @property
    def blocks(self) -> int:
        """What the blocks keep: every block's activations, or under checkpointing the inputs of the outermost
        segments (and what op-level selection keeps of them), and the activations of the blocks left out."""
        if not self.checkpoint:
            return self.num_layers * self.per_layer
        checkpointed = self.num_layers - self.keep
        return (kept_inputs(checkpointed, self.checkpoint) * self.segment_input + checkpointed * self.selected
                + self.keep * self.per_layer)

    @property
    def head(self) -> int:
        return self.final_norm + self.loss.saved

    @property
    def total(self) -> int:
        return self.blocks + self.head


@dataclass(frozen=True)
class BlockActivations:
    """One block's saved-for-backward bytes, in parts that its backward frees in turn: the FFN's first, then
    what the out projection and attention's last matmul keep, then the rest of attention's."""

    ffn: int  # the norm's, w1's and w3's inputs, SwiGLU's products
    attention_out: int  # the out projection's input; attention's V (or qkv output), output, logsumexp or P's cast
    attention_in: int  # the norm's, qkv's input, q and k after RoPE and the casts of its tables
    scores: int  # written-out attention's mask and probabilities, which its softmax's backward uses

    @property
    def total(self) -> int:
        return self.ffn + self.attention_out + self.attention_in + self.scores
