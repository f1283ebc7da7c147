"""A GPT-style Transformer LM with the CS336 architecture and size presets, by edition of the course.

Token embedding, N pre-norm blocks (RMSNorm, causal multi-head attention with RoPE, SwiGLU),
a final RMSNorm and an untied LM head; no biases. Attention is chosen by name; which blocks the backward
recomputes (activation checkpointing, systems.recompute) by `TransformerConfig.checkpoint` and its companions;
which elementwise ops run as fused Triton kernels (systems.kernels) by `fused`; and whether each block runs
compiled by `compile`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn as nn
import torch.nn.functional as F

from systems import attention
from systems.choice import Choice
from systems.loss import LMHead, check_chunk
from systems.recompute import Saves, run_blocks


class Attention(Choice):
    """The systems.attention.BACKENDS a config may name: causal self-attention whose saved tensors
    systems.accounting models. Written out (naive), torch's SDPA, or our FlashAttention-2 (flash)."""

    NAIVE = "naive"
    SDPA = "sdpa"
    FLASH = "flash"

    @classmethod
    def noun(cls) -> str:
        return "attention backend"


class Fused(Choice):
    """Which of systems.kernels' fused Triton kernels the model runs in place of eager ops: none, all, or one of
    them (to measure what each is worth): RMSNorm, RoPE of q and k, SwiGLU's silu(a) * b, and the loss's softmax
    over vocab tiles (the LM head's matmuls stay torch's, in chunks of `loss_chunk` tokens, or one chunk)."""

    NONE = "none"
    ALL = "all"
    RMSNORM = "rmsnorm"
    ROPE = "rope"
    SWIGLU = "swiglu"
    LOSS = "loss"

    def fuses(self, op: Fused) -> bool:
        return self in (Fused.ALL, op)


_SIZE_FIELDS = ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size", "context_length")


