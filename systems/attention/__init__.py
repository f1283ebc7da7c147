"""Attention by name (`BACKENDS`), and FlashAttention-2 three ways: written out, tiled in PyTorch, in Triton.

`FlashAttentionTriton` is imported on first use, so that this package imports where Triton is not installed.
"""

from __future__ import annotations

from systems.attention.backends import BACKENDS, BENCHED_BACKENDS, flash_attention, sdpa_attention
from systems.attention.pytorch import FlashAttentionPytorch
from systems.attention.reference import attention_reference, naive_attention

__all__ = ["BACKENDS", "BENCHED_BACKENDS", "FlashAttentionPytorch", "FlashAttentionTriton", "attention_reference",
           "flash_attention", "naive_attention", "sdpa_attention"]


def __getattr__(name: str):
    if name == "FlashAttentionTriton":
        from systems.attention.triton_launch import FlashAttentionTriton

        return FlashAttentionTriton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
