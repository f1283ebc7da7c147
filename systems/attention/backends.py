"""Attention by name: the one table that the model, the benchmarks and the command-line options choose from.

Every backend is a function (q, k, v, is_causal) -> o of q: (batch, [heads,] n_queries, d) and k, v:
(batch, [heads,] n_keys, d).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from systems.attention.pytorch import FlashAttentionPytorch
from systems.attention.reference import naive_attention


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """naive_attention through torch.compile, a graph per shape."""
    return _compiled_naive_attention()(q, k, v, is_causal)


@functools.cache
def _compiled_naive_attention():
    return torch.compile(naive_attention, dynamic=False)  # made on first use: importing Dynamo takes seconds


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    # Imported on first use, so that this package imports where Triton is not installed (pyproject installs it
    # on x86-64 Linux only).
    from systems.attention.triton_launch import FlashAttentionTriton

    return FlashAttentionTriton.apply(q, k, v, is_causal)


def gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """The Gluon FlashAttention-3-style forward (Hopper only), with the Triton FlashAttention-2 backward."""
    # Imported on first use, as triton_attention is.
    from systems.attention.gluon_forward import FlashAttentionGluon

    return FlashAttentionGluon.apply(q, k, v, is_causal)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """Differentiable FlashAttention-2: the Triton kernels on CUDA, the tiled PyTorch version elsewhere."""
    attend = triton_attention if q.device.type == "cuda" else FlashAttentionPytorch.apply
    return attend(q, k, v, is_causal)


BACKENDS = {
    "naive": naive_attention,
    "compiled": compiled_attention,
    "pytorch": FlashAttentionPytorch.apply,
    "triton": triton_attention,
    "gluon": gluon_attention,
    "flash": flash_attention,
    "sdpa": sdpa_attention,
}
# What the attention benchmarks time: "flash" is "triton" or "pytorch", timed under those names.
BENCHED_BACKENDS = ("naive", "compiled", "pytorch", "triton", "sdpa")