@dataclass(frozen=True)
class TransformerConfig:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    vocab_size: int = 10_000
    context_length: int = 1024
    rope_theta: float = 10_000.0
    attention: Attention = Attention.SDPA
    # Debug mode: every forward checks that the token ids, and the target ids of its loss, lie in [0, vocab_size),
    # at the cost of a host sync and, under torch.compile, a graph break.
    check_ids: bool = False
    # Activation checkpointing: blocks per segment at each level, outermost first. () keeps every block's
    # activations for the backward; (k,) keeps only the input of each run of k blocks and recomputes the rest
    # in the backward; (K, k) keeps the inputs of runs of K blocks, and each run's recomputation keeps only
    # the inputs of its runs of k, recomputed once more. systems.accounting.nested_checkpoint picks the
    # two-level sizes with the least peak memory.
    checkpoint: tuple[int, ...] = ()
    # Selective checkpointing (systems.recompute): the last `checkpoint_keep` blocks are left out of it and keep
    # all their activations; with `checkpoint_saves` other than "inputs" every checkpointed block is a segment
    # of its own that keeps its attention kernel's outputs ("attention"), or those and its matmuls' ("matmuls").
    checkpoint_keep: int = 0
    checkpoint_saves: Saves = Saves.INPUTS
    # The loss `TransformerLM(tokens, targets)` returns: None makes the whole logits; a number of tokens makes
    # that many tokens' logits at a time and keeps none (systems.loss.chunked_cross_entropy).
    loss_chunk: int | None = None
    # Which elementwise ops run as fused Triton kernels (systems.kernels): on CUDA, or on a CPU under
    # TRITON_INTERPRET=1.
    fused: Fused = Fused.NONE
    # Each block through torch.compile (regional: identical blocks share one graph), compiled at its first call.
    compile: bool = False

    def __post_init__(self):
        for name in _SIZE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not isinstance(self.rope_theta, (int, float)) or isinstance(self.rope_theta, bool):
            raise TypeError(f"rope_theta must be a float, got {self.rope_theta!r}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be positive and finite, got {self.rope_theta}")
        for name in ("check_ids", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_checkpoint(self.checkpoint)
        object.__setattr__(self, "checkpoint_saves", Saves(self.checkpoint_saves))
        _check_selection(self.checkpoint, self.checkpoint_keep, self.checkpoint_saves, self.num_layers, self.compile)
        object.__setattr__(self, "fused", Fused(self.fused))
        if self.loss_chunk is not None:
            check_chunk(self.loss_chunk, "loss_chunk")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.d_model // self.num_heads}")
        object.__setattr__(self, "attention", Attention(self.attention))  # a name, checked once

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads


def _check_checkpoint(levels) -> None:
    if not isinstance(levels, tuple) or not all(isinstance(k, int) and not isinstance(k, bool) for k in levels):
        raise TypeError(f"checkpoint must be a tuple of ints (blocks per segment, outermost first), got {levels!r}")
    if any(k < 1 for k in levels) or any(inner >= outer for outer, inner in zip(levels, levels[1:])):
        raise ValueError(f"checkpoint segment sizes must be positive and shrink from level to level, got {levels}")


def _check_selection(levels: tuple[int, ...], keep, saves: Saves, num_layers: int, compile: bool) -> None:
    if not isinstance(keep, int) or isinstance(keep, bool):
        raise TypeError(f"checkpoint_keep must be an int (blocks at the top left un-checkpointed), got {keep!r}")
    if keep and not levels:
        raise ValueError(f"checkpoint_keep={keep} leaves blocks out of a checkpointing that is not there: "
                         "set checkpoint too")
    if not 0 <= keep < num_layers:
        raise ValueError(f"checkpoint_keep must leave at least one of the {num_layers} blocks checkpointed, "
                         f"got {keep}")
    if saves != Saves.INPUTS and levels != (1,):
        raise ValueError(f"checkpoint_saves={str(saves)!r} selects ops within one-block segments: checkpoint must be "
                         f"(1,), got {levels}")
    if saves != Saves.INPUTS and compile:
        raise ValueError(f"checkpoint_saves={str(saves)!r} cannot select ops inside a compiled block, which runs as "
                         "one op: leave compile off, or save inputs only")


# Presets outside the course's tables, the same in every edition.
_TINY = {"tiny": TransformerConfig(d_model=64, d_ff=256, num_layers=2, num_heads=4, context_length=256)}
_LEADERBOARD = {
    # The course's 2026 leaderboard step: an 8.1B model (Qwen's vocabulary) at context 32768.
    "leaderboard-2026": TransformerConfig(d_model=4096, d_ff=11008, num_layers=34, num_heads=32, vocab_size=151_936,
                                          context_length=32_768),
    # Its shape made tiny for CPU runs of the same code: d_model, d_ff, heads, vocabulary and context all 1/32 of it.
    "leaderboard-2026-tiny": TransformerConfig(d_model=128, d_ff=344, num_layers=4, num_heads=32, vocab_size=4748,
                                               context_length=1024),
}
# Each edition's Table 1 ("model sizing"), vocabulary 10,000. The 2025 handout gives no default context: its
# presets keep the config's 1024, as every saved history made with them did.
_COURSE_2025 = {
    "small": TransformerConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": TransformerConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": TransformerConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": TransformerConfig(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7b": TransformerConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
}
# The 2026 handout (26.1.x, section 2.1.2) keeps small, medium and large, makes 2025's 2.7b its "xl", adds "10B",
# and says "use context length 512 unless otherwise specified".
_COURSE_2026 = {
    "small": TransformerConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12, context_length=512),
    "medium": TransformerConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, context_length=512),
    "large": TransformerConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20, context_length=512),
    "xl": TransformerConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32, context_length=512),
    "10B": TransformerConfig(d_model=4608, d_ff=12288, num_layers=50, num_heads=36, context_length=512),
}
# Each edition of the course's handout: its preset names. A name means one model within an edition ("xl" is
# 1.6k wide in 2025 and 2.56k wide in 2026), so a preset is looked up by name and edition (get_config).
EDITIONS = {
    "2025": MappingProxyType({**_TINY, **_COURSE_2025, **_LEADERBOARD}),
    "2026": MappingProxyType({**_TINY, **_COURSE_2026, **_LEADERBOARD}),
}
# 2025 by default: the preset names in histories saved before editions existed mean 2025's models.
DEFAULT_EDITION = "2025"


