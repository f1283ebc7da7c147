"""Attention written out, once: the model, the benchmarks and the tests' reference all use it; the input contract
every implementation enforces; and what the FlashAttention-2 autograd Functions keep for their backward."""

from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """softmax(q kᵀ/√d) v with every score held: the model's "naive" backend (`systems.accounting` models what
    it saves for the backward) and the benchmarks' baseline.

    q: (batch, [heads,] n_queries, d), k and v: (batch, [heads,] n_keys, d). With `is_causal`, query i sees
    keys j <= i.
    """
    return torch.softmax(_scores(q, k, is_causal), dim=-1) @ v


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`naive_attention` and the row log-sum-exp of its scaled scores, in the inputs' dtype, inputs checked.

    float64 is accepted as well, for computing the expected values of tests. The scores are computed a second
    time for the log-sum-exp, so that the output is exactly the model's written-out attention.
    """
    check_inputs(q, k, v, is_causal, dtypes=SUPPORTED_DTYPES + (torch.float64,))
    return naive_attention(q, k, v, is_causal), torch.logsumexp(_scores(q, k, is_causal), dim=-1)


def _scores(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """q kᵀ/√d, -inf where a causal query may not see a key: (..., n_queries, n_keys)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        n_queries, n_keys = scores.shape[-2:]
        visible = torch.ones(n_queries, n_keys, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                 max_head_dim: int | None = None, dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """Raise TypeError/ValueError unless q, k, v are (batch, [heads,] seq, d) tensors that fit together."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if q.dtype not in dtypes:
        raise TypeError(f"q has dtype {q.dtype}; supported are {[str(d) for d in dtypes]}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError("q, k, v must all be (batch, seq, d) or all (batch, heads, seq, d), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"batch/head dims of q {tuple(q.shape[:-2])} and k, v {tuple(k.shape[:-2])} differ")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims of q ({q.shape[-1]}) and k, v ({k.shape[-1]}) differ")
    if q.numel() == 0 or k.numel() == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if max_head_dim is not None and q.shape[-1] > max_head_dim:
        raise ValueError(f"head dim {q.shape[-1]} exceeds the supported maximum {max_head_dim}")


def save_for_recompute(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       is_causal: bool) -> torch.Tensor:
    """Keep on an autograd ctx what a FlashAttention-2 backward recomputes the scores from: the inputs, the output
    O and its log-sum-exp L, never the (n_queries, n_keys) probabilities naive_attention keeps. Returns o."""
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = is_causal
    return o


def saved_for_recompute(ctx) -> tuple:
    """q, k, v, o, lse and is_causal, as save_for_recompute kept them."""
    return (*ctx.saved_tensors, ctx.is_causal)
