"""FLOPs of the Transformer LM: a forward pass by part (the model's FLOPs, which MFU counts), the step under two
conventions (the leaderboard's, FlashAttention's; torchtitan's), and what activation checkpointing recomputes."""

from __future__ import annotations

from dataclasses import dataclass

from systems.accounting.checkpointing import recomputed_blocks
from systems.model import Attention, TransformerConfig
from systems.recompute import Saves


@dataclass(frozen=True)
class Flops:
    """Matmul FLOPs of one forward pass by part; backward does two matmuls (dX, dW) per forward one."""

    projections: int  # qkv, out and the three SwiGLU matrices of every block
    attention: int  # QKᵀ and PV, the causal (unmasked) half only
    lm_head: int

    @property
    def forward(self) -> int:
        return self.projections + self.attention + self.lm_head

    @property
    def backward(self) -> int:
        return 2 * self.forward

    @property
    def step(self) -> int:
        return self.forward + self.backward

    @property
    def flash_step(self) -> int:
        """The step as FlashAttention's benchmarks and the course's leaderboard count it: attention's backward is
        the five matmuls a FlashAttention backward runs (QKᵀ again, dV, dP, dQ, dK), 2.5 times its forward
        rather than twice."""
        return self.step + self.attention // 2

    @property
    def full_attention_step(self) -> int:
        """The step as torchtitan counts it (PaLM's 6N + 12 L H Q T per token): attention without the causal
        halving, its backward twice its forward: above `flash_step` by 2.5 attention forwards, the larger count
        at a long context."""
        return self.step + 3 * self.attention


def flops(config: TransformerConfig, batch_size: int, seq: int) -> Flops:
    check_shape(config, batch_size, seq)
    d, d_ff, layers = config.d_model, config.d_ff, config.num_layers
    tokens = batch_size * seq
    return Flops(
        projections=layers * 2 * tokens * (4 * d * d + 3 * d * d_ff),
        attention=layers * 2 * 2 * batch_size * seq * seq * d // 2,
        lm_head=2 * tokens * d * config.vocab_size,
    )


def recomputed_flops(config: TransformerConfig, batch_size: int, seq: int, *, device: str = "cuda") -> Flops:
    """The forward FLOPs the backward runs again under `config.checkpoint` (none without): the checkpointed
    blocks `recomputed_blocks` counts, less the w2 matmul at the end of each innermost segment; under op-level
    selection less what the recomputation takes from the forward instead (attention's kernel where `device` runs
    one, the matmuls). Not model FLOPs: MFU leaves them out."""
    model = flops(config, batch_size, seq)
    blocks, segments = recomputed_blocks(config.num_layers - config.checkpoint_keep, config.checkpoint)
    w2 = 2 * batch_size * seq * config.d_model * config.d_ff
    saves = config.checkpoint_saves
    projections = 0 if saves == Saves.MATMULS else blocks * model.projections // config.num_layers - segments * w2
    kept = saves != Saves.INPUTS and selects_attention(config.attention, device)
    return Flops(projections=projections, attention=0 if kept else blocks * model.attention // config.num_layers,
                 lm_head=0)


def selects_attention(attention: Attention, device: str) -> bool:
    """Whether op-level selection can keep attention's outputs: SDPA's kernels and our Triton FlashAttention-2's
    custom op, not attention written out (seq² scores) or FlashAttention-2 in PyTorch ops (flash off CUDA)."""
    return attention == Attention.SDPA or (attention == Attention.FLASH and device == "cuda")


def check_shape(config: TransformerConfig, batch_size: int, seq: int) -> None:
    if batch_size < 1 or seq < 1:
        raise ValueError(f"batch_size and seq must be positive, got {batch_size} and {seq}")
    if seq > config.context_length:
        raise ValueError(f"seq={seq} exceeds context_length={config.context_length}")