def get_config(preset: str, edition: str = DEFAULT_EDITION, **overrides) -> TransformerConfig:
    """The edition's preset with fields replaced, e.g. `get_config("xl", "2026", attention="flash")`."""
    if not isinstance(edition, str):
        raise TypeError(f"edition must be a string such as '2026', got {edition!r}")
    if edition not in EDITIONS:
        raise ValueError(f"unknown edition {edition!r}; choose from {', '.join(map(repr, EDITIONS))}")
    presets = EDITIONS[edition]
    if preset not in presets:
        others = [other for other, names in EDITIONS.items() if preset in names]
        if others:
            raise ValueError(f"{preset!r} is a {others[0]} preset; pass edition={others[0]!r}")
        listed = "; ".join(f"{name}: {', '.join(names)}" for name, names in EDITIONS.items())
        raise ValueError(f"unknown preset {preset!r}; the editions' presets are {listed}")
    return dataclasses.replace(presets[preset], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5, fused: bool = False):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from systems.kernels import rms_norm  # Triton, on first use

            return rms_norm(x, self.weight, self.eps)
        # Squares of bf16 activations lose too much precision: normalize in fp32.
        in_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """Rotates each (even, odd) pair of a head's features by a position-dependent angle."""

    def __init__(self, d_head: int, context_length: int, theta: float):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float64), inv_freq)  # (seq, d_head/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, heads, seq, d_head)
        seq = x.shape[-2]
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.num_heads, self.d_head = config.num_heads, config.d_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.out = nn.Linear(config.d_model, config.d_model, bias=False)
        self.rope = RotaryEmbedding(config.d_head, config.context_length, config.rope_theta)
        self.attend = attention.BACKENDS[config.attention]
        self.fused_rope = config.fused.fuses(Fused.ROPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (batch, seq, 3 * d_model) -> 3 x (batch, heads, seq, d_head)
        # (d_head spelled out, not -1: a batch with no tokens has no size to infer it from)
        q, k, v = self.qkv(x).view(batch, seq, 3, self.num_heads, self.d_head).permute(2, 0, 3, 1, 4)
        if self.fused_rope:
            from systems.kernels import rotate_qk  # Triton, on first use

            q, k = rotate_qk(q, k, self.rope.cos, self.rope.sin)
        else:
            q, k = self.rope(q), self.rope(k)
        y = self.attend(q, k, v, True)  # causal
        # (batch, seq, heads * d_head): d_model, or under tensor parallelism this rank's heads' share of it
        return self.out(y.transpose(1, 2).reshape(batch, seq, self.num_heads * self.d_head))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int, fused: bool = False):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from systems.kernels import silu_mul  # Triton, on first use

            return self.w2(silu_mul(self.w1(x), self.w3(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        fused_norm = config.fused.fuses(Fused.RMSNORM)
        self.attn_norm = RMSNorm(config.d_model, fused=fused_norm)
        self.attn = CausalSelfAttention(config)
        self.ffn_norm = RMSNorm(config.d_model, fused=fused_norm)
        self.ffn = SwiGLU(config.d_model, config.d_ff, fused=config.fused.fuses(Fused.SWIGLU))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class TransformerLM(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.final_norm = RMSNorm(config.d_model, fused=config.fused.fuses(Fused.RMSNORM))
        self.lm_head = LMHead(config.d_model, config.vocab_size, fused=config.fused.fuses(Fused.LOSS))
        self.apply(_init_weights)
        if config.compile:
            for block in self.blocks:  # lazily: a wrapper (FSDP) may add its hooks before the first call
                block.compile(dynamic=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (batch, seq) integer ids -> logits (batch, seq, vocab_size); either size may be 0. With
        targets (batch, seq), the mean cross-entropy instead, as `config.loss_chunk` makes it.

        The ids' range is checked only with `config.check_ids`: the check reads them back to the host,
        which stalls a GPU every step. Check them where batches are made instead (`systems.step.check_batch`
        on the host; `random_batch` does). Unchecked, an id outside [0, vocab_size) is an IndexError in the
        embedding or the loss on a CPU, and a device-side assert on a GPU.
        """
        config = self.config
        _check_token_shape(tokens, config.context_length)
        if config.check_ids:
            check_id_range(tokens, config.vocab_size, "token ids")
            if targets is not None:
                check_id_range(targets, config.vocab_size, "target ids")
        x = run_blocks(self.blocks, self.embedding(tokens), config.checkpoint, config.checkpoint_keep,
                       config.checkpoint_saves)
        if targets is None:
            return self.lm_head(self.final_norm(x))
        # One call of the head makes the logits and the loss: a sharded head is gathered for both.
        return self.lm_head(self.final_norm(x), targets, config.loss_chunk)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _check_token_shape(tokens: torch.Tensor, context_length: int) -> None:
    """Checks on the ids' dtype and shape only: no host sync, and torch.compile traces them."""
    if tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"token ids must be int64 or int32, got {tokens.dtype}")
    if tokens.dim() != 2:
        raise ValueError(f"token ids must be (batch, seq), got shape {tuple(tokens.shape)}")
    if tokens.shape[1] > context_length:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds context_length={context_length}")


def check_id_range(ids: torch.Tensor, vocab_size: int, what: str = "token ids") -> None:
    """Raise ValueError unless every id lies in [0, vocab_size). Synchronizes with the device."""
    if ((ids < 0) | (ids >= vocab_size)).any():
        raise ValueError(f"{what} must lie in [0, {vocab_size}), got ids from {ids.min().item()} to {ids.max().item()}")


def _init_weights(module: nn.Module) -> None:
    # The CS336 initialization: truncated normals scaled by fan-in plus fan-out.
    if isinstance(module, nn.Linear):
        std = math.sqrt(2.0 / (module.in_features + module.out_features))
        nn.init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
    elif isinstance(module, nn.Embedding):
        nn.init.trunc_normal_(module.weight, std=1.0, a=-3.0, b=3.0)
