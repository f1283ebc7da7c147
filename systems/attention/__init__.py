"""FlashAttention-2 three ways: written out, tiled in PyTorch, and as Triton kernels.

`FlashAttentionTriton` is imported on first use, so that this package imports where Triton is absent and
the kernels are defined only after the harness has decided on TRITON_INTERPRET.
"""

from __future__ import annotations

import torch

from systems.attention.pytorch import FlashAttentionPytorch
from systems.attention.reference import attention_reference

__all__ = ["FlashAttentionPytorch", "FlashAttentionTriton", "attention_reference", "flash_attention"]


def __getattr__(name: str):
    if name == "FlashAttentionTriton":
        from systems.attention.triton_kernels import FlashAttentionTriton

        return FlashAttentionTriton
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """Differentiable FlashAttention-2: the Triton kernels on CUDA, the tiled PyTorch version elsewhere."""
    # q: (batch, [heads,] n_queries, d), k and v: (batch, [heads,] n_keys, d)
    if q.device.type == "cuda":
        return __getattr__("FlashAttentionTriton").apply(q, k, v, is_causal)
    return FlashAttentionPytorch.apply(q, k, v, is_causal)
